"""``speculation.method = "auto"`` against every fixed method at its best k, the per-request
oracle and target-only, on a mixed workload of held-out text, at several concurrencies
(``--concurrency``, default 1, 4 and 8).

Slices (the prompts are pairwise disjoint windows of the bootstrap's held-out files, never
served before; every request is new to the policy within a phase):

- **code** and **prose**: a held-out window, continued greedily;
- **rag**: a question with its top-5 BM25 passages in the prompt (LLMA paper, Figure 6; the
  cases of ``benchmarks/llma.py``), the passages also given as ``references``;
- **repetition**: a held-out prose window repeated twice and then started a third time (text
  with heavy repetition: what copying is for);
- **creative**: a held-out prose window sampled at T = 1.0 (where drafting helps least; its
  outputs are sampled, so they are not compared).

Every request of the run is one cluster (``default``): ``auto`` is not told the slice, it sees
what serving sees (the request's temperature, references, each step's copy match and the load).

Arms, interleaved (the order rotates per request, or per group): ``target``; ``draft`` at
k = 2, 3; ``pld`` at k = 10; ``llma`` at k = 8 and 16 (serving's rule: the copy grows with the
match); ``dresd`` with ``--datastore``; and ``auto`` (one policy for the whole run, calibrated
once at start, learning as it serves, across the phases).

Phases, one per concurrency c, in increasing order:

- **c = 1**: each slice's first ``--cases`` requests (default 8), one at a time, in one shuffled
  mixed stream; the policy's load is its requests in flight (one).
- **c > 1**: each slice's first ``--groups`` x c requests (default 3 groups), in groups of c
  requests of one slice run at once in threads (so a slice's time is its own groups' time), the
  groups of different slices interleaved. The groups share target passes through one of
  serving's ``TargetBatcher`` (``max_batch`` = c), the policy is told the passes are padded
  (``padded_batches``) and its load is the batcher's requests in flight, as in serving. An
  arm's time is the wall time of its groups.

A slice therefore needs max(cases, groups x c) distinct prompts; where the held-out files (or
the RAG questions) have fewer, the slice's groups are cut short, with a warning.

Measures, per concurrency: "best fixed" is the fixed arm (target included) with the least total
time on the whole mix at that concurrency; the oracle takes, for each request (each group at
c > 1), the fastest fixed arm, known after the fact (an optimistic bar: a minimum over noisy
times). ``summary["by_concurrency"][c]`` has ``auto_vs_best_fixed`` (best fixed total / auto
total; the bar: >= 1), ``auto_vs_oracle`` (oracle / auto; the bar: >= 0.9),
``min_slice_vs_target`` (the least target / auto over the slices; the bar: >= 0.95),
``best_fixed`` and ``requests``, and two readings of the first ratio that its in-sample
choice of the best fixed arm biases against ``auto``: ``auto_vs_best_fixed_cv`` (the best
fixed arm chosen on the other folds, timed on each fold: what an operator who measured first
would have run) and ``auto_vs_best_fixed_ci90`` (a bootstrap interval over the groups). The
summary's top-level ratios are the worst over the concurrencies; ``greedy_identical`` holds when every greedy request of every arm and phase
equals target-only's output; ``cpu_model`` says where the times come from. Usage:

    .venv/bin/python benchmarks/adaptive.py --quick
    .venv/bin/python benchmarks/adaptive.py --json benchmarks/out/adaptive.json --doc docs/benchmarks.md
    .venv/bin/python benchmarks/adaptive.py --concurrency 1,4,8,16 --groups 2
    .venv/bin/python benchmarks/adaptive.py --replot benchmarks/out/adaptive.json --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.adaptive_report import (  # noqa: E402, F401  (some only re-exported: the names this module used to define)
    BARS,
    BOOTSTRAP,
    CHAIN_ARM,
    CV_FOLDS_C1,
    DOC_BEGIN,
    DOC_END,
    ESTIMATOR_ARMS,
    NO_SHADOWS,
    SLICES,
    SUMMARY_KEYS,
    _held_out_best_fixed,
    analyse,
    concurrencies,
    current_rules,
    greedy_identical,
    markdown,
    phase_text,
    plot,
    summary,
)
from benchmarks.common import environment, finish_report, target_name  # noqa: E402
from specops.serving.plan import plain_generate

log = logging.getLogger("benchmarks.adaptive")
CREATIVE_T = 1.0


@dataclass
class Case:
    slice: str
    name: str
    prompt_ids: list[int]
    references: list[list[int]] = field(default_factory=list)
    temperature: float = 0.0
    seed: int = 0


def fixed_arms(args) -> list[tuple[str, str, int | None]]:
    arms = [("target", "target", None)]
    arms += [(f"draft_k{k}", "draft", k) for k in args.draft_k]
    arms += [(f"pld_k{k}", "pld", k) for k in args.pld_k]
    arms += [(f"llma_k{k}", "llma", k) for k in args.llma_k]
    if args.datastore:
        arms.append(("dresd", "dresd", None))
    return arms


# ---------------------------------------------------------------- the workload
def phase_size(args, concurrency: int) -> int:
    """Requests per slice at ``concurrency``: ``cases`` at 1, ``groups`` groups of c above."""
    return args.cases if concurrency == 1 else args.groups * concurrency


def prompt_limit(args, target) -> int:
    """The longest RAG prompt: ``--max-prompt-tokens``, and above concurrency 1 at most half the
    target's positions less the new tokens. A batched pass pads its rows to the widest, so one
    request's prefill beside another's deep decode needs room for both prompts (a 1,024-position
    tiny target overflowed; SmolLM2's 8,192 never binds)."""
    limit = args.max_prompt_tokens
    positions = getattr(target.config, "max_position_embeddings", None)
    if positions and max(args.concurrency) > 1 and (positions - args.max_new_tokens) // 2 < limit:
        limit = (positions - args.max_new_tokens) // 2
        log.warning("RAG prompts cut to %d tokens: the target has %d positions", limit, positions)
    return limit


def build_cases(args, tok, max_prompt_tokens: int) -> list[Case]:
    """Each slice's distinct prompts, as many as its largest phase needs (fewer, with a warning,
    where the held-out files or the RAG questions run out), shuffled into one mixed stream."""
    from specops.workloads.prompts import distinct_prompts

    n = max(phase_size(args, c) for c in args.concurrency)
    code = distinct_prompts(Path(args.model_dir), tok, "code", n, num_tokens=args.prompt_tokens, seed=args.seed)
    prose = distinct_prompts(Path(args.model_dir), tok, "prose", 3 * n, num_tokens=args.prompt_tokens, seed=args.seed)
    # every third window to each prose-based slice: a short supply is shared evenly between them
    plain, repeated, sampled = prose[0::3][:n], prose[1::3][:n], prose[2::3][:n]
    cases = [Case("code", p.source, p.token_ids) for p in code]
    cases += [Case("prose", p.source, p.token_ids) for p in plain]
    for p in repeated:
        half = p.token_ids[: len(p.token_ids) // 2]
        cases.append(Case("repetition", p.source, p.token_ids + p.token_ids + half))
    cases += [
        Case("creative", p.source, p.token_ids, temperature=CREATIVE_T, seed=args.seed + i)
        for i, p in enumerate(sampled)
    ]
    cases += rag(args, tok, n, max_prompt_tokens)
    for s in SLICES:
        have = sum(c.slice == s for c in cases)
        if have < n:
            cut = [f"c={c}: {min(have, phase_size(args, c))} of {phase_size(args, c)}" for c in args.concurrency]
            log.warning(
                "slice %s: %d of the %d distinct prompts it needs; requests per phase %s", s, have, n, ", ".join(cut)
            )
    rng = random.Random(f"adaptive:{args.seed}")
    rng.shuffle(cases)  # one mixed stream: the policy is never told the slice
    return cases


def rag(args, tok, n: int, max_prompt_tokens: int) -> list[Case]:
    from benchmarks import llma

    ns = argparse.Namespace(
        cache_dir=args.cache_dir,
        kb_passages=args.kb_passages,
        source=args.source,
        model_dir=args.model_dir,
        seed=args.seed,
    )
    out = []
    for c in llma.rag_cases(ns, tok, n):
        ids = tok.encode(c.prompt, add_special_tokens=False)[-max_prompt_tokens:]
        out.append(Case("rag", c.name, ids, [tok.encode(r, add_special_tokens=False) for r in c.references]))
    return out


# ---------------------------------------------------------------- running arms
class Runner:
    """Runs one arm on one request, or on a group at once; owns the ``auto`` policy, whose load
    signal (:meth:`load`) follows the phase that runs."""

    def __init__(self, pair, args, datastore=None) -> None:
        from specops.core.auto_policy import AutoPolicy
        from specops.serving.engine.spec import SpecEngine

        self.pair, self.args, self.datastore = pair, args, datastore
        self.engine = SpecEngine(pair)
        self.batcher = None
        self.batched_engine = None
        self.in_flight = 0
        self._lock = threading.Lock()
        self.policy = AutoPolicy(seed=args.seed, max_k=max(16, *args.llma_k), load=self.load)
        self.policies = {"auto": self.policy}
        """Arm -> its own policy, learning from its own requests only (``--ablate-shadows`` adds one)."""
        if getattr(args, "ablate_shadows", False):
            self.policies[NO_SHADOWS] = AutoPolicy(
                seed=args.seed, max_k=max(16, *args.llma_k), load=self.load, copy_shadows=False
            )
        for arm in estimator_arms(args):
            self.policies[arm] = AutoPolicy(
                seed=args.seed, max_k=max(16, *args.llma_k), load=self.load, realized_estimator=ESTIMATOR_ARMS[arm]
            )
        if getattr(args, "ablate_chain", False):
            self.policies[CHAIN_ARM] = AutoPolicy(
                seed=args.seed, max_k=max(16, *args.llma_k), load=self.load, copy_chain=True
            )

    def load(self) -> int:
        """Requests in flight (serving gives the policy admission's running count): the batcher's
        while a concurrency > 1 phase runs, else this runner's own (one at a time)."""
        batcher = self.batcher
        return batcher.active if batcher is not None else self.in_flight

    @contextmanager
    def phase(self, concurrency: int):
        """One phase: above concurrency 1 its groups share target passes through one
        ``TargetBatcher`` (``max_batch`` = the concurrency) and the policy prices padded passes,
        as serving sets it when it runs a batcher; at 1, neither."""
        from specops.serving.engine.batching import TargetBatcher
        from specops.serving.engine.spec import SpecEngine

        if concurrency > 1:
            self.batcher = TargetBatcher(self.pair.target, max_batch=concurrency, window_s=0.002)
            self.batched_engine = SpecEngine(self.pair, target_lm=self.batcher.lm)
        for policy in self.policies.values():
            policy.padded_batches = self.batcher is not None and not self.batcher.packed
        try:
            yield
        finally:
            if self.batcher is not None:
                self.batcher.stop()
            self.batcher = self.batched_engine = None
            for policy in self.policies.values():
                policy.padded_batches = False

    def generate(self, method: str, k: int | None, case: Case, engine=None, arm: str = "") -> dict:
        from specops.serving.engine.types import SamplingParams
        from specops.serving.proposers.catalogue import ProposerResources

        a = self.args
        params = SamplingParams(temperature=case.temperature, max_new_tokens=a.max_new_tokens, seed=case.seed)
        refs = tuple(tuple(r) for r in case.references) if method in ("llma", "auto") else ()
        policy = self.policies.get(arm, self.policy)
        res = ProposerResources(pair=self.pair, references=refs, datastore=self.datastore, policy=policy)
        with self._lock:
            self.in_flight += 1
        t0 = time.perf_counter()
        try:
            out = plain_generate((engine or self.engine), case.prompt_ids, params, method=method, k=k, resources=res)
        finally:
            with self._lock:
                self.in_flight -= 1
        wall = time.perf_counter() - t0
        s = out.stats
        row = {
            "tokens": list(out.token_ids),
            "wall_s": wall,
            "generated": s.num_generated,
            "drafted": s.num_drafted,
            "accepted": s.num_accepted,
            "target_forwards": s.num_target_forwards,
        }
        if s.policy:
            row["policy"] = {m: v["steps"] for m, v in s.policy["methods"].items()}
        return row

    def group(self, method: str, k: int | None, cases: list[Case], arm: str = "") -> tuple[float, list[dict]]:
        """``cases`` at once, one thread each, sharing target passes; the group's wall time."""
        batcher, engine = self.batcher, self.batched_engine
        assert batcher is not None and len(cases) <= batcher.max_batch, "a group runs inside phase(concurrency)"
        rows: list[dict | None] = [None] * len(cases)

        def one(i: int) -> None:
            batcher.begin()
            try:
                rows[i] = self.generate(method, k, cases[i], engine, arm)
            finally:
                batcher.end()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(r is None for r in rows):
            raise RuntimeError(f"{method}: a request of the group failed (its thread's traceback is above)")
        return time.perf_counter() - t0, rows  # type: ignore[return-value]


def conc_groups(cases: list[Case], size: int = 4, per_slice: int | None = None) -> list[list[int]]:
    """Case indexes in groups of up to ``size`` of one slice each (so a slice's time at
    concurrency ``size`` is its own groups' time), the groups of different slices interleaved;
    each slice's first ``per_slice`` cases in stream order (None: all of them)."""
    by_slice: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        by_slice.setdefault(c.slice, []).append(i)
    chunks = {
        s: [ids[:per_slice][j : j + size] for j in range(0, len(ids[:per_slice]), size)] for s, ids in by_slice.items()
    }
    out: list[list[int]] = []
    for r in range(max((len(c) for c in chunks.values()), default=0)):
        out += [c[r] for c in chunks.values() if r < len(c)]
    return out


def phase_groups(cases: list[Case], args, concurrency: int) -> list[list[int]]:
    """The phase's groups of case indexes: at concurrency 1 each slice's first ``cases``, one at
    a time in the mixed stream's order; above, each slice's first ``groups`` x c in groups of c."""
    if concurrency == 1:
        rank: dict[str, int] = {}
        out = []
        for i, c in enumerate(cases):
            if rank.setdefault(c.slice, 0) < args.cases:
                out.append([i])
            rank[c.slice] += 1
        return out
    return conc_groups(cases, size=concurrency, per_slice=phase_size(args, concurrency))


def estimator_arms(args) -> list[str]:
    """The ``--ablate-estimator`` arms (``auto_geometric``, ``auto_mean``, ``auto_sum``)."""
    return [f"auto_{e}" for e in getattr(args, "ablate_estimator", None) or ()]


def run(cases: list[Case], runner: Runner, args) -> dict:
    arms = [*fixed_arms(args), ("auto", "auto", None)]
    if getattr(args, "ablate_shadows", False):
        arms.append((NO_SHADOWS, "auto", None))
    arms += [(arm, "auto", None) for arm in estimator_arms(args)]
    if getattr(args, "ablate_chain", False):
        arms.append((CHAIN_ARM, "auto", None))
    phases = {c: phase_groups(cases, args, c) for c in args.concurrency}
    per: dict[str, dict] = {str(c): {name: [] for name, _, _ in arms} for c in phases}
    walls: dict[str, dict] = {str(c): {name: [] for name, _, _ in arms} for c in phases if c > 1}
    total = len(arms) * sum(len(g) for groups in phases.values() for g in groups)
    with tqdm(total=total, desc="adaptive", unit="req") as bar:
        for c, groups in phases.items():
            n = sum(len(g) for g in groups)
            log.info("concurrency %d: %d requests (%d groups) x %d arms", c, n, len(groups), len(arms))
            bar.set_description(f"adaptive c={c}")
            with runner.phase(c):
                for gi, block in enumerate(groups):  # arms rotating per request (per group above 1)
                    order = arms[gi % len(arms) :] + arms[: gi % len(arms)]
                    for name, method, k in order:
                        if c == 1:
                            row = runner.generate(method, k, cases[block[0]], arm=name)
                            per["1"][name].append({"case": block[0], **row})
                        else:
                            wall, rows = runner.group(method, k, [cases[i] for i in block], arm=name)
                            walls[str(c)][name].append(wall)
                            per[str(c)][name] += [
                                {"case": i, **r, "group": gi, "group_wall_s": wall, "group_size": len(block)}
                                for i, r in zip(block, rows)
                            ]
                        bar.update(len(block))
    return {"per_case": per, "group_wall_s": walls, "arms": [a[0] for a in arms], "groups": phases}


def finish(report: dict, args) -> None:
    report["results"] = analyse(report)
    finish_report(
        report,
        args,
        summary=summary,
        markdown=markdown,
        plot=plot,
        png_name="adaptive.png",
        begin=DOC_BEGIN,
        end=DOC_END,
    )
    s = report["summary"]
    missed = [k for k, bar in BARS.items() if s[k] < bar] + ([] if s["greedy_identical"] else ["greedy_identical"])
    log.info("bars %s", "all met" if not missed else "missed: " + ", ".join(missed))


def parse(argv) -> argparse.Namespace:
    from specops.paths import models_dir

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Slices, arms and measures: see the module docstring (benchmarks/adaptive.py).",
    )
    p.add_argument(
        "--quick", action="store_true", help="2 cases per slice, concurrency 1,4, 1 group, 24 new tokens, fewer arms"
    )
    p.add_argument("--json", type=Path, help="write the results (with a `summary`) here")
    p.add_argument("--doc", type=Path, help="write the tables into this markdown file (docs/benchmarks.md)")
    p.add_argument("--plot", type=Path, help="PNG of the speed-ups (default: img/adaptive.png beside --doc)")
    p.add_argument(
        "--replot", type=Path, metavar="JSON", help="re-derive summary, table, plot and doc from a saved --json"
    )
    p.add_argument(
        "--model-dir", default=str(models_dir()), help="bootstrap-style target/ + draft/ (default: %(default)s)"
    )
    p.add_argument("--cache-dir", default=".specops/bench/llma", help="the RAG knowledge base is kept here")
    p.add_argument(
        "--datastore",
        default="",
        help="a DReSD datastore directory (`specops datastore build`) for "
        "the dresd arm and auto's dresd candidate; default: none",
    )
    p.add_argument("--cases", type=int, default=None, help="requests per slice at concurrency 1 (default 8, quick 2)")
    p.add_argument(
        "--concurrency",
        default=None,
        help="the phases' concurrencies, comma-separated (default 1,4,8; quick 1,4)",
    )
    p.add_argument(
        "--groups",
        type=int,
        default=None,
        help="groups of c requests per slice at each concurrency c > 1 (default 3, quick 1)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64, quick 24")
    p.add_argument("--prompt-tokens", type=int, default=96, help="held-out window length (code, prose, creative)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="RAG prompts are cut to their last N tokens")
    p.add_argument("--draft-k", default=None, help="draft arms' k (default 2,3; quick 3)")
    p.add_argument("--pld-k", default="10", help="prompt lookup arms' k")
    p.add_argument("--llma-k", default=None, help="LLMA arms' longest copy (default 8,16; quick 16)")
    p.add_argument(
        "--no-concurrency4",
        dest="concurrency",
        action="store_const",
        const="1",
        help="concurrency 1 only (an alias of --concurrency 1)",
    )
    p.add_argument("--kb-passages", type=int, default=2000, help="passages of the RAG knowledge base")
    p.add_argument("--source", action="append", help="text sources of the RAG KB (default: man pages + /usr/share/doc)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ablate-shadows",
        action="store_true",
        help=f"also run `auto` without its copy shadows (arm {NO_SHADOWS}: its own policy, calibrated alike; "
        "the A/B of serving/proposers/auto_shadow.py)",
    )
    p.add_argument(
        "--ablate-estimator",
        action="append",
        choices=sorted(e for e in ESTIMATOR_ARMS.values()),
        help="also run `auto` with this realized-speed estimator instead of its default 'mean' (arm "
        "auto_<name>: its own policy; 'mean' counts each step's ratio once, 'geometric' averages their logs, "
        "'sum' weights steps by their time; core/auto_fits.py SpeedCheck); repeatable",
    )
    p.add_argument(
        "--ablate-chain",
        action="store_true",
        help=f"also run `auto` with the copy chain on (arm {CHAIN_ARM}: its own policy, pricing a copy's token i "
        "at the match length it would then have, core/auto_policy.py copy_chain)",
    )
    args = p.parse_args(argv)
    full = {"cases": 8, "groups": 3, "concurrency": "1,4,8", "max_new_tokens": 64, "draft_k": "2,3", "llma_k": "8,16"}
    quick = {"cases": 2, "groups": 1, "concurrency": "1,4", "max_new_tokens": 24, "draft_k": "3", "llma_k": "16"}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("draft_k", "pld_k", "llma_k", "concurrency"):
        setattr(args, key, [int(k) for k in str(getattr(args, key)).split(",") if k])
    args.concurrency = sorted(set(args.concurrency))
    if not args.concurrency or args.concurrency[0] < 1:
        p.error(f"--concurrency: positive integers, comma-separated (got {args.concurrency})")
    if args.cases < 1 or args.groups < 1:
        p.error("--cases and --groups must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.replot:
        report = json.loads(args.replot.read_text())
        args.json = args.json or args.replot
        finish(report, args)
        return 0
    from specops.core.models import load_model_dir
    from specops.serving.proposers.auto import calibrate, calibration

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    pair = load_model_dir(Path(args.model_dir))
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    datastore = None
    if args.datastore:
        from specops.core.datastore import Datastore

        datastore = Datastore.load(Path(args.datastore))
    cases = build_cases(args, pair.tokenizer, prompt_limit(args, pair.target))
    counts = {s: sum(c.slice == s for c in cases) for s in SLICES}
    log.info("workload: %s", ", ".join(f"{s} {n}" for s, n in counts.items()))
    runner = Runner(pair, args, datastore)
    policy = runner.policy
    costs = calibrate(policy, pair)
    log.info("auto calibrated: %s", ", ".join(f"{k} {v:.2f} ms" for k, v in costs.items()))
    for other in runner.policies.values():  # an ablation starts from the same calibration
        if other is not policy:
            other.calibrated(*calibration(costs))
    warm = Case("warm", "warm", pair.tokenizer.encode("def main():\n    return 0\n", add_special_tokens=False))
    for _, method, k in fixed_arms(args):  # not auto: its policy starts from the calibration alone
        runner.generate(method, k, warm)
    command = ".venv/bin/python benchmarks/adaptive.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {
        "command": command,
        "target": target_name(Path(args.model_dir)),
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("json", "doc", "plot", "replot")
        },
        "cases": [
            {
                "slice": c.slice,
                "name": c.name,
                "temperature": c.temperature,
                "prompt_tokens": len(c.prompt_ids),
                "references": len(c.references),
            }
            for c in cases
        ],
        "calibration_ms": costs,
        "rules": current_rules(),
    }
    report.update(run(cases, runner, args))
    report["policy_end"] = policy.snapshot()
    for arm, arm_policy in runner.policies.items():
        if arm != "auto":
            report["policy_end_" + arm] = arm_policy.snapshot()
    report["wall_s"] = time.perf_counter() - t0
    report["environment"] = environment()
    finish(report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

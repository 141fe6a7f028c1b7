"""Engines benchmark: our engine next to vLLM's CPU build, on the same prompts, the comparison users ask for.

On held-out text-to-SQL chat prompts (``benchmarks/engines_learn.py``: never among the
requests the learned draft learned from), as token ids, greedy, the same ``max_tokens``,
at each ``--concurrency``, every arm decodes the same prompts through real HTTP:

- ``vllm_target``: vLLM serving the target, no speculation;
- ``vllm_ngram``: vLLM's n-gram prompt lookup (k = 3);
- ``vllm_bootstrap_draft``: vLLM's ``draft_model`` speculation with the bootstrap draft (k = 3);
- ``vllm_learned_draft``: the same with the learned champion for the sql domain (``--learn N``
  requests through the real ``OnlineTrainer`` and promotion gate, or ``--learned-draft DIR``);
- ``specops_target`` / ``specops_draft`` / ``specops_auto``: ``specops serve`` (a subprocess)
  with the learned draft as its draft, each request naming its method (target-only, the draft
  model at k = 3, and ``auto``).

Both engines run the target in float32 (vLLM's CPU default is bfloat16: ``--dtype float32``
is passed). vLLM's prefix caching is off: the benchmark sends each prompt to every arm and at
every concurrency, and a cache hit would skip a prefill no real repeat-free traffic skips;
our server has no prefix cache, and its LLMA session cache is off for the same reason.

**The same cores.** ``vllm_target`` and ``vllm_ngram`` run with ``VLLM_CPU_OMP_THREADS_BIND``
over every core (``--vllm-omp-bind all``: ``0-<n-1>``), as our server computes on every core
(``--threads``); ``vllm_target_default`` and ``vllm_ngram_default`` keep vLLM's own binding,
which on 2 cores leaves **one** core computing (the other is reserved for its scheduler and
API), reported beside them.

**One engine on the machine at a time.** Each *server group* (one vLLM server per vLLM arm;
one ``specops serve`` for all of our arms, each request naming its method) is started,
warmed up (untimed), run at every concurrency, and stopped before the next group starts:
an idle neighbour's threads cost the arm that follows it on 2 cores (issue 54 measured our
target-only at 15.3 tokens/s beside idle vLLM servers, 22.9 alone). The prompts are split
into ``--repeats`` slices; repeat ``r`` runs slice ``r`` through every group, the groups'
order (and our arms' order within our group) rotated by one each repeat, so drift in the
machine's speed is spread over the arms. Our server starts on a quiet machine, so ``auto``'s
cost priors are calibrated there.

**The prompts** (``--workload mixed``, the default): half held-out chat requests (the chat
workload's ``sql``, ``math`` and ``api`` domains, rendered with the chat template, never
served while learning) and half plain completions (96-token windows of the bootstrap's
held-out ``code`` and ``prose`` files), interleaved; ``--workload sql`` keeps the sql chat
prompts alone (what the learned-draft comparison serves).

Per arm and concurrency: tokens/s (generated tokens ÷ summed wall time of the arm's batches),
p50/p99 request latency, and the per-token α (Σ accepted ÷ (Σ accepted + steps or drafts that
ended in a rejection)): ours from each response's ``speculation`` block, vLLM's from the
deltas of its Prometheus spec-decode counters around the arm's batches (exact when every draft
had k tokens; otherwise accepted ÷ drafted, and ``alpha_basis`` says so). Greedy outputs are
compared across arms: vLLM arms by token ids against ``vllm_target``, our arms by text against
``specops_target`` (our API returns text only), and every arm by text against ``vllm_target``.

Summary: ``by_concurrency``, ``learned_vs_bootstrap_draft`` (tokens/s ratio per concurrency;
the bar is >= 1), ``ours_vs_vllm_target`` (best specops arm ÷ ``vllm_target``), ``identical_outputs``.

    .venv/bin/python benchmarks/engines.py --learn 250 --workload sql --json benchmarks/out/engines.json
    .venv/bin/python benchmarks/engines.py --learned-draft .specops/models/draft --prompts 32 \
        --doc-section engines-load --json benchmarks/out/engines_load.json
    .venv/bin/python benchmarks/engines.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchmarks.common import cpu_model, environment, target_name, write_doc_section  # noqa: E402
from benchmarks.engines_clients import (  # noqa: E402
    Arm,
    SpecopsServer,
    add_counters,
    counter_delta,
    profile_shares,
    run_batch,
    vllm_alpha,
)
from benchmarks.engines_report import doc_section, markdown, summarise  # noqa: E402
from specops.paths import models_dir  # noqa: E402
from specops.serving.vllm.process import ServerSpec, VLLMError, VLLMServer, vllm_python, vllm_version  # noqa: E402

log = logging.getLogger("bench.engines")


def doc_markers(section: str) -> tuple[str, str]:
    return (
        f"<!-- BEGIN {section} (written by benchmarks/engines.py; edits inside are overwritten) -->",
        f"<!-- END {section} -->",
    )


DOC_BEGIN, DOC_END = doc_markers("engines")
VLLM_ARMS = {  # arm -> (speculation, which draft, CPU binding: "all" every core, "default" vLLM's own)
    "vllm_target": ("none", None, "all"),
    "vllm_ngram": ("ngram", None, "all"),
    "vllm_target_default": ("none", None, "default"),
    "vllm_ngram_default": ("ngram", None, "default"),
    "vllm_bootstrap_draft": ("draft", "bootstrap", "all"),
    "vllm_learned_draft": ("draft", "learned", "all"),
}
DEFAULT_ARMS = ("vllm_target", "vllm_ngram", "vllm_target_default", "specops_target", "specops_draft", "specops_auto")
SPECOPS_ARMS = {"specops_target": "target", "specops_draft": "draft", "specops_auto": "auto"}
ARMS = (*VLLM_ARMS, *SPECOPS_ARMS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model-dir", type=Path, default=models_dir(), help="bootstrap dir with target/ and draft/")
    p.add_argument("--learn", type=int, default=250, help="sql chat requests the learned draft learns from (cached)")
    p.add_argument("--learned-draft", type=Path, default=None, help="use this draft directory instead of learning")
    p.add_argument(
        "--workload",
        choices=("mixed", "sql"),
        default="mixed",
        help="mixed: half held-out chat requests (sql, math, api), half plain completions of held-out code and "
        "prose; sql: held-out sql chat requests only",
    )
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 32; 4 with --quick)")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 64; 16 with --quick)")
    p.add_argument(
        "--concurrency", default=None, help="comma-separated client concurrencies (default 1,4,8,16; 1,2 quick)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="slices of the prompts; each repeat starts every server group in turn (one engine on the machine "
        "at a time), runs its slice at every concurrency and stops it, the groups' order rotating",
    )
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated arms, of {', '.join(ARMS)}")
    p.add_argument("--k", type=int, default=3, help="tokens drafted per step (vLLM's num_speculative_tokens)")
    p.add_argument(
        "--vllm-python", default="", help="the vLLM venv's python (default $SPECOPS_VLLM_PYTHON, .venv-vllm)"
    )
    p.add_argument(
        "--kv-cache-gb",
        type=int,
        default=1,
        help="VLLM_CPU_KVCACHE_SPACE per vLLM server, whole GiB (vLLM reads an integer; 1 GiB holds ~23k "
        "float32 tokens of SmolLM2-135M)",
    )
    p.add_argument(
        "--vllm-omp-bind",
        default="all",
        help="VLLM_CPU_OMP_THREADS_BIND of the vLLM arms without _default: all (every core, 0-<n-1>, as our "
        "server computes), auto (vLLM's own), or a CPU list",
    )
    p.add_argument(
        "--vllm-args",
        default=None,
        help="more arguments for every vLLM server, shell words (default none; '--enforce-eager' with --quick: "
        "no torch.compile warm-up, which takes minutes on 2 cores and measures nothing at the quick size)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of specops serve (and of learning)")
    p.add_argument("--specops-draft-dtype", default="auto", help="specops serve --draft-dtype (auto: timed at load)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default <models>/../engines/logs)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--quick", action="store_true", help="tiny models, 4 prompts, 16 tokens, concurrency 1 and 2")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument(
        "--doc-section",
        default="engines",
        help="the doc section to write (a run without the learned-draft arms writes its own, e.g. engines-load)",
    )
    p.add_argument("--extra-summary", type=Path, default=None, help="JSON object merged into the summary")
    p.add_argument("--replot", type=Path, default=None, metavar="JSON", help="re-derive table and doc from a --json")
    args = p.parse_args(argv)
    for name, full, quick in (("prompts", 32, 4), ("max_tokens", 64, 16), ("concurrency", "1,4,8,16", "1,2")):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.vllm_args is None:
        args.vllm_args = "--enforce-eager" if args.quick else ""
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    if args.repeats < 1 or args.prompts < args.repeats:
        p.error("--repeats must be at least 1 and at most --prompts")
    return args


VLLM_ARGS = ("--dtype", "float32", "--no-enable-prefix-caching", "--seed", "0")
"""Every vLLM server's arguments beyond the model's: float32 as our engine (greedy outputs compared),
no prefix cache (as ours: tenants share a server), a fixed seed."""


def omp_bind(setting: str) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a setting: every core for ``all``, None (vLLM's own) for ``auto``."""
    if setting == "all":
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
        return f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))
    return None if setting in ("auto", "default", "") else setting


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def server_groups(arms: list[str]) -> list[list[str]]:
    """The arms by the server they run on: one group per vLLM arm, one for all of ours."""
    groups = [[a] for a in arms if a in VLLM_ARMS]
    ours = [a for a in arms if a in SPECOPS_ARMS]
    return groups + ([ours] if ours else [])


def start_group(group: list[str], args, model_dir: Path, learned: Path, log_dir: Path, data_dir: Path, max_len: int):
    """The server of one group, started and ready (the caller stops it)."""
    arm = group[0]
    if arm in VLLM_ARMS:
        spec, which, binding = VLLM_ARMS[arm]
        bind = omp_bind(args.vllm_omp_bind) if binding == "all" else None
        server = VLLMServer(
            ServerSpec(
                model_dir / "target",
                speculation=spec,
                draft={"bootstrap": model_dir / "draft", "learned": learned}[which] if which else None,
                k=args.k,
                served_name="target",
                max_model_len=max_len,
                kv_cache_gb=args.kv_cache_gb,
                max_num_seqs=max(16, max(args.concurrency)),
                extra_args=(*VLLM_ARGS, *shlex.split(args.vllm_args)),
                env={"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {},
            ),
            python=vllm_python(args.vllm_python),
            log_dir=log_dir,
            name=arm,
        ).start()
    else:
        server = SpecopsServer(
            model_dir / "target",
            learned,
            log_dir=log_dir,
            data_dir=data_dir,
            threads=args.threads,
            concurrency=max(args.concurrency),
            draft_dtype=args.specops_draft_dtype,
        ).start()
    try:
        ready = server.wait_ready(900.0)
    except BaseException:
        server.stop()
        raise
    log.warning("%s ready after %.0fs", "specops" if arm in SPECOPS_ARMS else arm, ready)
    return server


def max_model_len(model_dir: Path, prompts: list[list[int]], max_tokens: int, k: int) -> int:
    """The longest prompt, the output and the drafts past it, rounded up to 64 (capped by the target's
    context): vLLM sizes its buffers by it, and the machine's memory is shared."""
    cfg = json.loads((model_dir / "target" / "config.json").read_text())
    need = max(len(p) for p in prompts) + max_tokens + 2 * k + 16
    return min(-(-need // 64) * 64, int(cfg.get("max_position_embeddings", need)))


def mem_available_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def make_arm(name: str, server, k: int) -> Arm:
    if name in VLLM_ARMS:
        return Arm(name, "vllm", server.url, k=0 if VLLM_ARMS[name][0] == "none" else k)
    return Arm(name, "specops", server.url, method=SPECOPS_ARMS[name])


def slices(indexed: list, repeats: int) -> list[list]:
    """The prompts split into ``repeats`` consecutive slices of (nearly) equal size (the workload
    interleaves its kinds of prompt, so each slice holds all of them)."""
    size = -(-len(indexed) // repeats)
    return [indexed[r * size : (r + 1) * size] for r in range(repeats)]


def measure(prompts: list[list[int]], args, start) -> tuple[dict, dict]:
    """Every arm at every concurrency, one server group on the machine at a time (module docstring);
    ``start(group)`` starts a group's server. Returns (per arm and concurrency the totals, server facts)."""
    indexed = list(enumerate(prompts))
    groups = server_groups(args.arms)
    raw: dict = {n: {} for n in args.arms}
    for n in args.arms:
        for c in args.concurrency:
            raw[n][str(c)] = {"wall_s": 0.0, "tokens": 0, "replies": [], "counters": None, "order": [], "load": []}
            raw[n][str(c)]["profile"] = {}
    facts: dict = {"ready_s": {}, "mem_available_gb_up": {}, "group_order": []}
    for rep, sl in enumerate(slices(indexed, args.repeats)):
        order = groups[rep % len(groups) :] + groups[: rep % len(groups)]
        facts["group_order"].append([g[0] if len(g) == 1 else "specops" for g in order])
        for pos, group in enumerate(order):
            label = group[0] if len(group) == 1 else "specops"
            server = start(group)
            try:
                facts["ready_s"].setdefault(label, []).append(server.ready_s)
                facts["mem_available_gb_up"].setdefault(label, []).append(mem_available_gb())
                inner = group[rep % len(group) :] + group[: rep % len(group)]
                arms = {n: make_arm(n, server, args.k) for n in inner}
                warm = arms[inner[0]]  # warm-up (untimed): a short request alone, then the largest concurrency
                run_batch(warm, indexed[:1], 1, min(8, args.max_tokens))
                run_batch(warm, indexed[: max(args.concurrency)], max(args.concurrency), min(8, args.max_tokens))
                for c in args.concurrency:
                    for n in inner:
                        arm, r = arms[n], raw[n][str(c)]
                        before, prof0 = arm.metrics(), arm.profile()
                        wall, replies = run_batch(arm, sl, c, args.max_tokens)
                        after, prof1 = arm.metrics(), arm.profile()
                        if prof0 is not None and prof1 is not None:
                            r["profile"] = {
                                key: r["profile"].get(key, 0.0) + v - prof0.get(key, 0.0) for key, v in prof1.items()
                            }
                        r["wall_s"] += wall
                        r["tokens"] += sum(x.tokens for x in replies)
                        r["replies"] += replies
                        r["order"].append([rep, pos])
                        r["load"].append([round(os.getloadavg()[0], 2), round(mem_available_gb() or 0.0, 2)])
                        if before is not None and after is not None:
                            r["counters"] = add_counters(r["counters"], counter_delta(before, after))
                    log.warning("repeat %d/%d: %s at c=%d done (%d prompts)", rep + 1, args.repeats, label, c, len(sl))
            finally:
                server.stop()
    return rows(raw, args), facts


def rows(raw: dict, args) -> dict:
    """Per arm and concurrency: tokens/s, latency percentiles, outputs, α, profile."""
    out: dict = {}
    for n, by_c in raw.items():
        out[n] = {}
        engine = "vllm" if n in VLLM_ARMS else "specops"
        for c, r in by_c.items():
            replies = sorted(r["replies"], key=lambda x: x.prompt)
            lat = [x.latency_s for x in replies]
            row = {
                "tokens": r["tokens"],
                "wall_s": r["wall_s"],
                "tokens_per_s": r["tokens"] / r["wall_s"] if r["wall_s"] else None,
                "p50_s": percentile(lat, 0.5),
                "p99_s": percentile(lat, 0.99),
                "ttft_s": None,
                "latencies_s": lat,
                "repeat_and_position": r["order"],
                "load_1m_and_mem_available_gb_after_each_batch": r["load"],
                "texts": [x.text for x in replies],
                "token_ids": [x.token_ids for x in replies] if engine == "vllm" else None,
                "completion_tokens": [x.tokens for x in replies],
            }
            ttft = [x.ttft_s for x in replies if x.ttft_s is not None]
            if ttft:
                row.update({"ttft_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99)})
            if r["profile"]:
                row["profile"] = profile_shares(r["profile"], r["wall_s"])
                row["profile_counters"] = r["profile"]
            if engine == "specops" and SPECOPS_ARMS[n] != "target":
                acc = sum(x.accepted for x in replies)
                rej = sum(x.rejected_steps for x in replies)
                dr = sum(x.drafted for x in replies)
                row.update(
                    {
                        "alpha_token": acc / (acc + rej) if acc + rej else None,
                        "alpha_drafted": acc / dr if dr else None,
                        "alpha_basis": "accepted / (accepted + steps ending in a rejection), per response",
                        "accepted": acc,
                        "drafted": dr,
                        "methods": sorted({x.method for x in replies if x.method}),
                    }
                )
            elif r["counters"] is not None:
                a = vllm_alpha(r["counters"], args.k)
                row.update({"alpha_token": a.pop("alpha_token"), "alpha_basis": a.pop("basis"), **a})
            out[n][c] = row
    return out


def compare(results: dict, concurrency: list[int]) -> dict:
    """Matches per comparison and concurrency ([identical, prompts]) and the mismatches found."""
    detail: dict = {}
    mismatches: list[dict] = []

    def check(label: str, a: str, b: str, field: str) -> None:
        if a not in results or b not in results:
            return
        for c in map(str, concurrency):
            xs, ys = results[a][c][field], results[b][c][field]
            same = [x == y for x, y in zip(xs, ys)]
            detail.setdefault(label, {})[c] = [sum(same), len(same)]
            for i, ok in enumerate(same):
                if not ok:
                    first = next(
                        (j for j, (u, v) in enumerate(zip(xs[i], ys[i])) if u != v), min(len(xs[i]), len(ys[i]))
                    )
                    mismatches.append({"comparison": label, "concurrency": int(c), "prompt": i, "first_diff": first})

    for n in VLLM_ARMS:
        if n != "vllm_target":
            check(f"{n} vs vllm_target (token ids)", n, "vllm_target", "token_ids")
    for n in SPECOPS_ARMS:
        if n != "specops_target":
            check(f"{n} vs specops_target (text)", n, "specops_target", "texts")
    for n in SPECOPS_ARMS:
        check(f"{n} vs vllm_target (text)", n, "vllm_target", "texts")
    for n in ("vllm_target", "specops_target"):  # the same arm across concurrencies
        if n in results:
            base = results[n][str(concurrency[0])]["texts"]
            for c in map(str, concurrency[1:]):
                same = [x == y for x, y in zip(results[n][c]["texts"], base)]
                detail.setdefault(f"{n} at c vs c={concurrency[0]} (text)", {})[c] = [sum(same), len(same)]
    identical = all(m == t for by_c in detail.values() for m, t in by_c.values())
    return {"identical": identical, "detail": detail, "mismatches": mismatches}


def finish(report: dict, args) -> int:
    report["summary"] = summarise(report)
    if args.extra_summary:
        report["summary"].update(json.loads(args.extra_summary.read_text()))
    table = markdown(report)
    print(table)
    print(json.dumps(report["summary"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if not args.no_doc:
        write_doc_section(args.doc, *doc_markers(args.doc_section), doc_text(report, args.doc_section))
    return 0


def doc_text(report: dict, section: str) -> str:
    """The doc section ``section`` (``engines`` or ``engines-load``), markers included, of a report
    whose summary is in it (a run's or its JSON's)."""
    begin, end = doc_markers(section)
    title = "Throughput under load, next to vLLM's CPU build" if section == "engines-load" else None
    return doc_section(report, markdown(report), begin, end, title)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replot:
        report = json.loads(args.replot.read_text())
        args.json = args.json or args.replot
        return finish(report, args)
    if any(a in VLLM_ARMS for a in args.arms):
        try:
            vllm_python(args.vllm_python)
        except VLLMError as exc:
            print(f"engines benchmark: {exc}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    command = " ".join(
        [".venv/bin/python", "benchmarks/engines.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    with tempfile.TemporaryDirectory(prefix="specops-engines-") as tmp_s:
        tmp = Path(tmp_s)
        from benchmarks.engines_learn import learn, perturbed_draft, workload_prompts
        from specops.core.models import load_tokenizer

        model_dir = Path(args.model_dir).resolve()  # the servers get absolute paths whatever their cwd
        if args.quick:
            from specops.trainer.bootstrap import run as bootstrap

            model_dir = tmp / "models"
            bootstrap(model_dir, tiny=True)
        if args.learned_draft:
            learned, learned_info = args.learned_draft, {"kind": "given", "dir": str(args.learned_draft)}
            meta = args.learned_draft / "learned.json"
            if meta.exists():
                learned_info.update(json.loads(meta.read_text()))
        elif "vllm_learned_draft" not in args.arms:  # no learned-draft arm: ours drafts with the bootstrap draft
            learned, learned_info = model_dir / "draft", {"kind": "bootstrap", "dir": str(model_dir / "draft")}
        elif args.quick:
            learned, learned_info = perturbed_draft(model_dir, tmp / "engines" / "perturbed")
        else:
            learned, learned_info = learn(model_dir, args.learn, seed=args.seed, threads=args.threads)
        learned = Path(learned).resolve()
        log.warning("draft of our server (and vLLM's learned-draft arm): %s", learned)
        target = target_name(model_dir)
        tok = load_tokenizer(model_dir / "target")
        workload = workload_prompts(tok, model_dir, args.prompts, args.seed, args.workload)
        prompts = [p.token_ids for p in workload]
        log_dir = args.log_dir or (tmp / "logs" if args.quick else model_dir.parent / "engines" / "logs")
        version = vllm_version(vllm_python(args.vllm_python)) if any(a in VLLM_ARMS for a in args.arms) else None
        max_len = max_model_len(model_dir, prompts, args.max_tokens, args.k)
        mem_before = mem_available_gb()

        def start(group: list[str]):
            return start_group(group, args, model_dir, learned, log_dir, tmp / "data", max_len)

        results, facts = measure(prompts, args, start)
    env = {**environment(), "cpu_model": cpu_model()}
    report = {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": env,
        "vllm_version": version,
        "config": {
            "target": target,
            "model_dir": str(args.model_dir) if not args.quick else "tiny (temporary)",
            "workload": args.workload,
            "prompts": len(prompts),
            "prompt_kinds": [p.kind for p in workload],
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "protocol": "isolated: one server group on the machine at a time, started and stopped per repeat",
            "isolated": True,
            "repeats": args.repeats,
            "k": args.k,
            "arms": args.arms,
            "specops_threads": args.threads,
            "specops_draft_dtype": args.specops_draft_dtype,
            "specops_cpu_linear": os.environ.get("SPECOPS_CPU_LINEAR", "auto"),
            "vllm_omp_bind": {
                a: (omp_bind(args.vllm_omp_bind) if VLLM_ARMS[a][2] == "all" else None) or "vLLM's default"
                for a in args.arms
                if a in VLLM_ARMS
            },
            "vllm_args": shlex.join([*VLLM_ARGS, *shlex.split(args.vllm_args)]),
            "kv_cache_gb": args.kv_cache_gb,
            "max_model_len": max_len,
            "streamed": True,
            "quick": args.quick,
        },
        "learned_draft": {**learned_info, "dir": str(learned)},
        "servers": {**facts, "mem_available_gb_before_start": mem_before},
        "arms": results,
        "outputs": compare(results, args.concurrency),
        "elapsed_s": time.perf_counter() - started,
    }
    return finish(report, args)


if __name__ == "__main__":
    sys.exit(main())

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
our server has no prefix cache, and its LLMA session cache is off for the same reason. vLLM
keeps its default CPU thread binding (on 2 cores: one OpenMP compute thread, one core
reserved for its scheduler and API); ours runs ``--threads`` torch threads (default 2) and
its draft in serving's default ``bfloat16`` (outputs are the float32 target's either way).

**Servers up at once, idle but one.** The vLLM servers are started together, ours once they
are up (it calibrates ``auto``'s cost priors as it starts, which vLLM's start-up would distort), and all stay up; an arm's batch runs while the others sit idle. That is sound only if an idle
server costs nothing: vLLM's engine core could busy-poll. The benchmark measures it after
start-up (CPU seconds of each server's process group over ``--idle-check-s``) and records
``idle_cpu_share`` per server in the JSON; on this machine an idle vLLM server used about
1 % of a core (it does not busy-poll once idle), so keeping them up does not distort the timings, and it avoids the
minutes each vLLM CPU server takes to start. Arms are **interleaved**: the prompts are split
into ``--rounds`` slices (fewer at a concurrency larger than a slice); for each concurrency
and slice, every arm runs the slice in turn, the arm order rotating each round, so drift in the (shared) machine's speed hits every arm
alike. Each server is warmed up first (untimed).

Per arm and concurrency: tokens/s (generated tokens ÷ summed wall time of the arm's batches),
p50/p99 request latency, and the per-token α (Σ accepted ÷ (Σ accepted + steps or drafts that
ended in a rejection)): ours from each response's ``speculation`` block, vLLM's from the
deltas of its Prometheus spec-decode counters around the arm's batches (exact when every draft
had k tokens; otherwise accepted ÷ drafted, and ``alpha_basis`` says so). Greedy outputs are
compared across arms: vLLM arms by token ids against ``vllm_target``, our arms by text against
``specops_target`` (our API returns text only), and every arm by text against ``vllm_target``.

Summary: ``by_concurrency``, ``learned_vs_bootstrap_draft`` (tokens/s ratio per concurrency;
the bar is >= 1), ``ours_vs_vllm_target`` (best specops arm ÷ ``vllm_target``), ``identical_outputs``.

    .venv/bin/python benchmarks/engines.py --learn 250 --json benchmarks/out/engines.json
    .venv/bin/python benchmarks/engines.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
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
    group_cpu_s,
    profile_shares,
    run_batch,
    vllm_alpha,
)
from benchmarks.engines_report import doc_section, markdown, summarise  # noqa: E402
from specops.paths import models_dir  # noqa: E402
from specops.serving.vllm.process import ServerSpec, VLLMError, VLLMServer, vllm_python  # noqa: E402

log = logging.getLogger("bench.engines")


def doc_markers(section: str) -> tuple[str, str]:
    return (
        f"<!-- BEGIN {section} (written by benchmarks/engines.py; edits inside are overwritten) -->",
        f"<!-- END {section} -->",
    )


DOC_BEGIN, DOC_END = doc_markers("engines")
VLLM_ARMS = {  # arm -> (speculation, which draft)
    "vllm_target": ("none", None),
    "vllm_ngram": ("ngram", None),
    "vllm_bootstrap_draft": ("draft", "bootstrap"),
    "vllm_learned_draft": ("draft", "learned"),
}
SPECOPS_ARMS = {"specops_target": "target", "specops_draft": "draft", "specops_auto": "auto"}
ARMS = (*VLLM_ARMS, *SPECOPS_ARMS)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model-dir", type=Path, default=models_dir(), help="bootstrap dir with target/ and draft/")
    p.add_argument("--learn", type=int, default=250, help="sql chat requests the learned draft learns from (cached)")
    p.add_argument("--learned-draft", type=Path, default=None, help="use this draft directory instead of learning")
    p.add_argument("--prompts", type=int, default=None, help="held-out sql chat prompts (default 16; 4 with --quick)")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 64; 16 with --quick)")
    p.add_argument(
        "--concurrency", default=None, help="comma-separated client concurrencies (default 1,4,8,16; 1,2 quick)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="slices of the prompts per concurrency (fewer where a slice would hold fewer prompts than the "
        "concurrency); every arm runs each slice in turn, the order rotating",
    )
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of the arms")
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
    p.add_argument("--vllm-omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's auto)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of specops serve (and of learning)")
    p.add_argument("--specops-draft-dtype", default="auto", help="specops serve --draft-dtype (auto: timed at load)")
    p.add_argument("--idle-check-s", type=float, default=5.0, help="seconds the idle servers' CPU use is measured")
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
    for name, full, quick in (("prompts", 16, 4), ("max_tokens", 64, 16), ("concurrency", "1,4,8,16", "1,2")):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    return args


def vllm_version(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "unknown"


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def start_servers(args, model_dir: Path, learned: Path, log_dir: Path, data_dir: Path, max_len: int) -> dict:
    """Every server the chosen arms need: vLLM's started together and waited for, then ours; name -> server."""
    python = vllm_python(args.vllm_python) if any(a in VLLM_ARMS for a in args.arms) else None
    drafts = {"bootstrap": model_dir / "draft", "learned": learned}
    servers: dict = {}
    env = {"VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_bind} if args.vllm_omp_bind else {}
    try:
        for arm in args.arms:
            if arm in VLLM_ARMS:
                spec, which = VLLM_ARMS[arm]
                servers[arm] = VLLMServer(
                    ServerSpec(
                        model_dir / "target",
                        speculation=spec,
                        draft=drafts[which] if which else None,
                        k=args.k,
                        served_name="target",
                        max_model_len=max_len,
                        kv_cache_gb=args.kv_cache_gb,
                        max_num_seqs=max(16, max(args.concurrency)),
                        extra_args=("--dtype", "float32", "--no-enable-prefix-caching", "--seed", "0"),
                        env=env,
                    ),
                    python=python,
                    log_dir=log_dir,
                    name=arm,
                ).start()
        for name, server in servers.items():  # vLLM's servers first: their start-up takes every core
            ready = server.wait_ready(900.0)
            log.warning("%s ready after %.0fs", name, ready)
        if any(a in SPECOPS_ARMS for a in args.arms):
            # ours on a quiet machine: serving calibrates auto's cost priors as it starts (beside
            # vLLM's start-up a 1-token pass took 1.4 s instead of 35 ms)
            servers["specops"] = SpecopsServer(
                model_dir / "target",
                learned,
                log_dir=log_dir,
                data_dir=data_dir,
                threads=args.threads,
                concurrency=max(args.concurrency),
                draft_dtype=args.specops_draft_dtype,
            ).start()
            ready = servers["specops"].wait_ready(900.0)
            log.warning("specops ready after %.0fs", ready)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict) -> None:
    for server in servers.values():
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - stop the rest whatever one does
            log.exception("stopping %s", getattr(server, "name", "?"))


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


def idle_shares(servers: dict, seconds: float) -> dict:
    """Share of one core each server's process group used while every server sat idle."""
    if seconds <= 0:
        return {}
    before = {n: group_cpu_s(s.proc.pid) for n, s in servers.items()}
    time.sleep(seconds)
    return {n: (group_cpu_s(s.proc.pid) - before[n]) / seconds for n, s in servers.items()}


def make_arms(args, servers: dict) -> dict[str, Arm]:
    arms = {}
    for name in args.arms:
        if name in VLLM_ARMS:
            arms[name] = Arm(name, "vllm", servers[name].url, k=0 if VLLM_ARMS[name][0] == "none" else args.k)
        else:
            arms[name] = Arm(name, "specops", servers["specops"].url, method=SPECOPS_ARMS[name])
    return arms


def slices(indexed: list, concurrency: int, rounds: int) -> list[list]:
    """The prompts split into at most ``rounds`` slices of at least ``concurrency`` prompts each
    (a slice smaller than the concurrency would never reach it)."""
    n = max(1, min(rounds, len(indexed) // max(1, concurrency)))
    size = -(-len(indexed) // n)
    return [indexed[s : s + size] for s in range(0, len(indexed), size)]


def measure(arms: dict[str, Arm], prompts: list[list[int]], args) -> dict:
    """Every arm at every concurrency, interleaved per slice; per arm and concurrency the totals."""
    indexed = list(enumerate(prompts))
    names = list(arms)
    results: dict = {n: {} for n in names}
    for arm in arms.values():  # warm-up (untimed): a short request alone, then the largest concurrency
        run_batch(arm, indexed[:1], 1, min(8, args.max_tokens))
        run_batch(arm, indexed[: max(args.concurrency)], max(args.concurrency), min(8, args.max_tokens))
    turn = 0
    for c in args.concurrency:
        for n in names:
            results[n][str(c)] = {
                "wall_s": 0.0,
                "tokens": 0,
                "replies": [],
                "counters": None,
                "order": [],
                "load": [],
                "profile": {},
            }
        for sl in slices(indexed, c, args.rounds):
            order = names[turn % len(names) :] + names[: turn % len(names)]
            turn += 1
            for pos, n in enumerate(order):
                arm, r = arms[n], results[n][str(c)]
                before, prof0 = arm.metrics(), arm.profile()
                wall, replies = run_batch(arm, sl, c, args.max_tokens)
                after, prof1 = arm.metrics(), arm.profile()
                if prof0 is not None and prof1 is not None:
                    r["profile"] = {k: r["profile"].get(k, 0.0) + v - prof0.get(k, 0.0) for k, v in prof1.items()}
                r["wall_s"] += wall
                r["tokens"] += sum(x.tokens for x in replies)
                r["replies"] += replies
                r["order"].append(pos)
                r["load"].append([round(os.getloadavg()[0], 2), round(mem_available_gb() or 0.0, 2)])
                if before is not None and after is not None:
                    r["counters"] = add_counters(r["counters"], counter_delta(before, after))
            log.warning("c=%d slice done (%d prompts)", c, len(sl))
    out: dict = {}
    for n, by_c in results.items():
        out[n] = {}
        for c, r in by_c.items():
            replies = sorted(r["replies"], key=lambda x: x.prompt)
            lat = [x.latency_s for x in replies]
            row = {
                "tokens": r["tokens"],
                "wall_s": r["wall_s"],
                "tokens_per_s": r["tokens"] / r["wall_s"] if r["wall_s"] else None,
                "p50_s": percentile(lat, 0.5),
                "p99_s": percentile(lat, 0.99),
                "latencies_s": lat,
                "positions_in_round": r["order"],
                "load_1m_and_mem_available_gb_after_each_batch": r["load"],
                "texts": [x.text for x in replies],
                "token_ids": [x.token_ids for x in replies] if arms[n].engine == "vllm" else None,
                "completion_tokens": [x.tokens for x in replies],
            }
            if r["profile"]:
                row["profile"] = profile_shares(r["profile"], r["wall_s"])
                row["profile_counters"] = r["profile"]
            if arms[n].engine == "specops" and arms[n].method != "target":
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
                a = vllm_alpha(r["counters"], arms[n].k)
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
        begin, end = doc_markers(args.doc_section)
        title = "Throughput under load, next to vLLM's CPU build" if args.doc_section == "engines-load" else None
        write_doc_section(args.doc, begin, end, doc_section(report, table, begin, end, title))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replot:
        report = json.loads(args.replot.read_text())
        args.json = args.json or args.replot
        return finish(report, args)
    if any(a in VLLM_ARMS for a in args.arms):
        try:
            python = vllm_python(args.vllm_python)
        except VLLMError as exc:
            print(f"engines benchmark: {exc}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    command = " ".join(
        [".venv/bin/python", "benchmarks/engines.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    with tempfile.TemporaryDirectory(prefix="specops-engines-") as tmp_s:
        tmp = Path(tmp_s)
        from benchmarks.engines_learn import heldout_prompts, learn, perturbed_draft
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
        elif args.quick:
            learned, learned_info = perturbed_draft(model_dir, tmp / "engines" / "perturbed")
        else:
            learned, learned_info = learn(model_dir, args.learn, seed=args.seed, threads=args.threads)
        learned = Path(learned).resolve()
        log.warning("learned draft: %s", learned)
        target = target_name(model_dir)
        tok = load_tokenizer(model_dir / "target")
        prompts = heldout_prompts(tok, args.prompts, args.seed)
        log_dir = args.log_dir or (tmp / "logs" if args.quick else model_dir.parent / "engines" / "logs")
        version = vllm_version(python) if any(a in VLLM_ARMS for a in args.arms) else None
        max_len = max_model_len(model_dir, prompts, args.max_tokens, args.k)
        mem_before = mem_available_gb()
        servers = start_servers(args, model_dir, learned, log_dir, tmp / "data", max_len)
        try:
            ready = {n: getattr(s, "ready_s", None) for n, s in servers.items()}
            idle = idle_shares(servers, args.idle_check_s)
            mem_up = mem_available_gb()
            results = measure(make_arms(args, servers), prompts, args)
        finally:
            stop_servers(servers)
    env = {**environment(), "cpu_model": cpu_model()}
    report = {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": env,
        "vllm_version": version,
        "config": {
            "target": target,
            "model_dir": str(args.model_dir) if not args.quick else "tiny (temporary)",
            "prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "rounds": {str(c): len(slices(list(enumerate(prompts)), c, args.rounds)) for c in args.concurrency},
            "k": args.k,
            "arms": args.arms,
            "specops_threads": args.threads,
            "specops_draft_dtype": args.specops_draft_dtype,
            "vllm_omp_bind": args.vllm_omp_bind or "auto",
            "vllm_args": "--dtype float32 --no-enable-prefix-caching --seed 0",
            "kv_cache_gb": args.kv_cache_gb,
            "max_model_len": max_len,
            "quick": args.quick,
        },
        "learned_draft": {**learned_info, "dir": str(learned)},
        "servers": {
            "ready_s": ready,
            "idle_cpu_share": idle,
            "idle_check_s": args.idle_check_s,
            "mem_available_gb_before_start": mem_before,
            "mem_available_gb_all_up": mem_up,
        },
        "arms": results,
        "outputs": compare(results, args.concurrency),
        "elapsed_s": time.perf_counter() - started,
    }
    return finish(report, args)


if __name__ == "__main__":
    sys.exit(main())

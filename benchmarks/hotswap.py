"""Hot-swap benchmark: how long a promotion takes to reach traffic, and what a swap costs
the requests served while it happens.

On the bootstrapped target/draft pair, one serving node (``ServingNode`` over a
``DraftFollower``) serves cluster ``code`` to ``--concurrency`` client threads that send
held-out code prompts back to back (greedy, draft method). The registry is a fresh
MLflow store on SQLite in a temporary directory, holding two draft versions: the
bootstrap's ``draft/`` (A) and a copy with every weight slightly perturbed (B). With
``--events`` (the default) each promotion is also pushed to serving as a ModelEvent on
``spec.events`` (local log); with ``--no-events`` serving learns of it only by polling
the registry every ``--poll-s``.

Timeline: a warm-up promotion of A (not measured), then ``--swaps`` promotions
alternating B, A, B, ... Each swap is a full follow: resolve the alias, download and
checksum the artifact, validate it (tokenizer hash, weights, a smoke forward), swap the
slot. Between swaps the load runs undisturbed for ``--steady-s``.

Definitions (wall clock, ``time.time()``):

- **promotion** of a swap: the moment ``RegistryStore.promote`` returned (the alias has
  moved and, with events, the ModelEvent is published);
- **slot swap latency**: promotion → the slot's reference assignment
  (``DraftSlot.history``);
- **swap latency**: promotion → the first request that *started on the new version*
  finished (what a client can observe);
- **swap window** of a swap: from its promotion until ``--tail-s`` after that first
  request on the new version finished;
- a request is a **swap request** when it *finished* inside a swap window, a **steady
  request** when it finished anywhere else after the warm-up. Classifying by one point
  of each request keeps the two classes free of length bias: classifying by overlap
  would put most long requests into the swap class and leave the steady class with
  the short ones. A swap window thus holds the requests in flight while the version
  was fetched and validated, the first ones on the new version and those of the tail.
  Requests that started before the first steady window (the warm-up) are not
  classified.

``p99_swap_over_steady`` is the p99 request latency of swap requests over the p99 of
steady requests (1.0: swaps cost nothing); the same for p50. Prompts differ in length
and acceptance, so the JSON also has each request's *slowdown*: its latency over the
steady median of the same prompt on the same version (``slowdown_p50_swap``,
``slowdown_p99_swap``, and ``slowdown_p99_steady`` as the noise floor). Every greedy output is
compared with target-only decoding of the same prompt (``identical_outputs``), and
every request that raised counts in ``failed_requests`` (both over the whole run,
warm-up included).

Writes JSON (``--json``; ``summary`` holds ``failed_requests``, ``swap_latency_s``,
``slot_swap_latency_s``, ``p99_swap_over_steady`` and more), prints tables and a
one-line JSON summary, and replaces the hotswap section of ``docs/benchmarks.md``
(``--no-doc`` skips that).

    .venv/bin/python benchmarks/hotswap.py --json benchmarks/out/hotswap.json
    .venv/bin/python benchmarks/hotswap.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, registry/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from benchmarks.common import environment, fmt, write_doc_section
from benchmarks.hotswap_run import (  # noqa: E402, F401  (some only re-exported: the names this module used to define)
    CLUSTER,
    REPLICA,
    Load,
    Request,
    load_prompts,
    perturbed_draft,
    run_swaps,
    wait_for,
)
from specops.core.models import load_model_dir
from specops.paths import models_dir
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate

log = logging.getLogger("bench.hotswap")

DOC_BEGIN = "<!-- BEGIN hotswap (written by benchmarks/hotswap.py; edits inside are overwritten) -->"
DOC_END = "<!-- END hotswap -->"


# ---------------------------------------------------------------- metrics
def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def ratio(x: float | None, y: float | None) -> float:
    return x / y if x is not None and y else float("nan")


def median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def analyse(run: dict) -> dict:
    """Classify the requests into swap and steady, and summarise."""
    t0 = run["measured_from"]
    reqs = [r for r in run["requests"] if r.start >= t0]
    windows = [s["window"] for s in run["swaps"]]

    def inside(r: Request, w: tuple[float, float]) -> bool:
        return w[0] <= r.end < w[1]

    ok = [r for r in reqs if not r.error]
    in_swap = [r for r in ok if any(inside(r, w) for w in windows)]
    in_steady = [r for r in ok if not any(inside(r, w) for w in windows)]
    swap_lat, steady_lat = [r.latency_s for r in in_swap], [r.latency_s for r in in_steady]
    by_version = {}
    for v in sorted({r.version for r in ok}):
        mine = [r for r in ok if r.version == v]
        steady_v = [r.latency_s for r in in_steady if r.version == v]
        drafted = sum(r.drafted for r in mine)
        by_version[v] = {
            "requests": len(mine),
            "acceptance": sum(r.accepted for r in mine) / drafted if drafted else None,
            "p50_steady_s": pct(steady_v, 50),
            "requests_steady": len(steady_v),
        }
    # slowdown: latency / steady median of the same prompt on the same version (prompts differ in length and acceptance)
    ref: dict[tuple[int, str], list[float]] = {}
    for r in in_steady:
        ref.setdefault((r.prompt, r.version), []).append(r.latency_s)
    base = {k: statistics.median(v) for k, v in ref.items()}
    slow = {
        c: [r.latency_s / base[(r.prompt, r.version)] for r in rs if (r.prompt, r.version) in base]
        for c, rs in (("swap", in_swap), ("steady", in_steady))
    }
    per_swap = []
    for i, s in enumerate(run["swaps"]):
        in_w = [r.latency_s for r in ok if inside(r, s["window"])]
        per_swap.append(
            {
                **{k: v for k, v in s.items() if k != "window"},
                "index": i + 1,
                "window_s": s["window"][1] - s["window"][0],
                "requests": len(in_w),
                "p50_s": pct(in_w, 50),
                "max_s": max(in_w, default=None),
            }
        )
    steady_counts = [sum(1 for r in in_steady if w0 <= r.end < w1) for w0, w1 in run["steady_windows"]]
    failed = [r for r in run["requests"] if r.error]
    served = [r for r in run["requests"] if not r.error]
    span = max((r.end for r in reqs), default=t0) - t0
    summary = {
        "failed_requests": len(failed),
        "identical_outputs": all(r.identical for r in served),
        "swaps": len(run["swaps"]),
        "swap_latency_s": median([s["swap_latency_s"] for s in run["swaps"]]),
        "swap_latency_max_s": max((s["swap_latency_s"] for s in run["swaps"]), default=None),
        "slot_swap_latency_s": median([s["slot_swap_latency_s"] for s in run["swaps"]]),
        "event_latency_s": median([s["event_latency_s"] for s in run["swaps"]]),
        "fetch_validate_s": median([s["load_s"] for s in run["swaps"]]),
        "p50_steady_s": pct(steady_lat, 50),
        "p99_steady_s": pct(steady_lat, 99),
        "p50_swap_s": pct(swap_lat, 50),
        "p99_swap_s": pct(swap_lat, 99),
        "p50_swap_over_steady": ratio(pct(swap_lat, 50), pct(steady_lat, 50)),
        "p99_swap_over_steady": ratio(pct(swap_lat, 99), pct(steady_lat, 99)),
        "slowdown_p50_swap": pct(slow["swap"], 50),
        "slowdown_p99_swap": pct(slow["swap"], 99),
        "slowdown_p99_steady": pct(slow["steady"], 99),
        "requests": len(reqs),
        "requests_swap": len(swap_lat),
        "requests_steady": len(steady_lat),
        "requests_per_s": len(reqs) / span if span > 0 else None,
        "versions_served": sorted({r.version for r in reqs if not r.error}),
    }
    classes = {id(r): "swap" for r in in_swap} | {id(r): "steady" for r in in_steady}
    requests = [
        {
            "client": r.client,
            "prompt": r.prompt,
            "start": round(r.start - t0, 4),
            "end": round(r.end - t0, 4),
            "latency_s": round(r.latency_s, 4),
            "version": r.version,
            "class": classes.get(id(r), "warmup"),
            "drafted": r.drafted,
            "accepted": r.accepted,
            "identical": r.identical,
            "error": r.error,
        }
        for r in run["requests"]
    ]
    return {
        "summary": summary,
        "per_swap": per_swap,
        "steady_window_requests": steady_counts,
        "by_version": by_version,
        "errors": sorted({r.error for r in failed})[:10],
        "requests": requests,
    }


# ---------------------------------------------------------------- report
def _ms(x: float | None) -> str:
    return fmt(None if x is None else x * 1e3, ".0f", " ms")


def _s(x: float | None) -> str:
    return fmt(x, ".2f", " s")


def tables(report: dict) -> tuple[list[Table], str]:
    """Rich tables for the terminal and the same numbers as markdown for the doc."""
    s = report["summary"]
    head = Table(title="Request latency: steady state vs during swaps")
    for col in ("requests", "count", "p50", "p99", "slowdown p50", "slowdown p99"):
        head.add_column(col, justify="left" if col == "requests" else "right")
    rows = [
        (
            "steady",
            s["requests_steady"],
            _ms(s["p50_steady_s"]),
            _ms(s["p99_steady_s"]),
            "1.00×",
            fmt(s["slowdown_p99_steady"], ".2f", "×"),
        ),
        (
            "during swaps",
            s["requests_swap"],
            _ms(s["p50_swap_s"]),
            _ms(s["p99_swap_s"]),
            fmt(s["slowdown_p50_swap"], ".2f", "×"),
            fmt(s["slowdown_p99_swap"], ".2f", "×"),
        ),
        (
            "swap / steady",
            "",
            fmt(s["p50_swap_over_steady"], ".2f", "×"),
            fmt(s["p99_swap_over_steady"], ".2f", "×"),
            "",
            "",
        ),
    ]
    for r in rows:
        head.add_row(*map(str, r))
    per = Table(title="Swaps (latencies from promotion)")
    cols = ("#", "versions", "event", "slot swap", "first served", "fetch+validate", "window", "requests", "p50", "max")
    for col in cols:
        per.add_column(col, justify="right")
    md = ["| requests | count | p50 | p99 | slowdown p50 | slowdown p99 |", "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {' | '.join(map(str, r))} |" for r in rows]
    md += [
        "",
        "| # | versions | event | slot swap | first request served | fetch + validate | window | requests | p50 | max |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in report["per_swap"]:
        cells = (
            str(w["index"]),
            f"{w['from']} → {w['to']}",
            _s(w["event_latency_s"]),
            _s(w["slot_swap_latency_s"]),
            _s(w["swap_latency_s"]),
            _s(w["load_s"]),
            _s(w["window_s"]),
            str(w["requests"]),
            _ms(w["p50_s"]),
            _ms(w["max_s"]),
        )
        per.add_row(*cells)
        md.append(f"| {' | '.join(cells)} |")
    ver = Table(title="Draft versions (A: bootstrap draft, B: perturbed copy)")
    for col in ("version", "requests", "acceptance", "steady requests", "steady p50"):
        ver.add_column(col, justify="right")
    names = {v: k for k, v in report["config"]["versions"].items()}
    md += ["", "| version | requests | acceptance | steady requests | steady p50 |", "|---|---:|---:|---:|---:|"]
    for v, r in report["by_version"].items():
        cells = (
            f"{v} ({names.get(v, v)})",
            str(r["requests"]),
            fmt(r["acceptance"], ".3f"),
            str(r["requests_steady"]),
            _ms(r["p50_steady_s"]),
        )
        ver.add_row(*cells)
        md.append(f"| {' | '.join(cells)} |")
    md += [
        "",
        f"Median over swaps: slot swap {_s(s['slot_swap_latency_s'])}, first request served on the new "
        f"version {_s(s['swap_latency_s'])} (max {_s(s['swap_latency_max_s'])}); failed requests "
        f"{s['failed_requests']}; greedy outputs identical to target-only decoding: "
        f"{'yes' if s['identical_outputs'] else 'NO'}.",
    ]
    return [head, per, ver], "\n".join(md)


def doc_section(report: dict, table: str) -> str:
    c, env, s = report["config"], report["environment"], report["summary"]
    push = (
        f"promotions pushed as ModelEvents on `spec.events` (local log), registry polled every {c['poll_s']:g} s"
        if c["events"]
        else f"no events: serving polls the registry every {c['poll_s']:g} s"
    )
    return "\n".join(
        [
            DOC_BEGIN,
            "## Hot-swap (`benchmarks/hotswap.py`)",
            "",
            "Command:",
            "",
            f"    {report['command']}",
            "",
            f"Date {report['date'][:10]}; {env['cpu_count']} CPU cores, {env['threads']} torch threads, no GPU; commit "
            f"{str(env['git_commit'])[:10]}{' (dirty)' if env['git_dirty'] else ''}. One serving node, cluster "
            f"`{CLUSTER}`, {c['concurrency']} client threads sending {c['prompts']} {c['prompt_kind']} prompts of "
            f"{c['prompt_tokens']} tokens back to back ({c['max_new_tokens']} new tokens, greedy, draft method); "
            f"MLflow registry on SQLite; {push}. {s['swaps']} promotions alternating between the bootstrap draft and a "
            f"perturbed copy, {c['steady_s']:g} s of steady load between swaps. Run time {report['elapsed_s']:.0f} s.",
            "",
            table,
            "",
            "Latencies are measured from the moment `promote()` returned (the alias has moved). *Slot swap*: the "
            "follower has fetched, checksummed and validated the version and assigned it to the slot; *first request "
            "served*: the first request that took the new version has finished (`swap_latency_s`). A swap window runs "
            f"from the promotion to {c['tail_s']:g} s after that first request; a request that finished inside a swap "
            "window counts as *during swaps*, any other as *steady* (classifying by the finish time, one point per "
            "request, keeps long requests from piling up in the swap class). *Slowdown*: a request's latency over the "
            "steady median of the same prompt on the same draft version (prompts differ in length and acceptance, "
            "so this removes the prompt mix from the comparison; the steady median is 1.00× by construction). The fetch and validation run on the follower's thread and "
            "compete with decoding for the CPU; the swap/steady ratios show what that costs the requests served meanwhile. "
            "With few requests per window the p99 is close to the maximum.",
            DOC_END,
        ]
    )


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap dir with target/, draft/, manifest.json")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--swaps", type=int, default=None, help="measured promotions (default 10; 5 with --quick)")
    p.add_argument(
        "--steady-s", type=float, default=None, help="seconds of steady load between swaps (default 10; 4 with --quick)"
    )
    p.add_argument(
        "--tail-s",
        type=float,
        default=1.0,
        help="a swap window ends this long after the first request on the new version finished",
    )
    p.add_argument(
        "--events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="push promotions to serving as ModelEvents (spec.events); --no-events: polling only",
    )
    p.add_argument("--poll-s", type=float, default=10.0, help="seconds between the follower's registry polls")
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="held-out code prompts cycled by the clients (default 32; 8 with --quick)",
    )
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per request")
    p.add_argument(
        "--perturb", type=float, default=0.02, help="noise (× each tensor's std) of the second draft version"
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--timeout-s", type=float, default=120.0, help="give up on a swap after this long (plus one --poll-s)"
    )
    p.add_argument("--quick", action="store_true", help="5 swaps, 4 s steady windows, 8 prompts (about a minute)")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    args.swaps = args.swaps if args.swaps is not None else (5 if args.quick else 10)
    args.steady_s = args.steady_s if args.steady_s is not None else (4.0 if args.quick else 10.0)
    args.prompts = args.prompts or (8 if args.quick else 32)
    if args.swaps < 1 or args.concurrency < 1 or args.steady_s <= 0 or args.tail_s < 0 or args.poll_s <= 0:
        p.error("need --swaps >= 1, --concurrency >= 1, --steady-s > 0, --tail-s >= 0, --poll-s > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    for noisy in ("alembic", "mlflow", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING if args.verbose else logging.ERROR)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model_dir = Path(args.model_dir)
    pair = load_model_dir(model_dir)
    if pair.draft is None:
        raise SystemExit(f"{model_dir} has no draft/; run `specops bootstrap` first")
    prompts, prompt_kind = load_prompts(model_dir, pair, args.prompts, args.prompt_tokens)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    ref_engine = SpecEngine(pair)
    refs = [
        plain_generate(ref_engine, p, params, method="target").token_ids
        for p in tqdm(prompts, desc="target-only references", unit="prompt")
    ]
    with tempfile.TemporaryDirectory(prefix="specops-hotswap-") as tmp:
        run = run_swaps(pair, prompts, refs, args, Path(tmp))
    result = analyse(run)
    report = {
        "command": " ".join(
            [".venv/bin/python", "benchmarks/hotswap.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {
            "model_dir": str(model_dir),
            "cluster": CLUSTER,
            "concurrency": args.concurrency,
            "swaps": args.swaps,
            "steady_s": args.steady_s,
            "tail_s": args.tail_s,
            "events": args.events,
            "poll_s": args.poll_s,
            "prompts": len(prompts),
            "prompt_kind": prompt_kind,
            "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens,
            "perturb": args.perturb,
            "versions": run["versions"],
        },
        "summary": result["summary"],
        "per_swap": result["per_swap"],
        "steady_window_requests": result["steady_window_requests"],
        "by_version": result["by_version"],
        "warmup": {k: v for k, v in run["warmup"].items() if k != "window"},
        "errors": result["errors"],
        "events_received": run["events_received"],
        "registry_setup_s": run["registry_setup_s"],
        "environment": environment(),
        "elapsed_s": time.perf_counter() - started,
        "requests": result["requests"],
        "requests_note": "times in s from the start of the first steady window; class by finish time",
    }
    rich_tables, table = tables(report)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    for t in rich_tables:
        console.print(t)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=float))
    if not args.no_doc:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, table))
    s = report["summary"]
    print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in s.items()}))
    return 0 if s["failed_requests"] == 0 and s["identical_outputs"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Soak and fault benchmark: serving, training and the registry as separate processes under
load, while a driver SIGKILLs them at random points and restarts them.

The system under test, each its own OS process group on loopback:

- ``mlflow server`` on a SQLite store (the registry's HTTP path, artifacts served by it);
- ``specops serve`` (``--stream local://DIR``, ``--registry http://...``), cluster ``faults``;
- ``specops train`` consuming that stream, registering every update in the registry and
  promoting it through the gate (``--gate-margin -1``: every candidate with evidence is
  promoted, so promotions and hot-swaps happen all through the run).

``--clients`` threads send distinct greedy completion requests (random token-id prompts,
``X-Request-Id`` ``fault-c<client>-<seq>``) back to back. Meanwhile the driver kills one
component at a time with SIGKILL at seeded random points (each of ``--kills`` slots of the
run gets one kill at a random point inside it; the components take turns in a seeded
shuffled order, so each is killed equally often), keeps it down for a random moment
and restarts it on the same port, store, stream and checkpoint directory. At the end the
server gets SIGTERM (it must flush and exit 0), the trainer SIGINT, and the run is checked.

Definitions:

- **kill window** of a component: from the moment the driver sends SIGKILL to the moment
  the restarted process is back: ``/readyz`` 200 for the server, ``/health`` 200 for the
  MLflow server, for the trainer (it has no probe) its startup line in its log, written
  once its imports are done and its registry is open. Windows of different components may
  overlap (the server may restart while the registry is down); a component is killed again
  only ``--min-gap-s`` after it is back.
- A request **overlaps** a window when it started before the window closed and ended
  after it opened. Only the *server's* windows excuse a failure: the trainer and the
  registry are off the request path, so their kills must fail no request. A failed request
  that overlaps a server window is an **in-flight** request of the killed server when it
  started before the kill, else it was **sent while the server was down**; any other failed
  request is **failed outside the kill windows** (must be 0).
- A logged record is **accepted** once the serving stream logger's publish returned (the
  local log appended it); records still queued in a server's memory die with it
  (``serving/fleet/stream_logger.py``). The driver scrapes each server's
  ``specops_stream_logger_published_total`` every second and once more just before killing
  it. **Accepted records lost** (must be 0) counts, per topic (``spec.misses``,
  ``spec.generations``):
  - for the server stopped gracefully at the end: every answered request's record
    missing from the stream (SIGTERM flushes everything);
  - for each killed server: the larger of (a) its last scraped published count minus the
    records of its requests in the stream, and (b) the *holes*: answered requests whose
    record is missing although a record of a request sent *after that answer arrived* is
    in the stream (one cluster is one partition, and the logger publishes in the order it
    logged, so a later record on disk proves every earlier one was accepted).
  Answered requests of killed servers whose records are missing otherwise were still
  queued when the server died (the documented limit); they are counted apart. Records the
  logger refused (its ``specops_stream_logger_dropped_total``: a record it could not build,
  shedding) were never accepted either: they are counted apart and must be 0 as well.
- **Versions duplicated** (must be 0): registered versions of ``draft-faults`` whose
  ``source_id`` tag (trainer id / cluster / checkpoint version, the registration's
  idempotency key) or whose training window (``lineage_offsets``: the first and last
  offset trained on per partition, cumulative, so two updates of one trainer differ in it
  unless the second trained on no new record) equals an earlier version's.
- **Tenant isolation and bounded clusters** (``check_isolation``, on the last server once the
  load has stopped): the clients take turns between two API keys (tenants) and a third key
  sends only probes; ``/readyz`` names no cluster; requests naming made-up clusters are 400s
  naming ``cluster`` and never become metric labels or stream records; and the extraction
  replay of issue 34 (tenant E probing tenant A's sampled output through LLMA's past
  sessions, then guessing it token by token) finds nothing, while the same probe by A does
  (the positive control).
- **Outputs equal to target-only**: after the run every answered prompt is decoded greedily
  target-only in this process (``SpecEngine``, ``method="target"``) and compared with the
  response text, and token for token with the ``output_ids`` of its GenerationRecord when
  that is in the stream. An output that differs only where the target's top two logits tie
  (every served token within ``TIE_TOL`` of the target's maximum given the served prefix,
  computed in float64) is the target's greedy output with a float32 tie broken the other way
  by a batched verification (``serving/engine/batching.py``); it is counted apart. Any other
  difference is a **diverged** output (must be 0).

The models are a tiny random pair by default (a ``--tiny`` bootstrap's tokenizer, a
2-layer target with peaky logits as the tests use, and a noisy copy of it as the draft),
so the run fits on 2 CPU cores; ``--models DIR`` uses DIR's ``target/`` and ``draft/``.

Writes JSON (``--json``; ``summary`` holds the counts above and ``violations``), prints
tables and a one-line JSON summary, replaces the faults section of ``docs/benchmarks.md``
(``--no-doc`` skips that), and exits 1 if an invariant is violated.

    .venv/bin/python benchmarks/faults.py --json benchmarks/out/faults.json
    .venv/bin/python benchmarks/faults.py --quick --no-doc
    .venv/bin/python benchmarks/faults.py --components trainer --kills 8 --no-doc   # kill one component only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, streams/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from rich.console import Console

from benchmarks.common import environment, write_doc_section
from benchmarks.soak.checks import (
    analyse,
    check_isolation,
    check_outputs,
    check_records,
    check_versions,
    classify,
    isolation_violations,
)
from benchmarks.soak.driver import Driver, Load
from benchmarks.soak.report import DOC_BEGIN, DOC_END, doc_section, tables
from benchmarks.soak.stack import (
    BOGUS_CLUSTERS,
    CLUSTER,
    COMPONENTS,
    DECOYS,
    DOWN_S,
    LOAD_TENANTS,
    TENANTS,
    TIE_TOL,
    TOPICS,
    TRAINER_UP,
    Attempt,
    Proc,
    Stack,
    Window,
    make_prompt,
    metric_clusters,
    perturbed,
    read_registry,
    read_stream,
    scrape,
    tiny_pair,
)

__all__ = [  # the parts live in benchmarks/soak/; tests/test_faults.py imports them from here
    "BOGUS_CLUSTERS",
    "CLUSTER",
    "COMPONENTS",
    "DECOYS",
    "DOC_BEGIN",
    "DOC_END",
    "DOWN_S",
    "LOAD_TENANTS",
    "NOISY",
    "TENANTS",
    "TIE_TOL",
    "TOPICS",
    "TRAINER_UP",
    "Attempt",
    "Driver",
    "Load",
    "Proc",
    "Stack",
    "Window",
    "analyse",
    "check_isolation",
    "check_outputs",
    "check_records",
    "check_versions",
    "classify",
    "doc_section",
    "isolation_violations",
    "main",
    "make_prompt",
    "metric_clusters",
    "parse_args",
    "perturbed",
    "read_registry",
    "read_stream",
    "run_and_report",
    "scrape",
    "tables",
    "tiny_pair",
]

log = logging.getLogger("bench.faults")

NOISY = ("alembic", "mlflow", "transformers", "urllib3", "trainer")
"""Loggers quietened in this process (the tiny bootstrap, the registry client, the references)."""


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--models",
        type=Path,
        default=None,
        help="directory with target/ and draft/ (default: a tiny random pair built in the work directory)",
    )
    p.add_argument("--duration-s", type=float, default=None, help="seconds of load (default 240; 75 with --quick)")
    p.add_argument(
        "--kills", type=int, default=None, help="SIGKILLs, the components taking turns (default 9; 3 with --quick)"
    )
    p.add_argument(
        "--components", default=",".join(COMPONENTS), help="comma-separated components to kill, taking turns"
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill plan, the prompts and the tiny models")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of each process")
    p.add_argument(
        "--min-gap-s", type=float, default=3.0, help="least steady load between one window and the next kill"
    )
    p.add_argument("--tail-s", type=float, default=5.0, help="least steady load after the last window")
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="give up on a (re)start after this long")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="client read timeout per request")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the stream, registry, checkpoints and process logs here (default: a temporary "
        "directory, removed unless an invariant is violated)",
    )
    p.add_argument("--quick", action="store_true", help="75 s of load, one kill of each component")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument(
        "--doc-from",
        type=Path,
        default=None,
        metavar="JSON",
        help="only rewrite the doc section from a saved --json report",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    args.duration_s = args.duration_s if args.duration_s is not None else (75.0 if args.quick else 240.0)
    args.kills = args.kills if args.kills is not None else (3 if args.quick else 9)
    args.components = tuple(c.strip() for c in args.components.split(",") if c.strip())
    if not args.components or not set(args.components) <= set(COMPONENTS):
        p.error(f"--components takes a comma-separated subset of {','.join(COMPONENTS)}")
    if args.kills < 0 or args.clients < 1 or args.duration_s <= 0 or args.max_tokens < 1:
        p.error("need --kills >= 0, --clients >= 1, --duration-s > 0, --max-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.doc_from:
        report = json.loads(args.doc_from.read_text())
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, tables(report)[1]))
        return 0
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    levels = {name: logging.getLogger(name).level for name in (log.name, *NOISY)}
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.WARNING if args.verbose else logging.ERROR)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:  # called in-process by tests/test_faults.py: leave the caller's threads and log levels as they were
        return run_and_report(args, argv)
    finally:
        torch.set_num_threads(threads)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def run_and_report(args: argparse.Namespace, argv: list[str] | None) -> int:
    started = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="specops-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    stack = None
    try:
        if args.models is None:
            model_dir = tiny_pair(work / "models", args.seed)
            models = "tiny random pair (2-layer target, noisy copy as draft)"
        else:
            model_dir, models = args.models, str(args.models)
        args.vocab = int(json.loads((model_dir / "target" / "config.json").read_text())["vocab_size"])
        stack = Stack(work, model_dir / "target", model_dir / "draft", args)
        run = Driver(stack, args).run()
    except BaseException:
        if stack is not None:
            log.error("the run failed; process logs in %s\n%s", work / "logs", stack.logs())
        raise
    finally:
        if stack is not None:
            stack.close()
    result = analyse(run, model_dir, args)
    s = result["summary"]
    report = {
        "command": " ".join(
            [".venv/bin/python", "benchmarks/faults.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {
            "models": models,
            "clients": args.clients,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "threads": args.threads,
            "duration_s": args.duration_s,
            "kills": args.kills,
            "components": args.components,
            "cluster": CLUSTER,
        },
        "summary": s,
        "kills": [
            {
                **asdict(w),
                "killed_at": round(w.killed_at, 2),
                "back_at": w.back_at and round(w.back_at, 2),
                "down_s": round(w.down_s, 2),
            }
            for w in run["windows"]
        ],
        "components": result["components"],
        "records": {k: v for k, v in result["records"].items()},
        "versions": result["versions"],
        "outputs": {k: v for k, v in result["outputs"].items()},
        "isolation": result["isolation"],
        "failures": result["failures"],
        "setup_s": round(run["setup_s"], 1),
        "load_s": run["load_s"],
        "environment": environment(),
        "elapsed_s": time.perf_counter() - started,
        "workdir": str(work),
    }
    rich_tables, table = tables(report)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    for t in rich_tables:
        console.print(t)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if not args.no_doc:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, table))
    print(json.dumps({k: v for k, v in s.items() if k != "violations"}))
    for v in s["violations"]:
        log.error("invariant violated: %s", v)
    if s["violations"]:
        log.error("process logs, stream and registry kept in %s", work)
    elif args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if s["invariants_hold"] else 1


if __name__ == "__main__":
    sys.exit(main())

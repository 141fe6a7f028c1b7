"""The OSD benchmark's command line."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.distill.constants import PARTS, SHIFT_WINDOWS, WINDOW
from benchmarks.harness.env import REPO_ROOT
from specops.paths import models_dir
from specops.serving.proposers.catalogue import DEFAULT_K
from specops.workloads.chat_workload import DOMAINS as DEFAULT_DOMAINS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="OSD benchmark: do drafts learn from production-shaped traffic they have never seen?",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Full run: about 1.5 h on 2 cores (target continuations cached after the first).",
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap dir with target/, draft/, manifest.json")
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="distinct chat requests served per domain (default 1000; 120 with --quick)",
    )
    p.add_argument(
        "--probe", type=int, default=None, help="held-out probe requests per domain (default 100; 40 with --quick)"
    )
    p.add_argument(
        "--router-texts",
        type=int,
        default=None,
        help="prompts per domain the router is fitted on (default 100; 30 with --quick)",
    )
    p.add_argument("--router-embedder", default="minilm", help="router embedder (serving's: minilm)")
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="new tokens per request (default 48; 32 with --quick)"
    )
    p.add_argument("--k", type=int, default=DEFAULT_K["draft"], help="draft tokens per step (the engine's default)")
    p.add_argument("--interval", type=int, default=None, help="trainer: update interval I (default: the trainer's)")
    p.add_argument("--lr", type=float, default=None, help="trainer: learning rate (default: the trainer's)")
    p.add_argument("--steps", type=int, default=None, help="trainer: AdamW steps per update (default: the trainer's)")
    p.add_argument(
        "--average-decay",
        type=float,
        default=None,
        metavar="D",
        help="trainer: publish a moving average of the weights at decay D, 0 = off (default: the trainer's)",
    )
    p.add_argument("--loss", choices=("fkl", "rkl", "jsd"), default=None, help="trainer: loss (default: the trainer's)")
    p.add_argument(
        "--positions",
        choices=("rejected", "all"),
        default=None,
        help="trainer: positions trained (default: the trainer's)",
    )
    p.add_argument(
        "--replay",
        choices=("clear", "recent", "reservoir"),
        default=None,
        help="trainer: replay policy (default: the trainer's)",
    )
    p.add_argument("--capacity", type=int, default=None, help="trainer: replay capacity (default: the trainer's)")
    p.add_argument(
        "--probe-every",
        type=int,
        default=None,
        help="measure the probe every N requests of a cluster (default 100; 40 with --quick)",
    )
    p.add_argument("--offline-epochs", type=int, default=2, help="offline distillation epochs (the paper's 2)")
    p.add_argument("--offline-lr", type=float, default=1e-3, help="offline learning rate")
    p.add_argument(
        "--offline-sweep",
        default="",
        metavar="LR:E,E;LR:E",
        help="more offline configurations (learning rate: epoch counts, one run per rate); the offline arm, the "
        "bound, is the best on the probe of these and the default (e.g. '1e-3:1,3;3e-3:1,2,3')",
    )
    p.add_argument(
        "--baseline-fraction",
        type=float,
        default=0.1,
        help="the paper's baseline: offline distillation on this share of each domain's served requests "
        "(0 skips; runs with the offline part)",
    )
    p.add_argument("--offline-batch", type=int, default=8, help="sequences per offline step")
    p.add_argument(
        "--generic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the loop from a generic (never distilled) draft (default: on; off with --quick)",
    )
    p.add_argument(
        "--generic-requests", type=int, default=None, help="requests per domain of the generic run (default 300)"
    )
    p.add_argument("--generic-steps", type=int, default=400, help="hard-label training steps of the generic draft")
    p.add_argument(
        "--shift-requests",
        type=int,
        default=None,
        help="requests per segment of the sql -> math -> sql switch on one draft (default 400; 40 with --quick; 0 skips)",
    )
    p.add_argument(
        "--gate-windows",
        default=",".join(map(str, SHIFT_WINDOWS)),
        help="shift run: more gated arms beside the gate's default, on the same candidates and requests, each W "
        "(held-out window W, 0 = all the trainer keeps) or W:F (and F fresh test-then-train requests, 0 = "
        "held-out only; W alone takes the default F) ('' for none)",
    )
    p.add_argument(
        "--main-windows",
        default="",
        help="main run: gate arms (W or W:F, as --gate-windows) measured as more gated arms (served α over each cluster's last "
        f"{WINDOW} requests; e.g. '0' for the whole held-out set)",
    )
    p.add_argument(
        "--auto-warm",
        type=int,
        default=None,
        help="probe prompts per domain the auto policy serves with the static draft before the speed arms (its "
        "history in the cluster; default 4, 1 with --quick)",
    )
    p.add_argument(
        "--families",
        choices=("seen", "all"),
        default="seen",
        help="seen: served traffic, its probe and the router texts leave out the held-out families (sql schemas, "
        "math templates, api packages: specops.workloads.chat_workload.HELD_OUT), which the template-disjoint probe uses; "
        "all: every family (the workload before issue 55, no disjoint probe)",
    )
    p.add_argument(
        "--probe-disjoint",
        type=int,
        default=None,
        help="template-disjoint probe requests per domain, from the held-out families only (default 100; 40 with "
        "--quick; 0 skips)",
    )
    p.add_argument("--audit-window", type=int, default=50, help="requests of its cluster each promotion is audited on")
    p.add_argument("--check-every", type=int, default=100, help="decode every N-th request with the real engine too")
    p.add_argument(
        "--speed-prompts",
        type=int,
        default=None,
        help="probe prompts per domain timed with the real engine (default 6; 2 with --quick; 0 skips)",
    )
    p.add_argument(
        "--prepare",
        action="store_true",
        help="only build the workload and cache the target's continuations (the slow first step), then exit",
    )
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="which parts to run (comma-separated): two processes can share the work, then --merge their JSONs",
    )
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="merge the --json reports of runs of different --parts (the first one's command and config "
        "lead), then write the summary, plot, JSON and doc as one run; runs nothing",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="run the recipe grid (quick size: --grid-requests per domain) instead of the arms",
    )
    p.add_argument(
        "--grid-reuse",
        type=Path,
        default=None,
        metavar="JSON",
        help="a (partial) --grid JSON whose rows are reused where the recipe and traffic size match",
    )
    p.add_argument("--grid-requests", type=int, default=None, help="requests per domain of each grid run (default 80)")
    p.add_argument(
        "--domains",
        default=",".join(DEFAULT_DOMAINS),
        help="chat domains, one cluster each (comma-separated; default %(default)s). docs: documentation "
        "paragraphs of pinned packages to rewrite in plain words, real text rather than templates "
        "(specops.workloads.chat_workload.REAL_TEXT); run it on its own and --merge its JSON beside the main run's",
    )
    p.add_argument("--batch", type=int, default=16, help="prompts per batched target generation")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--speed-threads",
        type=int,
        default=None,
        help="torch CPU threads for the speed part only (default: --threads); e.g. learn on 2 threads, time on 1 "
        "as a one-core replica serves",
    )
    p.add_argument("--quick", action="store_true", help="120 requests per domain, 32 new tokens, no generic run")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument(
        "--plot", type=Path, default=REPO_ROOT / "docs" / "img" / "osd.png", help="PNG plot of α over requests"
    )
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="re-derive the summary, plot, table and doc section from a saved --json report; runs nothing",
    )
    p.add_argument(
        "--teacher-forward",
        action="store_true",
        help="measure teacher-forward training (requests an external engine served, no distributions logged) "
        "against the native path instead of the arms (benchmarks/osd_teacher.py)",
    )
    p.add_argument("--tf-domains", default="sql", help="domains of --teacher-forward (comma-separated)")
    args = p.parse_args(argv)
    q = args.quick
    for name, full, quick in (
        ("requests", 1000, 120),
        ("probe", 100, 40),
        ("router_texts", 100, 30),
        ("max_new_tokens", 48, 32),
        ("probe_every", 100, 40),
        ("generic", True, False),
        ("generic_requests", 300, 60),
        ("shift_requests", 400, 40),
        ("speed_prompts", 6, 2),
        ("auto_warm", 4, 1),
        ("probe_disjoint", 100, 40),
        ("grid_requests", 80, 80),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    return args

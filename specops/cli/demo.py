"""``specops demo``: the closed loop in one command (the demo itself is ``specops.demo.run``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from specops.cli.common import add_model_dir, prose, set_threads
from specops.paths import data_dir

DESCRIPTION = prose(
    """
    Starts the embedded stack (local stream log, MLflow on SQLite with its UI, the trainer with its scheduler as its
    own process, the API server), replays production-shaped chat traffic through the HTTP API with the openai client
    (/v1/chat/completions in three domains the bootstrap never saw: sql, math, api; sql/math-heavy, then shifting to
    api-heavy; every prompt distinct, served once; the router fitted on other prompts of each domain; no speculation
    method named, so the server's default, auto, decodes), and shows α and auto's share of steps on the draft
    per cluster live (the OSD paper's per-token α) as the trainer promotes drafts and serving hot-swaps them. Ends
    with a speed and acceptance comparison on prompts never served (target-only, static draft, online draft, auto
    with the final champion, and DReSD on the datastore the trainer rebuilt from the served generations, once one is
    promoted), beside auto's speed on the same prompts before any traffic, and writes
    report/index.html and report/summary.json. --workload corpus replays raw continuations of held-out code and
    prose files instead. Builds the default models first if needed (about 10-13 minutes on 2 cores); the loop itself
    takes about 10 minutes on the default pair (150 requests; --quick: 24, about 3). Every run starts from fresh
    state under <data>/demo.
    """
)

# DemoConfig fields a flag overrides when given (None: the config's own default, quick or not)
OVERRIDES = ("requests", "clients", "max_tokens", "seed", "recurring", "workload", "method")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="the closed loop in one command: serving, stream, trainer, registry, hot-swap, acceptance going up",
        description=DESCRIPTION,
    )
    add_model_dir(p, "model directory")
    p.add_argument("--quick", action="store_true", help="a shorter run: 24 requests, 2 closing prompts per cluster")
    p.add_argument(
        "--workload",
        choices=("chat", "corpus"),
        default=None,
        help="chat: chat requests in the domains sql, math and api (production-shaped traffic for the "
        "Instruct target); corpus: raw continuations of held-out bootstrap files, code then prose "
        "(default: chat)",
    )
    p.add_argument("--requests", type=int, default=None, help="requests to replay (default: 150, --quick 24)")
    p.add_argument(
        "--recurring",
        type=int,
        default=None,
        metavar="N",
        help="draw prompts with replacement from N prompts per domain (recurring queries, which "
        "a draft can memorise) instead of serving each prompt once (default: 0, distinct prompts)",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help="concurrent client threads (default: 1, leaving a core to the trainer)",
    )
    p.add_argument(
        "--method",
        default=None,
        metavar="METHOD",
        help="the speculation method every request names, e.g. draft (default: none, as a client that knows "
        "nothing of speculation sends: the server decodes with its default, auto, which picks the draft model, "
        "LLMA copying or the target alone per step, by their measured speed)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default: 32)")
    p.add_argument("--seed", type=int, default=None, help="seed of the workload schedule (default: 0)")
    p.add_argument("--report", default="report", help="report directory (default: %(default)s)")
    p.add_argument(
        "--ui-port", type=int, default=5000, help="MLflow UI port, or the next free one (default: %(default)s)"
    )
    p.add_argument(
        "--linger",
        dest="linger",
        action="store_true",
        default=None,
        help="keep the MLflow UI and the API up after the report, until Ctrl-C (default: when interactive)",
    )
    p.add_argument("--no-linger", dest="linger", action="store_false", help="exit after the report")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from specops.demo.run import DemoConfig, run_demo

    set_threads(args.threads)
    cfg = DemoConfig.quick() if args.quick else DemoConfig()
    changes = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    cfg = dataclasses.replace(cfg, **changes)
    linger = sys.stdin.isatty() if args.linger is None else args.linger
    return run_demo(Path(args.model_dir), data_dir(), Path(args.report), cfg, ui_port=args.ui_port, linger=linger)

"""The ``specops`` command line: one module per command group, assembled here.

Each module in ``COMMANDS`` has ``add_parser(sub)``, which adds its command (or its group of subcommands) and sets
``func`` to the function that runs it. A new group is a new module with ``add_parser`` plus its entry in
``COMMANDS``; the options several groups share are in ``specops/cli/common.py``. Command functions import
torch, transformers and the serving and trainer packages when they run, so ``specops --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from specops import logs
from specops.cli import (
    artifact,
    bootstrap,
    datastore,
    demo,
    generate,
    kb,
    knnlm,
    models,
    policy,
    registry,
    router,
    serve,
    sessions,
    streams,
    train,
)
from specops.cli.common import add_version

# in the order `specops --help` lists them
COMMANDS = (
    bootstrap,
    models,
    generate,
    train,
    streams,
    serve,
    registry,
    artifact,
    router,
    datastore,
    knnlm,
    kb,
    sessions,
    policy,
    demo,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specops",
        description="Speculative-decoding drafters that learn online. "
        "Run `specops COMMAND --help` for each command's options.",
    )
    add_version(parser)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors in the log")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: all cores, max 8) (env: SPECOPS_THREADS)"
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=os.environ.get("SPECOPS_LOG_FORMAT", "text").lower(),
        help="text lines, or one JSON object per line with time, level, logger, message and the record's fields "
        "(default: text) (env: SPECOPS_LOG_FORMAT)",
    )
    parser.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        default=os.environ.get("SPECOPS_ACCESS_LOG", "1").lower() not in ("0", "false", "no", "off"),
        help="no access log line per API request (logger specops.access) (env: SPECOPS_ACCESS_LOG=0)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _setup_logging(verbose: int, fmt: str = "text", access_log: bool = True) -> None:
    level = logging.WARNING if verbose < 0 else logging.INFO if verbose == 0 else logging.DEBUG
    logs.setup(level, fmt, access_log=access_log)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):  # a TOML file of the command's options: defaults the flags override
        from specops import config_file

        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        try:
            sub.set_defaults(**config_file.load(args.config, sub, args.command))
        except ValueError as exc:
            sub.error(str(exc))
        args = parser.parse_args(argv)
    try:
        _setup_logging(-1 if args.quiet else args.verbose, args.log_format, args.access_log)
    except ValueError as exc:  # argparse checks choices of flags, not of defaults from the environment
        parser.error(f"SPECOPS_LOG_FORMAT: {exc}")
    from specops.core.errors import SpecOpsError
    from specops.registry.errors import RegistryError
    from specops.streams.errors import StreamError

    try:
        return int(args.func(args) or 0)
    except (SpecOpsError, StreamError, RegistryError) as err:
        print(f"specops {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

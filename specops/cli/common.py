"""What several command groups share: argparse types, argument blocks, the torch thread count.

Light on purpose: every command module imports it while ``specops --help`` builds the parser.
"""

from __future__ import annotations

import argparse
import os
import sys

from specops.paths import models_dir


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def env_note(*names: str) -> str:
    """The ``(env: NAME, ...)`` note a flag's help ends with when its value or its default comes from there."""
    return f"(env: {', '.join(names)})"


def version_text() -> str:
    """``specops --version``: the installed package's version, and torch's and Python's (read from the
    installed metadata: nothing is imported)."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"specops {version('specops')} (torch {version('torch')}, Python {sys.version.split()[0]})"


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` and exit (looked up only when asked, so parsing stays fast)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def add_version(parser: argparse.ArgumentParser) -> None:
    """``-V, --version`` on the top-level parser."""
    parser.add_argument(
        "-V", "--version", action=_VersionAction, help="print the version of specops (and torch) and exit"
    )


THREADS_ENV = "SPECOPS_THREADS"
"""The default of ``--threads`` where it is not given (a container's CPU limit, a test run sharing cores)."""


def default_threads() -> int:
    """``$SPECOPS_THREADS`` when set (a positive integer), else all cores, at most 8."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise SystemExit(f"{THREADS_ENV}={raw!r}: expected a positive integer (torch CPU threads)")
        return int(raw)
    return min(os.cpu_count() or 1, 8)


def set_threads(n: int | None) -> None:
    """``--threads``: torch CPU threads (default: :func:`default_threads`)."""
    import torch

    torch.set_num_threads(n or default_threads())


def add_group(sub, name: str, *, help: str, description: str) -> argparse._SubParsersAction:
    """A command group ``specops NAME SUBCOMMAND``: its parser, and the subparsers to add its subcommands to.

    The chosen subcommand's name lands in ``args.<NAME>_command``."""
    p = sub.add_parser(name, help=help, description=description)
    return p.add_subparsers(dest=f"{name}_command", required=True, metavar="SUBCOMMAND")


def add_model_dir(p: argparse.ArgumentParser, what: str) -> None:
    """``--model-dir``, a bootstrap's models (``specops bootstrap --out``)."""
    p.add_argument(
        "--model-dir", default=str(models_dir()), help=f"{what} (default: %(default)s) (env: SPECOPS_DATA_DIR)"
    )


def fail(command: str, message: str) -> int:
    """Say why ``specops COMMAND`` cannot run, the way argparse does, and return its exit status 2."""
    print(f"specops {command}: error: {message}", file=sys.stderr)
    return 2


def prose(text: str) -> str:
    """A help text written as a paragraph in the source: its line breaks and indentation become single spaces."""
    return " ".join(text.split())

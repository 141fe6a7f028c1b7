"""``--config FILE``: a TOML file of a command's options, the file the Helm chart and the
compose stack mount for ``specops train``.

Keys are the command's long option names with ``-`` written ``_`` (``poll_records = 64``,
``schedule = true``), at the top level or under a table named after the command
(``[train]``). The file sets defaults: a flag on the command line still wins, and
``$SPECOPS_STREAM_URL`` / ``$SPECOPS_REGISTRY_URI`` keep their meaning for keys the file
leaves out. A key that is not an option, a value of the wrong type or outside the option's
choices is an error that names the key.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The long options of ``parser`` by TOML key (``--poll-records`` -> ``poll_records``)."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest in ("help", "config"):
            continue
        for s in longs:
            out[s[2:].replace("-", "_")] = action
    return out


def load(path: str | Path, parser: argparse.ArgumentParser, command: str) -> dict[str, Any]:
    """``dest -> value`` from the TOML file at ``path``, checked against ``parser``'s options.

    Raises ``ValueError`` with a message naming the file and the key."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read --config {path}: {exc}") from exc
    if isinstance(data.get(command), dict):
        rest = {k: v for k, v in data.items() if k != command}
        if rest:
            raise ValueError(f"--config {path}: keys {sorted(rest)} are outside the [{command}] table")
        data = data[command]
    options = options_of(parser)
    values: dict[str, Any] = {}
    for key, value in data.items():
        action = options.get(key)
        if action is None:
            raise ValueError(
                f"--config {path}: unknown key {key!r}: not a `specops {command}` option "
                f"(keys are long option names with _ for -, e.g. poll_records)"
            )
        values[action.dest] = _coerce(path, key, action, value)
    return values


def _coerce(path: str | Path, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"--config {path}: {key}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        # store_false options (--no-x) share a dest with their positive twin: the file says the dest's value
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if action.nargs == 0 or isinstance(value, (dict, list)) and action.nargs is None:
        raise ValueError(f"{where} cannot be set from a file ({type(value).__name__} given)")
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a {getattr(action.type, '__name__', 'string')}, got {value!r}")
    if action.type is not None:
        try:
            value = (
                action.type(value if isinstance(value, str) else str(value)) if action.type is not str else str(value)
            )
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
    elif not isinstance(value, str):
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where} must be one of {sorted(action.choices)}, got {value!r}")
    return value

"""``--config FILE``: a TOML file of a command's options, the file the Helm chart and the
compose stack mount for ``specops train``.

Keys are the command's long option names with ``-`` written ``_`` (``poll_records = 64``,
``schedule = true``), at the top level or under a table named after the command
(``[train]``). The file sets defaults: a flag on the command line still wins, and
``$SPECOPS_STREAM_URL`` / ``$SPECOPS_REGISTRY_URI`` keep their meaning for keys the file
leaves out. A key that is not an option, a value of the wrong type or outside the option's
choices is an error that names the key and the file.

The file is read by the loader ``specops serve`` uses (``specops.core.settings``, pydantic-settings'
TOML source). The command's options become a pydantic-settings model, :func:`options_model`,
generated from its parser: one field per long option, a strict bool for a switch, a ``Literal`` of
the choices, the option's own type otherwise (an argparse type function such as ``positive_int``
runs as the field's validator). argparse has no public listing of a parser's options, so
:func:`options_of` reads ``parser._actions``, and only it does.
"""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StrictBool, create_model
from pydantic_settings import SettingsConfigDict

from specops.core import settings

_NOTES = re.compile(r"\s*\((?:default|env)(?:[^()]|\([^()]*\))*\)")
"""An argparse help's "(default: %(default)s)" and "(env: VAR)" notes, nested parentheses included."""


class FileOptions(settings.ExplicitSettings):
    """Base of the generated option models: every field defaults to None (= not in the file)."""

    model_config = SettingsConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_default=False)


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


def help_text(action: argparse.Action) -> str:
    """An option's help without its "(default: ...)" and "(env: ...)" notes: what a file's key means."""
    return _NOTES.sub("", action.help or "").replace("%%", "%")


def options_model(parser: argparse.ArgumentParser, command: str) -> type[FileOptions]:
    """A pydantic-settings model of ``parser``'s long options, one field per TOML key (see the module docstring)."""
    fields: dict[str, Any] = {
        key: (_annotation(action), Field(None, description=help_text(action)))
        for key, action in options_of(parser).items()
        if _settable(action)
    }
    return create_model(f"{command.title()}Options", __base__=FileOptions, **fields)


def load(path: str | Path, parser: argparse.ArgumentParser, command: str) -> dict[str, Any]:
    """``dest -> value`` from the TOML file at ``path``, checked against ``parser``'s options.

    Raises ``ValueError`` with a message naming the file and the key."""
    data = settings.read_toml(path, "--config")
    if isinstance(data.get(command), dict):
        rest = {k: v for k, v in data.items() if k != command}
        if rest:
            raise ValueError(f"--config {path}: keys {sorted(rest)} are outside the [{command}] table")
    unknown = f"not a `specops {command}` option (keys are long option names with _ for -, e.g. poll_records)"
    model = options_model(parser, command)
    values = settings.load(model, path=path, table=command, env={}, what="--config", unknown=unknown)
    options = options_of(parser)
    out: dict[str, Any] = {}
    for key in values.model_fields_set:
        action, value = options[key], getattr(values, key)
        # store_false options (--no-x) share a dest with their positive twin: the file says the dest's value
        out[action.dest] = (not value) if isinstance(action, argparse._StoreFalseAction) else value
    return out


def _settable(action: argparse.Action) -> bool:
    """Switches and options that take one value (a key cannot count -v's or append)."""
    switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
    return switch or (action.nargs in (None, "?") and isinstance(action, argparse._StoreAction))


def _annotation(action: argparse.Action) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return StrictBool
    if action.choices is not None:
        return Literal[tuple(action.choices)]
    if action.type in (None, str):
        return str
    if isinstance(action.type, type):  # int, float
        returns = action.type
    else:
        try:
            returns = typing.get_type_hints(action.type).get("return", Any)
        except (TypeError, NameError):
            returns = Any
    # the value goes through the option's type as the flag's text would: 8.0 is no int, as on the command line
    return Annotated[returns, BeforeValidator(_argparse_type(action.type))]


def _argparse_type(convert: Any) -> Any:
    """A field validator that runs an argparse type function on the TOML value, as the command line would."""

    def validate(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return convert(value if isinstance(value, str) else str(value))
        except (TypeError, argparse.ArgumentTypeError) as exc:
            raise ValueError(str(exc)) from exc

    return validate

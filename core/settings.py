"""One way to load settings: a pydantic-settings model from its defaults < a TOML file < the environment < overrides.

``specops serve`` (``ServeConfig``) and ``specops train --config`` (``specops/config_file.py``) load through
:func:`load`; the streams package, below core, builds ``StreamConfig`` from the same pydantic-settings sources.
The settings classes keep plain construction plain: ``ServeConfig(port=9000)`` reads no file and no environment
(their ``settings_customise_sources`` keeps only the keyword arguments), and :func:`load` hands the model its
sources explicitly (pydantic-settings' ``_build_sources``), highest priority first.

A bad value is one ``ValueError`` whose message names every problem with where it came from: the field and the
file, the environment variable and its value, or the option given.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsError,
    TomlConfigSettingsSource,
)

SECRET = re.compile(r"key|password|secret|token", re.IGNORECASE)
"""Fields whose values an error message never repeats."""


class ExplicitSettings(BaseSettings):
    """A settings model whose plain construction reads only its keyword arguments: ``Model(port=9000)``
    takes no file and no environment; :func:`load` hands it those sources explicitly. (``StreamConfig``,
    below core, repeats this one method.)"""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        **_: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, reading ``environ`` (a rendered chart's env, a test's) instead of
    ``os.environ``: prefixes, aliases and parsing stay pydantic-settings'."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = dict(environ)
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {(k if self.case_sensitive else k.lower()): v for k, v in self._environ.items()}


def env_name(settings_cls: type[BaseSettings], field: str) -> str:
    """The environment variable of ``field``: the class's ``env_prefix`` and the field's name, upper case."""
    return (settings_cls.model_config.get("env_prefix", "") + field).upper()


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict; ``ValueError`` naming ``what`` and the file when it cannot be read."""
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from exc


def load(
    settings_cls: type[BaseSettings],
    *,
    path: str | Path | None = None,
    table: str | None = None,
    env: Mapping[str, str] | None = None,
    env_aliases: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    what: str = "config",
    unknown: str = "not a setting",
) -> Any:
    """``settings_cls`` from its defaults, then the TOML file at ``path``, then the environment, then ``overrides``.

    ``table``: the file may hold the fields under ``[table]`` instead of at its top level. ``env``: the
    variables to read (default: ``os.environ``; ``{}`` reads none). ``env_aliases``: other variable
    -> the field's own variable, read when the field's own is unset (``SPECOPS_API_KEYS`` for
    ``SPECOPS_SERVE_API_KEYS``). ``overrides``: the command line's values by field (``None`` = not given).
    Raises ``ValueError``: ``cannot read <what> <path>: ...``, or ``invalid <what>: `` and each bad field with
    where it came from (a key the model does not have: ``unknown key: <unknown>``)."""
    environ = dict(os.environ if env is None else env)
    read_as: dict[str, str] = {}  # variable -> the alias it was read from
    for alias, var in (env_aliases or {}).items():
        if environ.get(alias) and var not in environ:
            environ[var], read_as[var] = environ[alias], alias
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    sources: list[PydanticBaseSettingsSource] = [
        InitSettingsSource(settings_cls, given),
        MappingEnvSource(settings_cls, environ),
    ]
    if path:
        data = read_toml(path, what)
        header = (table,) if table and isinstance(data.get(table), dict) else ()
        sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(path), toml_table_header=header))
    try:
        origins = _origins(settings_cls, sources, environ, read_as, path)
        return settings_cls(_build_sources=(tuple(sources), given))
    except ValidationError as exc:
        raise ValueError(f"invalid {what}: " + "; ".join(describe(exc, origins, unknown=unknown))) from exc
    except SettingsError as exc:  # a variable pydantic-settings could not parse (JSON of a complex field)
        raise ValueError(f"invalid {what}: {exc}") from exc


def _origins(
    settings_cls: type[BaseSettings],
    sources: list[PydanticBaseSettingsSource],
    environ: Mapping[str, str],
    read_as: Mapping[str, str],
    path: str | Path | None,
) -> dict[str, str]:
    """field -> where its value came from (a variable with its value, unless the field is a secret), the
    highest-priority source last written winning."""
    out: dict[str, str] = {}
    for source in reversed(sources):
        for key in source():
            if isinstance(source, TomlConfigSettingsSource):
                out[key] = f"in {path}"
            elif isinstance(source, EnvSettingsSource):
                var = env_name(settings_cls, key)
                shown = "" if SECRET.search(key) else f"={environ.get(var, '')!r}"
                out[key] = read_as.get(var, var) + shown
            else:
                out[key] = "--" + key.replace("_", "-")
    return out


def describe(
    exc: ValidationError, origins: Mapping[str, str] | None = None, unknown: str = "not a setting"
) -> list[str]:
    """One ``field (origin): problem`` line per error of ``exc`` (``config: problem`` for the model's own checks)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(map(str, err["loc"]))
        origin = (origins or {}).get(str(err["loc"][0])) if err["loc"] else None
        msg = f"unknown key: {unknown}" if err["type"] == "extra_forbidden" else err["msg"]
        msg = msg.removeprefix("Value error, ")
        lines.append(f"{loc or 'config'}{f' ({origin})' if origin else ''}: {msg}")
    return lines

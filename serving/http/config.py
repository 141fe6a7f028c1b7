"""``specops serve`` settings: typed sections, from defaults < a TOML file < environment < flags.

Users see flat keys: a serve.toml key, ``SPECOPS_SERVE_<KEY>`` (upper case, e.g.
``SPECOPS_SERVE_PORT=9000``; lists comma-separated) and ``--key`` are one name each, as before the
split. ``SPECOPS_API_KEYS`` is also read for ``api_keys``, and ``SPECOPS_STREAM_URL`` /
``SPECOPS_REGISTRY_URI`` keep their meaning everywhere else. A TOML file may hold the keys at its top
level or under a ``[serve]`` table.

Code reads typed sections: :class:`ServeConfig` composes ``api`` (:class:`ApiConfig`, the HTTP front
door), ``admission``, ``engine``, ``fleet``, ``retrieval`` and ``vllm`` (``specops.serving.config``,
the sections the replica reads). :data:`KEYS` is the one table from a flat key to its section and
field (``port`` -> ``cfg.api.port``, ``vllm_k`` -> ``cfg.vllm.k``, ``engine`` -> ``cfg.engine.kind``).

:class:`ServeKeys` is the flat pydantic-settings model generated from that table (the sections'
fields under their flat keys): :meth:`ServeConfig.load` reads the sources into it through
``specops.core.settings.load`` (the loader ``specops train --config`` shares), and the flags, the
environment variables and the Helm values schema are its fields. ``ServeConfig(**flat_keys)`` (or
:meth:`ServeConfig.from_flat`) builds the sections from flat keys and reads no file and no environment.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic_settings import SettingsConfigDict

from specops.core import settings
from specops.core.errors import ModelConfigError
from specops.serving.config import (
    CLUSTER_NAME,
    AdmissionConfig,
    EngineConfig,
    FleetConfig,
    Names,
    ReplicaConfig,
    RetrievalConfig,
    Section,
    VLLMConfig,
)
from specops.serving.http.tenancy import check_config as check_tenants
from specops.serving.proposers.catalogue import describe

__all__ = ["CLUSTER_NAME", "KEYS", "ApiConfig", "ServeConfig", "ServeKeys", "add_arguments", "overrides_from_args"]

ENV_PREFIX = "SPECOPS_SERVE_"
ENV_ALIASES = {"SPECOPS_API_KEYS": ENV_PREFIX + "API_KEYS"}
"""Other variables read for a key when its own ``SPECOPS_SERVE_<KEY>`` is unset."""
DEFAULTS_FROM_ENV = {
    "vllm_python": ("SPECOPS_VLLM_PYTHON",),
    "draft_dtype": ("SPECOPS_DRAFT_DTYPE",),
    "model_dir": ("SPECOPS_DATA_DIR",),
    "cache_dir": ("SPECOPS_DATA_DIR",),
    "stream": ("SPECOPS_STREAM_URL", "SPECOPS_DATA_DIR"),
    "registry": ("SPECOPS_REGISTRY_URI", "SPECOPS_REGISTRY_ARTIFACTS", "SPECOPS_DATA_DIR"),
}
"""Keys whose default (empty, 'default' or 'auto') is resolved from these variables when the replica starts."""


class ApiConfig(Section):
    """The HTTP front door: where it listens, the model id, keys and tenants, connection limits."""

    served_model_name: str = Field("specops", description="model id clients send as `model` and /v1/models lists")
    host: str = Field("127.0.0.1", description="interface to listen on (0.0.0.0 for every interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0 = any free port)")
    api_keys: Names = Field(
        default_factory=list,
        description="bearer keys accepted on /v1/* (none = no auth), "
        "each KEY or NAME:KEY (NAME: the key's tenant; unnamed: a hash of the key); also "
        "$SPECOPS_API_KEYS, comma-separated",
    )
    route_tenants: Names = Field(
        default_factory=lambda: ["*"],
        description="tenants (api_keys NAMEs, or "
        "key-<hash>) whose requests may send `cluster` instead of being routed; '*' = "
        "every tenant, empty = none (403 naming `cluster`)",
    )
    admin_tenants: Names = Field(
        default_factory=list,
        description="tenants that may read GET /v1/policy (the "
        "auto policy's state of every cluster); '*' = every tenant (without api_keys "
        "everyone is admin)",
    )
    auth_metrics: bool = Field(False, description="also require a key on /metrics")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body accepted (413 above)")
    header_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest a connection may take to send a request's "
        "headers, from connecting or from the request's first byte (408, then "
        "closed)",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="longest a request's body may take to arrive after its headers (408, then closed)"
    )
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="an idle kept-alive connection is closed after this many seconds"
    )

    @model_validator(mode="after")
    def _check(self) -> ApiConfig:
        check_tenants(self.api_keys, self.route_tenants, self.admin_tenants)
        return self


SECTIONS: dict[str, type[Section]] = {
    "api": ApiConfig,
    "admission": AdmissionConfig,
    "engine": EngineConfig,
    "fleet": FleetConfig,
    "retrieval": RetrievalConfig,
    "vllm": VLLMConfig,
}
"""The sections of :class:`ServeConfig`, by attribute name."""

KEYS: dict[str, tuple[str, str]] = {  # flat key (serve.toml, SPECOPS_SERVE_<KEY>, --key) -> (section, field)
    "engine": ("engine", "kind"),
    "vllm_python": ("vllm", "python"),
    "vllm_speculation": ("vllm", "speculation"),
    "vllm_k": ("vllm", "k"),
    "vllm_copy_k": ("vllm", "copy_k"),
    "vllm_max_model_len": ("vllm", "max_model_len"),
    "vllm_kv_cache_gb": ("vllm", "kv_cache_gb"),
    "vllm_args": ("vllm", "args"),
    "vllm_start_timeout_s": ("vllm", "start_timeout_s"),
    "vllm_standby": ("vllm", "standby"),
    "vllm_draft_vocab": ("vllm", "draft_vocab"),
    "model_dir": ("engine", "model_dir"),
    "target": ("engine", "target"),
    "draft": ("engine", "draft"),
    "draft_dtype": ("engine", "draft_dtype"),
    "device": ("engine", "device"),
    "dtype": ("engine", "dtype"),
    "served_model_name": ("api", "served_model_name"),
    "stream": ("fleet", "stream"),
    "registry": ("fleet", "registry"),
    "replica": ("fleet", "replica"),
    "cache_dir": ("fleet", "cache_dir"),
    "host": ("api", "host"),
    "port": ("api", "port"),
    "api_keys": ("api", "api_keys"),
    "route_tenants": ("api", "route_tenants"),
    "admin_tenants": ("api", "admin_tenants"),
    "auth_metrics": ("api", "auth_metrics"),
    "max_body_bytes": ("api", "max_body_bytes"),
    "header_timeout_s": ("api", "header_timeout_s"),
    "body_timeout_s": ("api", "body_timeout_s"),
    "keep_alive_timeout_s": ("api", "keep_alive_timeout_s"),
    "max_prompt_tokens": ("admission", "max_prompt_tokens"),
    "max_tokens_limit": ("admission", "max_tokens_limit"),
    "default_max_tokens": ("admission", "default_max_tokens"),
    "max_k": ("admission", "max_k"),
    "max_n_drafts": ("admission", "max_n_drafts"),
    "session_cache_tokens": ("retrieval", "session_cache_tokens"),
    "session_sharing": ("retrieval", "session_sharing"),
    "max_references": ("admission", "max_references"),
    "max_reference_tokens": ("admission", "max_reference_tokens"),
    "kb_dirs": ("retrieval", "kb_dirs"),
    "knnlm_dirs": ("retrieval", "knnlm_dirs"),
    "datastore_dir": ("retrieval", "datastore_dir"),
    "default_method": ("engine", "default_method"),
    "auto_priors": ("engine", "auto_priors"),
    "auto_calibrate": ("engine", "auto_calibrate"),
    "auto_max_k": ("engine", "auto_max_k"),
    "max_concurrency": ("admission", "max_concurrency"),
    "max_queue": ("admission", "max_queue"),
    "batch_max_size": ("engine", "batch_max_size"),
    "batch_window_ms": ("engine", "batch_window_ms"),
    "queue_timeout_s": ("admission", "queue_timeout_s"),
    "request_timeout_s": ("admission", "request_timeout_s"),
    "shutdown_timeout_s": ("admission", "shutdown_timeout_s"),
    "load_signal": ("admission", "load_signal"),
    "router": ("fleet", "router"),
    "default_cluster": ("fleet", "default_cluster"),
    "clusters": ("fleet", "clusters"),
    "poll_s": ("fleet", "poll_s"),
    "auto_rollback": ("fleet", "auto_rollback"),
    "rollback_min_requests": ("fleet", "rollback_min_requests"),
    "rollback_margin": ("fleet", "rollback_margin"),
    "live_report_every": ("fleet", "live_report_every"),
    "log_sample_every": ("fleet", "log_sample_every"),
    "log_queue_size": ("fleet", "log_queue_size"),
}
"""The one map from the flat keys users write to the sections code reads (its order: ``--help``'s)."""
assert sorted(KEYS.values()) == sorted((s, f) for s, cls in SECTIONS.items() for f in cls.model_fields)


class ServeConfig(BaseModel):
    """Everything ``specops serve`` needs, in typed sections; validated at construction.

    ``ServeConfig(port=9000, vllm_k=4)`` takes flat keys (:data:`KEYS`) as well as sections."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api: ApiConfig = Field(default_factory=ApiConfig, description="the HTTP front door")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="request limits, concurrency")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="who decodes, models, batching, auto")
    fleet: FleetConfig = Field(default_factory=FleetConfig, description="stream, registry, routing, hot-swap")
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig, description="what requests copy from")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="the vLLM servers (engine = vllm)")

    @model_validator(mode="before")
    @classmethod
    def _sections_from_flat(cls, data: Any) -> Any:
        """Flat keys (``port``) go into their sections (``api``); a section given whole is kept
        (``engine``, both a key and a section, is the section when given a section or a dict)."""

        def flat(key: str, value: Any) -> bool:
            return key in KEYS and not (key in SECTIONS and isinstance(value, (BaseModel, dict)))

        if not isinstance(data, dict) or not any(flat(k, v) for k, v in data.items()):
            return data
        out: dict[str, Any] = {k: v for k, v in data.items() if not flat(k, v)}
        for key, value in data.items():
            if flat(key, value):
                section, field = KEYS[key]
                given = out.get(section, {})
                given = given.model_dump() if isinstance(given, BaseModel) else dict(given)
                out[section] = {**given, field: value}
        return out

    @classmethod
    def from_flat(cls, **keys: Any) -> ServeConfig:
        """The config from flat keys (``port=9000``), as a serve.toml file or the flags name them."""
        return cls(**keys)

    def flat(self) -> dict[str, Any]:
        """Flat key -> value, every key (the inverse of :meth:`from_flat`)."""
        return {key: getattr(getattr(self, section), field) for key, (section, field) in KEYS.items()}

    # ------------------------------------------------------------ derived
    @property
    def replica_name(self) -> str:
        return self.fleet.replica or f"{socket.gethostname()}-{self.api.port}"

    def paths(self, data_dir: Path) -> tuple[Path, Path]:
        """(target dir, base draft dir)."""
        return self.engine.paths(data_dir)

    def replica(self) -> ReplicaConfig:
        """The sections the replica reads (``specops.serving.replica.Replica``), and its name."""
        return ReplicaConfig(
            name=self.replica_name,
            admission=self.admission,
            engine=self.engine,
            fleet=self.fleet,
            retrieval=self.retrieval,
            vllm=self.vllm,
        )

    # ------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        env: dict[str, str] | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> ServeConfig:
        """Defaults, then the TOML file (top level or ``[serve]``), then ``SPECOPS_SERVE_*`` variables (and
        ``SPECOPS_API_KEYS``) from ``env`` (default: ``os.environ``), then ``overrides`` (``None``: not given),
        all by flat key."""
        try:
            keys = settings.load(
                ServeKeys,
                path=path,
                table="serve",
                env=env,
                env_aliases=ENV_ALIASES,
                overrides=overrides,
                what="serve config",
                unknown="not a `specops serve` setting (see `specops serve --help`: the flags' names with _ for -)",
            )
        except ValueError as exc:
            raise ModelConfigError(str(exc)) from exc
        return cls.from_flat(**keys.model_dump())


class _FlatKeys(settings.ExplicitSettings):
    """Base of :class:`ServeKeys`: the sections' own checks run on the flat keys too, as ``config: ...``."""

    # enable_decoding=False: a list comes from the environment comma-separated, not as JSON
    model_config = SettingsConfigDict(extra="forbid", frozen=True, env_prefix=ENV_PREFIX, enable_decoding=False)

    @model_validator(mode="after")
    def _sections(self) -> _FlatKeys:
        try:
            ServeConfig.from_flat(**self.model_dump())
        except ValidationError as exc:  # a rule between fields of one section: said as the model's own
            raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
        return self


ServeKeys: type[_FlatKeys] = create_model(
    "ServeKeys",
    __base__=_FlatKeys,
    __doc__="The flat keys of ``specops serve`` (:data:`KEYS`): a serve.toml, the environment, the flags.",
    **{key: (SECTIONS[s].model_fields[f].annotation, SECTIONS[s].model_fields[f]) for key, (s, f) in KEYS.items()},
)


def env_vars(name: str) -> list[str]:
    """The environment variables that set key ``name``, its own first."""
    own = settings.env_name(ServeKeys, name)
    return [own, *(alias for alias, var in ENV_ALIASES.items() if var == own)]


def env_note(name: str) -> str:
    """The ``(env: ...)`` note of key ``name``'s ``--help``: the variables that set it, and those its default reads."""
    note = "env: " + ", ".join(env_vars(name))
    if name in DEFAULTS_FROM_ENV:
        note += "; the default reads " + ", ".join(DEFAULTS_FROM_ENV[name])
    return f" ({note})"


def add_arguments(parser) -> None:
    """One ``--flag`` per flat key, with the field's description as its help (default: None = not given)."""
    for name, info in ServeKeys.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = info.get_default(call_default_factory=True)
        shown = "" if default in ("", [], None) else f" (default: {default!r})"
        described = info.description + (": " + describe() if name == "default_method" else "")  # as of now
        help_text = f"{described}{shown}{env_note(name)}".replace("%", "%%")
        if info.annotation is bool:
            parser.add_argument(flag, default=None, action="store_true", help=help_text)
            parser.add_argument(
                "--no-" + name.replace("_", "-"), dest=name, action="store_false", default=None, help=argparse.SUPPRESS
            )
        elif name == "api_keys":
            parser.add_argument(flag, default=None, metavar="KEY[,KEY]", help=help_text)
        elif name in ("route_tenants", "admin_tenants"):
            parser.add_argument(flag, default=None, metavar="NAME[,NAME]", help=help_text)
        elif name in ("kb_dirs", "knnlm_dirs"):
            parser.add_argument(flag, default=None, metavar="DIR[,DIR]", help=help_text)
        elif name == "clusters":
            parser.add_argument(flag, default=None, metavar="NAME[,NAME]", help=help_text)
        else:
            parser.add_argument(flag, default=None, metavar=name.upper(), help=help_text)


def overrides_from_args(args) -> dict[str, Any]:
    return {name: getattr(args, name) for name in ServeKeys.model_fields if getattr(args, name, None) is not None}

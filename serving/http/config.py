"""``specops serve`` settings: one typed config, from defaults < a TOML file < environment < flags.

Every field has a default and a one-line description; the description is also the
field's ``--help`` text, so the command line and this file cannot drift apart.

Environment: ``SPECOPS_SERVE_<FIELD>`` (upper case), e.g. ``SPECOPS_SERVE_PORT=9000``;
lists are comma-separated. ``SPECOPS_API_KEYS`` is also read for ``api_keys``, and
``SPECOPS_STREAM_URL`` / ``SPECOPS_REGISTRY_URI`` keep their meaning everywhere else.
A TOML file may hold the fields at its top level or under a ``[serve]`` table.

``ServeConfig`` is a pydantic-settings model; :meth:`ServeConfig.load` builds it from those sources through
``specops.core.settings.load``, the loader ``specops train --config`` shares. ``ServeConfig(**fields)`` itself
reads no file and no environment.
"""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from specops.core import settings
from specops.core.device import DEVICE_PATTERN
from specops.core.errors import ModelConfigError
from specops.serving.http.tenancy import check_config as check_tenants
from specops.serving.proposers.catalogue import CATALOGUE, describe, methods

ENV_PREFIX = "SPECOPS_SERVE_"
ENV_ALIASES = {"SPECOPS_API_KEYS": ENV_PREFIX + "API_KEYS"}
"""Other variables read for a field when its own ``SPECOPS_SERVE_<FIELD>`` is unset."""
DEFAULTS_FROM_ENV = {
    "vllm_python": ("SPECOPS_VLLM_PYTHON",),
    "draft_dtype": ("SPECOPS_DRAFT_DTYPE",),
    "model_dir": ("SPECOPS_DATA_DIR",),
    "cache_dir": ("SPECOPS_DATA_DIR",),
    "stream": ("SPECOPS_STREAM_URL", "SPECOPS_DATA_DIR"),
    "registry": ("SPECOPS_REGISTRY_URI", "SPECOPS_REGISTRY_ARTIFACTS", "SPECOPS_DATA_DIR"),
}
"""Fields whose default (empty, 'default' or 'auto') is resolved from these variables when the replica starts."""
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""What a request's ``cluster`` may be (``specops.serving.http.schema.ClusterName``), so a configured cluster is one too."""


class ServeConfig(settings.ExplicitSettings):
    """Everything ``specops serve`` needs; validated at construction."""

    # enable_decoding=False: a list comes from the environment comma-separated (``_split``), not as JSON
    model_config = SettingsConfigDict(extra="forbid", frozen=True, env_prefix=ENV_PREFIX, enable_decoding=False)

    # ---- which engine decodes
    engine: Literal["specops", "vllm"] = Field(
        "specops",
        description="who decodes: specops (this process, every method) or vllm (vLLM servers this process starts, one "
        "per draft in use; the API, keys, routing, logging and hot-swap stay here)",
    )
    vllm_python: str = Field(
        "", description="Python of the vLLM venv (default: $SPECOPS_VLLM_PYTHON, else .venv-vllm/bin/python)"
    )
    vllm_speculation: str = Field(
        "draft",
        pattern=r"^\s*(draft|ngram|copy|none)\s*(,\s*(draft|ngram|copy|none)\s*)*$",
        description="how the vLLM servers speculate, one server per entry (comma-separated): draft (each cluster's "
        "champion draft), ngram (vLLM's n-gram lookup), copy (LLMA: the request's references, retrieved passages "
        "and past sessions), none (target-only); with several, a request names one or 'auto' chooses per request",
    )
    vllm_k: int = Field(3, ge=1, le=16, description="tokens vLLM drafts per step (num_speculative_tokens)")
    vllm_copy_k: int = Field(
        8,
        ge=1,
        le=16,
        description="tokens the copy server (vllm_speculation copy) drafts per step at most: a copy is 1 + the "
        "matched n-gram's length (up to 8), so vllm_k's 3 would cut the long spans LLMA copies",
    )
    vllm_max_model_len: int = Field(2048, ge=64, description="vLLM's --max-model-len (prompt + output tokens)")
    vllm_kv_cache_gb: int = Field(
        1, ge=1, description="KV cache per vLLM server on a CPU (VLLM_CPU_KVCACHE_SPACE, whole GiB)"
    )
    vllm_args: str = Field("", description="more arguments for every vLLM server, e.g. '--enforce-eager' (shell words)")
    vllm_start_timeout_s: float = Field(900.0, gt=0, description="longest a vLLM server may take to start serving")
    vllm_standby: int = Field(
        1,
        ge=0,
        le=8,
        description="draft servers kept started ahead with the base draft (vllm_speculation with draft): a "
        "cluster's first champion loads into one in seconds instead of waiting for a new server's start; a "
        "cluster that has a champion reloads its own server in place either way; 0 saves the memory",
    )
    vllm_draft_vocab: bool = Field(
        True,
        description="a draft with its own vocabulary (draft_vocab.json) scores only those tokens in vLLM too "
        "(our model class over a view of its folder); false: vLLM computes its full LM head",
    )

    # ---- where things are
    model_dir: str = Field(
        "", description="bootstrap-style directory holding target/ and draft/ (default: the data directory's models/)"
    )
    target: str = Field("", description="target model directory (overrides <model_dir>/target)")
    draft: str = Field(
        "", description="base draft directory every new cluster starts from (overrides <model_dir>/draft)"
    )
    draft_dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto",
        description="precision the drafts run in (the target's --dtype decides the outputs, not this): auto "
        "times float32 and bfloat16 at load on a CPU and keeps the faster (bfloat16 on a GPU); float16 needs a GPU",
    )
    device: str = Field("cpu", description="where the target and drafts run: cpu, cuda (the current GPU) or cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="precision the target runs in; outputs are the target's in this precision "
        "(float32 on a CPU; bfloat16 or float16 on a GPU)",
    )
    served_model_name: str = Field("specops", description="model id clients send as `model` and /v1/models lists")
    stream: str = Field(
        "default",
        description="stream the requests are logged to: local://DIR, kafka://HOST:PORT, "
        "'default' ($SPECOPS_STREAM_URL, else the local log under the data directory) or 'none'",
    )
    registry: str = Field(
        "default",
        description="registry the drafts and the router follow: sqlite:////abs/mlflow.db, "
        "postgresql://..., http://host:port, 'default' ($SPECOPS_REGISTRY_URI, else SQLite under the "
        "data directory) or 'none' (serve the base draft only)",
    )
    replica: str = Field(
        "",
        description="this replica's name: its own event consumer group and cache directory "
        "(default: <hostname>-<port>)",
    )
    cache_dir: str = Field(
        "", description="where fetched drafts and routers are kept (default: <data>/serve/<replica>)"
    )

    # ---- network
    host: str = Field("127.0.0.1", description="interface to listen on (0.0.0.0 for every interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0 = any free port)")
    api_keys: list[str] = Field(
        default_factory=list,
        description="bearer keys accepted on /v1/* (none = no auth), "
        "each KEY or NAME:KEY (NAME: the key's tenant; unnamed: a hash of the key); also "
        "$SPECOPS_API_KEYS, comma-separated",
    )
    route_tenants: list[str] = Field(
        default_factory=lambda: ["*"],
        description="tenants (api_keys NAMEs, or "
        "key-<hash>) whose requests may send `cluster` instead of being routed; '*' = "
        "every tenant, empty = none (403 naming `cluster`)",
    )
    admin_tenants: list[str] = Field(
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

    # ---- request limits
    max_prompt_tokens: int = Field(
        2048, ge=1, description="longest prompt accepted, in tokens (also capped by the target's context)"
    )
    max_tokens_limit: int = Field(1024, ge=1, description="largest `max_tokens` a request may ask for")
    default_max_tokens: int = Field(64, ge=1, description="`max_tokens` when a request does not say")
    max_k: int = Field(
        16, ge=1, le=64, description="largest `speculation.k` (tokens drafted per step) a request may ask for"
    )
    max_n_drafts: int = Field(
        16, ge=1, le=64, description="largest `speculation.n_drafts` (rows per step, dresd) a request may ask for"
    )
    session_cache_tokens: int = Field(
        65536,
        ge=0,
        description="tokens of past outputs kept per cluster as LLMA's cache-assisted copy source (0 = off)",
    )
    session_sharing: Literal["tenant", "shared"] = Field(
        "tenant",
        description="whose past outputs an LLMA request copies from: 'tenant' (its own tenant's, per "
        "cluster) or 'shared' (every tenant's of the cluster, and seeded from the registry's sessions-<cluster>: "
        "a key can then test guesses of another key's outputs, see docs/api.md#tenancy-and-isolation)",
    )
    max_references: int = Field(32, ge=0, le=1024, description="most `references` texts (LLMA) a request may send")
    max_reference_tokens: int = Field(
        32768,
        ge=0,
        description="most tokens a request's `references` (and, for LLMA in chat, its earlier turns) may hold together",
    )
    kb_dirs: list[str] = Field(
        default_factory=list,
        description="knowledge-base directories (`specops kb build "
        "--out`) served by their names before the registry's `kb-<name>@champion`",
    )
    knnlm_dirs: list[str] = Field(
        default_factory=list,
        description="kNN-LM datastore directories (`specops knnlm "
        "build --out`) served by their folder names before the registry's "
        "`knnlm-<name>@champion`",
    )
    datastore_dir: str = Field(
        "",
        description="fallback DReSD datastore for clusters with no `datastore-<cluster>@champion` yet (`specops datastore build`); empty: none",
    )
    default_method: str = Field(
        "auto",
        json_schema_extra=lambda schema: schema.update(enum=list(methods())),
        description="decoding when a request does not say, one of the method catalogue's",
    )
    auto_priors: str = Field(
        "",
        description="JSON priors of the `auto` policy (`specops policy fit --out`): "
        "acceptance per cluster and method, measured costs; empty: start from calibration",
    )
    auto_calibrate: bool = Field(
        True,
        description="measure the target's verify cost and the draft's step at load, "
        "as the `auto` policy's cost priors (about a second)",
    )
    auto_max_k: int = Field(
        16, ge=1, le=64, description="longest draft `auto` may choose (copies; a draft model's chain stops at 8)"
    )

    # ---- concurrency
    max_concurrency: int = Field(2, ge=1, le=256, description="requests decoded at once (decode worker threads)")
    max_queue: int = Field(32, ge=0, description="requests waiting for a worker; beyond it requests get 429 at once")
    batch_max_size: int = Field(
        8,
        ge=1,
        le=64,
        description="most concurrent requests sharing one target forward pass (1 = no cross-request batching)",
    )
    batch_window_ms: float = Field(
        2.0,
        ge=0,
        le=100,
        description="how long a target step waits for other requests' "
        "steps to batch with (only while other requests are decoding)",
    )
    queue_timeout_s: float = Field(60.0, gt=0, description="longest a request waits for a worker before a 503")
    request_timeout_s: float = Field(600.0, gt=0, description="longest one request may decode before it is stopped")
    shutdown_timeout_s: float = Field(
        600.0,
        ge=0,
        description="on SIGTERM/SIGINT the replica stops admitting (/readyz 503, new requests 503) and waits this "
        "long for in-flight requests to finish before it closes them and exits; the chart sets it from the pod's "
        "terminationGracePeriodSeconds (a second SIGINT exits at once)",
    )
    load_signal: str = Field(
        "",
        description="write {'load', 'time'} JSON here every second (the trainer's "
        "--load-signal: it skips work while serving is busy)",
    )

    # ---- routing and hot-swap
    router: Literal["registry", "none"] = Field(
        "registry",
        description="how requests without `cluster` are routed: 'registry' (follow the registered "
        "router's champion; until one exists they go to default_cluster) or 'none'",
    )
    default_cluster: str = Field("default", description="cluster of requests without `cluster` when no router decides")
    clusters: list[str] = Field(
        default_factory=list,
        description="clusters a request may name in `cluster`, besides "
        "default_cluster, the router's clusters and those with a registered champion draft "
        "(any other name: 400 naming `cluster`)",
    )
    poll_s: float = Field(
        10.0, gt=0, description="seconds between registry polls for new champions (events are instant)"
    )
    auto_rollback: bool = Field(
        True, description="roll a new champion back when its live acceptance falls below its predecessor's"
    )
    rollback_min_requests: int = Field(200, ge=1, description="requests a champion serves before it is judged")
    rollback_margin: float = Field(0.05, ge=0, description="live acceptance drop that triggers a rollback")
    live_report_every: int = Field(50, ge=1, description="requests between live-acceptance reports to the registry")

    # ---- logging to the stream
    log_sample_every: int = Field(1, ge=1, description="log one request in N to the stream")
    log_queue_size: int = Field(2048, ge=2, description="records queued for the stream before the oldest are shed")

    @field_validator("api_keys", "route_tenants", "admin_tenants", "kb_dirs", "knnlm_dirs", "clusters", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @field_validator("vllm_speculation")
    @classmethod
    def _speculations(cls, v: str) -> str:
        names = [p.strip() for p in v.split(",") if p.strip()]
        if len(set(names)) != len(names):
            raise ValueError(f"vllm_speculation names a method twice: {v!r}")
        return ",".join(names)

    @property
    def vllm_speculations(self) -> tuple[str, ...]:
        """``vllm_speculation`` as a tuple (one vLLM server each; the draft model's per version)."""
        return tuple(self.vllm_speculation.split(","))

    @field_validator("default_method")
    @classmethod
    def _method(cls, v: str) -> str:
        if v not in CATALOGUE:  # the catalogue as it is now: a method registered before start-up counts
            raise ValueError(f"default_method {v!r} is not a method; choose one of {', '.join(methods())}")
        return v

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) is above max_tokens_limit ({self.max_tokens_limit})"
            )
        check_tenants(self.api_keys, self.route_tenants, self.admin_tenants)
        if not DEVICE_PATTERN.match(self.device):
            raise ValueError(f"device {self.device!r} is not a device: say cpu, cuda or cuda:N")
        if self.device == "cpu" and "float16" in (self.dtype, self.draft_dtype):
            raise ValueError("float16 needs a GPU: on a CPU use bfloat16 (or float32)")
        bad = [c for c in (self.default_cluster, *self.clusters) if not CLUSTER_NAME.match(c)]
        if bad:
            raise ValueError(
                f"cluster names are letters, digits and _.- (at most 64, a letter or digit first): "
                f"{', '.join(map(repr, bad[:5]))} is not one"
            )
        return self

    # ------------------------------------------------------------ derived
    @property
    def replica_name(self) -> str:
        return self.replica or f"{socket.gethostname()}-{self.port}"

    def paths(self, data_dir: Path) -> tuple[Path, Path]:
        """(target dir, base draft dir)."""
        model_dir = Path(self.model_dir) if self.model_dir else data_dir / "models"
        target = Path(self.target) if self.target else model_dir / "target"
        draft = Path(self.draft) if self.draft else model_dir / "draft"
        return target, draft

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
        ``SPECOPS_API_KEYS``) from ``env`` (default: ``os.environ``), then ``overrides`` (``None``: not given)."""
        try:
            return settings.load(
                cls,
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


def env_vars(name: str) -> list[str]:
    """The environment variables that set field ``name``, its own first."""
    own = settings.env_name(ServeConfig, name)
    return [own, *(alias for alias, var in ENV_ALIASES.items() if var == own)]


def env_note(name: str) -> str:
    """The ``(env: ...)`` note of field ``name``'s ``--help``: the variables that set it, and those its default reads."""
    note = "env: " + ", ".join(env_vars(name))
    if name in DEFAULTS_FROM_ENV:
        note += "; the default reads " + ", ".join(DEFAULTS_FROM_ENV[name])
    return f" ({note})"


def add_arguments(parser) -> None:
    """One ``--flag`` per field, with the field's description as its help (default: None = not given)."""
    for name, info in ServeConfig.model_fields.items():
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
    return {name: getattr(args, name) for name in ServeConfig.model_fields if getattr(args, name, None) is not None}

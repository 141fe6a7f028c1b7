"""The typed sections of ``specops serve``'s settings that the replica reads (``specops.serving.replica``).

``specops.serving.http.config.ServeConfig`` composes them with the HTTP layer's own ``ApiConfig``; its
``KEYS`` table maps each flat key (serve.toml, ``SPECOPS_SERVE_<KEY>``, ``--key``) onto one section's
field. Every field has a default and a one-line description (the flag's ``--help`` text); each section
validates its own fields and the rules between them at construction.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from specops.core.device import DEVICE_PATTERN
from specops.serving.proposers.catalogue import CATALOGUE, methods

CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""What a request's ``cluster`` may be (``specops.serving.http.schema.ClusterName``), so a configured cluster is one too."""


def _split(v: Any) -> Any:
    """A list from a comma-separated string (the environment's and a flag's form)."""
    if isinstance(v, str):
        return [k.strip() for k in v.split(",") if k.strip()]
    return v


Names = Annotated[list[str], BeforeValidator(_split)]
"""A list of names, also given comma-separated."""


def _speculations(v: str) -> str:
    names = [p.strip() for p in v.split(",") if p.strip()]
    if len(set(names)) != len(names):
        raise ValueError(f"vllm_speculation names a method twice: {v!r}")
    return ",".join(names)


def _method(v: str) -> str:
    if v not in CATALOGUE:  # the catalogue as it is now: a method registered before start-up counts
        raise ValueError(f"default_method {v!r} is not a method; choose one of {', '.join(methods())}")
    return v


class Section(BaseModel):
    """A section of the serve settings: frozen, and no key it does not know."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class AdmissionConfig(Section):
    """What a request may ask for, and how many run and wait at once."""

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
    max_references: int = Field(32, ge=0, le=1024, description="most `references` texts (LLMA) a request may send")
    max_reference_tokens: int = Field(
        32768,
        ge=0,
        description="most tokens a request's `references` (and, for LLMA in chat, its earlier turns) may hold together",
    )
    max_concurrency: int = Field(2, ge=1, le=256, description="requests decoded at once (decode worker threads)")
    max_queue: int = Field(32, ge=0, description="requests waiting for a worker; beyond it requests get 429 at once")
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

    @model_validator(mode="after")
    def _check(self) -> AdmissionConfig:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) is above max_tokens_limit ({self.max_tokens_limit})"
            )
        return self


class EngineConfig(Section):
    """Who decodes, the models and their precision, cross-request batching, the default method and ``auto``."""

    kind: Literal["specops", "vllm"] = Field(
        "specops",
        description="who decodes: specops (this process, every method) or vllm (vLLM servers this process starts, one "
        "per draft in use; the API, keys, routing, logging and hot-swap stay here)",
    )
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
    default_method: Annotated[str, AfterValidator(_method)] = Field(
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

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if not DEVICE_PATTERN.match(self.device):
            raise ValueError(f"device {self.device!r} is not a device: say cpu, cuda or cuda:N")
        if self.device == "cpu" and "float16" in (self.dtype, self.draft_dtype):
            raise ValueError("float16 needs a GPU: on a CPU use bfloat16 (or float32)")
        return self

    def paths(self, data_dir: Path) -> tuple[Path, Path]:
        """(target dir, base draft dir)."""
        model_dir = Path(self.model_dir) if self.model_dir else data_dir / "models"
        target = Path(self.target) if self.target else model_dir / "target"
        draft = Path(self.draft) if self.draft else model_dir / "draft"
        return target, draft


class FleetConfig(Section):
    """The stream, the registry, this replica's name, routing, hot-swap and the request log."""

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
    router: Literal["registry", "none"] = Field(
        "registry",
        description="how requests without `cluster` are routed: 'registry' (follow the registered "
        "router's champion; until one exists they go to default_cluster) or 'none'",
    )
    default_cluster: str = Field("default", description="cluster of requests without `cluster` when no router decides")
    clusters: Names = Field(
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
    log_sample_every: int = Field(1, ge=1, description="log one request in N to the stream")
    log_queue_size: int = Field(2048, ge=2, description="records queued for the stream before the oldest are shed")

    @model_validator(mode="after")
    def _check(self) -> FleetConfig:
        bad = [c for c in (self.default_cluster, *self.clusters) if not CLUSTER_NAME.match(c)]
        if bad:
            raise ValueError(
                f"cluster names are letters, digits and _.- (at most 64, a letter or digit first): "
                f"{', '.join(map(repr, bad[:5]))} is not one"
            )
        return self


class RetrievalConfig(Section):
    """What requests retrieve and copy from: knowledge bases, kNN-LM and DReSD datastores, past sessions."""

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
    kb_dirs: Names = Field(
        default_factory=list,
        description="knowledge-base directories (`specops kb build "
        "--out`) served by their names before the registry's `kb-<name>@champion`",
    )
    knnlm_dirs: Names = Field(
        default_factory=list,
        description="kNN-LM datastore directories (`specops knnlm "
        "build --out`) served by their folder names before the registry's "
        "`knnlm-<name>@champion`",
    )
    datastore_dir: str = Field(
        "",
        description="fallback DReSD datastore for clusters with no `datastore-<cluster>@champion` yet (`specops datastore build`); empty: none",
    )


class VLLMConfig(Section):
    """The vLLM servers this process starts when vLLM decodes (``engine = "vllm"``)."""

    python: str = Field(
        "", description="Python of the vLLM venv (default: $SPECOPS_VLLM_PYTHON, else .venv-vllm/bin/python)"
    )
    speculation: Annotated[str, AfterValidator(_speculations)] = Field(
        "draft",
        pattern=r"^\s*(draft|ngram|copy|none)\s*(,\s*(draft|ngram|copy|none)\s*)*$",
        description="how the vLLM servers speculate, one server per entry (comma-separated): draft (each cluster's "
        "champion draft), ngram (vLLM's n-gram lookup), copy (LLMA: the request's references, retrieved passages "
        "and past sessions), none (target-only); with several, a request names one or 'auto' chooses per request",
    )
    k: int = Field(3, ge=1, le=16, description="tokens vLLM drafts per step (num_speculative_tokens)")
    copy_k: int = Field(
        8,
        ge=1,
        le=16,
        description="tokens the copy server (vllm_speculation copy) drafts per step at most: a copy is 1 + the "
        "matched n-gram's length (up to 8), so vllm_k's 3 would cut the long spans LLMA copies",
    )
    max_model_len: int = Field(2048, ge=64, description="vLLM's --max-model-len (prompt + output tokens)")
    kv_cache_gb: int = Field(
        1, ge=1, description="KV cache per vLLM server on a CPU (VLLM_CPU_KVCACHE_SPACE, whole GiB)"
    )
    args: str = Field("", description="more arguments for every vLLM server, e.g. '--enforce-eager' (shell words)")
    start_timeout_s: float = Field(900.0, gt=0, description="longest a vLLM server may take to start serving")
    standby: int = Field(
        1,
        ge=0,
        le=8,
        description="draft servers kept started ahead with the base draft (vllm_speculation with draft): a "
        "cluster's first champion loads into one in seconds instead of waiting for a new server's start; a "
        "cluster that has a champion reloads its own server in place either way; 0 saves the memory",
    )
    draft_vocab: bool = Field(
        True,
        description="a draft with its own vocabulary (draft_vocab.json) scores only those tokens in vLLM too "
        "(our model class over a view of its folder); false: vLLM computes its full LM head",
    )

    @property
    def speculations(self) -> tuple[str, ...]:
        """``speculation`` as a tuple (one vLLM server each; the draft model's per version)."""
        return tuple(self.speculation.split(","))


class ReplicaConfig(Section):
    """What one replica reads (``specops.serving.replica.Replica``): its name and four sections."""

    name: str = Field("replica", description="this replica's name (its event consumer group, its registry reports)")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="concurrency, limits, load")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="who decodes, models, batching, auto")
    fleet: FleetConfig = Field(default_factory=FleetConfig, description="stream, registry, routing, hot-swap")
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig, description="what requests copy from")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="the vLLM servers (engine = vllm)")

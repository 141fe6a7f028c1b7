"""Typed configuration of the streams package.

Every field has a default; ``StreamConfig.from_env()`` applies ``SPECOPS_STREAM_<FIELD>``
overrides (for example ``SPECOPS_STREAM_URL=kafka://broker:9092``; booleans as
1/0, true/false, yes/no or on/off; ``topics`` and the ``*_options`` dicts as JSON).

``StreamConfig`` is a pydantic-settings model, loaded like ``specops serve``'s settings
(``specops.core.settings``, which this package sits below): ``StreamConfig(**fields)`` reads
no environment, ``from_env`` adds the environment source under the keyword arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from specops.streams.errors import StreamConfigError

ENV_PREFIX = "SPECOPS_STREAM_"


@dataclass
class Topics:
    """Topic names (the defaults are the design's)."""

    misses: str = "spec.misses"
    """One ``MissRecord`` per finished request, keyed by cluster id."""
    generations: str = "spec.generations"
    """One ``GenerationRecord`` per finished request, keyed by cluster id."""
    events: str = "spec.events"
    """``ModelEvent`` promotions and rollbacks, keyed by model name."""
    deadletter: str = "spec.deadletter"
    """Invalid records, with where they came from and why they were refused."""

    def all(self) -> list[str]:
        return [self.misses, self.generations, self.events, self.deadletter]


class StreamConfig(BaseSettings):
    """How to reach the stream and how its clients behave."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", use_attribute_docstrings=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        **_: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """``StreamConfig(**fields)`` takes only its arguments; :meth:`from_env` adds the environment."""
        return (init_settings,)

    url: str = "local://./.specops/streams"
    """``local:///abs/path`` or ``local://./relative/path`` (embedded durable log), or
    ``kafka://host:port[,host:port]``."""
    topics: Topics = Field(default_factory=Topics)
    """Topic names."""
    num_partitions: int = 8
    """Partitions of topics this system creates (one cluster always maps to one)."""
    replication_factor: int = 1
    """Kafka replication factor of created topics."""
    session_timeout_s: float = 10.0
    """A group member silent for this long is considered dead and its partitions move."""
    heartbeat_interval_s: float = 3.0
    """How often a consumer tells its group it is alive (less than a third of the session timeout)."""
    max_poll_interval_s: float = 300.0
    """A member that does not poll for this long leaves its group (stuck processing)."""
    request_timeout_s: float = 30.0
    """How long a publish waits for the backend's acknowledgement."""
    # --- kafka only
    security_protocol: str = "PLAINTEXT"
    """``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``."""
    ssl_cafile: str | None = None
    """CA bundle that signed the brokers' certificates."""
    ssl_certfile: str | None = None
    """Client certificate (mutual TLS)."""
    ssl_keyfile: str | None = None
    """Client private key (mutual TLS)."""
    ssl_check_hostname: bool = True
    """Verify the broker's certificate matches its host name."""
    sasl_mechanism: str | None = None
    """``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512`` or ``OAUTHBEARER``."""
    sasl_plain_username: str | None = None
    """SASL user (PLAIN and SCRAM)."""
    sasl_plain_password: str | None = Field(None, repr=False)
    """SASL password (PLAIN and SCRAM); prefer the environment variable to a file."""
    client_options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed verbatim to every kafka-python client."""
    producer_options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``KafkaProducer`` only (they override ours)."""
    consumer_options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for group ``KafkaConsumer`` instances only."""
    # --- local only
    fsync: bool = True
    """Local log: ``fsync`` every published batch (survives power loss, not only kill -9)."""
    segment_bytes: int = 64 * 1024 * 1024
    """Local log: roll to a new segment file past this size."""
    retention_s: float = 7 * 24 * 3600.0
    """Local log: delete sealed segments last written longer ago than this (0 = keep forever; Kafka's default is 7 days)."""
    retention_bytes: int = 0
    """Local log: per partition, delete the oldest sealed segments beyond this size (0 = no size limit)."""

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            for err in exc.errors():  # our own checks' errors, as they were raised
                if isinstance(err.get("ctx", {}).get("error"), StreamConfigError):
                    raise err["ctx"]["error"] from None
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
            raise StreamConfigError(f"invalid stream config: {problems}") from exc

    @model_validator(mode="after")
    def _check(self) -> StreamConfig:
        if not (self.url.startswith("local://") or self.url.startswith("kafka://")):
            raise StreamConfigError(
                f"stream url must start with local:// or kafka://, got {self.url!r} "
                "(for example local://./.specops/streams or kafka://127.0.0.1:9092)"
            )
        if self.num_partitions < 1:
            raise StreamConfigError(f"num_partitions must be >= 1, got {self.num_partitions}")
        if self.heartbeat_interval_s <= 0 or self.session_timeout_s < 2 * self.heartbeat_interval_s:
            raise StreamConfigError(
                "session_timeout_s must be at least twice heartbeat_interval_s "
                f"(got {self.session_timeout_s} and {self.heartbeat_interval_s})"
            )
        if self.max_poll_interval_s < self.session_timeout_s:
            raise StreamConfigError(
                f"max_poll_interval_s ({self.max_poll_interval_s}) must be >= session_timeout_s ({self.session_timeout_s})"
            )
        if self.retention_s < 0 or self.retention_bytes < 0:
            raise StreamConfigError("retention_s and retention_bytes must be >= 0 (0 disables them)")
        if self.segment_bytes < 1024:
            raise StreamConfigError(f"segment_bytes must be >= 1024, got {self.segment_bytes}")
        if self.security_protocol not in ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"):
            raise StreamConfigError(f"unknown security_protocol {self.security_protocol!r}")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> StreamConfig:
        """Defaults, then ``SPECOPS_STREAM_<FIELD>`` variables of ``environ`` (default ``os.environ``), then
        ``overrides``. A bad variable is a ``StreamConfigError`` naming it and its value."""
        env = dict(os.environ if environ is None else environ)
        sources = (InitSettingsSource(cls, overrides), _MappingEnvSource(cls, env))
        try:
            return cls(_build_sources=(sources, overrides))
        except StreamConfigError as exc:
            if not isinstance(exc.__cause__, ValidationError):
                raise
            problems = []
            for err in exc.__cause__.errors():
                name = str(err["loc"][0]) if err["loc"] else ""
                var = ENV_PREFIX + name.upper()
                shown = "" if "password" in name else f"={env.get(var)!r}"  # never repeat a secret
                where = f"{var}{shown}" if name not in overrides and var in env else name or "config"
                problems.append(f"{where}: {err['msg']}")
            raise StreamConfigError(f"invalid stream config: {'; '.join(problems)}") from exc.__cause__


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (as ``specops.core.settings.MappingEnvSource``,
    which this package cannot import)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {(k if self.case_sensitive else k.lower()): v for k, v in self._environ.items()}

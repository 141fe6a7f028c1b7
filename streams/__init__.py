"""Record schemas and the stream backends: Kafka (``kafka://``) and an embedded durable
append-only log (``local://``), behind one contract (``specops.streams.base``)."""

from __future__ import annotations

from pathlib import Path

from specops.streams.base import Consumer, Delivery, Message, OutMessage, Producer, Stream
from specops.streams.config import StreamConfig, Topics
from specops.streams.errors import (
    CommitFailedError,
    OffsetOutOfRangeError,
    RecordValidationError,
    StreamConfigError,
    StreamError,
    StreamUnavailableError,
)

__all__ = [
    "CommitFailedError",
    "Consumer",
    "Delivery",
    "Message",
    "OffsetOutOfRangeError",
    "OutMessage",
    "Producer",
    "RecordValidationError",
    "Stream",
    "StreamConfig",
    "StreamConfigError",
    "StreamError",
    "StreamUnavailableError",
    "Topics",
    "open_stream",
]


def open_stream(url_or_cfg: str | StreamConfig | None = None) -> Stream:
    """Open the backend named by the URL's scheme.

    ``local:///abs/path`` and ``local://./rel/path`` open the embedded log in that
    directory (created if missing); ``kafka://h1:9092,h2:9092`` connects to those
    bootstrap brokers. Unknown schemes raise :class:`StreamConfigError`.
    """
    if url_or_cfg is None:
        cfg = StreamConfig.from_env()
    elif isinstance(url_or_cfg, str):
        cfg = StreamConfig.from_env(url=url_or_cfg)
    else:
        cfg = url_or_cfg
    url = cfg.url
    if url.startswith("local://"):
        from specops.streams.local.stream import LocalStream

        rest = url[len("local://") :]
        if not rest:
            raise StreamConfigError("local:// needs a path: local:///abs/path or local://./relative/path")
        return LocalStream(Path(rest), cfg)
    if url.startswith("kafka://"):
        from specops.streams.kafka import KafkaStream

        servers = [s for s in url[len("kafka://") :].strip("/").split(",") if s]
        if not servers or any(":" not in s for s in servers):
            raise StreamConfigError(
                f"kafka url needs host:port pairs, got {url!r} (for example kafka://127.0.0.1:9092)"
            )
        return KafkaStream(servers, cfg)
    raise StreamConfigError(f"unknown stream url scheme in {url!r}: use local:// or kafka://")

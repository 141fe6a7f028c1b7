"""The producer of the local log: batches by partition, appended under each partition's
lock (see ``specops.streams.local.stream`` for the guarantees)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specops.streams.base import Delivery, OutMessage, Producer, partition_for_key
from specops.streams.errors import RecordValidationError, StreamError, StreamUnavailableError
from specops.streams.local.append import PartitionAppender
from specops.streams.local.files import TP, check_name
from specops.streams.local.frames import BODY, MAX_BODY

if TYPE_CHECKING:
    from specops.streams.local.stream import LocalStream


def _check_message(m: OutMessage) -> tuple[bytes | None, bytes]:
    key, value = m.key, m.value
    if key is not None and not isinstance(key, (bytes, bytearray)):
        raise RecordValidationError("OutMessage", "key", f"must be bytes or None, got {type(key).__name__}")
    if not isinstance(value, (bytes, bytearray)):
        raise RecordValidationError("OutMessage", "value", f"must be bytes, got {type(value).__name__}")
    if BODY.size + len(key or b"") + len(value) > MAX_BODY:
        raise RecordValidationError("OutMessage", "value", f"record too large ({len(value)} bytes, max {MAX_BODY})")
    return (None if key is None else bytes(key)), bytes(value)


class LocalProducer(Producer):
    """Appends to a :class:`LocalStream`; holds one lock file and segment per partition used."""

    def __init__(self, stream: LocalStream) -> None:
        self._stream = stream
        self._appenders: dict[TP, PartitionAppender] = {}
        self._closed = False

    def publish(self, topic: str, messages: Sequence[OutMessage]) -> list[Delivery]:
        if self._closed:
            raise StreamError("publish on a closed producer")
        check_name("topic", topic)
        records = [_check_message(m) for m in messages]
        if not records:
            return []
        n = self._stream.num_partitions(topic, create=True) or 0
        by_partition: dict[int, list[int]] = {}
        for i, (key, _) in enumerate(records):
            by_partition.setdefault(partition_for_key(key, n), []).append(i)
        timestamp_ms = int(time.time() * 1000)
        out: list[Delivery] = [Delivery(0, 0)] * len(records)
        for p in sorted(by_partition):
            indices = by_partition[p]
            first = self._append(topic, p, [records[i] for i in indices], timestamp_ms)
            for k, i in enumerate(indices):
                out[i] = Delivery(p, first + k)
        return out

    def _append(self, topic: str, p: int, records: list[tuple[bytes | None, bytes]], timestamp_ms: int) -> int:
        try:
            try:
                return self._appender(topic, p).append(records, timestamp_ms)
            except FileNotFoundError:
                # The partition directory is gone (topic or root removed): recreate, retry once.
                self._appenders.pop((topic, p)).close()
                self._stream.forget(topic)
                if p >= (self._stream.num_partitions(topic, create=True) or 0):
                    raise StreamUnavailableError(f"topic {topic} was recreated without partition {p}") from None
                return self._appender(topic, p).append(records, timestamp_ms)
        except OSError as exc:
            raise self._stream._unavailable(f"cannot append to {topic}[{p}]", exc) from exc

    def _appender(self, topic: str, p: int) -> PartitionAppender:
        if (topic, p) not in self._appenders:
            cfg = self._stream.cfg
            pdir = self._stream.partition_dir(topic, p)
            self._appenders[(topic, p)] = PartitionAppender(
                pdir, cfg.segment_bytes, cfg.fsync, cfg.retention_bytes, cfg.retention_s
            )
        return self._appenders[(topic, p)]

    def close(self) -> None:
        self._closed = True
        for appender in self._appenders.values():
            appender.close()
        self._appenders.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # never raise from a finalizer
            pass

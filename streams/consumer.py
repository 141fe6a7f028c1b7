"""Typed, at-least-once consumption with dead letters.

:class:`RecordConsumer` wraps a backend :class:`~specops.streams.base.Consumer`:

1. ``poll()`` decodes and validates each message. A valid record of an expected type is
   returned; anything else (bad bytes, failed validation, an unexpected record type) is
   wrapped in a :class:`~specops.streams.records.DeadLetter` with the raw bytes, the source
   topic/partition/offset and the reason, queued for the dead-letter topic and logged.
   The consumer moves on; it never raises on bad data.
2. ``commit()`` first publishes the queued dead letters and only then commits offsets,
   so an offset is never committed past a record that is neither processed nor
   dead-lettered. If the dead-letter publish fails, nothing is committed and the error
   propagates: after a restart those records come back (at-least-once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter

from specops.streams import codec
from specops.streams.base import Consumer, Message, OutMessage, Producer, Stream
from specops.streams.errors import RecordValidationError
from specops.streams.records import DeadLetter, Record

log = logging.getLogger(__name__)

DEADLETTERS = Counter(
    "specops_stream_deadletters_total", "Records refused by a consumer and sent to the dead-letter topic", ["topic"]
)
CONSUMED = Counter("specops_stream_records_consumed_total", "Valid records returned to a consumer", ["topic"])


@dataclass(frozen=True)
class Delivered:
    """A valid record and the message it came from."""

    record: Record
    message: Message


@dataclass
class ConsumerStats:
    delivered: int = 0
    deadlettered: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    """Dead letters per short reason (the field that failed)."""


class RecordConsumer:
    """A consumer-group member that yields typed records and dead-letters the rest."""

    def __init__(
        self,
        stream: Stream,
        group: str,
        topics: Sequence[str],
        *,
        deadletter_topic: str = "spec.deadletter",
        expect: Sequence[type] | None = None,
    ) -> None:
        self.stream = stream
        self.group = group
        self.deadletter_topic = deadletter_topic
        self.expect = tuple(expect) if expect else None
        self.consumer: Consumer = stream.consumer(group, list(topics))
        self._dlq_producer: Producer | None = None
        self._pending: list[DeadLetter] = []
        self.stats = ConsumerStats()

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Delivered]:
        """Valid records of the next batch; invalid ones are queued as dead letters."""
        out: list[Delivered] = []
        for msg in self.consumer.poll(max_records=max_records, timeout_s=timeout_s):
            try:
                record = codec.decode(msg.value)
                if self.expect and not isinstance(record, self.expect):
                    names = ", ".join(t.__name__ for t in self.expect)
                    raise RecordValidationError(
                        type(record).__name__, "type", f"topic {msg.topic} carries {names} only"
                    )
            except RecordValidationError as e:
                self._dead_letter(msg, e)
                continue
            out.append(Delivered(record, msg))
            CONSUMED.labels(msg.topic).inc()
        self.stats.delivered += len(out)
        return out

    def _dead_letter(self, msg: Message, err: RecordValidationError) -> None:
        reason = str(err)
        log.warning(
            "dead-lettering %s[%d]@%d (%d bytes): %s", msg.topic, msg.partition, msg.offset, len(msg.value), reason
        )
        self._pending.append(
            DeadLetter(
                source_topic=msg.topic,
                source_partition=msg.partition,
                source_offset=msg.offset,
                key=msg.key,
                value=bytes(msg.value),
                reason=reason[:4096],
                error_type=type(err).__name__,
                consumer_group=self.group,
            )
        )
        self.stats.deadlettered += 1
        short = f"{err.record_type}.{err.field}"
        self.stats.reasons[short] = self.stats.reasons.get(short, 0) + 1
        DEADLETTERS.labels(msg.topic).inc()

    def refuse(self, delivered: Delivered, field: str, reason: str) -> None:
        """Dead-letter a valid record its consumer will not take (published before the next commit)."""
        err = RecordValidationError(type(delivered.record).__name__, field, reason)
        self._dead_letter(delivered.message, err)

    def flush_deadletters(self) -> None:
        """Publish queued dead letters (raises StreamUnavailableError if it cannot)."""
        if not self._pending:
            return
        if self._dlq_producer is None:
            self._dlq_producer = self.stream.producer()
        batch = [OutMessage(key=d.key, value=codec.encode(d)) for d in self._pending]
        self._dlq_producer.publish(self.deadletter_topic, batch)
        log.info("published %d dead letter(s) to %s", len(batch), self.deadletter_topic)
        self._pending.clear()

    def commit(self) -> None:
        """Dead letters first, then offsets: nothing is committed without a trace."""
        self.flush_deadletters()
        self.consumer.commit()

    def assignment(self) -> set[tuple[str, int]]:
        return self.consumer.assignment()

    def close(self) -> None:
        """Leave the group without committing (queued dead letters come back on restart)."""
        self.consumer.close()
        if self._dlq_producer is not None:
            self._dlq_producer.close()
            self._dlq_producer = None

    def __enter__(self) -> RecordConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

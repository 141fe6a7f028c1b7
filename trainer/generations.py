"""Reading ``spec.generations`` for a job that registers what it builds (the router refit, the
DReSD datastore rebuild): its own consumer group, at-least-once.

:class:`GenerationsReader` polls GenerationRecords (malformed ones go to the dead-letter
topic), remembers per partition the offsets consumed since the last commit (the *lineage*
of the next registered version), and commits only when told to, after the registration."""

from __future__ import annotations

from collections.abc import Iterator


class GenerationsReader:
    """``spec.generations`` in consumer group ``group``; call :meth:`commit` after registering."""

    def __init__(
        self, stream_cfg, group: str, *, poll_records: int = 500, poll_timeout_s: float = 1.0, max_polls: int = 100
    ) -> None:
        self.stream_cfg, self.group = stream_cfg, group
        self.poll_records, self.poll_timeout_s, self.max_polls = poll_records, poll_timeout_s, max_polls
        self.pending: dict[str, list[int]] = {}
        """Per partition, [first, last] offsets consumed since the last commit."""
        self._stream = self._consumer = None

    def _open(self):
        if self._consumer is None:
            from specops.streams import open_stream
            from specops.streams.consumer import RecordConsumer
            from specops.streams.records import GenerationRecord

            self._stream = open_stream(self.stream_cfg)
            self._consumer = RecordConsumer(
                self._stream,
                self.group,
                [self.stream_cfg.topics.generations],
                deadletter_topic=self.stream_cfg.topics.deadletter,
                expect=[GenerationRecord],
            )
        return self._consumer

    def records(self) -> Iterator[tuple[tuple[str, int, int], object]]:
        """``((topic, partition, offset), GenerationRecord)`` for every record until a poll comes
        back empty (at most ``max_polls`` polls). A record may come again after a rebalance."""
        consumer = self._open()
        for _ in range(self.max_polls):
            delivered = consumer.poll(max_records=self.poll_records, timeout_s=self.poll_timeout_s)
            if not delivered:
                return
            for d in delivered:
                msg = d.message
                lo, hi = self.pending.get(str(msg.partition), [msg.offset, msg.offset])
                self.pending[str(msg.partition)] = [min(lo, msg.offset), max(hi, msg.offset)]
                yield (msg.topic, msg.partition, msg.offset), d.record

    def lineage(self) -> dict:
        return {"topic": self.stream_cfg.topics.generations, "offsets": {p: list(r) for p, r in self.pending.items()}}

    def commit(self) -> None:
        """Commit everything consumed (only after what it fed is registered)."""
        self._open().commit()
        self.pending.clear()

    def close(self) -> None:
        """Leave the group without committing (uncommitted records come back to the next reader)."""
        if self._consumer is not None:
            self._consumer.close()
        if self._stream is not None:
            self._stream.close()
        self._consumer = self._stream = None

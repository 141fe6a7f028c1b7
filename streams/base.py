"""The stream contract every backend implements (``kafka://`` and ``local://``).

A :class:`Stream` is opened from a URL by :func:`specops.streams.open_stream`. It hands out
producers and consumers:

- :meth:`Producer.publish` appends a batch of ``(key, value)`` messages to one topic and
  returns only once the backend holds them durably (Kafka ``acks=all``; the local log
  after ``write`` and, when configured, ``fsync``). A message with the same key always
  lands in the same partition, so one key stays in order.
- :meth:`Consumer.poll` returns the next batch of the partitions assigned to this
  member of the consumer group; :meth:`Consumer.commit` records that everything
  returned so far is processed. After a restart or a rebalance, delivery resumes at the
  committed offsets, so uncommitted records are delivered again (at-least-once).

Message keys and values are opaque bytes here; ``specops.streams.codec`` gives them meaning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Message:
    """One record as stored in a topic partition."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int
    """Append time at the backend, milliseconds since the epoch."""


@dataclass(frozen=True)
class OutMessage:
    """One record to publish."""

    key: bytes | None
    value: bytes


@dataclass(frozen=True)
class Delivery:
    """Where a published message landed."""

    partition: int
    offset: int


class Producer(ABC):
    """Appends messages to topics. Safe to use from one thread at a time."""

    @abstractmethod
    def publish(self, topic: str, messages: Sequence[OutMessage]) -> list[Delivery]:
        """Append ``messages`` to ``topic``, in order per key, and wait until durable.

        Returns one :class:`Delivery` per message, in input order. Raises
        :class:`~specops.streams.errors.StreamUnavailableError` when the backend cannot take
        them; in that case any subset may have been written (at-least-once).
        """

    @abstractmethod
    def close(self) -> None:
        """Release connections and files. Idempotent."""

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Consumer(ABC):
    """A member of a consumer group reading some partitions of some topics."""

    @abstractmethod
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Message]:
        """Up to ``max_records`` messages from the assigned partitions, in offset order
        per partition; waits up to ``timeout_s`` when nothing is available (then
        returns ``[]``). Also keeps this member alive in its group."""

    @abstractmethod
    def commit(self) -> None:
        """Commit the position after every message returned by ``poll`` so far.

        Raises :class:`~specops.streams.errors.CommitFailedError` if the group took the
        partitions away meanwhile (those records are redelivered to their new owner)
        and :class:`~specops.streams.errors.StreamUnavailableError` if the backend is down.
        """

    @abstractmethod
    def assignment(self) -> set[tuple[str, int]]:
        """The ``(topic, partition)`` pairs this member currently owns."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group without committing. Idempotent."""

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stream(ABC):
    """One backend at one URL."""

    url: str

    @abstractmethod
    def ensure_topics(self, topics: Mapping[str, int]) -> None:
        """Create each missing topic with the given number of partitions. Existing
        topics are left as they are."""

    @abstractmethod
    def list_topics(self) -> dict[str, int]:
        """Every topic and its number of partitions."""

    @abstractmethod
    def producer(self) -> Producer:
        """A new producer."""

    @abstractmethod
    def consumer(self, group: str, topics: Sequence[str]) -> Consumer:
        """A new member of consumer group ``group`` subscribed to ``topics``. A group
        with no committed offset starts at the earliest record."""

    @abstractmethod
    def end_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the offset the next appended record will get."""

    @abstractmethod
    def committed(self, group: str, topic: str) -> dict[int, int]:
        """Per partition, the committed offset of ``group`` (partitions it never
        committed are absent)."""

    @abstractmethod
    def read(self, topic: str, *, from_end: int | None = None, timeout_s: float = 5.0) -> Iterator[Message]:
        """Read ``topic`` outside any group, partition by partition, up to the end
        offsets at the time of the call. With ``from_end=n`` start ``n`` records
        before the end of each partition. For inspection and tests; commits nothing."""

    def damage(self, topic: str) -> list[dict[str, Any]]:
        """Damaged byte ranges found in ``topic``'s storage, one dict each (``partition``,
        ``segment``, ``start``, ``end``, ``bytes``, ``where``, ``quarantine``). Only the local
        log keeps its own storage; on Kafka the broker does, and this is empty."""
        return []

    def close(self) -> None:
        """Release shared clients. Idempotent."""

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def partition_for_key(key: bytes | None, num_partitions: int) -> int:
    """The partition a keyed message goes to: Kafka's default (murmur2, positive
    modulo), so a cluster id maps to the same partition number on both backends.
    Unkeyed messages go to partition 0 on the local log."""
    if key is None:
        return 0
    from kafka.partitioner.default import murmur2

    return (murmur2(key) & 0x7FFFFFFF) % num_partitions

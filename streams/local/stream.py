"""Embedded, durable, append-only log: the ``local://`` backend of ``specops.streams.base``.

Several processes on one machine share one directory: serving processes publish,
trainer processes consume in consumer groups. Layout under the root::

    .lock                                    root lock (flock) serialising topic creation
    topics/<topic>/topic.json                {"num_partitions": N, "created": ts}
    topics/<topic>/<p>/.lock                 per-partition append lock (flock)
    topics/<topic>/<p>/<base:020d>.log       segments, named by their first offset
    groups/<group>/members/<member>.json     one per live consumer; mtime = last heartbeat
    groups/<group>/offsets/<topic>/<p>       {"offset", "segment", "pos", "member", "ts"}

The log's pieces, one module each: frames and the scanner (``specops.streams.local.frames``),
the corruption policy (``specops.streams.local.damage``), cursors and reading
(``specops.streams.local.segment``), appending (``specops.streams.local.append``), names and metadata
files (``specops.streams.local.files``), the producer (``specops.streams.local.producer``) and consumer
groups (``specops.streams.local.group``); this module holds :class:`LocalStream`, the topics and
the committed offsets. Metadata, member and offset files are written to a temporary
file in the same directory and renamed over the old one (with ``cfg.fsync``, the file
and then its directory are fsynced). The root is created on first use; an unusable
root raises :class:`StreamUnavailableError` from the operation that needed it.
Guarantees:

- **Appends** hold an exclusive ``flock`` on the partition, quarantine and truncate a
  torn tail left by a producer killed mid-write (only a tail: nothing valid after it),
  write the batch (one ``write`` per segment) and, with ``cfg.fsync``, ``fsync`` it
  before ``publish`` returns. A kill -9 of any producer or consumer loses nothing
  ``publish`` returned for; power loss is covered only with ``fsync`` on. Offsets grow
  by one per record from 0 and are never reused: records lost to a damaged tail leave a
  gap (the partition's high-water mark). A producer caches the end of each partition;
  records appended meanwhile by other producers are scanned (and CRC-checked) to find
  the new end.
- **Readers** never return a torn record: they stop before an incomplete or corrupt
  frame at the tail and retry at the next poll. Damage in the middle of a segment
  (valid frames after it) is skipped, reported and quarantined, never taken for the
  tail; see ``specops.streams.local.segment`` for the corruption policy.
- **Consumer groups** are at-least-once. Members heartbeat by touching their file; a
  member silent for ``session_timeout_s`` (or not polling for ``max_poll_interval_s``)
  is dead. Partition ``p`` of a topic belongs to ``live[p % len(live)]`` of the sorted
  live members subscribed to it; every member recomputes this at least every
  ``heartbeat_interval_s / 2`` while polling, and at every commit. There is no
  stop-the-world rebalance: for that short window two members may both read a moved
  partition (duplicates, never loss), and a commit of a partition that moved away
  raises :class:`CommitFailedError`. A newly owned partition starts at the group's
  committed offset (the stored byte position is a hint, checked before use); one
  beyond everything the partition ever held raises :class:`OffsetOutOfRangeError`.
  Liveness compares file mtimes with the wall clock, so all members must share one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from specops.streams.base import Message, Stream
from specops.streams.config import StreamConfig
from specops.streams.errors import StreamConfigError, StreamUnavailableError
from specops.streams.local.damage import QUARANTINE, damage_seen
from specops.streams.local.files import POLL_STEP_S, TP, check_name, fsync_dir, read_json, write_json_atomic
from specops.streams.local.group import LocalConsumer
from specops.streams.local.producer import LocalProducer
from specops.streams.local.segment import PartitionReader, Tail, find_tail, locate

__all__ = ["LocalConsumer", "LocalProducer", "LocalStream"]

log = logging.getLogger(__name__)

_QUARANTINED = re.compile(r"(\d{20})\.(\d+)-(\d+)\.bin")
_LOST = re.compile(r"(\d{20})\.lost-(\d+)-(\d+)\.offsets")


class LocalStream(Stream):
    """The log in directory ``root`` (created on first use; relative to the current
    directory at construction)."""

    def __init__(self, root: Path, cfg: StreamConfig | None = None) -> None:
        self.root = Path(root).absolute()
        self.url = f"local://{self.root}"
        self.cfg = cfg if cfg is not None else StreamConfig(url=self.url)
        self._partitions: dict[str, int] = {}
        self._tails: dict[TP, Tail] = {}

    def topic_dir(self, topic: str) -> Path:
        return self.root / "topics" / topic

    def partition_dir(self, topic: str, partition: int) -> Path:
        return self.topic_dir(topic) / str(partition)

    def group_dir(self, group: str) -> Path:
        return self.root / "groups" / group

    def _unavailable(self, what: str, exc: BaseException) -> StreamUnavailableError:
        return StreamUnavailableError(f"local stream at {self.root}: {what}: {exc}")

    def ensure_topics(self, topics: Mapping[str, int]) -> None:
        for name, n in topics.items():
            check_name("topic", name)
            if not isinstance(n, int) or n < 1:
                raise StreamConfigError(f"topic {name!r}: num_partitions must be an int >= 1, got {n!r}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                for name, n in topics.items():
                    self._create_topic(name, n)
            finally:
                os.close(fd)  # releases the flock
        except (OSError, ValueError) as exc:
            raise self._unavailable(f"cannot create topics {sorted(topics)}", exc) from exc

    def _create_topic(self, name: str, n: int) -> None:
        """Under the root lock: create ``name`` unless its metadata file exists."""
        meta_path = self.topic_dir(name) / "topic.json"
        meta = read_json(meta_path)
        if meta is None:
            for p in range(n):
                self.partition_dir(name, p).mkdir(parents=True, exist_ok=True)
            write_json_atomic(meta_path, {"num_partitions": n, "created": time.time()}, self.cfg.fsync)
            if self.cfg.fsync:
                fsync_dir(self.topic_dir(name).parent)
            log.info("created topic %s with %d partitions in %s", name, n, self.root)
            meta = {"num_partitions": n}
        self._partitions[name] = int(meta["num_partitions"])

    def num_partitions(self, topic: str, create: bool = False) -> int | None:
        """Partitions of ``topic``; None if it does not exist (created when ``create``)."""
        if topic in self._partitions:
            return self._partitions[topic]
        try:
            meta = read_json(self.topic_dir(topic) / "topic.json")
        except (OSError, ValueError) as exc:
            raise self._unavailable(f"cannot read metadata of topic {topic}", exc) from exc
        if meta is None:
            if not create:
                return None
            self.ensure_topics({topic: self.cfg.num_partitions})
            return self._partitions[topic]
        self._partitions[topic] = int(meta["num_partitions"])
        return self._partitions[topic]

    def forget(self, topic: str) -> None:
        """Drop cached metadata of ``topic`` (its directory went away)."""
        self._partitions.pop(topic, None)

    def list_topics(self) -> dict[str, int]:
        try:
            names = sorted(os.listdir(self.root / "topics"))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise self._unavailable("cannot list topics", exc) from exc
        found = {name: self.num_partitions(name) for name in names}
        return {name: n for name, n in found.items() if n is not None}

    def producer(self) -> LocalProducer:
        return LocalProducer(self)

    def consumer(self, group: str, topics: Sequence[str]) -> LocalConsumer:
        return LocalConsumer(self, group, topics)

    def end_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the offset after the last complete record ({} for a missing topic)."""
        n = self.num_partitions(check_name("topic", topic))
        out: dict[int, int] = {}
        try:
            for p in range(n or 0):
                tail, _ = find_tail(self.partition_dir(topic, p), self._tails.get((topic, p)))
                self._tails[(topic, p)] = tail
                out[p] = tail.next_offset
        except OSError as exc:
            raise self._unavailable(f"cannot read the end of {topic}", exc) from exc
        return out

    def damage(self, topic: str) -> list[dict[str, Any]]:
        """Damaged byte ranges of ``topic``'s segments: those quarantined on disk and those
        this process met (see ``specops.streams.local.damage``), one dict each, by partition."""
        found: dict[tuple[int, str, int, int], dict[str, Any]] = {}
        for p in range(self.num_partitions(check_name("topic", topic)) or 0):
            pdir = self.partition_dir(topic, p)
            for d in damage_seen(pdir):
                q = str(d.quarantine) if d.quarantine else None
                found[(p, d.segment.stem, d.start, d.end)] = dict(
                    partition=p,
                    segment=int(d.segment.stem),
                    start=d.start,
                    end=d.end,
                    bytes=d.size,
                    where=d.where,
                    quarantine=q,
                )
            with contextlib.suppress(FileNotFoundError):
                for name in sorted(os.listdir(pdir / QUARANTINE)):
                    lost = _LOST.fullmatch(name)
                    if lost is not None:  # whole records lost from a tail: offsets, not bytes
                        first, last = int(lost[2]), int(lost[3])
                        found[(p, lost[1], -1, first)] = dict(
                            partition=p,
                            segment=int(lost[1]),
                            start=0,
                            end=0,
                            bytes=0,
                            where=f"offsets {first}-{last} were handed out but their records are not in the log "
                            "(lost whole with a damaged tail)",
                            quarantine=None,
                            offsets=[first, last],
                        )
                        continue
                    m = _QUARANTINED.fullmatch(name)
                    if m is None or (p, m[1], int(m[2]), int(m[3])) in found:
                        continue
                    start, end = int(m[2]), int(m[3])
                    found[(p, m[1], start, end)] = dict(
                        partition=p,
                        segment=int(m[1]),
                        start=start,
                        end=end,
                        bytes=end - start,
                        where="quarantined earlier",
                        quarantine=str(pdir / QUARANTINE / name),
                    )
        return [found[k] for k in sorted(found)]

    def read_committed(self, group: str, topic: str, partition: int) -> dict[str, Any] | None:
        """The committed-offset record of one partition, or None."""
        path = self.group_dir(group) / "offsets" / topic / str(partition)
        try:
            rec = read_json(path)
        except ValueError as exc:
            log.error("ignoring unreadable committed offset %s (%s): the group restarts it earlier", path, exc)
            return None
        except OSError as exc:
            raise self._unavailable(f"cannot read committed offset {path}", exc) from exc
        valid = isinstance(rec, dict) and isinstance(rec.get("offset"), int) and rec["offset"] >= 0
        if rec is not None and not valid:
            log.error("ignoring malformed committed offset %s: %r", path, rec)
            return None
        return rec

    def committed(self, group: str, topic: str) -> dict[int, int]:
        check_name("group", group)
        n = self.num_partitions(check_name("topic", topic)) or 0
        recs = {p: self.read_committed(group, topic, p) for p in range(n)}
        return {p: rec["offset"] for p, rec in recs.items() if rec is not None}

    def read(self, topic: str, *, from_end: int | None = None, timeout_s: float = 5.0) -> Iterator[Message]:
        """Records of ``topic`` up to the end offsets at the call ([] for a missing topic);
        waits up to ``timeout_s`` per partition for records below that end."""
        ends = self.end_offsets(topic)
        return self._read_partitions(topic, ends, from_end, timeout_s)

    def _read_partitions(
        self, topic: str, ends: dict[int, int], from_end: int | None, timeout_s: float
    ) -> Iterator[Message]:
        for p, end in sorted(ends.items()):
            start = 0 if from_end is None else max(0, end - from_end)
            pdir = self.partition_dir(topic, p)
            try:
                reader = PartitionReader(pdir, topic, p, locate(pdir, start))
            except OSError as exc:
                raise self._unavailable(f"cannot read {topic}[{p}]", exc) from exc
            try:
                yield from self._read_until(reader, end, timeout_s)
            finally:
                reader.close()

    def _read_until(self, reader: PartitionReader, end: int, timeout_s: float) -> Iterator[Message]:
        deadline = time.monotonic() + timeout_s
        while reader.cursor.offset < end:
            try:
                batch = reader.read(min(500, end - reader.cursor.offset))
            except OSError as exc:
                raise self._unavailable(f"cannot read {reader.topic}[{reader.partition}]", exc) from exc
            yield from (m for m in batch if m.offset < end)
            if not batch:
                if time.monotonic() > deadline:
                    cur = reader.cursor.offset
                    where = f"{reader.topic}[{reader.partition}]"
                    log.warning("read %s: stopped at offset %d before the end %d", where, cur, end)
                    return
                time.sleep(POLL_STEP_S)

"""Embedded, durable, append-only log: the ``local://`` backend of ``streams.base``.

Several processes on one machine share one directory: serving processes publish,
trainer processes consume in consumer groups. Layout under the root::

    .lock                                    root lock (flock) serialising topic creation
    topics/<topic>/topic.json                {"num_partitions": N, "created": ts}
    topics/<topic>/<p>/.lock                 per-partition append lock (flock)
    topics/<topic>/<p>/<base:020d>.log       segments, named by their first offset
    groups/<group>/members/<member>.json     one per live consumer; mtime = last heartbeat
    groups/<group>/offsets/<topic>/<p>       {"offset", "segment", "pos", "member", "ts"}

Frames, segment scanning, appending and the corruption policy live in
``streams.local_segment``. Metadata, member and offset files are written to a temporary
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
  tail; see ``streams.local_segment`` for the corruption policy.
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
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specops.streams.base import Consumer, Delivery, Message, OutMessage, Producer, Stream, partition_for_key
from specops.streams.config import StreamConfig
from specops.streams.errors import (
    CommitFailedError,
    OffsetOutOfRangeError,
    RecordValidationError,
    StreamConfigError,
    StreamError,
    StreamUnavailableError,
)
from specops.streams.local_segment import (
    BODY,
    MAX_BODY,
    QUARANTINE,
    Cursor,
    PartitionAppender,
    PartitionReader,
    Tail,
    cursor_from_hint,
    damage_seen,
    find_tail,
    fsync_dir,
    locate,
)

log = logging.getLogger(__name__)

TP = tuple[str, int]
_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_POLL_STEP_S = 0.02
_QUARANTINED = re.compile(r"(\d{20})\.(\d+)-(\d+)\.bin")


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise StreamConfigError(
            f"invalid {kind} name {name!r}: use 1-249 characters of A-Z a-z 0-9 . _ - (not . or ..)"
        )
    return name


def _write_json_atomic(path: Path, obj: Any, fsync: bool) -> None:
    """Write ``obj`` to a temporary file next to ``path`` and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)


def _read_json(path: Path) -> Any | None:
    """The parsed file, or None if it does not exist. Raises ValueError if unparsable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


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
            _check_name("topic", name)
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
        meta = _read_json(meta_path)
        if meta is None:
            for p in range(n):
                self.partition_dir(name, p).mkdir(parents=True, exist_ok=True)
            _write_json_atomic(meta_path, {"num_partitions": n, "created": time.time()}, self.cfg.fsync)
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
            meta = _read_json(self.topic_dir(topic) / "topic.json")
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
        n = self.num_partitions(_check_name("topic", topic))
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
        this process met (see ``streams.local_segment``), one dict each, by partition."""
        found: dict[tuple[int, str, int, int], dict[str, Any]] = {}
        for p in range(self.num_partitions(_check_name("topic", topic)) or 0):
            pdir = self.partition_dir(topic, p)
            for d in damage_seen(pdir):
                q = str(d.quarantine) if d.quarantine else None
                found[(p, d.segment.stem, d.start, d.end)] = dict(partition=p, segment=int(d.segment.stem),
                    start=d.start, end=d.end, bytes=d.size, where=d.where, quarantine=q)  # fmt: skip
            with contextlib.suppress(FileNotFoundError):
                for name in sorted(os.listdir(pdir / QUARANTINE)):
                    m = _QUARANTINED.fullmatch(name)
                    if m is None or (p, m[1], int(m[2]), int(m[3])) in found:
                        continue
                    start, end = int(m[2]), int(m[3])
                    found[(p, m[1], start, end)] = dict(partition=p, segment=int(m[1]), start=start, end=end,
                        bytes=end - start, where="quarantined earlier", quarantine=str(pdir / QUARANTINE / name))  # fmt: skip
        return [found[k] for k in sorted(found)]

    def read_committed(self, group: str, topic: str, partition: int) -> dict[str, Any] | None:
        """The committed-offset record of one partition, or None."""
        path = self.group_dir(group) / "offsets" / topic / str(partition)
        try:
            rec = _read_json(path)
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
        _check_name("group", group)
        n = self.num_partitions(_check_name("topic", topic)) or 0
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
                time.sleep(_POLL_STEP_S)


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
        _check_name("topic", topic)
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


class _Heartbeat:
    """Daemon thread touching the member file every ``interval_s`` while the consumer
    polls at least every ``max_poll_s``. Holds no reference to the consumer."""

    def __init__(self, path: Path, interval_s: float, max_poll_s: float) -> None:
        self.path, self.interval_s, self.max_poll_s = path, interval_s, max_poll_s
        self.last_poll = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stream-heartbeat-{path.stem[:8]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stalled = False
        while not self._stop.wait(self.interval_s):
            idle = time.monotonic() - self.last_poll
            if idle > self.max_poll_s:
                if not stalled:
                    log.warning(
                        "consumer %s did not poll for %.1fs (max_poll_interval_s): leaving its group", self.path.stem, idle
                    )
                stalled = True
                continue
            stalled = False
            try:
                os.utime(self.path)
            except FileNotFoundError:
                pass  # expired by the group; the next poll rejoins
            except OSError as exc:
                log.warning("heartbeat of consumer %s failed: %s", self.path.stem, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class LocalConsumer(Consumer):
    """A member of a consumer group of a :class:`LocalStream` (see the module doc)."""

    def __init__(self, stream: LocalStream, group: str, topics: Sequence[str]) -> None:
        self._closed = True  # until joined, so close() and __del__ are safe if this fails
        self._heartbeat: _Heartbeat | None = None
        self._stream, self._cfg, self._group = stream, stream.cfg, _check_name("group", group)
        self._topics = sorted({_check_name("topic", t) for t in topics})
        if not self._topics:
            raise StreamConfigError("a consumer needs at least one topic")
        self.member_id = uuid.uuid4().hex
        self._members_dir = stream.group_dir(group) / "members"
        self._member_path = self._members_dir / f"{self.member_id}.json"
        self._readers: dict[TP, PartitionReader] = {}
        self._pending: dict[TP, Cursor] = {}  # position after the last record polled, uncommitted
        self._lost: set[TP] = set()  # polled, uncommitted and revoked since
        self._member_topics: dict[str, frozenset[str]] = {}
        self._next_rebalance = 0.0
        self._round = 0
        try:
            self._join()
        except OSError as exc:
            raise stream._unavailable(f"cannot join group {group}", exc) from exc
        self._heartbeat = _Heartbeat(self._member_path, self._cfg.heartbeat_interval_s, self._cfg.max_poll_interval_s)
        self._closed = False

    def _join(self) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "topics": self._topics, "created": time.time()}
        _write_json_atomic(self._member_path, info, fsync=False)

    def _check_open(self) -> None:
        if self._closed:
            raise StreamError(f"consumer {self.member_id} of group {self._group} is closed")

    def assignment(self) -> set[TP]:
        return set(self._readers)

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Message]:
        self._check_open()
        assert self._heartbeat is not None
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            while True:
                self._heartbeat.last_poll = time.monotonic()
                self._maybe_rebalance()
                out = self._read(max(1, max_records))
                remaining = deadline - time.monotonic()
                if out or remaining <= 0:
                    return out
                time.sleep(min(_POLL_STEP_S, remaining))
        except OSError as exc:
            raise self._stream._unavailable(f"poll of group {self._group} failed", exc) from exc

    def _read(self, max_records: int) -> list[Message]:
        """Round-robin over the assigned partitions, starting one further each call;
        a first pass gives each partition an equal share, a second fills up."""
        tps = sorted(self._readers)
        if not tps:
            return []
        k = self._round % len(tps)
        self._round += 1
        order = tps[k:] + tps[:k]
        out: list[Message] = []
        for share in (max(1, max_records // len(order)), max_records):
            for tp in order:
                if len(out) >= max_records:
                    break
                batch = self._readers[tp].read(min(share, max_records - len(out)))
                if batch:
                    out.extend(batch)
                    self._pending[tp] = replace(self._readers[tp].cursor)
        return out

    def commit(self) -> None:
        self._check_open()
        if not self._pending and not self._lost:
            return
        try:
            self._maybe_rebalance(force=True)
            failed = set(self._lost)
            for tp in sorted(self._pending):
                if tp in self._readers:
                    self._write_offset(tp, self._pending[tp])
                else:
                    failed.add(tp)
                del self._pending[tp]
            self._lost.clear()
        except OSError as exc:
            raise self._stream._unavailable(f"commit of group {self._group} failed", exc) from exc
        if failed:
            names = ", ".join(f"{t}[{p}]" for t, p in sorted(failed))
            raise CommitFailedError(
                f"group {self._group}: {names} moved to another member before the commit; "
                "their records since the last commit will be delivered to the new owner"
            )

    def _write_offset(self, tp: TP, cursor: Cursor) -> None:
        topic, p = tp
        rec = {"offset": cursor.offset, "segment": cursor.segment, "pos": cursor.pos}
        rec |= {"member": self.member_id, "ts": time.time()}
        path = self._stream.group_dir(self._group) / "offsets" / topic / str(p)
        _write_json_atomic(path, rec, self._cfg.fsync)

    def _maybe_rebalance(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_rebalance:
            return
        self._next_rebalance = now + self._cfg.heartbeat_interval_s / 2
        self._ensure_member()
        self._apply(self._compute_assignment())

    def _ensure_member(self) -> None:
        """Touch our member file; if the group expired us meanwhile, drop everything and rejoin."""
        try:
            if time.time() - os.stat(self._member_path).st_mtime <= self._cfg.session_timeout_s:
                os.utime(self._member_path)
                return
        except FileNotFoundError:
            pass
        log.warning(
            "consumer %s was expired from group %s (silent for more than %.1fs): rejoining; "
            "its partitions restart from their committed offsets",
            self.member_id,
            self._group,
            self._cfg.session_timeout_s,
        )
        self._apply(set())
        self._join()

    def _live_members(self) -> dict[str, frozenset[str]]:
        """Live member ids and their topics; removes the files of dead members."""
        try:
            names = os.listdir(self._members_dir)
        except FileNotFoundError:
            names = []
        live: dict[str, frozenset[str]] = {}
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            mid, path = name[: -len(".json")], self._members_dir / name
            if mid != self.member_id and self._remove_if_expired(path, mid):
                continue
            topics = self._member_topics.get(mid) or self._read_member_topics(path)
            if topics is not None:
                live[mid] = topics
        live[self.member_id] = frozenset(self._topics)
        self._member_topics = live
        return live

    def _remove_if_expired(self, path: Path, mid: str) -> bool:
        """True (and its file removed) if the member has been silent for the session timeout."""
        try:
            if time.time() - os.stat(path).st_mtime <= self._cfg.session_timeout_s:
                return False
        except FileNotFoundError:
            return True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            log.info("group %s: removed member %s (silent for %.1fs)", self._group, mid, self._cfg.session_timeout_s)
        return True

    def _read_member_topics(self, path: Path) -> frozenset[str] | None:
        try:
            info = _read_json(path)
        except ValueError as exc:
            log.error("group %s: ignoring unreadable member file %s: %s", self._group, path, exc)
            return None
        return None if info is None else frozenset(info.get("topics", []))

    def _compute_assignment(self) -> set[TP]:
        live = self._live_members()
        owned: set[TP] = set()
        for topic in self._topics:
            members = sorted(mid for mid, topics in live.items() if topic in topics)
            n = self._stream.num_partitions(topic) or 0
            owned.update((topic, p) for p in range(n) if members[p % len(members)] == self.member_id)
        return owned

    def _apply(self, assignment: set[TP]) -> None:
        """Drop revoked partitions (their uncommitted polls become lost) and open the new
        ones at their committed offsets."""
        old = set(self._readers)
        for tp in sorted(old - assignment):
            self._readers.pop(tp).close()
            if self._pending.pop(tp, None) is not None:
                self._lost.add(tp)
        for tp in sorted(assignment - old):
            self._readers[tp] = self._open_reader(tp)
        if old != assignment:
            log.info(
                "group %s member %s: assigned %s, revoked %s",
                self._group,
                self.member_id[:8],
                sorted(assignment - old),
                sorted(old - assignment),
            )

    def _open_reader(self, tp: TP) -> PartitionReader:
        topic, p = tp
        pdir = self._stream.partition_dir(topic, p)
        rec = self._stream.read_committed(self._group, topic, p)
        if rec is None:
            return PartitionReader(pdir, topic, p, locate(pdir, 0))
        try:
            cursor = cursor_from_hint(pdir, rec["offset"], rec.get("segment"), rec.get("pos"))
        except OffsetOutOfRangeError as exc:
            path = self._stream.group_dir(self._group) / "offsets" / topic / str(p)
            raise OffsetOutOfRangeError(
                f"group {self._group}: committed {exc} To restart {topic}[{p}] from the earliest record, delete "
                f"{path} (check first which log is the right one)"
            ) from None
        return PartitionReader(pdir, topic, p, cursor)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        try:
            os.unlink(self._member_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("consumer %s could not remove its member file: %s", self.member_id, exc)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # never raise from a finalizer
            pass

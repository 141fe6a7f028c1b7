"""Consumer groups of the local log: members, heartbeats, partition assignment and
committed offsets (the guarantees are in ``specops.streams.local.stream``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from specops.streams.base import Consumer, Message
from specops.streams.errors import CommitFailedError, OffsetOutOfRangeError, StreamConfigError, StreamError
from specops.streams.local.files import POLL_STEP_S, TP, check_name, read_json, write_json_atomic
from specops.streams.local.segment import Cursor, PartitionReader, cursor_from_hint, locate

if TYPE_CHECKING:
    from specops.streams.local.stream import LocalStream

log = logging.getLogger("specops.streams.local.stream")


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
                        "consumer %s did not poll for %.1fs (max_poll_interval_s): leaving its group",
                        self.path.stem,
                        idle,
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
        self._stream, self._cfg, self._group = stream, stream.cfg, check_name("group", group)
        self._topics = sorted({check_name("topic", t) for t in topics})
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
        write_json_atomic(self._member_path, info, fsync=False)

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
                time.sleep(min(POLL_STEP_S, remaining))
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
        write_json_atomic(path, rec, self._cfg.fsync)

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
            info = read_json(path)
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

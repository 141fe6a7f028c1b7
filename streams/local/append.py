"""Appending to a partition of the local log, under its flock (see ``specops.streams.local.stream``).

Before each batch the appender repairs the tail: bytes after the last valid frame are
quarantined and truncated (a torn write, or a damaged tail; ``specops.streams.local.damage``),
and the next offset is raised to the high-water mark (``specops.streams.local.segment``).
Whole sealed segments past the retention limits are deleted when a segment rolls.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from specops.streams.local.damage import quarantine, record_lost_offsets, report_damage
from specops.streams.local.files import fsync_dir
from specops.streams.local.frames import (
    BODY,
    HEADER,
    MAGIC,
    MAGIC_BYTES,
    MAX_BODY,
    PREFIX,
    encode_frame,
    list_segments,
    segment_path,
)
from specops.streams.local.segment import HWM_FILE, Tail, find_tail, load_hwm, partition_name, write_hwm

log = logging.getLogger("specops.streams.local.stream")


def write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _is_torn_write(head: bytes, torn: int, next_offset: int, log_end: int) -> bool:
    """Whether the ``torn`` bytes starting with ``head`` are what a producer killed while
    writing the record with ``next_offset`` leaves: its header (or a prefix of it), with
    a body that runs past the end of the file. ``log_end``: the offset after the last
    valid frame; below ``next_offset``, offsets were handed out past it."""
    if len(head) < HEADER.size:  # cut inside the header: check what is there
        if not head or not MAGIC_BYTES.startswith(head[:4]):
            return False
        if len(head) >= 8 and not BODY.size <= int.from_bytes(head[4:8], "little") <= MAX_BODY:
            return False
        written = head[12:20]  # the part of the offset that made it to the file
        if written:
            return next_offset.to_bytes(8, "little").startswith(written)
        # No offset to compare: if offsets were handed out past the log's end, the cut record
        # may be one of them (acknowledged), so it is damage, not a torn write.
        return next_offset == log_end
    magic, body_len, _, offset, _, _ = HEADER.unpack(head)
    return (
        magic == MAGIC and offset == next_offset and BODY.size <= body_len <= MAX_BODY and PREFIX.size + body_len > torn
    )


class PartitionAppender:
    """Appends batches to one partition, under the partition's flock."""

    def __init__(
        self, pdir: Path, segment_bytes: int, fsync: bool, retention_bytes: int = 0, retention_s: float = 0.0
    ) -> None:
        self.pdir, self.segment_bytes, self.fsync = pdir, segment_bytes, fsync
        self.retention_bytes, self.retention_s = retention_bytes, retention_s
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._fd_key: tuple[int, int] | None = None  # (segment base, inode) of _fd
        self._tail: Tail | None = None

    def append(self, records: list[tuple[bytes | None, bytes]], timestamp_ms: int) -> int:
        """Append ``records`` and return the offset of the first."""
        self._lock()
        try:
            self._tail = self._repair_tail()
            return self._write(records, timestamp_ms)
        finally:
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _lock(self) -> None:
        """Lock the partition, reopening the lock file if it was replaced meanwhile."""
        path = self.pdir / ".lock"
        for _ in range(8):
            if self._lock_fd is None:
                self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(self._lock_fd).st_ino:
                    return
            self.close()
        raise OSError(f"lock file {path} keeps being replaced")

    def _repair_tail(self) -> Tail:
        """The tail to append at: bytes after the last valid frame are quarantined and
        truncated, and the next offset is raised to the high-water mark."""
        tail, torn = find_tail(self.pdir, self._tail)
        mark = load_hwm(self.pdir)
        hwm = 0 if mark is None else mark
        if torn:
            # Every append leaves the high-water mark behind it, so a torn record at the mark was
            # never handed out. Without a readable mark (deleted, corrupted, or lost with the disk)
            # nothing says so: the torn bytes may hold acknowledged records, their offsets committed.
            # Then they are damage, and no offset they may hold is handed out again: each record
            # takes at least HEADER.size bytes (issue 58: the next record reused such an offset,
            # and a group committed past it never received that record).
            known = mark is not None
            self._truncate(tail, torn, max(tail.next_offset, hwm), may_be_torn_write=known)
            if not known:
                hwm = max(hwm, tail.next_offset + -(-torn // HEADER.size))
        if tail.ino == -1:  # no segment yet: the first one is named by its first offset
            return Tail(hwm, -1, 0, hwm)
        if hwm > tail.next_offset:
            log.error(
                "%s: offsets %d-%d were handed out but their records are not in the log (lost with a damaged "
                "tail); the next record gets offset %d, so that no offset is used twice",
                partition_name(self.pdir),
                tail.next_offset,
                hwm - 1,
                hwm,
            )
            try:
                record_lost_offsets(self.pdir, tail.base, tail.next_offset, hwm - 1)
            except OSError as exc:
                log.warning("%s: could not record the lost offsets: %s", partition_name(self.pdir), exc)
            tail = replace(tail, next_offset=hwm)
        return tail

    def _truncate(self, tail: Tail, torn: int, next_offset: int, *, may_be_torn_write: bool = True) -> None:
        """Quarantine and cut the ``torn`` bytes after ``tail``: a torn write (the header
        of the next record, cut short; only when ``may_be_torn_write``), or a damaged tail.
        Raises OSError, truncating nothing, if the quarantine copy cannot be written."""
        fd = self._open_segment(tail.base)
        path = segment_path(self.pdir, tail.base)
        start, end = tail.end, tail.end + torn
        head = os.pread(fd, HEADER.size, start)
        if may_be_torn_write and _is_torn_write(head, torn, next_offset, tail.next_offset):
            copied = quarantine(fd, path, start, end, ".torn")
            log.warning(
                "%s: truncating %d bytes of a torn record at the end of segment %d (a producer died mid-append); "
                "copied to %s",
                self.pdir,
                torn,
                tail.base,
                copied,
            )
        else:
            copied = quarantine(fd, path, start, end)
            report_damage(fd, path, start, end, "at the end of the active segment; truncating them", copied=copied)
        os.ftruncate(fd, tail.end)
        if self.fsync:
            os.fsync(fd)

    def _open_segment(self, base: int) -> int:
        """The write descriptor of segment ``base``, created if missing."""
        path = segment_path(self.pdir, base)
        if self._fd is not None and self._fd_key is not None and self._fd_key[0] == base:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == self._fd_key[1]:
                    return self._fd
        self._close_segment()
        created = not path.exists()  # exact: we hold the partition lock
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._fd, self._fd_key = fd, (base, os.fstat(fd).st_ino)
        if created and self.fsync:
            fsync_dir(self.pdir)
        return fd

    def _write(self, records: list[tuple[bytes | None, bytes]], timestamp_ms: int) -> int:
        assert self._tail is not None
        start_base = self._tail.base
        self._open_segment(self._tail.base)
        first = offset = self._tail.next_offset
        buf = bytearray()
        for key, value in records:
            if self._tail.end + len(buf) >= self.segment_bytes:
                self._flush(buf, offset)
                buf = bytearray()
                self._open_segment(offset)
                self._tail = Tail(offset, self._fd_key[1] if self._fd_key else -1, 0, offset)
            buf += encode_frame(offset, timestamp_ms, key, value)
            offset += 1
        self._flush(buf, offset)
        rolled = self._tail.base != start_base
        write_hwm(self.pdir, offset, self.fsync and rolled)
        if rolled:  # the right moment to apply retention
            self._enforce_retention()
        return first

    def _enforce_retention(self) -> None:
        """Delete whole sealed segments, oldest first, that are older than ``retention_s``
        or beyond ``retention_bytes`` for the partition (0 disables either). Runs under
        the partition lock when a segment rolls; the active segment is never deleted.
        A reader holding a deleted segment open finishes it; a consumer whose committed
        offset was deleted restarts at the earliest record, with a warning."""
        if not (self.retention_bytes or self.retention_s):
            return
        bases = list_segments(self.pdir)
        sizes = {}
        for b in bases:
            with contextlib.suppress(FileNotFoundError):
                sizes[b] = os.stat(segment_path(self.pdir, b))
        total = sum(st.st_size for st in sizes.values())
        now = time.time()
        for b in bases[:-1]:
            st = sizes.get(b)
            if st is None:
                continue
            too_old = self.retention_s and now - st.st_mtime > self.retention_s
            too_big = self.retention_bytes and total > self.retention_bytes
            if not (too_old or too_big):
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_path(self.pdir, b))
                total -= st.st_size
                log.info("%s: retention deleted segment %d (%d bytes)", self.pdir, b, st.st_size)

    def _flush(self, buf: bytearray, next_offset: int) -> None:
        assert self._tail is not None and self._fd is not None and self._fd_key is not None
        if not buf:
            return
        write_all(self._fd, buf)
        if self.fsync:
            os.fsync(self._fd)
        self._tail = replace(self._tail, ino=self._fd_key[1], end=self._tail.end + len(buf), next_offset=next_offset)

    def _close_segment(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._fd_key = None, None

    def close(self) -> None:
        if self.fsync and self._tail is not None:
            with contextlib.suppress(OSError):
                fd = os.open(self.pdir / HWM_FILE, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self._close_segment()
        self._tail = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

"""Frames, segment files and partition cursors of the local log (see ``streams.local``).

A partition directory holds segment files named by the offset of their first record,
zero-padded (``00000000000000000042.log``). A segment is a sequence of frames, all
integers little-endian::

    magic u32 | body_len u32 | crc32(body) u32 | body
    body = offset u64 | timestamp_ms u64 | key_len i32 (-1: no key) | key | value

Scanning stops at the first frame that is incomplete (header or body cut short) or
fails its check (bad magic, absurd length, CRC mismatch). Such a frame at the tail is
a write in progress or the leftover of a producer killed mid-write: readers wait for
it, the next producer truncates it under the partition lock. A CRC failure *followed
by a valid frame* cannot come from a crashed writer (every writer truncates a torn tail
before appending), only from external corruption: it is logged as an error and
skipped, on the condition that its length field is sane (otherwise the frames after it
cannot be found, and the scan stops there).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from streams.base import Message

log = logging.getLogger("streams.local")

MAGIC = 0x31474F4C  # b"LOG1"
PREFIX = struct.Struct("<III")  # magic, body_len, crc32(body)
BODY = struct.Struct("<QQi")  # offset, timestamp_ms, key_len
HEADER = struct.Struct("<IIIQQi")  # PREFIX + BODY, parsed at once
MAX_BODY = 1 << 30
SUFFIX = ".log"
READ_CHUNK = 256 * 1024


def encode_frame(offset: int, timestamp_ms: int, key: bytes | None, value: bytes) -> bytes:
    """One record as stored on disk."""
    key_len = -1 if key is None else len(key)
    body = b"".join((BODY.pack(offset, timestamp_ms, key_len), key or b"", value))
    return PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body


def segment_path(pdir: Path, base: int) -> Path:
    return pdir / f"{base:020d}{SUFFIX}"


def list_segments(pdir: Path) -> list[int]:
    """Base offsets of the partition's segments, ascending ([] if none or no directory)."""
    try:
        names = os.listdir(pdir)
    except FileNotFoundError:
        return []
    stems = (n[: -len(SUFFIX)] for n in names if n.endswith(SUFFIX))
    return sorted(int(s) for s in stems if s.isdigit())


class Status(Enum):
    OK = "ok"
    INCOMPLETE = "incomplete"
    CORRUPT = "corrupt"


@dataclass(frozen=True, slots=True)
class Frame:
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes
    size: int
    """Bytes the frame takes in the segment."""


class _Window:
    """Bytes of a segment read ahead with ``pread``. Lives for one scan only, so data
    truncated and rewritten by a producer is never served from a stale buffer."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._start = 0
        self._buf = memoryview(b"")

    def get(self, pos: int, n: int) -> memoryview:
        """``n`` bytes at ``pos``, or fewer where the file ends."""
        off = pos - self._start
        if off < 0 or off + n > len(self._buf):
            self._buf = memoryview(os.pread(self._fd, max(n, READ_CHUNK), pos))
            self._start, off = pos, 0
        return self._buf[off : off + n]


def read_frame(win: _Window, pos: int, keep: bool = True) -> tuple[Status, Frame | None, int]:
    """The frame at ``pos``, its status and its size (0 when the header is unusable).
    With ``keep=False`` the key and value are not copied out."""
    head = win.get(pos, HEADER.size)
    if len(head) < HEADER.size:
        return Status.INCOMPLETE, None, 0
    magic, body_len, crc, offset, ts, key_len = HEADER.unpack(head)
    if magic != MAGIC or not BODY.size <= body_len <= MAX_BODY:
        return Status.CORRUPT, None, 0
    size = PREFIX.size + body_len
    data = win.get(pos, size)
    if len(data) < size:
        return Status.INCOMPLETE, None, size
    if zlib.crc32(data[PREFIX.size :]) != crc or not -1 <= key_len <= body_len - BODY.size:
        return Status.CORRUPT, None, size
    if not keep:
        return Status.OK, Frame(offset, ts, None, b"", size), size
    k1 = HEADER.size + max(key_len, 0)
    key = None if key_len < 0 else bytes(data[HEADER.size : k1])
    return Status.OK, Frame(offset, ts, key, bytes(data[k1:]), size), size


@dataclass
class Scan:
    frames: list[Frame]
    end: int
    """Byte position after the last frame consumed (valid or skipped)."""
    next_offset: int | None
    """Offset after the last valid frame consumed; None if none was."""
    stop_offset: int | None = None
    """Offset of the frame the scan stopped before because of ``until_offset``."""


def scan(
    fd: int,
    pos: int,
    *,
    max_frames: int | None = None,
    until_offset: int | None = None,
    keep: bool = True,
    name: str = "segment",
) -> Scan:
    """Valid frames from byte ``pos`` on, up to ``max_frames``, stopping before the first
    frame whose offset is ``>= until_offset``, or at the tail (see the module doc)."""
    win = _Window(fd)
    out = Scan([], pos, None)
    while max_frames is None or len(out.frames) < max_frames:
        status, frame, size = read_frame(win, out.end, keep)
        if status is Status.OK and frame is not None:
            if until_offset is not None and frame.offset >= until_offset:
                out.stop_offset = frame.offset
                break
            if keep:
                out.frames.append(frame)
            out.next_offset = frame.offset + 1
            out.end += size
        elif status is Status.CORRUPT and size and read_frame(win, out.end + size, False)[0] is Status.OK:
            log.error(
                "%s: skipping a corrupt record of %d bytes at byte %d (CRC mismatch with valid records after "
                "it: the file was damaged outside this library); that record is lost",
                name,
                size,
                out.end,
            )
            out.end += size
        else:
            break
    return out


@dataclass(frozen=True)
class Tail:
    """The validated end of a partition: its last segment and the next offset."""

    base: int = 0
    ino: int = -1
    """Inode of the segment file (-1: the partition has no segment yet)."""
    end: int = 0
    next_offset: int = 0


def find_tail(pdir: Path, cached: Tail | None) -> tuple[Tail, int]:
    """The partition's tail and the number of torn bytes after it. Scans only the bytes
    appended since ``cached`` when it still describes the last segment."""
    bases = list_segments(pdir)
    if not bases:
        return Tail(), 0
    path = segment_path(pdir, bases[-1])
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        start = Tail(bases[-1], st.st_ino, 0, bases[-1])
        if cached is not None and (cached.base, cached.ino) == (start.base, start.ino) and cached.end <= st.st_size:
            start = cached
        if start.end == st.st_size:
            return start, 0
        res = scan(fd, start.end, keep=False, name=str(path))
        next_offset = start.next_offset if res.next_offset is None else res.next_offset
        return Tail(start.base, start.ino, res.end, next_offset), os.fstat(fd).st_size - res.end
    finally:
        os.close(fd)


@dataclass
class Cursor:
    """A read position: segment base offset, byte position in it, and next offset."""

    segment: int
    pos: int
    offset: int


def locate(pdir: Path, offset: int) -> Cursor:
    """The cursor of ``offset``, scanning the one segment that holds it. An offset before
    the first or after the last record resets to the earliest (logged)."""
    bases = list_segments(pdir)
    if not bases or offset < bases[0]:
        if offset > 0:
            log.warning("%s: offset %d is out of range; starting from the earliest record", pdir, offset)
        return Cursor(bases[0], 0, bases[0]) if bases else Cursor(0, 0, 0)
    base = max(b for b in bases if b <= offset)
    if offset == base:
        return Cursor(base, 0, base)
    fd = os.open(segment_path(pdir, base), os.O_RDONLY)
    try:
        res = scan(fd, 0, until_offset=offset, keep=False, name=str(segment_path(pdir, base)))
    finally:
        os.close(fd)
    if res.stop_offset is not None:
        return Cursor(base, res.end, res.stop_offset)
    reached = base if res.next_offset is None else res.next_offset
    if reached == offset:
        return Cursor(base, res.end, offset)
    later = [b for b in bases if b > base]
    if later:
        return Cursor(later[0], 0, later[0])
    log.warning("%s: offset %d is past the end (%d); starting from the earliest record", pdir, offset, reached)
    return Cursor(bases[0], 0, bases[0])


def cursor_from_hint(pdir: Path, offset: int, segment: object, pos: object) -> Cursor:
    """The cursor of a committed ``offset``, trusting the stored byte position only if a
    frame with that offset is there."""
    if isinstance(segment, int) and isinstance(pos, int) and pos >= 0:
        try:
            fd = os.open(segment_path(pdir, segment), os.O_RDONLY)
        except FileNotFoundError:
            return locate(pdir, offset)
        try:
            status, frame, _ = read_frame(_Window(fd), pos, keep=False)
        finally:
            os.close(fd)
        if status is Status.OK and frame is not None and frame.offset == offset:
            return Cursor(segment, pos, offset)
    return locate(pdir, offset)


class PartitionReader:
    """Reads one partition forward from a cursor, following segment rolls."""

    def __init__(self, pdir: Path, topic: str, partition: int, cursor: Cursor) -> None:
        self.pdir, self.topic, self.partition, self.cursor = pdir, topic, partition, cursor
        self._fd: int | None = None

    def read(self, max_records: int) -> list[Message]:
        """Up to ``max_records`` complete records from the cursor on ([] at the tail)."""
        out: list[Message] = []
        while len(out) < max_records:
            fd = self._open()
            if fd is None:
                break
            cur = self.cursor
            res = scan(fd, cur.pos, max_frames=max_records - len(out), name=str(segment_path(self.pdir, cur.segment)))
            tp = (self.topic, self.partition)
            out.extend(Message(*tp, f.offset, f.key, f.value, f.timestamp_ms) for f in res.frames)
            cur.pos = res.end
            if res.next_offset is not None:
                cur.offset = res.next_offset
            # A writer creates the segment named by our next offset only after writing every
            # earlier offset, so once it exists this segment holds nothing more for us.
            if len(out) >= max_records or cur.offset == cur.segment or not segment_path(self.pdir, cur.offset).exists():
                break
            leftover = os.fstat(fd).st_size - cur.pos
            if leftover > 0:
                log.error("%s: skipping %d unreadable bytes at the end of a sealed segment", self.pdir, leftover)
            self._switch(Cursor(cur.offset, 0, cur.offset))
        return out

    def _open(self) -> int | None:
        if self._fd is None:
            try:
                self._fd = os.open(segment_path(self.pdir, self.cursor.segment), os.O_RDONLY)
            except FileNotFoundError:
                bases = list_segments(self.pdir)
                if bases and self.cursor.segment not in bases:
                    cur = self.cursor
                    log.warning("%s: segment %d is gone; relocating offset %d", self.pdir, cur.segment, cur.offset)
                    self.cursor = locate(self.pdir, self.cursor.offset)
                return None  # nothing published yet, or retry at the next read
        return self._fd

    def _switch(self, cursor: Cursor) -> None:
        self.close()
        self.cursor = cursor

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


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
            self._tail = self._truncate_torn_tail()
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

    def _truncate_torn_tail(self) -> Tail:
        tail, torn = find_tail(self.pdir, self._tail)
        if torn:
            log.warning(
                "%s: truncating %d bytes of a torn record at the end of segment %d (a producer died mid-append)",
                self.pdir,
                torn,
                tail.base,
            )
            fd = self._open_segment(tail.base)
            os.ftruncate(fd, tail.end)
            if self.fsync:
                os.fsync(fd)
        return tail

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
        if self._tail.base != start_base:  # rolled: the right moment to apply retention
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
        self._close_segment()
        self._tail = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

"""Frames, segment files and partition cursors of the local log (see ``streams.local``).

A partition directory holds segment files named by the offset of their first record,
zero-padded (``00000000000000000042.log``). A segment is a sequence of frames, all
integers little-endian::

    magic u32 | body_len u32 | crc32(body) u32 | body
    body = offset u64 | timestamp_ms u64 | key_len i32 (-1: no key) | key | value

Corruption policy. A frame that is incomplete (header or body cut short) or fails its
check (bad magic, absurd length, CRC mismatch) is either

- **a tail**: nothing valid follows it in the segment. In the active segment this is a
  write in progress or the leftover of a producer killed mid-write: readers wait for
  it, and the next producer, under the partition lock, copies it to the quarantine
  directory and truncates it. Only a tail is ever truncated.
- **damage**: a valid frame follows it (found by scanning forward for the magic, a sane
  length, a matching CRC and a plausible offset). A crashed writer cannot leave this
  (every writer truncates a torn tail before appending); the file was damaged outside
  this library. Readers and producers resynchronise at that valid frame: nothing after
  the damage is lost or deleted. The damaged byte range is logged as an ERROR (once
  per process), counted (:func:`damage_seen`, ``specops_stream_damaged_bytes_total``)
  and copied to ``<partition>/quarantine/<segment>.<start>-<end>.bin``; the bytes stay
  in the segment, skipped, until retention deletes the segment (rewriting a segment
  under live readers would be the riskier repair).

Offsets are never reused. ``<partition>/.hwm`` holds the partition's high-water mark,
the offset after the last record ever appended, rewritten in place after every append
(and fsynced at segment rolls and on close, with ``fsync``). The next offset is the
larger of the log's end and the mark, so records lost to a damaged tail leave a gap in
the offsets instead of being replaced by new records with the same offsets. A consumer
whose committed offset is beyond both is an error naming the partition
(:class:`OffsetOutOfRangeError`), never a silent restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

from prometheus_client import Counter

from specops.streams.base import Message
from specops.streams.errors import OffsetOutOfRangeError

log = logging.getLogger("specops.streams.local")

MAGIC = 0x31474F4C  # b"LOG1"
PREFIX = struct.Struct("<III")  # magic, body_len, crc32(body)
BODY = struct.Struct("<QQi")  # offset, timestamp_ms, key_len
HEADER = struct.Struct("<IIIQQi")  # PREFIX + BODY, parsed at once
MAX_BODY = 1 << 30
MAGIC_BYTES = struct.pack("<I", MAGIC)
SUFFIX = ".log"
READ_CHUNK = 256 * 1024
RESYNC_CHUNK = 1 << 20
QUARANTINE = "quarantine"
HWM_FILE = ".hwm"
HWM = struct.Struct("<IQI")  # magic, high-water mark, crc32 of the first 12 bytes
HWM_MAGIC = 0x314D5748  # b"HWM1"


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
    END = "end"
    """No byte at the position: the end of the file."""
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
        return (Status.INCOMPLETE if head else Status.END), None, 0
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
    damaged: list[tuple[int, int]] = field(default_factory=list)
    """Byte ranges skipped as damage (a valid frame follows each)."""
    torn: bool = False
    """The scan stopped at an invalid frame that nothing valid follows (a tail)."""


def resync(fd: int, pos: int, min_offset: int | None) -> int | None:
    """Byte position of the first valid frame after ``pos`` whose offset is at least
    ``min_offset``, or None. Candidates are the magic's occurrences; each must have a
    sane length and a matching CRC."""
    win, start = _Window(fd), pos + 1
    while True:
        chunk = os.pread(fd, RESYNC_CHUNK, start)
        i = chunk.find(MAGIC_BYTES)
        while i >= 0:
            status, frame, _ = read_frame(win, start + i, keep=False)
            if status is Status.OK and frame is not None and (min_offset is None or frame.offset >= min_offset):
                return start + i
            i = chunk.find(MAGIC_BYTES, i + 1)
        if len(chunk) < RESYNC_CHUNK:
            return None
        start += len(chunk) - (len(MAGIC_BYTES) - 1)


def scan(
    fd: int,
    pos: int,
    *,
    max_frames: int | None = None,
    until_offset: int | None = None,
    keep: bool = True,
    expect_offset: int | None = None,
    path: Path | None = None,
) -> Scan:
    """Valid frames from byte ``pos`` on, up to ``max_frames``, stopping before the first
    frame whose offset is ``>= until_offset``, or at a tail; damage followed by valid
    frames is reported (when ``path`` names the segment) and skipped (see the module
    doc). ``expect_offset``: the offset the first frame at ``pos`` should have at least."""
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
            continue
        if status is Status.END:
            break
        found = resync(fd, out.end, out.next_offset if out.next_offset is not None else expect_offset)
        if found is None:
            out.torn = True
            break
        win = _Window(fd)
        # Bytes are only ever appended past a tail: a frame read while it was being written is
        # complete once a valid frame after it is visible. Read it again before calling it damage.
        if read_frame(win, out.end, keep=False)[0] is Status.OK:
            continue
        if path is not None:
            report_damage(fd, path, out.end, found, "valid records follow it")
        out.damaged.append((out.end, found))
        out.end = found
    return out


# ------------------------------------------------------------------ damage


@dataclass(frozen=True)
class Damage:
    """A byte range of a segment that holds no valid frame."""

    segment: Path
    start: int
    end: int
    where: str
    """Why it is damage: "valid records follow it", "at the end of a sealed segment", ..."""
    quarantine: Path | None
    """The copy of the bytes, or None if it could not be written."""

    @property
    def size(self) -> int:
        return self.end - self.start


DAMAGED = Counter(
    "specops_stream_damaged_bytes",
    "Bytes of the local log found damaged in this process: skipped by readers, copied to quarantine",
    ["topic", "partition"],
)
_damage_lock = threading.Lock()
_damage: dict[tuple[str, int, int, int], Damage] = {}


def damage_seen(pdir: Path | None = None) -> list[Damage]:
    """Damaged ranges this process has met (of partition ``pdir``, or all), oldest first."""
    with _damage_lock:
        found = list(_damage.values())
    return [d for d in found if pdir is None or d.segment.parent == pdir]


def quarantine_path(segment: Path, start: int, end: int, suffix: str = ".bin") -> Path:
    """Where bytes ``[start, end)`` of ``segment`` are kept: ``.bin`` for damage, ``.torn``
    for the torn write of a producer killed mid-append (not damage)."""
    return segment.parent / QUARANTINE / f"{segment.stem}.{start}-{end}{suffix}"


def quarantine(fd: int, segment: Path, start: int, end: int, suffix: str = ".bin") -> Path:
    """Copy bytes ``[start, end)`` of the open ``segment`` to its quarantine file (once;
    written to a temporary file, fsynced and renamed). Raises OSError."""
    dest = quarantine_path(segment, start, end, suffix)
    if dest.exists():
        return dest
    dest.parent.mkdir(exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            pos = start
            while pos < end:
                chunk = os.pread(fd, min(RESYNC_CHUNK, end - pos), pos)
                if not chunk:
                    break
                f.write(chunk)
                pos += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return dest


def report_damage(fd: int, segment: Path, start: int, end: int, where: str, *, copied: Path | None = None) -> Damage:
    """Log (ERROR, once per process), count and quarantine damaged bytes ``[start, end)``
    of ``segment``. A failed quarantine copy is logged, not raised (readers may lack write
    access); ``copied``: the copy was already made."""
    key = (str(segment), os.fstat(fd).st_ino, start, end)
    with _damage_lock:
        if key in _damage:
            return _damage[key]
    if copied is None:
        try:
            copied = quarantine(fd, segment, start, end)
        except OSError as exc:
            log.warning("%s: could not copy damaged bytes %d-%d to quarantine: %s", segment, start, end, exc)
    found = Damage(segment, start, end, where, copied)
    with _damage_lock:
        if key in _damage:
            return _damage[key]
        _damage[key] = found
    DAMAGED.labels(segment.parent.parent.name, segment.parent.name).inc(end - start)
    log.error(
        "%s: %d damaged bytes at bytes %d-%d (%s): the file was damaged outside this library; the records "
        "there are lost, every other record is kept; the bytes are copied to %s",
        segment,
        end - start,
        start,
        end,
        where,
        copied or "nowhere (quarantine failed)",
    )
    return found


# ------------------------------------------------------------------ high-water mark


def read_hwm(pdir: Path) -> int:
    """The partition's high-water mark (0 if it has none yet, or an unreadable one)."""
    try:
        with open(pdir / HWM_FILE, "rb") as f:
            data = f.read(HWM.size)
    except FileNotFoundError:
        return 0
    if len(data) == HWM.size:
        magic, value, crc = HWM.unpack(data)
        if magic == HWM_MAGIC and crc == zlib.crc32(data[:12]):
            return int(value)
    log.error("%s: unreadable high-water mark %r: using the log's end instead", pdir / HWM_FILE, data)
    return 0


def write_hwm(pdir: Path, value: int, fsync: bool) -> None:
    """Overwrite the high-water mark in place (one 16-byte ``pwrite``)."""
    head = struct.pack("<IQ", HWM_MAGIC, value)
    fd = os.open(pdir / HWM_FILE, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, head + struct.pack("<I", zlib.crc32(head)), 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Tail:
    """The validated end of a partition: its last segment and the next offset."""

    base: int = 0
    ino: int = -1
    """Inode of the segment file (-1: the partition has no segment yet)."""
    end: int = 0
    next_offset: int = 0


def find_tail(pdir: Path, cached: Tail | None) -> tuple[Tail, int]:
    """The partition's tail and the number of bytes after it that hold no valid frame (a
    torn write, or a damaged tail). Scans only the bytes appended since ``cached`` when
    it still describes the last segment; damage met on the way is reported."""
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
        res = scan(fd, start.end, keep=False, expect_offset=start.next_offset, path=path)
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


def partition_name(pdir: Path) -> str:
    """``topic[p]`` of a partition directory."""
    return f"{pdir.parent.name}[{pdir.name}]"


def locate(pdir: Path, offset: int) -> Cursor:
    """The cursor of ``offset``, scanning the one segment that holds it. An offset before
    the first record (deleted by retention) starts at the earliest record, logged; an
    offset in a gap starts at the next record. An offset beyond the log's end and its
    high-water mark raises :class:`OffsetOutOfRangeError`."""
    bases = list_segments(pdir)
    if not bases or offset < bases[0]:
        if not bases:
            _check_in_range(pdir, offset, 0)
            return Cursor(offset, 0, offset)
        if offset > 0:
            log.warning(
                "%s: offset %d was deleted by retention; starting from the earliest record, %d",
                partition_name(pdir),
                offset,
                bases[0],
            )
        return Cursor(bases[0], 0, bases[0])
    base = max(b for b in bases if b <= offset)
    if offset == base:
        return Cursor(base, 0, base)
    path = segment_path(pdir, base)
    fd = os.open(path, os.O_RDONLY)
    try:
        res = scan(fd, 0, until_offset=offset, keep=False, expect_offset=base, path=path)
    finally:
        os.close(fd)
    if res.stop_offset is not None:
        return Cursor(base, res.end, res.stop_offset)
    reached = base if res.next_offset is None else res.next_offset
    later = [b for b in bases if b > base]
    if reached < offset and later:
        return Cursor(later[0], 0, later[0])
    if reached < offset:
        _check_in_range(pdir, offset, reached)
    return Cursor(base, res.end, offset)


def _check_in_range(pdir: Path, offset: int, end: int) -> None:
    """Raise unless ``offset`` was handed out (or is the next one): records lost with a
    damaged tail leave offsets below the high-water mark that no record holds."""
    hwm = read_hwm(pdir)
    if offset > max(end, hwm):
        raise OffsetOutOfRangeError(
            f"{partition_name(pdir)}: offset {offset} is beyond the end of the log ({end}) and beyond every "
            f"offset it ever handed out (high-water mark {hwm}): the log at {pdir} was replaced or restored, "
            "or the offset was edited"
        )


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
            self._scan(fd, max_records - len(out), out)
            if len(out) >= max_records:
                break
            # A writer creates a later segment only after its last write to this one, so
            # once one exists this segment is sealed: read what it still holds, then move on.
            later = [b for b in list_segments(self.pdir) if b > self.cursor.segment]
            if not later:
                break
            res = self._scan(fd, max_records - len(out), out)
            if len(out) >= max_records:
                break
            size = os.fstat(fd).st_size
            if res.torn and size > self.cursor.pos:
                path = segment_path(self.pdir, self.cursor.segment)
                report_damage(fd, path, self.cursor.pos, size, "at the end of a sealed segment")
            self._switch(Cursor(later[0], 0, max(later[0], self.cursor.offset)))
        return out

    def _scan(self, fd: int, max_frames: int, out: list[Message]) -> Scan:
        cur = self.cursor
        path = segment_path(self.pdir, cur.segment)
        res = scan(fd, cur.pos, max_frames=max_frames, expect_offset=cur.offset, path=path)
        tp = (self.topic, self.partition)
        out.extend(Message(*tp, f.offset, f.key, f.value, f.timestamp_ms) for f in res.frames)
        cur.pos = res.end
        if res.next_offset is not None:
            cur.offset = res.next_offset
        return res

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


def _is_torn_write(head: bytes, torn: int, next_offset: int) -> bool:
    """Whether the ``torn`` bytes starting with ``head`` are what a producer killed while
    writing the record with ``next_offset`` leaves: its header (or a prefix of it), with
    a body that runs past the end of the file."""
    if len(head) < HEADER.size:  # cut inside the header: check what is there
        if not head or not MAGIC_BYTES.startswith(head[:4]):
            return False
        if len(head) >= 8 and not BODY.size <= int.from_bytes(head[4:8], "little") <= MAX_BODY:
            return False
        return len(head) < 20 or int.from_bytes(head[12:20], "little") == next_offset
    magic, body_len, _, offset, _, _ = HEADER.unpack(head)
    return magic == MAGIC and offset == next_offset and BODY.size <= body_len <= MAX_BODY and PREFIX.size + body_len > torn


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
        hwm = read_hwm(self.pdir)
        if torn:
            self._truncate(tail, torn, max(tail.next_offset, hwm))
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
            tail = replace(tail, next_offset=hwm)
        return tail

    def _truncate(self, tail: Tail, torn: int, next_offset: int) -> None:
        """Quarantine and cut the ``torn`` bytes after ``tail``: a torn write (the header
        of the next record, cut short), or a damaged tail. Raises OSError, truncating
        nothing, if the quarantine copy cannot be written."""
        fd = self._open_segment(tail.base)
        path = segment_path(self.pdir, tail.base)
        start, end = tail.end, tail.end + torn
        if _is_torn_write(os.pread(fd, HEADER.size, start), torn, next_offset):
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

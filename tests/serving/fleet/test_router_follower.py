"""Router hot-swap: the follower swaps to a newly promoted router on an event and on polling, ignores
other models' events, and keeps its router through a registry outage or a corrupt artifact."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from specops.registry import RegistryConfig, RegistryStore, RegistryUnavailableError
from specops.serving.fleet.router import RouterFollower
from specops.streams.records import ModelEvent
from tests.registry.router_factory import FakeEmbedder, saved_router, stored_file


class Counting:
    """A RegistryStore that counts champion look-ups and can be taken down."""

    def __init__(self, reg: RegistryStore) -> None:
        self.reg, self.lookups, self.down = reg, 0, False

    def artifact(self, kind: str):
        outer, view = self, self.reg.artifact(kind)

        class Counted:
            def by_alias(self, key: str = "", alias: str = "champion"):
                outer.lookups += 1
                if outer.down:
                    raise RegistryUnavailableError("registry down (test)")
                return view.by_alias(key, alias)

            def fetch(self, rv, dest):
                return view.fetch(rv, dest)

        return Counted()


def _publish(reg: RegistryStore, tmp_path, name: str, clusters=("code", "prose"), **kw) -> str:
    rv = reg.artifact("router").register("", saved_router(tmp_path / name, clusters, **kw))
    reg.artifact("router").promote("", rv.version, reason=name)
    return rv.version


def _failures(reason: str) -> float:
    return REGISTRY.get_sample_value("specops_router_swap_failures_total", {"reason": reason}) or 0.0


def _wait(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def reg(sqlite_uri) -> RegistryStore:
    return RegistryStore(RegistryConfig(uri=sqlite_uri))


def test_follower_swaps_on_event_and_on_poll(reg, tmp_path):
    embedder = FakeEmbedder()
    registry = Counting(reg)
    follower = RouterFollower(
        registry, cache_dir=tmp_path / "cache", embedder_factory=lambda kind: embedder, poll_s=3600.0
    )
    assert follower.current() is None and follower.route("x") is None
    v1 = _publish(reg, tmp_path, "r1")
    follower.start()
    try:
        assert follower.wait_idle(20)
        assert follower.current().version == v1 and follower.swaps == 1  # the first check at start
        assert follower.route("def f(): pass").router_version == v1
        before = follower.current()

        v2 = _publish(reg, tmp_path, "r2", ("code", "prose", "sql"), seed=1)
        lookups = registry.lookups
        follower.on_event(ModelEvent(kind="promotion", model_name="draft-code", version="9"))  # another model
        assert follower.wait_idle(20) and registry.lookups == lookups and follower.current() is before
        follower.on_event(ModelEvent(kind="promotion", model_name="router", version=v2, previous_version=v1))
        assert follower.wait_idle(20)
        router = follower.current()
        assert router.version == v2 and router.clusters == ("code", "prose", "sql") and follower.swaps == 2
        assert before.version == v1 and before.k == 2  # a request holding the old router keeps it intact
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [f"v{v2}"]  # older fetches pruned
    finally:
        follower.stop()

    polling = RouterFollower(
        reg, cache_dir=tmp_path / "cache2", embedder_factory=lambda kind: embedder, poll_s=0.2
    ).start()
    try:
        _wait(lambda: polling.current() is not None and polling.current().version == v2)
        v3 = _publish(reg, tmp_path, "r3", seed=2)  # no event: the poll finds it
        _wait(lambda: polling.current().version == v3)
        assert polling.swaps == 2 and [v for _, v in polling.history] == [v2, v3]
        assert REGISTRY.get_sample_value("specops_router_version") == float(v3)
    finally:
        polling.stop()


def test_outage_and_corrupt_artifact_keep_the_router(reg, tmp_path, request, sqlite_uri):
    embedder = FakeEmbedder()
    registry = Counting(reg)
    follower = RouterFollower(registry, cache_dir=tmp_path / "cache", embedder_factory=lambda kind: embedder)
    v1 = _publish(reg, tmp_path, "r1")
    assert follower.check() and follower.current().version == v1
    kept = follower.current()

    registry.down = True  # 1. the registry cannot be reached
    before = _failures("registry_unavailable")
    assert not follower.check() and follower.current() is kept and follower.failures == 1
    assert _failures("registry_unavailable") == before + 1
    registry.down = False

    rv = reg.artifact("router").register("", saved_router(tmp_path / "r2", seed=5))  # 2. a corrupt artifact is promoted
    stored = stored_file(rv, "router.safetensors", request, RegistryConfig(uri=sqlite_uri))
    data = bytearray(stored.read_bytes())
    data[-5] ^= 0xFF
    stored.write_bytes(bytes(data))
    reg.artifact("router").promote("", rv.version)
    before = _failures("artifact_integrity")
    assert not follower.check() and follower.current() is kept and follower.failures == 2
    assert _failures("artifact_integrity") == before + 1
    assert not (tmp_path / "cache" / f"v{rv.version}").exists()

    v3 = _publish(reg, tmp_path, "r3", embedder=FakeEmbedder(salt="other"))  # 3. fitted with another embedder
    before = _failures("router")
    assert not follower.check() and follower.current() is kept and _failures("router") == before + 1

    v4 = _publish(reg, tmp_path, "r4", seed=7)  # 4. a good one again: swapped in
    assert follower.check() and follower.current().version == v4 and v4 != v3

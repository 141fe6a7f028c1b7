"""The generic alias follower with a toy kind: follows promotions and rollbacks, keeps the
current version when loading fails or the registry is down, and never exposes a half-built object."""

from __future__ import annotations

import json
import threading
import time

import pytest

from specops.registry import RegistryConfig, RegistryStore, RegistryUnavailableError
from specops.serving.fleet.follower import AliasFollower, FollowConfig
from specops.streams.records import ModelEvent
from tests.registry.test_kinds import datastore_dir


class Datastores(AliasFollower):
    """A toy datastore follower: 'loading' reads the JSON and refuses entries < 0."""

    def __init__(self, registry, tmp_path) -> None:
        super().__init__(registry, "datastore", FollowConfig(poll_s=0.2, backoff_initial_s=0.05, backoff_max_s=0.1))
        self.tmp_path, self.held, self.refused = tmp_path, {}, []

    def serving_version(self, key):
        held = self.held.get(key)
        return held["version"] if held else None

    def load(self, key, version):
        dest = self.tmp_path / f"{key}-v{version.version}"
        self.registry.artifact("datastore").fetch(version, dest)
        meta = json.loads((dest / "datastore.json").read_text())
        if meta["num_entries"] < 0:
            raise ValueError(f"version {version.version} has {meta['num_entries']} entries")
        return {"version": version.version, **meta}  # built whole, then installed by one assignment

    def install(self, key, version, obj, load_s):
        self.held[key] = obj

    def failed(self, key, exc, reason, retry_in):
        self.refused.append((key, reason))
        super().failed(key, exc, reason, retry_in)


class Flaky:
    def __init__(self, reg):
        self.reg, self.down = reg, False

    def artifact(self, kind):
        outer, view = self, self.reg.artifact(kind)

        class View:
            def by_alias(self, key="", alias="champion"):
                if outer.down:
                    raise RegistryUnavailableError("down (test)")
                return view.by_alias(key, alias)

            def fetch(self, v, dest):
                return view.fetch(v, dest)

        return View()


def wait(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def reg(sqlite_uri):
    return RegistryStore(RegistryConfig(uri=sqlite_uri))


def test_follows_promotions_events_and_rollbacks(reg, tmp_path):
    ds = reg.artifact("datastore")
    v1 = ds.register("sql", datastore_dir(tmp_path / "a", 4)).version
    ds.promote("sql", v1)
    f = Datastores(reg, tmp_path / "cache")
    f.follow("sql")
    f.start()
    try:
        wait(lambda: f.serving_version("sql") == v1)
        v2 = ds.register("sql", datastore_dir(tmp_path / "b", 6)).version
        ds.promote("sql", v2)
        f.on_event(ModelEvent(kind="promotion", model_name="datastore-sql", version=v2, previous_version=v1))
        wait(lambda: f.serving_version("sql") == v2)
        assert f.held["sql"]["num_entries"] == 6
        f.on_event(ModelEvent(kind="promotion", model_name="draft-sql", version="9"))  # another kind: ignored
        assert f.wait_idle(10) and f.serving_version("sql") == v2
        ds.rollback("sql", reason="test")
        wait(lambda: f.serving_version("sql") == v1)  # found by polling
    finally:
        f.stop()


def test_a_refused_artifact_and_an_outage_keep_the_current_version(reg, tmp_path):
    ds = reg.artifact("datastore")
    v1 = ds.register("code", datastore_dir(tmp_path / "a", 4)).version
    ds.promote("code", v1)
    flaky = Flaky(reg)
    f = Datastores(flaky, tmp_path / "cache")
    assert f.check("code") and f.serving_version("code") == v1
    bad_dir = datastore_dir(tmp_path / "bad", 4)
    (bad_dir / "datastore.json").write_text(json.dumps({"num_entries": -1}))
    bad = ds.register("code", bad_dir).version
    ds.promote("code", bad)
    assert not f.check("code") and f.serving_version("code") == v1
    assert f.refused[-1] == ("code", "ValueError")
    flaky.down = True
    assert not f.check("code") and f.serving_version("code") == v1
    assert f.refused[-1] == ("code", "registry_unavailable")
    flaky.down = False
    good = ds.register("code", datastore_dir(tmp_path / "c", 5)).version
    ds.promote("code", good)
    assert f.check("code") and f.serving_version("code") == good


def test_readers_never_see_a_half_built_object(reg, tmp_path):
    ds = reg.artifact("datastore")
    f = Datastores(reg, tmp_path / "cache")
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            held = f.held.get("x")
            if held is not None:
                seen.append((held["version"], held["num_entries"]))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(3):
            v = ds.register("x", datastore_dir(tmp_path / f"v{i}", 4)).version
            ds.promote("x", v)
            assert f.check("x")
    finally:
        stop.set()
        t.join()
    assert seen and all(n == 4 for _, n in seen)

"""A datastore rebuild killed after registering (before its offsets commit) is not registered
again by the restarted trainer, which reads the same generations: the latest version carries
the hash of its inputs (issue 34, item 9). New generations still make a new version."""

from __future__ import annotations

import pytest

from specops.registry import RegistryConfig, RegistryStore
from specops.streams import StreamConfig
from specops.trainer.datastores import DatastoreRebuilder, inputs_sha256
from tests.conftest import random_prompts
from tests.trainer.test_datastores import (
    CFG,
    DownOnRegister,
    _all_committed,
    _publish,
    _run_until,
)


class Killed(BaseException):
    """kill -9 at a chosen step: nothing after it runs (not even an ``except Exception``)."""


class DiesOnPromote(DownOnRegister):
    """A registry whose promote never happens: the process died between register and promote."""

    def artifact(self, kind):
        view = self.reg.artifact(kind)

        class View:
            def __getattr__(self, name):
                return getattr(view, name)

            def promote(self, *a, **kw):
                raise Killed("killed before the promotion")

        return View()


@pytest.fixture
def stream_cfg(tmp_path):
    return StreamConfig(url=f"local://{tmp_path / 'streams'}", fsync=False)


def _die_at_commit(rebuilder: DatastoreRebuilder) -> None:
    def commit():
        raise Killed("killed before the commit")

    rebuilder.reader.commit = commit


def test_a_restarted_rebuild_registers_nothing_twice(stream_cfg, sqlite_uri, tiny_target):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    kind = reg.artifact("datastore")
    _publish(stream_cfg, tiny_target, random_prompts(30, seed=7))

    first = DatastoreRebuilder(stream_cfg, reg, tiny_target, tokenizer_sha256="abc", cfg=CFG)
    _die_at_commit(first)
    with pytest.raises(Killed):
        first.run_once()  # registered and promoted, then killed before the commit
    first.close()
    assert not _all_committed(stream_cfg)
    (v1,) = kind.versions("code")
    assert kind.by_alias("code").version == v1.version and len(v1.tags["inputs_sha256"]) == 64

    second = DatastoreRebuilder(stream_cfg, reg, tiny_target, tokenizer_sha256="abc", cfg=CFG)
    try:
        again = _run_until(second, "unchanged")
        assert again.clusters == {"code": "unchanged"} and again.versions == {"code": v1.version}
        assert [v.version for v in kind.versions("code")] == [v1.version]  # one version, not two
        assert _all_committed(stream_cfg)  # the re-read generations are in a registered version
        # New generations: a second version.
        _publish(stream_cfg, tiny_target, random_prompts(30, seed=8))
        more = second.run_once()
        while not more.clusters:
            more = second.run_once()
        assert more.clusters["code"] in ("promoted", "registered")
        assert len(kind.versions("code")) == 2
    finally:
        second.close()


def test_a_promotion_cut_short_by_a_crash_is_finished_not_rebuilt(stream_cfg, sqlite_uri, tiny_target):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    kind = reg.artifact("datastore")
    _publish(stream_cfg, tiny_target, random_prompts(30, seed=7))
    first = DatastoreRebuilder(stream_cfg, DiesOnPromote(reg), tiny_target, cfg=CFG)
    with pytest.raises(Killed):
        first.run_once()
    first.close()
    (v1,) = kind.versions("code")
    assert kind.by_alias("code") is None and v1.metric("gate_passed") == 1.0  # registered, never promoted

    second = DatastoreRebuilder(stream_cfg, reg, tiny_target, cfg=CFG)
    try:
        again = _run_until(second, "promoted")
        assert again.clusters == {"code": "promoted"} and again.versions == {"code": v1.version}
    finally:
        second.close()
    assert [v.version for v in kind.versions("code")] == [v1.version]
    assert kind.by_alias("code").version == v1.version and _all_committed(stream_cfg)


def test_inputs_hash_covers_documents_split_and_config():
    from dataclasses import replace

    train, held = [[1, 2, 3], [4, 5]], [([6, 7, 8], 1)]
    base = inputs_sha256("code", CFG.datastore, "tok", train, held)
    assert base == inputs_sha256("code", CFG.datastore, "tok", [list(d) for d in train], list(held))
    assert base != inputs_sha256("code", CFG.datastore, "tok", [[1, 2], [3, 4, 5]], held)  # same tokens, cut apart
    assert base != inputs_sha256("code", CFG.datastore, "tok", train + [[9, 9]], held)
    assert base != inputs_sha256("code", CFG.datastore, "tok", train, [([6, 7, 8], 2)])
    assert base != inputs_sha256("prose", CFG.datastore, "tok", train, held)
    assert base != inputs_sha256("code", replace(CFG.datastore, dims=8), "tok", train, held)
    assert base != inputs_sha256("code", CFG.datastore, "other", train, held)

"""The router as the registered model ``router``: register, promote (announced), fetch verified,
corrupt artifacts refused, and the draft kind's ``keys()`` still lists drafts only. On every real store."""

from __future__ import annotations

import json

import pytest

from specops.core.router import Router
from specops.registry import (
    CHALLENGER,
    CHAMPION,
    ArtifactFormatError,
    ArtifactIntegrityError,
    RegistryStore,
)
from tests.registry.router_factory import FakeEmbedder, saved_router, stored_file

LINEAGE = {"topic": "spec.generations", "offsets": {"0": [0, 11], "2": [3, 8]}}


def test_register_promote_fetch_router(store_cfg, tiny_models, tmp_path):
    changes = []
    reg = RegistryStore(store_cfg, on_change=changes.append)
    router = reg.artifact("router")
    first = router.versions()
    src = saved_router(tmp_path / "r1", ("code", "prose", "sql"))
    rv = router.register(
        "",
        src,
        metrics={"mean_distance": 0.31, "agreement": 0.9},
        lineage=LINEAGE,
        params={"k": 3},
        source_id=f"test/{tmp_path.name}",
    )
    assert rv.name == "router" and rv.kind == "router" and rv.aliases == (CHALLENGER,)
    assert rv.clusters == ("code", "prose", "sql")
    assert rv.embedder_kind == "fake" and rv.embedder_sha256 == FakeEmbedder().config_sha256
    assert rv.tags["config_sha256"] == rv.embedder_sha256 and rv.manifest_sha256
    assert json.loads(rv.tags["lineage_offsets"]) == LINEAGE["offsets"] and rv.tags["lineage_partitions"] == "0,2"
    assert rv.metric("agreement") == pytest.approx(0.9)
    assert router.register("", src, source_id=f"test/{tmp_path.name}").version == rv.version  # idempotent
    assert [v.version for v in router.versions()] == [v.version for v in first] + [rv.version]

    change = router.promote("", rv.version, reason="first router")
    assert change.model_name == "router" and change.cluster == "" and change.version == rv.version
    assert changes == [change]  # announced through on_change, like a draft promotion
    champion = router.by_alias("", CHAMPION)
    assert champion is not None and champion.version == rv.version and CHAMPION in champion.aliases
    assert champion.tags["promotion_reason"] == "first router"
    router.promote("", rv.version)
    assert len(changes) == 1  # already the champion: nothing to announce

    manifest = router.fetch(champion, tmp_path / "fetched")
    assert manifest["format"] == "specops-router/1" and manifest["meta"]["clusters"] == ["code", "prose", "sql"]
    assert sorted(p.name for p in (tmp_path / "fetched").iterdir()) == [
        "manifest.json",
        "router.json",
        "router.safetensors",
    ]
    loaded = Router.load(tmp_path / "fetched", FakeEmbedder(), version=champion.version)
    assert loaded.clusters == ("code", "prose", "sql") and loaded.route("def f(): pass").router_version == rv.version

    # drafts and the router live side by side; the draft kind's keys() lists drafts only
    reg.artifact("draft").register("routertest", tiny_models / "draft", tokenizer_sha256="t" * 64)
    listed = reg.artifact("draft").keys()
    assert "routertest" in listed and "router" not in listed


def test_corrupt_router_artifact_is_refused(store_cfg, tmp_path, request):
    reg = RegistryStore(store_cfg)
    router = reg.artifact("router")
    rv = router.register("", saved_router(tmp_path / "r"))
    stored = stored_file(rv, "router.safetensors", request, store_cfg)
    data = bytearray(stored.read_bytes())
    data[-3] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match="sha256"):
        router.fetch(rv, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_only_saved_routers_are_registered(store_cfg, tmp_path):
    reg = RegistryStore(store_cfg)
    router = reg.artifact("router")
    path = saved_router(tmp_path / "r")
    (path / "notes.txt").write_text("not part of a router")
    with pytest.raises(ArtifactFormatError, match="unexpected"):
        router.register("", path)
    (path / "notes.txt").unlink()
    (path / "router.json").write_text("[]")
    with pytest.raises(ArtifactFormatError, match="not a saved router"):
        router.register("", path)

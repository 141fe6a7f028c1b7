"""Every artifact kind gets the same registry operations (``RegistryStore.artifact``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specops.registry import (
    KINDS,
    ArtifactFormatError,
    RegistryConfig,
    RegistryError,
    RegistryStore,
    kind_of,
)
from specops.registry.errors import ArtifactIntegrityError


@pytest.fixture
def reg(sqlite_uri) -> RegistryStore:
    changes = []
    store = RegistryStore(RegistryConfig(uri=sqlite_uri), on_change=changes.append)
    store.changes = changes  # type: ignore[attr-defined]
    return store


def datastore_dir(path, n: int):
    path.mkdir(parents=True)
    save_file({"keys": torch.randn(n, 4), "next_tokens": torch.arange(n)}, str(path / "datastore.safetensors"))
    (path / "datastore.json").write_text(json.dumps({"num_entries": n}))
    return path


def test_kinds_name_their_models_and_read_names_back():
    assert KINDS["draft"].model_name("code") == "draft-code" and KINDS["router"].model_name() == "router"
    assert KINDS["datastore"].model_name("sql") == "datastore-sql" and KINDS["kb"].model_name("wiki") == "kb-wiki"
    assert kind_of("datastore-sql")[0].name == "datastore" and kind_of("datastore-sql")[1] == "sql"
    assert kind_of("router") == (KINDS["router"], "") and kind_of("draft-") is None and kind_of("other") is None


def test_a_datastore_is_registered_promoted_rolled_back_retained_and_described(reg, tmp_path):
    ds = reg.artifact("datastore")
    versions = [
        ds.register(
            "sql",
            datastore_dir(tmp_path / f"d{i}", 8 + i),
            tags={"config_sha256": f"c{i}"},
            metrics={"offline_acceptance": 0.1 * i},
            source_id=f"build-{i}",
        ).version
        for i in range(4)
    ]
    assert ds.register("sql", tmp_path / "d0", source_id="build-0").version == versions[0]  # idempotent
    assert ds.by_alias("sql") is None and ds.by_alias("sql", "challenger").version == versions[-1]
    ds.promote("sql", versions[1], reason="first")
    change = ds.promote("sql", versions[2], reason="better")
    assert (
        change.artifact == "datastore"
        and change.model_name == "datastore-sql"
        and change.previous_version == versions[1]
    )
    assert ds.by_alias("sql").version == versions[2]
    back = ds.rollback("sql", reason="worse live")
    assert back.kind == "rollback" and back.version == versions[1] and ds.by_alias("sql").version == versions[1]
    assert [c.model_name for c in reg.changes] == ["datastore-sql"] * 3
    v = ds.get("sql", versions[2])
    assert v.kind == "datastore" and v.key == "sql" and v.tags["rolled_back"] == "worse live"
    assert v.tags["config_sha256"] == "c2" and v.metric("offline_acceptance") == pytest.approx(0.2)
    archived = ds.retain("sql", keep_last=1)
    assert versions[0] in archived and versions[1] not in archived  # the champion stays
    desc = ds.describe("sql")
    assert desc["aliases"]["champion"] == versions[1] and len(desc["versions"]) == 4
    assert ds.keys() == ["sql"] and reg.artifact("draft").keys() == []  # drafts are listed on their own
    dest = tmp_path / "fetched"
    manifest = ds.fetch(ds.get("sql", versions[1]), dest)
    assert manifest["format"] == "specops-datastore/1" and (dest / "datastore.safetensors").is_file()
    with pytest.raises(RegistryError, match="archived"):
        ds.promote("sql", versions[0])


def test_a_kind_refuses_files_it_never_carries(reg, tmp_path):
    bad = datastore_dir(tmp_path / "bad", 4)
    (bad / "index.pkl").write_bytes(b"\x80\x04")
    with pytest.raises(ArtifactFormatError, match="safetensors and JSON"):
        reg.artifact("kb").register("wiki", bad)
    with pytest.raises(ValueError, match="unknown artifact kind"):
        reg.artifact("weights")


def test_a_tampered_datastore_is_refused_on_fetch(reg, tmp_path):
    ds = reg.artifact("datastore")
    v = ds.register("code", datastore_dir(tmp_path / "d", 4))
    dest = tmp_path / "ok"
    ds.fetch(v, dest)
    (dest / "datastore.json").write_text("{}")
    from specops.registry.artifacts import verify_dir

    with pytest.raises(ArtifactIntegrityError):
        verify_dir(dest, v.manifest_sha256, KINDS["datastore"].format)


def test_drafts_and_routers_are_kinds_too(reg, tmp_path):
    from tests.registry.router_factory import saved_router

    rv = reg.artifact("router").register("", saved_router(tmp_path / "r", ("a", "b")))
    router = reg.artifact("router")
    router.promote("", rv.version, reason="generic")
    assert reg.artifact("router").by_alias().version == rv.version == router.by_alias().version
    assert router.describe()["model"] == "router"

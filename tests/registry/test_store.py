"""The registry on real MLflow stores: SQLite, PostgreSQL, and an ``mlflow server`` over HTTP."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from specops.registry import (
    CHALLENGER,
    CHAMPION,
    ArtifactIntegrityError,
    RegistryConfig,
    RegistryStore,
    RegistryUnavailableError,
    VersionNotFoundError,
    decide,
)

LINEAGE = {"topic": "spec.misses", "offsets": {"0": [0, 41], "3": [7, 19]}}


@pytest.fixture
def cluster() -> str:
    return f"c{uuid.uuid4().hex[:6]}"  # unique: the HTTP server is shared by the module


def _register(reg: RegistryStore, cluster: str, model_dir: Path, score: float, **kw):
    return reg.artifact("draft").register(
        cluster,
        model_dir,
        tokenizer_sha256="tok" * 8,
        lineage=LINEAGE,
        metrics={"offline_acceptance_sampling": score, "offline_acceptance_greedy": score / 2},
        params={"lr": 1e-3},
        **kw,
    )


def test_register_version_carries_tags_metrics_and_verified_weights(store_cfg, cluster, tiny_models, tmp_path):
    changes = []
    reg = RegistryStore(store_cfg, on_change=changes.append)
    drafts = reg.artifact("draft")
    v1 = _register(reg, cluster, tiny_models / "draft", 0.40, source_id="t/v1")
    assert v1.version == "1" and v1.aliases == (CHALLENGER,)
    for key in ("tokenizer_sha256", "config_sha256", "manifest_sha256", "lineage_topic", "lineage_offsets"):
        assert v1.tags[key], key
    assert v1.tags["lineage_partitions"] == "0,3" and json.loads(v1.tags["lineage_offsets"]) == LINEAGE["offsets"]
    assert v1.metric("offline_acceptance_sampling") == pytest.approx(0.40)
    run = reg.models.client.get_run(v1.run_id)
    assert run.data.metrics["offline_acceptance_greedy"] == pytest.approx(0.20) and run.data.params["lr"] == "0.001"
    # idempotent by source: a trainer re-registering the same checkpoint after a crash gets the same version
    assert _register(reg, cluster, tiny_models / "draft", 0.40, source_id="t/v1").version == "1"
    v2 = _register(reg, cluster, tiny_models / "draft", 0.50, source_id="t/v2", parent_version="1")
    assert v2.version == "2" and v2.tags["parent_version"] == "1"
    assert drafts.aliases(cluster) == {CHALLENGER: "2"}
    manifest = drafts.fetch(v2, tmp_path / "fetched")
    assert (tmp_path / "fetched" / "model.safetensors").read_bytes() == (
        tiny_models / "draft" / "model.safetensors"
    ).read_bytes()
    assert manifest["meta"]["cluster"] == cluster
    listed = drafts.keys()
    assert cluster in listed and not changes


def test_gate_promote_rollback_chain(store_cfg, cluster, tiny_models):
    changes = []
    reg = RegistryStore(store_cfg, on_change=changes.append)
    drafts = reg.artifact("draft")
    for score in (0.40, 0.50, 0.45, 0.60):
        _register(reg, cluster, tiny_models / "draft", score)
    assert drafts.by_alias(cluster, CHAMPION) is None
    first = decide("1", None, 0.40, None, margin=0.01, num_positions=100, min_positions=10)
    assert first.promoted and drafts.apply_gate(cluster, first).version == "1"
    # a worse candidate is refused, and the decision with its numbers is recorded on it
    worse = decide("3", "1", 0.39, 0.40, margin=0.01, num_positions=100, min_positions=10)
    assert not worse.promoted and drafts.apply_gate(cluster, worse) is None
    v3 = drafts.get(cluster, "3")
    assert v3.tags["gate_decision"] == "rejected" and float(v3.tags["gate_champion_acceptance"]) == pytest.approx(0.40)
    assert drafts.aliases(cluster)[CHAMPION] == "1"
    # too little evidence is refused too, whatever the scores
    assert not decide("2", "1", 0.9, 0.4, margin=0.01, num_positions=5, min_positions=10).promoted
    better = decide("2", "1", 0.50, 0.40, margin=0.01, num_positions=100, min_positions=10)
    assert drafts.apply_gate(cluster, better).previous_version == "1"
    drafts.promote(cluster, "4", reason="operator")
    assert drafts.get(cluster, "4").tags["previous_champion"] == "2"
    # rollback walks back the promotion history, skipping versions already rolled back
    assert drafts.rollback(cluster, reason="bad live").version == "2"
    assert drafts.get(cluster, "4").tags["rolled_back"] == "bad live"
    assert drafts.rollback(cluster, reason="again").version == "1"
    with pytest.raises(VersionNotFoundError):
        drafts.rollback(cluster, reason="nothing before 1")
    assert drafts.rollback(cluster, reason="x", expect_current="4") is None  # the champion moved on: no-op
    assert [(c.kind, c.version, c.previous_version) for c in changes] == [
        ("promotion", "1", ""),
        ("promotion", "2", "1"),
        ("promotion", "4", "2"),
        ("rollback", "2", "4"),
        ("rollback", "1", "2"),
    ]


def test_retention_archives_old_unaliased_versions(store_cfg, cluster, tiny_models, tmp_path):
    reg = RegistryStore(store_cfg)
    drafts = reg.artifact("draft")
    for i in range(6):
        _register(reg, cluster, tiny_models / "draft", 0.1 * i)
    drafts.promote(cluster, "2")
    drafts.promote(cluster, "3")
    archived = drafts.retain(cluster, keep_last=2)
    # kept: 5, 6 (newest), 3 (champion), 2 (its rollback target); 6 is also the challenger
    assert archived == ["1", "4"]
    assert [v.version for v in drafts.versions(cluster, include_archived=False)] == ["2", "3", "5", "6"]
    assert drafts.get(cluster, "1").archived
    with pytest.raises(Exception, match="archived"):
        drafts.fetch(drafts.get(cluster, "1"), tmp_path / "gone")
    assert drafts.retain(cluster, keep_last=2) == []  # idempotent


def test_corrupt_artifact_is_refused(store_cfg, cluster, tiny_models, tmp_path, request):
    reg = RegistryStore(store_cfg)
    drafts = reg.artifact("draft")
    dv = _register(reg, cluster, tiny_models / "draft", 0.4)
    if store_cfg.is_http:
        server = request.getfixturevalue("mlflow_server")
        stored = next(server.artifacts.rglob(f"*{dv.run_id}*/**/model.safetensors"))
    else:
        stored = Path(dv.source.removeprefix("file://")) / "model.safetensors"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match="sha256"):
        drafts.fetch(dv, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_gate_with_a_standard_error_promotes_only_wins_beyond_noise():
    from specops.registry import decide

    kw = dict(margin=0.005, num_positions=500, min_positions=32, metric="served")
    assert decide("3", "2", 0.52, 0.50, **kw).promoted  # no stderr: the margin alone decides
    noisy = decide("3", "2", 0.52, 0.50, stderr=0.02, **kw)
    assert not noisy.promoted and "within noise" in noisy.reason and noisy.extra == {"stderr": 0.02, "z": 1.645}
    clear = decide("3", "2", 0.56, 0.50, stderr=0.02, **kw)
    assert clear.promoted and "± 0.0200" in clear.reason
    assert not decide("3", "2", 0.49, 0.50, stderr=0.001, **kw).promoted  # a loss is never promoted
    assert decide("3", "2", 0.49, 0.50, stderr=0.05, **{**kw, "margin": -1.0}).promoted  # -1: every candidate


def test_create_version_retries_an_unavailable_store_and_finds_a_lost_reply(sqlite_uri, cluster, tiny_models, caplog):
    """create_model_version failing as unavailable is retried (a warning each time) up to ``retries``
    more times, then re-raised; a try whose reply was lost is found by ``source_id``, not repeated."""
    from mlflow.exceptions import MlflowException

    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    real = reg.models.client.create_model_version
    calls: list[str] = []

    def flaky(*args, fail: int = 2, lose: bool = False, **kw):
        calls.append("try")
        if len(calls) <= fail:
            raise MlflowException("database is locked")
        created = real(*args, **kw)
        if lose and len(calls) == fail + 1:
            raise MlflowException("connection reset after the commit")
        return created

    reg.models.client.create_model_version = flaky
    with caplog.at_level("WARNING", logger="specops.registry.models"):
        v1 = _register(reg, cluster, tiny_models / "draft", 0.4)
    assert v1.version == "1" and len(calls) == 3
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retried) == 2 and "database is locked (attempt 1/6)" in retried[0] and "(attempt 2/6)" in retried[1]

    calls.clear()
    reg.models.client.create_model_version = lambda *a, **kw: flaky(*a, fail=0, lose=True, **kw)
    v2 = _register(reg, cluster, tiny_models / "draft", 0.5, source_id="t/lost")
    assert (v2.version, v2.tags["source_id"], len(calls)) == ("2", "t/lost", 1)  # found, not created again
    assert [v.version for v in reg.models.versions(v2.name)] == ["1", "2"]

    calls.clear()
    reg.models.client.create_model_version = lambda *a, **kw: flaky(*a, fail=99, **kw)
    with pytest.raises(RegistryUnavailableError, match="database is locked"):
        _register(reg, cluster, tiny_models / "draft", 0.6, retries=1)
    assert len(calls) == 2

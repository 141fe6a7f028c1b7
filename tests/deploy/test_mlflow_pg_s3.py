"""The scale-out registry layout end to end: ``mlflow server`` on PostgreSQL with its artifacts in S3.

One real server process for the module (``tests/deploy/conftest.py``): a fresh PostgreSQL
database migrated by ``mlflow db upgrade`` (the chart's initContainer), moto's S3 server
on loopback, ``--serve-artifacts`` into ``s3://<bucket>/mlflow``. Through our registry API
over HTTP a draft is registered, promoted, fetched and hot-swapped into serving; then the
bucket and the database are read directly, to see that the weights and the versions
really live there.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import psycopg2
import pytest

from specops.core.models import load_model_dir, load_tokenizer, tokenizer_hash
from specops.registry import CHALLENGER, CHAMPION, RegistryConfig, RegistryStore
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.hotswap import BASE, FAILURES, DraftFollower, HotSwapConfig
from specops.serving.fleet.node import ServingNode
from specops.serving.plan import DecodePlan, plain_generate
from tests.conftest import random_prompts

pytestmark = pytest.mark.slow  # starts a server process and an S3 endpoint

GREEDY = SamplingParams(max_new_tokens=8)
PICKLED = (".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt", ".joblib")


def _register(reg: RegistryStore, tiny_models: Path, cluster: str, which: str = "draft"):
    """Register ``tiny_models/<which>`` (with the target's tokenizer) as a new version of ``draft-<cluster>``."""
    tok = tiny_models / "target"
    return reg.artifact("draft").register(
        cluster, tiny_models / which, tokenizer_dir=tok, tokenizer_sha256=tokenizer_hash(load_tokenizer(tok))
    )


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def _query(db_uri: str, sql: str, *args) -> list[tuple]:
    conn = psycopg2.connect(db_uri.replace("postgresql+psycopg2://", "postgresql://"), connect_timeout=3)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, args)
            return cur.fetchall()
    finally:
        conn.close()


def test_draft_lives_in_postgres_and_s3(pg_s3_server, pg_database, s3_bucket, tiny_models, tmp_path):
    reg = RegistryStore(RegistryConfig(uri=pg_s3_server.uri, experiment="deploy-roundtrip"))
    cluster = f"pg{uuid.uuid4().hex[:6]}"
    dv = _register(reg, tiny_models, cluster)
    assert dv.version == "1" and dv.aliases == (CHALLENGER,)
    assert dv.source.startswith("mlflow-artifacts:"), dv.source  # served: clients never see the bucket
    change = reg.artifact("draft").promote(cluster, dv.version, reason="deploy test")
    assert (change.kind, change.version, change.previous_version) == ("promotion", "1", "")
    drafts = reg.artifact("draft")
    assert drafts.by_alias(cluster, CHAMPION).version == "1" and drafts.aliases(cluster) == {
        CHALLENGER: "1",
        CHAMPION: "1",
    }

    # fetched through the server from S3, checksums verified: exactly the files registered
    fetched = tmp_path / "cache" / "v1"
    fetched.parent.mkdir()
    manifest = drafts.fetch(drafts.by_alias(cluster, CHAMPION), fetched)
    names = set(manifest["files"])
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    for name in names:
        src = tiny_models / ("draft" if (tiny_models / "draft" / name).exists() else "target") / name
        assert (fetched / name).read_bytes() == src.read_bytes(), name

    # the bucket holds the artifact under the server's destination prefix, and nothing pickled
    keys = s3_bucket.keys("mlflow/")
    mine = [k for k in keys if f"/{dv.run_id}/" in k]
    weights = [k for k in mine if k.endswith("/draft/model.safetensors")]
    assert len(weights) == 1, mine
    assert s3_bucket.read(weights[0]) == (tiny_models / "draft" / "model.safetensors").read_bytes()
    prefix = weights[0].removesuffix("model.safetensors")
    assert {prefix + n for n in ("config.json", "manifest.json")} <= set(mine), mine
    assert not [k for k in keys if k.lower().endswith(PICKLED)]

    # the database holds the model, the version (pointing at the served artifact) and the aliases
    name = f"draft-{cluster}"
    assert _query(pg_database, "SELECT name FROM registered_models WHERE name = %s", name) == [(name,)]
    assert _query(pg_database, "SELECT version, run_id, source FROM model_versions WHERE name = %s", name) == [
        (1, dv.run_id, dv.source)
    ]
    aliases = _query(pg_database, "SELECT alias, version FROM registered_model_aliases WHERE name = %s", name)
    assert sorted(aliases) == [(CHALLENGER, 1), (CHAMPION, 1)]
    tags = dict(_query(pg_database, "SELECT key, value FROM model_version_tags WHERE name = %s AND version = 1", name))
    assert tags["manifest_sha256"] == dv.manifest_sha256 and tags["promotion_reason"] == "deploy test"


def test_hot_swap_follows_the_pg_s3_registry_with_no_failed_request(pg_s3_server, tiny_models, tmp_path):
    """Requests run throughout while the champion moves twice; every one succeeds with the target's greedy
    output, and the slot ends on the last champion, each version fetched from S3 through the server."""
    pair = load_model_dir(tiny_models)
    ref = SpecEngine(pair)
    prompts = [
        (p, plain_generate(ref, p, GREEDY, method="target").token_ids)
        for p in random_prompts(4, seed=11, lo=4, hi=10, vocab=pair.vocab_size)
    ]
    reg = RegistryStore(RegistryConfig(uri=pg_s3_server.uri, experiment="deploy-hotswap"))
    cluster = f"hs{uuid.uuid4().hex[:6]}"
    v1 = _register(reg, tiny_models, cluster, "target").version  # the target's own weights as draft
    v2 = _register(reg, tiny_models, cluster, "draft").version
    follower = DraftFollower(
        reg,
        pair.draft,
        target_vocab=pair.vocab_size,
        target_tokenizer_sha256=pair.tokenizer_sha256,
        cache_dir=tmp_path / "cache",
        # polls only wait (a resolve is one small HTTP call): a short one sees each promotion sooner
        cfg=HotSwapConfig(poll_s=0.2, backoff_initial_s=0.2, backoff_max_s=1.0, auto_rollback=False),
    ).start()
    node = ServingNode(pair, follower)
    stop, results, errors = threading.Event(), [], []

    def client() -> None:  # a steady trickle, not a busy loop: the follower's fetch shares the two cores
        n = 0
        while not stop.wait(0.1):
            prompt, want = prompts[n % len(prompts)]
            n += 1
            try:
                results.append((node.generate(DecodePlan.plain(prompt, GREEDY, cluster=cluster)), want))
            except Exception as exc:  # noqa: BLE001 - the test counts every failure
                errors.append(repr(exc))

    thread = threading.Thread(target=client)
    thread.start()
    try:
        _wait(lambda: len(results) >= 2, 30, "requests on the base draft")
        for v in (v1, v2):
            reg.artifact("draft").promote(cluster, v, reason="deploy hot-swap")
            _wait(lambda v=v: follower.slot(cluster).current().version == v, 30, f"the swap to {v}")
            _wait(lambda v=v: any(s.draft_version == v for s, _ in results), 30, f"a request on version {v}")
    finally:
        stop.set()
        thread.join(60)
        follower.stop()
    assert errors == []
    assert [v for _, v in follower.slot(cluster).history] == [BASE, v1, v2]
    assert all(served.result.token_ids == want for served, want in results)
    assert {s.draft_version for s, _ in results} >= {BASE, v1, v2}
    failures = [
        s
        for m in FAILURES.collect()
        for s in m.samples
        if s.labels.get("cluster") == cluster and s.name.endswith("_total")
    ]
    assert sum(s.value for s in failures) == 0, failures


def test_both_postgresql_spellings_reach_the_same_store(
    pg_database, s3_bucket, pg_s3_server, tiny_models, tmp_path, monkeypatch
):
    """A bare ``postgresql://`` (rewritten for psycopg2) and ``postgresql+psycopg2://`` are one store: a draft
    registered straight into PostgreSQL + S3 through one spelling (a trainer without the server) is listed
    and fetched through the other, and seen by the server."""
    bare_uri = pg_database.replace("postgresql+psycopg2://", "postgresql://")
    bare = RegistryConfig(uri=bare_uri, artifact_root=f"s3://{s3_bucket.bucket}/direct", experiment="deploy-direct")
    explicit = RegistryConfig(uri=pg_database, experiment="deploy-direct")
    assert bare.uri == explicit.uri == pg_database and not bare.is_http
    for key, value in s3_bucket.env.items():  # this process writes to S3 itself
        monkeypatch.setenv(key, value)
    cluster = f"dr{uuid.uuid4().hex[:6]}"
    dv = _register(RegistryStore(bare), tiny_models, cluster)
    assert dv.source.startswith(f"s3://{s3_bucket.bucket}/direct/"), dv.source
    through_explicit = RegistryStore(explicit).artifact("draft").versions(cluster)
    through_server = RegistryStore(RegistryConfig(uri=pg_s3_server.uri)).artifact("draft").versions(cluster)
    assert [(v.version, v.run_id, v.source) for v in through_explicit] == [(dv.version, dv.run_id, dv.source)]
    assert [(v.version, v.run_id, v.source) for v in through_server] == [(dv.version, dv.run_id, dv.source)]
    RegistryStore(explicit).artifact("draft").fetch(through_explicit[0], tmp_path / "fetched")
    assert (tmp_path / "fetched" / "model.safetensors").read_bytes() == (
        tiny_models / "draft" / "model.safetensors"
    ).read_bytes()
    direct = s3_bucket.keys("direct/")
    assert any(k.endswith("/draft/model.safetensors") for k in direct)
    assert not [k for k in direct if k.lower().endswith(PICKLED)]

"""The router: MiniLM routes clearly separated prompts to the right cluster, the artifact
round-trips, malformed artifacts are refused with a clear error, and the target embedder works."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specops.core.embed import MiniLMEmbedder, TargetHiddenEmbedder, make_embedder
from specops.core.errors import RouterError
from specops.core.models import ModelPair, load_model, load_tokenizer
from specops.core.router import CENTROIDS_FILE, META_FILE, RouteDecision, Router
from specops.trainer.router_fit import fit_router
from tests.serving.router_texts import HELDOUT, TRAIN


@pytest.fixture(scope="module")
def minilm() -> MiniLMEmbedder:
    return MiniLMEmbedder()  # the weights load once per process


@pytest.fixture(scope="module")
def router(minilm) -> Router:
    return fit_router(TRAIN, minilm, seed=0)


def test_minilm_routes_clearly_separated_prompts(router):
    assert router.clusters == ("code", "prose", "sql") and router.k == 3 and router.dim == 384
    assert router.fitted_on == {"code": 5, "prose": 5, "sql": 5}
    for cluster, prompts in HELDOUT.items():
        for prompt, decision in zip(prompts, router.route_batch(prompts), strict=True):
            assert isinstance(decision, RouteDecision)
            assert decision.cluster == cluster, (prompt, decision)
            assert 0.0 <= decision.distance < 1.0 and decision.router_version == "local"
    assert router.route(HELDOUT["sql"][0]).cluster == "sql"


def test_embedders_give_unit_vectors(minilm, tiny_models):
    texts = ["def f(x):\n    return x", "A short sentence about the weather.", ""]
    v = minilm.embed(texts)
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v[:2], axis=1), 1.0, atol=1e-5) and not v[2].any()  # empty: zero vector
    assert np.allclose(minilm.embed(texts[:1]), v[:1], atol=1e-5)  # batching does not change a vector
    target = TargetHiddenEmbedder(load_model(tiny_models / "target"), load_tokenizer(tiny_models / "target"))
    t = target.embed(texts)
    assert t.shape == (3, target.dim) and t.dtype == np.float32 and target.dim == target.model.config.hidden_size
    assert np.allclose(np.linalg.norm(t[:2], axis=1), 1.0, atol=1e-5) and not t[2].any()
    singles = np.concatenate([target.embed([x]) for x in texts[:2]])
    assert np.allclose(singles, t[:2], atol=1e-5)  # right padding leaves each prompt's mean unchanged
    assert target.config_sha256 == TargetHiddenEmbedder(target.model, target.tokenizer).config_sha256
    assert target.config_sha256 != minilm.config_sha256 and len(target.config_sha256) == 64
    assert make_embedder("minilm").config_sha256 == minilm.config_sha256
    pair = ModelPair(target=target.model, draft=None, tokenizer=target.tokenizer)
    assert make_embedder("target", target=pair).config_sha256 == target.config_sha256  # how serving builds it
    with pytest.raises(RouterError, match="needs the target model"):
        make_embedder("target")
    with pytest.raises(RouterError, match="unknown embedder"):
        make_embedder("bert")


def test_save_load_round_trip(router, minilm, tmp_path):
    path = router.save(tmp_path / "r")
    assert sorted(p.name for p in path.iterdir()) == sorted([CENTROIDS_FILE, META_FILE])
    meta = json.loads((path / META_FILE).read_text())
    assert meta["clusters"] == ["code", "prose", "sql"] and meta["dim"] == 384
    assert meta["embedder"] == {"kind": "minilm", "config_sha256": minilm.config_sha256}
    loaded = Router.load(path, minilm, version="7")
    assert loaded.version == "7" and loaded.clusters == router.clusters and loaded.fitted_on == router.fitted_on
    assert np.array_equal(loaded.centroids, router.centroids) and loaded.metrics == pytest.approx(router.metrics)
    prompts = [p for ps in HELDOUT.values() for p in ps]
    assert [d.cluster for d in loaded.route_batch(prompts)] == [d.cluster for d in router.route_batch(prompts)]
    assert Router.load(path).version == "local"  # no embedder: loads, but cannot route
    with pytest.raises(RouterError, match="no embedder"):
        Router.load(path).route("x")


class OtherEmbedder:
    kind, dim, config_sha256 = "minilm", 384, "0" * 64

    def embed(self, texts):
        return np.ones((len(texts), 384), np.float32) / np.sqrt(384)


def _centroids(path, value):
    save_file(value, str(path / CENTROIDS_FILE))


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("no json", lambda p: (p / META_FILE).unlink(), "router.json is missing"),
        ("bad json", lambda p: (p / META_FILE).write_text("{not json"), "not a router description"),
        ("format", lambda p: _edit(p, format="specops-router/9"), "format 'specops-router/9'"),
        ("dim", lambda p: _edit(p, dim=128), "router.json says dim 128"),
        ("names", lambda p: _edit(p, clusters=["code", "code", "sql"]), "unique"),
        ("count", lambda p: _edit(p, clusters=["code", "prose"]), "3 centroids for 2 cluster names"),
        ("nan", lambda p: _centroids(p, {"centroids": np.full((3, 384), np.nan, np.float32)}), "NaN"),
        ("norm", lambda p: _centroids(p, {"centroids": np.full((3, 384), 0.5, np.float32)}), "unit length"),
        ("dtype", lambda p: _centroids(p, {"centroids": np.zeros((3, 384), np.float64)}), "float32"),
        (
            "extra",
            lambda p: _centroids(p, {**load_file(str(p / CENTROIDS_FILE)), "w": np.zeros(2, np.float32)}),
            "exactly one tensor",
        ),
        (
            "truncated",
            lambda p: (p / CENTROIDS_FILE).write_bytes((p / CENTROIDS_FILE).read_bytes()[:100]),
            "not a readable safetensors",
        ),
    ],
)
def test_malformed_artifacts_are_refused(router, minilm, tmp_path, name, damage, message):
    path = router.save(tmp_path / name)
    damage(path)
    with pytest.raises(RouterError, match=message):
        Router.load(path, minilm)


def test_a_router_refuses_another_embedder(router, tmp_path):
    path = router.save(tmp_path / "r")
    with pytest.raises(RouterError, match="fitted with embedder minilm"):
        Router.load(path, OtherEmbedder())
    with pytest.raises(RouterError, match="refit it with this embedder"):
        router.bind(OtherEmbedder())


def _edit(path, **changes):
    meta = json.loads((path / META_FILE).read_text())
    meta.update(changes)
    (path / META_FILE).write_text(json.dumps(meta))

"""Small routers for registry and hot-swap tests, with an embedder that needs no model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from specops.core.embed import normalise
from specops.core.router import Router

DIM = 8


class FakeEmbedder:
    """Deterministic, model-free: a text's vector is a hash of its characters (kind ``fake``)."""

    kind = "fake"
    dim = DIM

    def __init__(self, salt: str = "") -> None:
        self.config_sha256 = hashlib.sha256(f"fake{salt}".encode()).hexdigest()
        self.calls = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        out = np.zeros((len(texts), DIM), np.float32)
        for i, text in enumerate(texts):
            for ch in text:
                out[i, ord(ch) % DIM] += 1.0
        return normalise(out)


def make_router(
    clusters: tuple[str, ...] = ("code", "prose"), *, seed: int = 0, embedder: FakeEmbedder | None = None
) -> Router:
    embedder = embedder or FakeEmbedder()
    centroids = normalise(np.random.default_rng(seed).normal(size=(len(clusters), DIM)).astype(np.float32))
    return Router(
        centroids=centroids,
        clusters=tuple(clusters),
        embedder_kind=embedder.kind,
        embedder_sha256=embedder.config_sha256,
        fitted_on={c: 10 for c in clusters},
        metrics={"mean_distance": 0.25, "num_texts": 10.0 * len(clusters)},
    )


def saved_router(
    path: Path, clusters: tuple[str, ...] = ("code", "prose"), *, seed: int = 0, embedder: FakeEmbedder | None = None
) -> Path:
    return make_router(clusters, seed=seed, embedder=embedder).save(path)


def stored_file(version, name: str, request, store_cfg) -> Path:
    """Where the registry keeps file ``name`` of a version's artifact (to corrupt it)."""
    if store_cfg.is_http:
        server = request.getfixturevalue("mlflow_server")
        return next(server.artifacts.rglob(f"*{version.run_id}*/**/{name}"))
    return Path(version.source.removeprefix("file://")) / name

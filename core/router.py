"""The prompt router: embed the prompt, pick the nearest of K named centroids.

A request that names its ``cluster`` keeps it. Any other request is routed: its prompt is
embedded (``specops.core.embed``: all-MiniLM-L6-v2, or the target's own hidden states) and
goes to the cluster whose centroid has the highest cosine similarity. The
:class:`RouteDecision` carries the cluster, the cosine distance to its centroid and the
router version that decided. Each cluster has its own draft lineage; a cluster the
registry has no draft for yet is served by the bootstrap draft (``specops.serving.fleet.hotswap``).

**The artifact** is a directory of safetensors and JSON only::

    router.safetensors   "centroids": [K, dim] float32, one unit-length row per cluster
    router.json          {"format": "specops-router/1", "clusters": [K names], "dim",
                          "embedder": {"kind", "config_sha256"}, "fitted_on": {cluster: texts},
                          "metrics": {...}, "created_at", "version"}

:meth:`Router.load` checks all of it (shapes, dimension, finite unit rows, the embedder's
kind and hash) and raises :class:`~specops.core.errors.RouterError` saying what is wrong. Serving follows
``router@champion`` with ``specops.serving.fleet.router.RouterFollower``; the trainer fits and saves a
router (``trainer/router_fit.py``): both use this one format.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specops.core.embed import Embedder
from specops.core.errors import RouterError

FORMAT = "specops-router/1"
CENTROIDS_FILE, META_FILE = "router.safetensors", "router.json"
LOCAL = "local"
"""Version of a router that is not (yet) a registry version."""


@dataclass(frozen=True)
class RouteDecision:
    """Where one prompt goes."""

    cluster: str
    distance: float
    """Cosine distance (1 - cosine similarity) from the prompt's embedding to the chosen centroid."""
    router_version: str
    """Registry version of the router that decided (``local`` for an unregistered one)."""


@dataclass(frozen=True, eq=False)
class Router:
    """K named centroids in an embedder's space, and that embedder. Immutable once built."""

    centroids: np.ndarray
    """[K, dim] float32, every row of unit length."""
    clusters: tuple[str, ...]
    """Cluster name of each centroid row."""
    embedder_kind: str
    """Kind of embedder the centroids were fitted with (``minilm`` or ``target``)."""
    embedder_sha256: str
    """Config hash of that embedder; routing refuses any other."""
    version: str = LOCAL
    """Registry version (``local`` before registration)."""
    fitted_on: dict[str, int] = field(default_factory=dict)
    """Texts per cluster the centroids were fitted on."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Fit metrics (mean distance, agreement with the previous router, ...)."""
    created_at: str = ""
    """When it was fitted (UTC, ISO 8601)."""
    embedder: Embedder | None = field(default=None, repr=False)
    """What embeds prompts for :meth:`route`; None: this router can be saved but not route."""

    def __post_init__(self) -> None:
        c, names = self.centroids, self.clusters
        if not isinstance(c, np.ndarray) or c.dtype != np.float32 or c.ndim != 2:
            raise RouterError(
                f"router centroids must be a [K, dim] float32 array, got "
                f"{getattr(c, 'dtype', type(c).__name__)} {getattr(c, 'shape', '')}"
            )
        if not names or c.shape[0] != len(names):
            raise RouterError(f"router has {c.shape[0]} centroids for {len(names)} cluster names {list(names)}")
        if len(set(names)) != len(names) or any(not isinstance(n, str) or not n or "," in n for n in names):
            raise RouterError(f"router cluster names must be unique non-empty strings without commas: {list(names)}")
        if not np.isfinite(c).all():
            raise RouterError("router centroids hold NaN or infinite values")
        norms = np.linalg.norm(c, axis=1)
        if np.abs(norms - 1.0).max() > 1e-3:
            raise RouterError(f"router centroids must have unit length, got norms {np.round(norms, 4).tolist()}")
        if self.embedder is not None:
            self._check_embedder(self.embedder)

    @property
    def k(self) -> int:
        return len(self.clusters)

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])

    def _check_embedder(self, embedder: Embedder) -> None:
        if embedder.kind != self.embedder_kind or embedder.config_sha256 != self.embedder_sha256:
            raise RouterError(
                f"router {self.version} was fitted with embedder {self.embedder_kind} "
                f"(config {self.embedder_sha256[:12]}), not {embedder.kind} "
                f"(config {embedder.config_sha256[:12]}): refit it with this embedder"
            )
        if embedder.dim != self.dim:
            raise RouterError(
                f"router {self.version} has {self.dim}-dimensional centroids, the {embedder.kind} "
                f"embedder gives {embedder.dim}"
            )

    def bind(self, embedder: Embedder) -> Router:
        """This router routing with ``embedder`` (which must be the one it was fitted with)."""
        return replace(self, embedder=embedder)

    # ------------------------------------------------------------ routing
    def similarities(self, embeddings: np.ndarray) -> np.ndarray:
        """[n, K] cosine similarities of unit ``embeddings`` [n, dim] to every centroid."""
        assert embeddings.ndim == 2 and embeddings.shape[1] == self.dim, embeddings.shape
        return embeddings.astype(np.float32) @ self.centroids.T

    def route_batch(self, texts: list[str]) -> list[RouteDecision]:
        if self.embedder is None:
            raise RouterError("this router has no embedder: load it with one, or bind() one")
        sims = self.similarities(self.embedder.embed(list(texts)))  # [n, K]
        best = sims.argmax(axis=1)
        return [RouteDecision(self.clusters[j], float(1.0 - sims[i, j]), self.version) for i, j in enumerate(best)]

    def route(self, text: str) -> RouteDecision:
        return self.route_batch([text])[0]

    # ------------------------------------------------------------ artifact
    def save(self, path: Path) -> Path:
        """Write ``router.safetensors`` and ``router.json`` into the directory ``path``."""
        from safetensors.numpy import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {"centroids": np.ascontiguousarray(self.centroids)}, str(path / CENTROIDS_FILE), metadata={"format": FORMAT}
        )
        meta = {
            "format": FORMAT,
            "clusters": list(self.clusters),
            "dim": self.dim,
            "embedder": {"kind": self.embedder_kind, "config_sha256": self.embedder_sha256},
            "fitted_on": {k: int(v) for k, v in self.fitted_on.items()},
            "metrics": {k: float(v) for k, v in self.metrics.items()},
            "created_at": self.created_at or _now(),
            "version": self.version,
        }
        (path / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: Path, embedder: Embedder | None = None, *, version: str | None = None) -> Router:
        """A router saved by :meth:`save`, checked; ``version`` overrides the one in router.json
        (the follower passes the registry's). Raises RouterError on anything malformed."""
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        path = Path(path)
        for name in (CENTROIDS_FILE, META_FILE):
            if not (path / name).is_file():
                raise RouterError(f"{path} is not a saved router: {name} is missing")
        try:
            meta = json.loads((path / META_FILE).read_text())
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            clusters = tuple(meta["clusters"])
            dim = int(meta["dim"])
            kind, sha = str(meta["embedder"]["kind"]), str(meta["embedder"]["config_sha256"])
            fitted_on = {str(k): int(v) for k, v in (meta.get("fitted_on") or {}).items()}
            metrics = {str(k): float(v) for k, v in (meta.get("metrics") or {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RouterError(f"{path / META_FILE} is not a router description: {type(exc).__name__}: {exc}") from exc
        try:
            tensors = load_file(str(path / CENTROIDS_FILE))
        except (SafetensorError, OSError, ValueError) as exc:
            raise RouterError(f"{path / CENTROIDS_FILE} is not a readable safetensors file: {exc}") from exc
        if set(tensors) != {"centroids"}:
            raise RouterError(
                f"{path / CENTROIDS_FILE} must hold exactly one tensor 'centroids', has {sorted(tensors)}"
            )
        centroids = tensors["centroids"]
        if centroids.ndim != 2 or centroids.shape[1] != dim:
            raise RouterError(
                f"{path / CENTROIDS_FILE}: centroids of shape {centroids.shape}, router.json says dim {dim}"
            )
        return cls(
            centroids=centroids,
            clusters=clusters,
            embedder_kind=kind,
            embedder_sha256=sha,
            version=str(version or meta.get("version") or LOCAL),
            fitted_on=fitted_on,
            metrics=metrics,
            created_at=str(meta.get("created_at", "")),
            embedder=embedder,
        )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

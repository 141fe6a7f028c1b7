"""The prompt router: embed the prompt, pick the nearest of K named centroids.

A request that names its ``cluster`` keeps it. Any other request is routed: its prompt is
embedded (``serving.fleet.embed``: all-MiniLM-L6-v2, or the target's own hidden states) and
goes to the cluster whose centroid has the highest cosine similarity. The
:class:`RouteDecision` carries the cluster, the cosine distance to its centroid and the
router version that decided. Each cluster has its own draft lineage; a cluster the
registry has no draft for yet is served by the bootstrap draft (``serving.fleet.hotswap``).

**The artifact** is a directory of safetensors and JSON only::

    router.safetensors   "centroids": [K, dim] float32, one unit-length row per cluster
    router.json          {"format": "specops-router/1", "clusters": [K names], "dim",
                          "embedder": {"kind", "config_sha256"}, "fitted_on": {cluster: texts},
                          "metrics": {...}, "created_at", "version"}

:meth:`Router.load` checks all of it (shapes, dimension, finite unit rows, the embedder's
kind and hash) and raises :class:`~serving.errors.RouterError` saying what is wrong.

**Hot-swap.** :class:`RouterFollower` follows ``router@champion`` in the registry like
``DraftFollower`` follows drafts: it polls, and checks at once on a ModelEvent for
``router``; a new version is fetched (checksums verified by the registry), loaded,
validated and smoke-routed on a background thread, then swapped in with one reference
assignment. A request uses the router it read when it started. A registry outage or a
refused artifact keeps the current router (logged, counted in
``specops_router_swap_failures_total{reason}``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from prometheus_client import Counter, Gauge

from specops.registry import RegistryStore
from specops.serving.fleet.embed import Embedder, make_embedder
from specops.serving.fleet.follower import AliasFollower, FollowConfig
from specops.serving.errors import RouterError

log = logging.getLogger(__name__)

FORMAT = "specops-router/1"
CENTROIDS_FILE, META_FILE = "router.safetensors", "router.json"
LOCAL = "local"
"""Version of a router that is not (yet) a registry version."""

ROUTER_VERSION = Gauge("specops_router_version", "Registry version of the router serving now (0: none or unregistered)")
ROUTER_SWAPS = Counter("specops_router_swaps_total", "Router versions swapped in")
ROUTER_SWAP_FAILURES = Counter("specops_router_swap_failures_total",
                               "Failed router follow attempts (the current router kept routing)",
                               ["reason"])  # fmt: skip


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
            raise RouterError(f"router centroids must be a [K, dim] float32 array, got "
                              f"{getattr(c, 'dtype', type(c).__name__)} {getattr(c, 'shape', '')}")  # fmt: skip
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
            raise RouterError(f"router {self.version} was fitted with embedder {self.embedder_kind} "
                              f"(config {self.embedder_sha256[:12]}), not {embedder.kind} "
                              f"(config {embedder.config_sha256[:12]}): refit it with this embedder")  # fmt: skip
        if embedder.dim != self.dim:
            raise RouterError(f"router {self.version} has {self.dim}-dimensional centroids, the {embedder.kind} "
                              f"embedder gives {embedder.dim}")  # fmt: skip

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
        save_file({"centroids": np.ascontiguousarray(self.centroids)}, str(path / CENTROIDS_FILE),
                  metadata={"format": FORMAT})  # fmt: skip
        meta = {"format": FORMAT, "clusters": list(self.clusters), "dim": self.dim,
                "embedder": {"kind": self.embedder_kind, "config_sha256": self.embedder_sha256},
                "fitted_on": {k: int(v) for k, v in self.fitted_on.items()},
                "metrics": {k: float(v) for k, v in self.metrics.items()},
                "created_at": self.created_at or _now(), "version": self.version}  # fmt: skip
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
            raise RouterError(f"{path / CENTROIDS_FILE} must hold exactly one tensor 'centroids', "
                              f"has {sorted(tensors)}")  # fmt: skip
        centroids = tensors["centroids"]
        if centroids.ndim != 2 or centroids.shape[1] != dim:
            raise RouterError(f"{path / CENTROIDS_FILE}: centroids of shape {centroids.shape}, router.json says "
                              f"dim {dim}")  # fmt: skip
        return cls(centroids=centroids, clusters=clusters, embedder_kind=kind, embedder_sha256=sha,
                   version=str(version or meta.get("version") or LOCAL), fitted_on=fitted_on, metrics=metrics,
                   created_at=str(meta.get("created_at", "")), embedder=embedder)  # fmt: skip


# ---------------------------------------------------------------- hot-swap
KEY = ""
"""The router kind is not keyed: one router for the deployment."""


class RouterFollower(AliasFollower):
    """Keeps the serving router on the registry's ``router@champion`` (the ``router`` kind's
    :class:`~serving.fleet.follower.AliasFollower`, key ``""``).

    ``embedder_factory(kind)`` returns the embedder a router of that kind routes with
    (serving passes one that knows its target for ``target``); one per kind is kept.
    """

    def __init__(self, registry: RegistryStore | None, *, cache_dir: Path,
                 embedder_factory: Callable[[str], Embedder] = make_embedder, initial: Router | None = None,
                 poll_s: float = 30.0) -> None:  # fmt: skip
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        super().__init__(registry, "router", FollowConfig(poll_s=poll_s, backoff_initial_s=min(1.0, poll_s),
                                                          backoff_max_s=poll_s))  # fmt: skip
        self.cache_dir = Path(cache_dir)
        self.embedder_factory = embedder_factory
        self.poll_s = poll_s
        self._router = initial
        self.swaps = 0
        """Routers swapped in by this follower."""
        self.failures = 0
        """Follow attempts that kept the current router."""
        self.history: list[tuple[float, str]] = []
        """(wall time, version) of every swap, for tests and logs."""
        self._embedders: dict[str, Embedder] = {}
        self.keys.add(KEY)
        if initial is not None:
            ROUTER_VERSION.set(_version_number(initial.version))

    def current(self) -> Router | None:
        """The router serving now (one reference read), or None before the first one."""
        return self._router

    def route(self, text: str) -> RouteDecision | None:
        """The current router's decision, or None when there is no router yet."""
        router = self._router
        return None if router is None else router.route(text)

    def request_check(self, key: str = KEY) -> None:
        """Resolve ``router@champion`` soon (on the follower's thread)."""
        super().request_check(key)

    def check(self, key: str = KEY) -> bool:
        """One check now: resolve, fetch, verify, validate, swap. True when a new router was swapped in."""
        return super().check(key)

    # ------------------------------------------------------------ the follower's steps
    def serving_version(self, key: str) -> str | None:
        return self._router.version if self._router is not None else None

    def load(self, key: str, version) -> Router:
        return self._load(version)  # 2. fetch + 3. validate

    def install(self, key: str, version, obj: Router, load_s: float) -> None:
        current, self._router = self._router, obj  # 4. swap: one reference assignment
        self.swaps += 1
        self.history.append((time.time(), obj.version))
        ROUTER_SWAPS.inc()
        ROUTER_VERSION.set(_version_number(obj.version))
        log.info("router: swapped %s -> %s (clusters %s; fetched and validated in %.2fs)",
                 current.version if current else "none", obj.version, ",".join(obj.clusters), load_s)  # fmt: skip
        self._prune(keep=obj.version)

    def failed(self, key: str, exc: Exception, reason: str, retry_in: float | None) -> None:
        ROUTER_SWAP_FAILURES.labels(reason).inc()
        self.failures += 1
        current = self._router
        log.warning("router: keeping version %s: %s (%s)", current.version if current else "none", exc, reason)

    def _embedder(self, kind: str) -> Embedder:
        if kind not in self._embedders:
            self._embedders[kind] = self.embedder_factory(kind)
        return self._embedders[kind]

    def _load(self, rv) -> Router:
        embedder = self._embedder(rv.embedder_kind)
        if rv.embedder_sha256 and rv.embedder_sha256 != embedder.config_sha256:  # before downloading anything
            raise RouterError(f"router version {rv.version} was fitted with {rv.embedder_kind} config "
                              f"{rv.embedder_sha256[:12]}, this server's is {embedder.config_sha256[:12]}")  # fmt: skip
        dest = self.cache_dir / f"v{rv.version}"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.registry.fetch(rv, dest)  # checksums against the manifest and the version's tag  # type: ignore[union-attr]
        try:
            router = Router.load(dest, embedder, version=rv.version)
            if tuple(rv.clusters) and tuple(rv.clusters) != router.clusters:
                raise RouterError(f"router version {rv.version}: router.json names clusters {list(router.clusters)}, "
                                  f"the registry {list(rv.clusters)}")  # fmt: skip
            decision = router.route("def main():\n    return 0")  # smoke: the embedder runs, dimensions fit
            if not np.isfinite(decision.distance):
                raise RouterError(f"router version {rv.version}: a smoke route gave distance {decision.distance}")
        except Exception:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return router

    def _prune(self, keep: str) -> None:
        for old in self.cache_dir.glob("v*"):
            if old.is_dir() and old.name != f"v{keep}":
                shutil.rmtree(old, ignore_errors=True)


def _version_number(version: str) -> float:
    return float(version) if version.isdigit() else 0.0


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

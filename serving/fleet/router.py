"""The serving router's hot-swap: the router artifact itself (:class:`~specops.core.router.Router`, its
format and routing) is in ``core/router.py``.

**Hot-swap.** :class:`RouterFollower` follows ``router@champion`` in the registry like
``DraftFollower`` follows drafts: it polls, and checks at once on a ModelEvent for
``router``; a new version is fetched (checksums verified by the registry), loaded,
validated and smoke-routed on a background thread, then swapped in with one reference
assignment. A request uses the router it read when it started. A registry outage or a
refused artifact keeps the current router (logged, counted in
``specops_router_swap_failures_total{reason}``).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client import Counter, Gauge

from specops.core.embed import Embedder, make_embedder
from specops.core.errors import RouterError
from specops.core.router import RouteDecision, Router
from specops.registry import RegistryStore
from specops.serving.fleet.follower import AliasFollower, FollowConfig

log = logging.getLogger(__name__)

ROUTER_VERSION = Gauge("specops_router_version", "Registry version of the router serving now (0: none or unregistered)")
ROUTER_SWAPS = Counter("specops_router_swaps_total", "Router versions swapped in")
ROUTER_SWAP_FAILURES = Counter(
    "specops_router_swap_failures_total", "Failed router follow attempts (the current router kept routing)", ["reason"]
)

KEY = ""
"""The router kind is not keyed: one router for the deployment."""


class RouterFollower(AliasFollower):
    """Keeps the serving router on the registry's ``router@champion`` (the ``router`` kind's
    :class:`~specops.serving.fleet.follower.AliasFollower`, key ``""``).

    ``embedder_factory(kind)`` returns the embedder a router of that kind routes with
    (serving passes one that knows its target for ``target``); one per kind is kept.
    """

    def __init__(
        self,
        registry: RegistryStore | None,
        *,
        cache_dir: Path,
        embedder_factory: Callable[[str], Embedder] = make_embedder,
        initial: Router | None = None,
        poll_s: float = 30.0,
    ) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        super().__init__(
            registry, "router", FollowConfig(poll_s=poll_s, backoff_initial_s=min(1.0, poll_s), backoff_max_s=poll_s)
        )
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
        log.info(
            "router: swapped %s -> %s (clusters %s; fetched and validated in %.2fs)",
            current.version if current else "none",
            obj.version,
            ",".join(obj.clusters),
            load_s,
        )
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
            raise RouterError(
                f"router version {rv.version} was fitted with {rv.embedder_kind} config "
                f"{rv.embedder_sha256[:12]}, this server's is {embedder.config_sha256[:12]}"
            )
        dest = self.cache_dir / f"v{rv.version}"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.registry.artifact("router").fetch(rv, dest)  # checksums against the manifest and the version's tag  # type: ignore[union-attr]
        try:
            router = Router.load(dest, embedder, version=rv.version)
            if tuple(rv.clusters) and tuple(rv.clusters) != router.clusters:
                raise RouterError(
                    f"router version {rv.version}: router.json names clusters {list(router.clusters)}, "
                    f"the registry {list(rv.clusters)}"
                )
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

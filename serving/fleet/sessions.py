"""Serving's past sessions follow the registry: each cluster's cache is seeded from
``sessions-<cluster>@champion``.

The ``sessions`` kind's :class:`~specops.serving.fleet.follower.AliasFollower`: a check fetches the
champion (checksums against its manifest), loads it (:func:`load_sessions` re-checks its own
sha256, dtypes, offsets and token ids against this target's vocabulary), refuses one made with
another tokenizer, and replaces the cluster's outputs in the
:class:`~specops.serving.proposers.session_cache.SessionCache` (:meth:`SessionCache.seed`: the new
index is swapped in by one assignment; a running request keeps the index it took). Outputs
finished after that are added on top as before. A refused or unreachable version keeps the
current cache.

Which clusters: every ``sessions-<cluster>`` registered when serving starts, and again every
``poll_s`` (a cluster first registered later is found then), and any named by a ModelEvent;
in serving, only those that are clusters of the server (``AliasFollower.allow``,
``specops.serving.fleet.clusters``): a registered index of a name no request can send is not polled.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from prometheus_client import Counter, Gauge

from specops.core.clusters import cluster_label
from specops.core.sessions.store import SavedSessions, SessionStoreError, load_sessions
from specops.registry import RegistryStore
from specops.registry.errors import RegistryError
from specops.serving.fleet.follower import AliasFollower, FollowConfig
from specops.serving.proposers.session_cache import SessionCache

log = logging.getLogger(__name__)

SEEDS = Counter(
    "specops_llma_session_seeds_total", "Past-sessions caches seeded from a registered version", ["cluster"]
)
VERSION = Gauge(
    "specops_llma_session_version", "Registry version the cluster's past sessions were seeded from", ["cluster"]
)

LIST = "list:"
"""Worker item: look for clusters with a registered past-sessions index."""


class SessionFollower(AliasFollower):
    """Seeds each cluster's past sessions from ``sessions-<cluster>@champion``."""

    def __init__(
        self,
        registry: RegistryStore | None,
        sessions: SessionCache,
        *,
        cache_dir: Path,
        target_tokenizer_sha256: str = "",
        vocab_size: int | None = None,
        follow: FollowConfig | None = None,
    ) -> None:
        super().__init__(registry, "sessions", follow)
        self.sessions = sessions
        self.cache_dir = Path(cache_dir)
        self.target_tokenizer_sha256 = target_tokenizer_sha256
        self.vocab_size = vocab_size
        self._versions: dict[str, str] = {}
        self.seeds = 0

    def start(self) -> SessionFollower:
        super().start()
        self.enqueue(LIST)
        return self

    def handle(self, item: str) -> bool:
        if item != LIST:
            return False
        try:
            for key in self.registry.artifact("sessions").keys() if self.registry is not None else ():
                self.follow(key)
        except RegistryError as exc:  # the next listing retries; what is held keeps serving
            log.warning("could not list registered past sessions: %s", exc)
        if self.registry is not None and not self._stop.is_set():
            timer = threading.Timer(self.follow_cfg.poll_s, self.enqueue, args=(LIST,))
            timer.daemon = True
            timer.start()
        return True

    # ------------------------------------------------------------ the follower's steps
    def serving_version(self, key: str) -> str | None:
        return self._versions.get(key)

    def load(self, key: str, version) -> SavedSessions:
        dest = self.cache_dir / key / str(version.version)
        if dest.exists():
            shutil.rmtree(dest)
        try:
            self.registry.artifact("sessions").fetch(version, dest)  # manifest checksums
            saved = load_sessions(dest, vocab_size=self.vocab_size)  # its own sha256, shapes, token ids
        finally:
            shutil.rmtree(dest, ignore_errors=True)  # held in memory from here on
        made_with = saved.tokenizer_sha256
        if made_with and self.target_tokenizer_sha256 and made_with != self.target_tokenizer_sha256:
            raise SessionStoreError(
                f"sessions-{key} version {version.version} was built with tokenizer "
                f"{made_with[:12]}; this target's is {self.target_tokenizer_sha256[:12]}"
            )
        return saved

    def install(self, key: str, version, obj: SavedSessions, load_s: float) -> None:
        kept = self.sessions.seed(key, obj.docs)
        self._versions[key] = str(version.version)
        self.seeds += 1
        SEEDS.labels(cluster_label(key)).inc()
        VERSION.labels(cluster_label(key)).set(float(version.version) if str(version.version).isdigit() else 0)
        log.info(
            "past sessions %s: seeded from version %s (%d of %d outputs, %d tokens; loaded in %.2fs)",
            key,
            version.version,
            kept,
            len(obj.docs),
            obj.num_tokens,
            load_s,
        )

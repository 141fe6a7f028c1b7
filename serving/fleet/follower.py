"""One alias follower for every artifact kind: keep what serving holds on ``<kind>@champion``.

An :class:`AliasFollower` follows the registry alias ``champion`` of one artifact kind
(``specops.registry.kinds``) for a set of keys (a draft per cluster, one router, later a datastore
per cluster and the knowledge bases). One check of a key (:meth:`AliasFollower.check`) is:

1. **resolve** the key's champion in the registry (on a timer every ``poll_s``, and at once
   when a ModelEvent for its registered model arrives);
2. if it names a version serving does not hold, **load and validate** it: the kind's own
   step (:meth:`AliasFollower.load`: fetch with checksums, then whatever proves the artifact
   fits this server);
3. **install** it: one reference assignment (:meth:`AliasFollower.install`), so a request
   that took the old object finishes with it and the next one gets the new one.

Everything runs on the follower's one worker thread; a request never waits for it. A
registry outage or a refused artifact keeps the current version serving; it is logged,
counted (``specops_follower_failures_total``) and retried with exponential backoff.
Subclasses give the kind's load/validate and install; ``specops.serving.fleet.hotswap``
(drafts) and ``specops.serving.fleet.router`` (the router) are the two today.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter

from specops.core.clusters import ClusterLabels
from specops.registry import CHAMPION, RegistryError, RegistryStore
from specops.registry.kinds import KINDS, ArtifactKind

log = logging.getLogger(__name__)

FAILURES = Counter(
    "specops_follower_failures_total", "Follow attempts that kept the current version", ["kind", "key", "reason"]
)
KEY_LABELS = ClusterLabels()
"""Bounded ``key`` label values of ``FAILURES`` (clusters and knowledge-base names)."""


@dataclass(frozen=True)
class FollowConfig:
    """How a follower polls and retries."""

    poll_s: float = 10.0
    """Seconds between registry polls of every key (events trigger a check at once)."""
    backoff_initial_s: float = 1.0
    """First retry delay after a failed check; doubles per consecutive failure."""
    backoff_max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.poll_s <= 0 or not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need poll_s > 0 and 0 < backoff_initial_s <= backoff_max_s")


@dataclass
class LiveStats:
    """What one served version did live: requests, drafted and accepted tokens."""

    requests: int = 0
    drafted: int = 0
    accepted: int = 0
    reported_at: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class AliasFollower:
    """Follows ``champion`` of one artifact kind for every key it is told to follow."""

    def __init__(self, registry: RegistryStore | None, kind: str, follow: FollowConfig | None = None) -> None:
        self.registry = registry
        self.kind: ArtifactKind = KINDS[kind]
        self.follow_cfg = follow or FollowConfig()
        self.keys: set[str] = set()
        self.allow: Callable[[str], bool] | None = None
        """Which keys may be followed (serving: clusters that exist, ``specops.serving.fleet.clusters``); None: any.
        A key it refuses is not followed, and one it stops allowing is no longer polled."""
        self._failures: dict[str, tuple[int, float]] = {}
        """Per key: consecutive failures and when the next queued attempt may run."""
        self._lock = threading.Lock()
        self._check_lock = threading.Lock()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._pending: set[str] = set()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._work, name=f"{kind}-follower", daemon=True)
        self._ticker = threading.Thread(target=self._tick, name=f"{kind}-follower-poll", daemon=True)

    # ------------------------------------------------------------ the kind's steps
    def serving_version(self, key: str) -> str | None:
        """The version serving holds for ``key`` now (None: nothing yet)."""
        raise NotImplementedError

    def load(self, key: str, version) -> object:
        """Fetch and validate ``version`` (an ``ArtifactVersion``); raise on anything wrong."""
        raise NotImplementedError

    def install(self, key: str, version, obj: object, load_s: float) -> None:
        """Swap the loaded object in (one reference assignment) and say so."""
        raise NotImplementedError

    def failed(self, key: str, exc: Exception, reason: str, retry_in: float | None) -> None:
        """A check kept the current version (``retry_in``: the backoff before the next queued try)."""
        FAILURES.labels(self.kind.name, KEY_LABELS(key), reason).inc()
        log.warning(
            "%s %s keeps version %s: %s (%s)%s",
            self.kind.name,
            key or "-",
            self.serving_version(key) or "none",
            exc,
            reason,
            f"; retrying in {retry_in:.1f}s" if retry_in else "",
        )

    def handle(self, item: str) -> bool:
        """Worker items other than key checks (a subclass's own queued work); True if handled."""
        return False

    # ------------------------------------------------------------ lifecycle
    def start(self) -> AliasFollower:
        self._worker.start()
        self._ticker.start()
        for key in list(self.keys):
            self.request_check(key)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._queue.put(None)
        for t in (self._worker, self._ticker):
            if t.is_alive():
                t.join(timeout_s)

    def follow(self, key: str) -> None:
        """Follow ``key`` from now on (checked at once), if ``allow`` lets it."""
        if self.allow is not None and not self.allow(key):
            return
        with self._lock:
            new = key not in self.keys
            self.keys.add(key)
        if new:
            self.request_check(key)

    def request_check(self, key: str) -> None:
        """Resolve the key's champion soon, on the worker thread."""
        self.enqueue(key)

    def enqueue(self, item: str) -> None:
        """Queue work, at most once while it waits: a burst of events, or every request
        finishing while the registry is down, costs one registry call, not one each."""
        with self._lock:
            if item in self._pending:
                return
            self._pending.add(item)
        self._queue.put(item)

    def on_event(self, event) -> None:
        """A ModelEvent from ``spec.events``: check the key it names, if this follower's kind."""
        key = self.kind.key_of(getattr(event, "model_name", "") or "")
        if key is not None:
            self.follow(key) if key not in self.keys else self.request_check(key)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Block until no check is queued or running (tests and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.02)
        return False

    def _tick(self) -> None:
        while not self._stop.wait(self.follow_cfg.poll_s):
            for key in list(self.keys):
                if self.allow is not None and not self.allow(key):
                    with self._lock:
                        self.keys.discard(key)  # no longer a key a request can use: not polled any more
                    continue
                self.request_check(key)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                with self._lock:
                    self._pending.discard(item)
                if not self.handle(item):
                    _, not_before = self._failures.get(item, (0, 0.0))
                    if time.monotonic() >= not_before:  # backing off otherwise; the next poll or timer retries
                        self.check(item)
            except Exception:  # never let the worker die: serving goes on with what it has
                log.exception("%s follower: %s failed", self.kind.name, item)
            finally:
                self._queue.task_done()

    # ------------------------------------------------------------ the check
    def check(self, key: str) -> bool:
        """One check of ``key`` now: resolve, load and validate, install. True when a new
        version was installed; False when serving already held the champion, or on failure."""
        if self.registry is None:
            return False
        with self._check_lock:
            try:
                version = self.registry.artifact(self.kind.name).by_alias(key, CHAMPION)  # 1.
                if version is None or version.version == self.serving_version(key):
                    self._failures.pop(key, None)
                    return False
                t0 = time.perf_counter()
                obj = self.load(key, version)  # 2.
            except Exception as exc:  # registry down, corrupt or unfit artifact: keep what we have
                if not isinstance(exc, (RegistryError, OSError, ValueError)):
                    log.exception("%s %s: unexpected failure loading the champion", self.kind.name, key or "-")
                failures, _ = self._failures.get(key, (0, 0.0))
                delay = min(self.follow_cfg.backoff_max_s, self.follow_cfg.backoff_initial_s * 2**failures)
                self._failures[key] = (failures + 1, time.monotonic() + delay)
                self.failed(key, exc, getattr(exc, "code", type(exc).__name__), delay)
                if failures == 0 and not self._stop.is_set():
                    timer = threading.Timer(delay, self.request_check, args=(key,))
                    timer.daemon = True
                    timer.start()
                return False
            self._failures.pop(key, None)
            self.install(key, version, obj, time.perf_counter() - t0)  # 3.
            return True

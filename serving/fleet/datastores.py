"""Serving's DReSD datastores: one per cluster, following ``datastore-<cluster>@champion``.

The ``datastore`` kind's :class:`~specops.serving.fleet.follower.AliasFollower`: a check fetches the
champion (checksums against its manifest), loads it (:meth:`Datastore.load` re-checks every
index file's sha256 and refuses anything malformed), proves it fits this target (hidden size,
vocabulary, tokenizer) and installs it with one reference assignment. A request takes its
cluster's :class:`DatastoreHandle` once, so a swap never changes a running request, and a
refused or unreachable version keeps the current one serving.

Every ``live_report_every`` DReSD requests on a registered version, its live MAR (accepted /
drafted tokens of the requests it served) goes to the registry as the version's metrics
``live_mar`` and ``live_requests`` (queued on the follower's worker, never on a request), next
to the ``mar`` its rebuild replayed offline; the gauge ``specops_datastore_live_mar`` has it now.

A cluster with no champion yet uses the **fallback** datastore (``specops datastore build``
over the bootstrap corpus: out of distribution, version ``base``), when serving has one.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge

from specops.core.clusters import cluster_label
from specops.core.datastore import Datastore
from specops.core.errors import DatastoreError
from specops.registry import RegistryStore
from specops.registry.errors import RegistryError
from specops.serving.fleet.follower import AliasFollower, FollowConfig, LiveStats

log = logging.getLogger(__name__)

SWAPS = Counter("specops_datastore_swaps_total", "Datastores swapped in", ["cluster"])
VERSION = Gauge("specops_datastore_version", "Registry version of the datastore serving (0 = fallback)", ["cluster"])
LIVE_MAR = Gauge(
    "specops_datastore_live_mar",
    "Live DReSD acceptance (accepted / drafted) per datastore version served",
    ["cluster", "version"],
)


@dataclass(frozen=True)
class DatastoreHandle:
    """The datastore a request uses, and its version (``base`` for the fallback)."""

    datastore: Datastore | None
    version: str


class DatastoreFollower(AliasFollower):
    """Per-cluster datastores on ``datastore-<cluster>@champion``, with a fallback."""

    def __init__(
        self,
        registry: RegistryStore | None,
        target,
        *,
        cache_dir: Path,
        fallback: Datastore | None = None,
        target_tokenizer_sha256: str = "",
        vocab_size: int | None = None,
        follow: FollowConfig | None = None,
        live_report_every: int = 50,
    ) -> None:
        if live_report_every < 1:
            raise ValueError(f"live_report_every must be >= 1, got {live_report_every}")
        super().__init__(registry, "datastore", follow)
        self.target = target
        self.cache_dir = Path(cache_dir)
        self.target_tokenizer_sha256 = target_tokenizer_sha256
        self.vocab_size = vocab_size
        self.fallback = DatastoreHandle(fallback, "base" if fallback is not None else "")
        if fallback is not None:
            fallback.check_fits(target, vocab_size)
        self._current: dict[str, DatastoreHandle] = {}
        self._install_lock = threading.Lock()
        self.swaps = 0
        self.live_report_every = live_report_every
        self.live: dict[tuple[str, str, str], LiveStats] = {}
        self._live_lock = threading.Lock()

    def record(self, cluster: str, version: str, stats, method: str = "dresd") -> None:
        """Count one finished request of ``method`` (``dresd``, or ``retrieval``, which drafts from
        the same datastore) on the datastore version it used (cheap; the registry write is queued
        on the follower's worker). DReSD's counts are the version's ``live_mar``; another method's
        are ``live_mar_<method>``, so the offline MAR is compared with DReSD's alone."""
        if not version:
            return
        with self._live_lock:
            live = self.live.setdefault((cluster, version, method), LiveStats())
            live.requests += 1
            live.drafted += stats.num_drafted
            live.accepted += stats.num_accepted
            due = version != "base" and live.requests - live.reported_at >= self.live_report_every
            if due:
                live.reported_at = live.requests  # queued once per window
        if method == "dresd":
            LIVE_MAR.labels(cluster_label(cluster), version).set(live.acceptance)
        if due:
            self.enqueue(f"live:{method}:{cluster}:{version}")

    def handle(self, item: str) -> bool:
        if not item.startswith("live:"):
            return False
        _, method, rest = item.split(":", 2)
        cluster, version = rest.rsplit(":", 1)
        with self._live_lock:
            live = self.live[(cluster, version, method)]
            snapshot = LiveStats(live.requests, live.drafted, live.accepted)
        suffix = "" if method == "dresd" else f"_{method}"
        try:
            kind = self.registry.artifact("datastore")
            kind.log_metric(cluster, version, f"live_mar{suffix}", snapshot.acceptance, step=snapshot.requests)
            kind.log_metric(cluster, version, f"live_requests{suffix}", snapshot.requests, step=snapshot.requests)
        except RegistryError as exc:  # best effort: the next window reports again
            log.warning("could not report live MAR of datastore-%s version %s: %s", cluster, version, exc)
        return True

    def current(self, cluster: str) -> DatastoreHandle:
        """The cluster's datastore now (one dict read); following starts on first use."""
        handle = self._current.get(cluster)
        if cluster not in self.keys:  # new, or no longer followed while it was not a cluster
            self.follow(cluster)
        return self.fallback if handle is None else handle

    # ------------------------------------------------------------ the follower's steps
    def serving_version(self, key: str) -> str | None:
        handle = self._current.get(key)
        return handle.version if handle is not None else None

    def load(self, key: str, version) -> Datastore:
        dest = self.cache_dir / key / str(version.version)
        if dest.exists():
            shutil.rmtree(dest)
        self.registry.artifact("datastore").fetch(version, dest)  # manifest checksums
        store = Datastore.load(dest)  # every index file's sha256, shapes, ranges
        store.check_fits(self.target, self.vocab_size)
        store.suffix_index()  # the retrieval method's exact-match index, built here rather than in a request
        made_with = store.meta.get("tokenizer_sha256", "")
        if made_with and self.target_tokenizer_sha256 and made_with != self.target_tokenizer_sha256:
            raise DatastoreError(
                f"datastore-{key} version {version.version} was built with tokenizer "
                f"{made_with[:12]}; this target's is {self.target_tokenizer_sha256[:12]}"
            )
        return store

    def install(self, key: str, version, obj: Datastore, load_s: float) -> None:
        with self._install_lock:
            previous = self._current.get(key)
            self._current = {**self._current, key: DatastoreHandle(obj, str(version.version))}  # one assignment
        self.swaps += 1
        SWAPS.labels(cluster_label(key)).inc()
        VERSION.labels(cluster_label(key)).set(float(version.version) if str(version.version).isdigit() else 0)
        log.info(
            "datastore %s: swapped %s -> %s (%d entries, %.0f bytes/entry; loaded in %.2fs)",
            key,
            previous.version if previous else self.fallback.version or "none",
            version.version,
            obj.num_entries,
            obj.bytes_per_entry,
            load_s,
        )
        # Older cached versions are not needed: running requests hold the object, not the files.
        for old in (self.cache_dir / key).glob("*"):
            if old.name != str(version.version):
                shutil.rmtree(old, ignore_errors=True)

    def wait_for(self, cluster: str, version: str, timeout_s: float = 30.0) -> bool:
        """Block until ``cluster`` serves ``version`` (tests and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.serving_version(cluster) == version:
                return True
            time.sleep(0.02)
        return False

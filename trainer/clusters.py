"""The online trainer's bound on its clusters: how many it keeps in memory, how many it creates.

A cluster's draft and AdamW state take three times the draft's weights in memory, so the
trainer holds at most ``OnlineConfig.max_loaded_clusters`` of them. Every update already
checkpoints draft and optimiser (``specops.trainer.checkpoint``, safetensors and JSON), so unloading the
least recently used idle cluster writes only its buffered and held-out records
(``buffer.msgpack``) and drops it; its next record reloads it from that checkpoint, weights and
optimiser state identical. A cluster whose weights changed since its checkpoint is never
unloaded, and one waiting to be registered only when no other can go.

It creates at most ``OnlineConfig.max_clusters`` clusters in all (those already under ``--out``
count): a record of a further cluster goes to the dead-letter topic with the reason, before any
draft is made for it. Serving accepts only clusters that exist (``specops.serving.fleet.clusters``); this
is the trainer's own bound, whatever writes to the stream.

:class:`ClusterBudget` is the bookkeeping (which clusters exist, which are unloaded, which one
goes next) and the metrics; ``specops.trainer.online.trainer.OnlineTrainer`` does the loading and unloading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import Counter, Gauge

from specops.trainer import checkpoint as ckpt

LOADED = Gauge("specops_trainer_clusters_loaded", "Clusters whose draft and optimiser are in memory")
KNOWN = Gauge(
    "specops_trainer_clusters",
    "Clusters the trainer has, loaded or not (at most max_clusters, plus any found under --out beyond it)",
)
UNLOADS = Counter(
    "specops_trainer_cluster_unloads_total",
    "Idle clusters unloaded (their checkpoint kept) to stay within max_loaded_clusters",
)
RELOADS = Counter("specops_trainer_cluster_reloads_total", "Clusters loaded back from their checkpoint")
REFUSED = Counter(
    "specops_trainer_cluster_refused_records_total",
    "Records dead-lettered because their cluster would be one more than max_clusters",
)


class ClusterBudget:
    """Which clusters exist, which are out of memory, and which one to unload next."""

    def __init__(self, max_loaded: int, max_clusters: int, existing: Iterable[str] = ()) -> None:
        assert max_loaded >= 1 and max_clusters >= 1
        self.max_loaded = max_loaded
        self.max_clusters = max_clusters
        self.known: set[str] = set(existing)
        """Every cluster created or found under ``--out``."""
        self.unloaded: set[str] = set(self.known)
        """Known clusters not in memory (all of them until loaded)."""
        self.counts = {"unloaded": 0, "reloaded": 0, "refused": 0}
        KNOWN.set(len(self.known))

    def admits(self, cluster: str) -> bool:
        """True when ``cluster`` exists or may be created; else the refusal is counted."""
        if cluster in self.known or len(self.known) < self.max_clusters:
            return True
        self.counts["refused"] += 1
        REFUSED.inc()
        return False

    def refusal(self, cluster: str) -> str:
        """The dead letter's reason for a record of ``cluster``."""
        return (
            f"cluster {cluster[:80]!r} would be one more than the trainer's max_clusters ({self.max_clusters}): "
            "raise --max-clusters, or remove clusters no longer served from --out"
        )

    def loaded(self, cluster: str, num_loaded: int) -> None:
        """``cluster`` is in memory now (created, or reloaded from its checkpoint)."""
        if cluster in self.unloaded:
            self.unloaded.discard(cluster)
            self.counts["reloaded"] += 1
            RELOADS.inc()
        self.known.add(cluster)
        KNOWN.set(len(self.known))
        LOADED.set(num_loaded)

    def dropped(self, cluster: str, num_loaded: int) -> None:
        """``cluster`` was unloaded."""
        self.unloaded.add(cluster)
        self.counts["unloaded"] += 1
        UNLOADS.inc()
        LOADED.set(num_loaded)

    def victim(
        self, loaded: Iterable[str], *, keep: str, idle: Callable[[str], bool], pinned: Callable[[str], bool]
    ) -> str | None:
        """The least recently used cluster to unload (``loaded`` oldest first), never ``keep`` nor
        one that is not ``idle``; a ``pinned`` one (waiting to be registered) only if nothing else can go."""
        candidates = [c for c in loaded if c != keep and idle(c)]
        return next((c for c in candidates if not pinned(c)), candidates[0] if candidates else None)

    def startup(self, root: Path) -> list[str]:
        """The clusters under ``root`` to load at start: the ``max_loaded`` most recently written."""
        return sorted(self.known, key=lambda c: (ckpt.last_written(root, c), c))[-self.max_loaded :]

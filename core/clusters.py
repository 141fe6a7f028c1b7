"""Cluster labels of metrics: the bounded label set every Prometheus metric labelled by cluster uses
(serving's and the trainer's alike). Which clusters exist is serving's question
(``specops.serving.fleet.clusters.KnownClusters``).

**Bounded labels** (:class:`ClusterLabels`): metrics label a cluster by its name for the first
``MAX_LABELLED`` names they see in this process, and every later one as ``OTHER``. Serving sees
only clusters that exist, so the cap matters only for a fleet with more clusters than that; it
keeps ``/metrics`` bounded whatever the registry holds.
"""

from __future__ import annotations

import threading

MAX_LABELLED = 64
"""Distinct cluster names a process's metrics label by name; the rest are ``OTHER``."""
OTHER = "(other)"
"""Label of the clusters beyond ``MAX_LABELLED`` (not a valid cluster name, so never a real one)."""


class ClusterLabels:
    """Label values for metrics labelled by cluster: at most ``limit`` names, then ``OTHER``."""

    def __init__(self, limit: int = MAX_LABELLED) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, cluster: str) -> str:
        if cluster in self._names:
            return cluster
        with self._lock:
            if cluster in self._names or len(self._names) < self.limit:
                self._names.add(cluster)
                return cluster
        return OTHER

    def names(self) -> frozenset[str]:
        """The clusters labelled by name so far."""
        return frozenset(self._names)


LABELS = ClusterLabels()
"""The process's cluster labels: one set, as the Prometheus registry is one per process."""


def cluster_label(cluster: str) -> str:
    """The label value of ``cluster`` in every metric labelled by cluster."""
    return LABELS(cluster)

"""Which clusters exist: the names a request may send as ``cluster``, and the bounded label
set every Prometheus metric labelled by cluster uses.

**A cluster exists** when it is one of (:class:`KnownClusters`):

1. the server's ``default_cluster`` and the operator's ``clusters`` (``ServeConfig``);
2. a cluster of the router serving now (``router@champion``: its ``router.json``);
3. a cluster with a registered **champion** draft (``draft-<cluster>@champion``), as the draft
   follower last listed them (``DraftFollower.champions``, refreshed every ``poll_s``).

Registry champions count because only a trusted writer makes one: the trainer, after training on
records serving accepted and gating the result, or an operator (``specops registry promote``).
Serving accepts only clusters that exist, so a client cannot bring a champion into being by
naming a cluster. A challenger, a datastore or a past-sessions artifact alone does not make a
cluster, and neither does anything serving holds in memory (draft slots, past outputs, the
``auto`` policy's statistics): those exist only because a request named the cluster.

Any other name is refused with a 400 naming ``cluster`` (:meth:`KnownClusters.check`), and the
followers take no key that is not a cluster (:meth:`KnownClusters.exists` is their filter), so
a made-up name costs one refused request, not a slot, a poll every ``poll_s`` and metric series.

**Bounded labels** (:class:`ClusterLabels`): metrics label a cluster by its name for the first
``MAX_LABELLED`` names they see in this process, and every later one as ``OTHER``. Serving sees
only clusters that exist, so the cap matters only for a fleet with more clusters than that; it
keeps ``/metrics`` bounded whatever the registry holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable

from specops.serving.errors import InvalidRequestError, echo

MAX_LABELLED = 64
"""Distinct cluster names a process's metrics label by name; the rest are ``OTHER``."""
OTHER = "(other)"
"""Label of the clusters beyond ``MAX_LABELLED`` (not a valid cluster name, so never a real one)."""
MAX_LISTED = 20
"""Most cluster names a refusal lists (the rest are counted)."""


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


class KnownClusters:
    """The clusters a request may name (see the module docstring); cheap enough for every request."""

    def __init__(self, configured: Iterable[str], *, router: Callable[[], object | None] = lambda: None,
                 champions: Callable[[], Collection[str]] = frozenset) -> None:  # fmt: skip
        self.configured = frozenset(c for c in configured if c)
        """``default_cluster`` and ``clusters`` of the server's config."""
        self._router = router
        """The router serving now (``Router``, with ``clusters``), or None."""
        self._champions = champions
        """Clusters with a registered champion draft (``DraftFollower.champions``)."""

    def _routed(self) -> Collection[str]:
        router = self._router()
        return getattr(router, "clusters", ()) if router is not None else ()

    def exists(self, cluster: str) -> bool:
        return cluster in self.configured or cluster in self._routed() or cluster in self._champions()

    def names(self) -> list[str]:
        """Every cluster that exists now, sorted."""
        return sorted(self.configured | set(self._routed()) | set(self._champions()))

    def check(self, cluster: str) -> str:
        """``cluster`` when it exists; else the caller's 400 naming ``cluster``, saying how to fix it."""
        if self.exists(cluster):
            return cluster
        names = self.names()
        more = len(names) - MAX_LISTED
        listed = ", ".join(names[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")
        raise InvalidRequestError(f"cluster {echo(cluster)} is not a cluster of this server: leave cluster out to be "
                                  f"routed, or name one of: {listed} (an operator adds clusters with the serve "
                                  "setting `clusters`)", "cluster")  # fmt: skip

"""Which clusters exist: the names a request may send as ``cluster``.

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

Metrics label clusters with ``specops.core.clusters.cluster_label`` (a bounded label set).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from specops.core.errors import InvalidRequestError, echo

MAX_LISTED = 20
"""Most cluster names a refusal lists (the rest are counted)."""


class KnownClusters:
    """The clusters a request may name (see the module docstring); cheap enough for every request."""

    def __init__(
        self,
        configured: Iterable[str],
        *,
        router: Callable[[], object | None] = lambda: None,
        champions: Callable[[], Collection[str]] = frozenset,
    ) -> None:
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
        raise InvalidRequestError(
            f"cluster {echo(cluster)} is not a cluster of this server: leave cluster out to be "
            f"routed, or name one of: {listed} (an operator adds clusters with the serve "
            "setting `clusters`)",
            "cluster",
        )

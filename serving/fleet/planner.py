"""The fleet's part of a request's plan: which cluster serves it, and how it drafts there.

The HTTP layer (``specops.serving.http.server.ServingState.plan``) parses the body, checks the
tenant's rights and builds the :class:`~specops.serving.plan.DecodePlan`; what the fleet decides
for it is here, each once per request:

1. :func:`choose_method`: the method, looked up in the catalogue (the request's only look-up),
   its ``k`` and rows, and its own options, validated by its
   :class:`~specops.serving.proposers.catalogue.MethodSpec`'s options model;
2. :func:`route`: the cluster (the request's, which must exist, else the router's choice, else
   the default), counted by :meth:`Route.count` once the request is planned;
3. :func:`check_resources`: what the method needs is loaded for that cluster (a draft model, a
   datastore).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from specops.core.clusters import cluster_label
from specops.core.models import ModelPair
from specops.serving.metrics import ROUTED
from specops.serving.proposers import catalogue
from specops.serving.proposers.catalogue import MethodOptions, MethodSpec, ProposerResources


@dataclass(frozen=True)
class MethodChoice:
    """How a request drafts: its method, ``k``, rows per step and the method's own options."""

    spec: MethodSpec
    k: int
    """Tokens drafted per step: the request's, else the method's default within the server's cap."""
    n_drafts: int
    """Rows per step the request asked for (0: the method's default)."""
    options: MethodOptions


def choose_method(
    method: str | None, k: int | None, n_drafts: int | None, options: Mapping[str, object], *, default: str, max_k: int
) -> MethodChoice:
    """The request's :class:`MethodChoice` (``default``: the server's method when it names none;
    ``k`` and ``n_drafts`` already within the server's caps); the caller's 400 naming
    ``speculation.<field>`` when an option is not the method's or out of its bounds."""
    spec = catalogue.method_spec(method or default)  # the one catalogue look-up of the request
    k = k or min(spec.default_k, max_k)  # a default never exceeds the server's cap
    return MethodChoice(spec, k, n_drafts or 0, spec.parse_options(options))


@dataclass(frozen=True)
class Route:
    """The cluster that serves a request, and who chose it."""

    cluster: str
    source: str
    """``request`` (the request's field), ``router`` or ``default``."""
    router_version: str = ""

    def count(self) -> None:
        """``specops_routed_requests_total``: once per planned request."""
        ROUTED.labels(cluster_label(self.cluster), self.source).inc()


def route(cluster: str | None, text: Callable[[], str], *, known, router, default_cluster: str) -> Route:
    """The request's cluster: ``cluster`` when it names one (``known.check``: a 400 naming
    ``cluster`` unless it exists), else the current router's choice over the prompt's ``text()``
    (``router``: a ``specops.serving.fleet.router.RouterFollower``, or None), else ``default_cluster``."""
    if cluster is not None:
        known.check(cluster)
        return Route(cluster, "request")
    current = router.current() if router is not None else None
    if current is None:
        return Route(default_cluster, "default")
    decision = current.route(text())
    return Route(decision.cluster, "router", decision.router_version)


def check_resources(spec: MethodSpec, pair: ModelPair, cluster: str, datastores) -> None:
    """The caller's 400 when ``cluster`` lacks what ``spec`` needs (``datastores``: the replica's
    ``specops.serving.fleet.datastores.DatastoreFollower``, or None)."""
    datastore = datastores.current(cluster).datastore if datastores is not None else None
    catalogue.check_resources(spec, ProposerResources(pair=pair, cluster=cluster, datastore=datastore))

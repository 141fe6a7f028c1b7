"""One request's :class:`DecodePlan`: everything decided about it, once, at the edge.

The HTTP layer (``specops.serving.http.server.ServingState.plan``) validates the body and builds
the plan: the method's :class:`~specops.serving.proposers.catalogue.MethodSpec` (looked up and its
resources checked there, once), the decoding mode (a key of :data:`specops.serving.modes.MODES`),
sampling and limits, LLMA's references, the retrieval or kNN-LM block with the artifact it
names, the cluster and the tenant. Every layer below (the replica, the serving node, the
retrieval loop, kNN-LM) reads the plan; none re-reads the body, re-looks-up the method or
tests its name.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from specops.serving.engine.prefix import PrefixShare
from specops.serving.engine.types import SamplingParams
from specops.serving.proposers.catalogue import MethodSpec, ProposerConfig, method_spec


@dataclass(frozen=True)
class RetrievalPlan:
    """A retrieval-augmented request: the loop's settings and the knowledge base it names."""

    cfg: object
    """``specops.serving.ralm.loop.RalmConfig`` (its ``mode``: ``oneshot``, ``ralmseq`` or ``ralmspec``)."""
    kb: object
    """The knowledge base (``specops.serving.fleet.catalog.Loaded``: name, version, artifact)."""
    retriever: str
    """The kind of the knowledge base's retriever to search with (``exact``, ``hnsw``, ...)."""


@dataclass(frozen=True)
class KnnPlan:
    """A kNN-LM request: its settings and the datastore it names."""

    cfg: object
    """``specops.serving.ralm.knnlm.decode.KnnConfig``."""
    store: object
    """The kNN-LM datastore (``specops.serving.fleet.catalog.Loaded``)."""


@dataclass(frozen=True)
class DecodePlan:
    """What to decode and how: immutable, built once per request."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    spec: MethodSpec
    """The decoding method, resolved from the catalogue (its resources already checked)."""
    k: int | None = None
    """Tokens drafted per step (None: the method's default)."""
    mode: str = "plain"
    """A key of ``specops.serving.modes.MODES``: ``plain``, ``oneshot``, ``ralm`` or ``knnlm``."""
    cluster: str = "default"
    cluster_source: str = "default"
    """``request`` (the request's field), ``router`` or ``default``."""
    router_version: str = ""
    n_drafts: int = 0
    """Rows per step for a multi-draft method (0: the method's default)."""
    llma_min_n: int = 1
    """The shortest trailing match that copies (methods that copy references)."""
    references: tuple[tuple[int, ...], ...] = ()
    """Reference texts, tokenized (the request's ``references``, earlier chat turns)."""
    retrieval: RetrievalPlan | None = None
    knnlm: KnnPlan | None = None
    prompt_text: str = ""
    stop: tuple[str, ...] = ()
    """Stop sequences (the HTTP layer ends the stream at the first)."""
    tenant: str = "anonymous"
    """The id of the tenant that sent it (``specops.serving.http.tenancy``; never the key)."""
    session_scope: str = ""
    """Whose past outputs of the cluster it copies from and adds to (a tenant id; ``""``: shared)."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The request's id in the logged records: the server's own, or ``<tenant>/<X-Request-Id>``, so
    two tenants' ids never meet (``client_request_id`` is what the client sent)."""
    client_request_id: str = ""
    """The client's ``X-Request-Id``, as sent (the response's id and header); empty: none was sent."""
    prefix_share: PrefixShare | None = field(default=None, compare=False, repr=False)
    """Its part in its request's choices' shared prefill (``n``, ``best_of``; ``specops.serving.engine.prefix``)."""

    @property
    def method(self) -> str:
        return self.spec.name

    def proposer_config(self) -> ProposerConfig:
        """The per-request method settings for the proposer."""
        return ProposerConfig(method=self.spec.name, n_drafts=self.n_drafts, llma_min_n=self.llma_min_n)

    @classmethod
    def plain(cls, prompt_ids, params: SamplingParams, *, method: str = "draft", **fields) -> DecodePlan:
        """A plan for callers without an HTTP body (benchmarks, tests): ``method`` looked up here."""
        return cls(tuple(int(t) for t in prompt_ids), params, method_spec(method), **fields)

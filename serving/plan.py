"""One request's :class:`DecodePlan`: everything decided about it, once, at the edge.

The HTTP layer (``specops.serving.http.server.ServingState.plan``) validates the body and builds
the plan, with the fleet's part (``specops.serving.fleet.planner``): the method's
:class:`~specops.serving.proposers.catalogue.MethodSpec` (looked up and its resources checked
there, once), its ``k``, rows and options (its options model's instance, validated there), the
decoding mode (a key of :data:`specops.serving.modes.MODES`), sampling and limits, LLMA's
references, the retrieval or kNN-LM block with the artifact it names, the cluster and the
tenant. Every layer below (the replica, the serving node, the retrieval loop, kNN-LM) reads
the plan; none re-reads the body, re-looks-up the method or tests its name. The node builds
the proposer from it (:meth:`DecodePlan.proposer`) and hands the engine that proposer and ``k``.

Callers without an HTTP body (tests, benchmarks, the CLI) build one with
:meth:`DecodePlan.plain`, or decode on a bare engine with :func:`plain_generate`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from specops.core.errors import InvalidRequestError
from specops.serving.engine.prefix import PrefixShare
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import ContextSpan, GenerationResult, SamplingParams
from specops.serving.proposers.catalogue import (
    CATALOGUE,
    MAX_DRAFTS,
    MethodOptions,
    MethodSpec,
    ProposerResources,
    build_proposer,
    method_spec,
)

if TYPE_CHECKING:  # types only: the plan names them, the modes import them
    from specops.serving.engine.session import DecodeSession
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.fleet.catalog import Loaded
    from specops.serving.ralm.knnlm.decode import KnnConfig
    from specops.serving.ralm.types import RalmConfig


@dataclass(frozen=True)
class RetrievalPlan:
    """A retrieval-augmented request: the loop's settings and the knowledge base it names."""

    cfg: RalmConfig
    """Its ``mode``: ``oneshot``, ``ralmseq`` or ``ralmspec``."""
    kb: Loaded
    """The knowledge base (name, version, artifact)."""
    retriever: str
    """The kind of the knowledge base's retriever to search with (``exact``, ``hnsw``, ...)."""


@dataclass(frozen=True)
class KnnPlan:
    """A kNN-LM request: its settings and the datastore it names."""

    cfg: KnnConfig
    store: Loaded
    """The kNN-LM datastore (name, version, artifact)."""


@dataclass(frozen=True)
class DecodePlan:
    """What to decode and how: immutable, built once per request."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    spec: MethodSpec
    """The decoding method, resolved from the catalogue (its resources already checked)."""
    k: int
    """Tokens drafted per step (the method's default when the request did not say)."""
    options: MethodOptions
    """The method's own options (an instance of ``spec.options``: validated, defaults filled)."""
    mode: str = "plain"
    """A key of ``specops.serving.modes.MODES``: ``plain``, ``oneshot``, ``ralm`` or ``knnlm``."""
    cluster: str = "default"
    cluster_source: str = "default"
    """``request`` (the request's field), ``router`` or ``default``."""
    router_version: str = ""
    n_drafts: int = 0
    """Rows per step for a multi-draft method (0: the method's default)."""
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

    def __post_init__(self) -> None:
        assert isinstance(self.options, self.spec.options), (type(self.options), self.spec.name)
        if not isinstance(self.n_drafts, int) or not 0 <= self.n_drafts <= MAX_DRAFTS:
            raise InvalidRequestError(
                f"n_drafts must be an integer in 0..{MAX_DRAFTS}, got {self.n_drafts!r}", "speculation.n_drafts"
            )

    @property
    def method(self) -> str:
        return self.spec.name

    def proposer(self, res: ProposerResources) -> Proposer | None:
        """This request's proposer over ``res`` (None: target-only), with its options and rows."""
        return self.spec.build(self.options, replace(res, n_drafts=self.n_drafts))

    @classmethod
    def plain(
        cls, prompt_ids, params: SamplingParams, *, method: str = "draft", k: int | None = None, **given
    ) -> DecodePlan:
        """A plan for callers without an HTTP body (benchmarks, tests): ``method`` looked up here,
        ``given`` split into plan fields (``n_drafts``, ``references``, ``cluster``, ...) and the
        method's options (``n``, ``pld_max_ngram``, ...; validated by its options model)."""
        spec = method_spec(method)
        names = {f.name for f in fields(cls)}
        plan_fields = {key: v for key, v in given.items() if key in names}
        options = spec.parse_options({key: v for key, v in given.items() if key not in names})
        prompt = tuple(int(t) for t in prompt_ids)
        return cls(prompt, params, spec, k if k is not None else spec.default_k, options, **plan_fields)


def plain_generate(
    engine: SpecEngine,
    prompt_ids,
    params: SamplingParams,
    method: str = "draft",
    *,
    resources: ProposerResources | None = None,
    proposer: Proposer | None = None,
    context_spans: tuple[ContextSpan, ...] = (),
    on_step: Callable | None = None,
    meta: object | None = None,
    prefix_share: PrefixShare | None = None,
    **given,
) -> GenerationResult:
    """One decode on a bare engine, for callers without a plan (tests, benchmarks, the CLI): the
    plan built by :meth:`DecodePlan.plain` (``given``: ``k``, ``n_drafts``, the method's options),
    its proposer over ``resources`` (default: the engine's pair; ``proposer``: a ready one),
    then ``SpecEngine.generate``."""
    from specops.serving.engine.spec import RequestHooks

    proposer, k = _proposer(engine, prompt_ids, params, method, resources, proposer, given)
    hooks = RequestHooks(on_step=on_step, meta=meta, prefix_share=prefix_share)
    return engine.generate(list(prompt_ids), params, proposer, k, tuple(context_spans), hooks)


def plain_session(
    engine: SpecEngine,
    prompt_ids,
    params: SamplingParams,
    method: str = "draft",
    *,
    resources: ProposerResources | None = None,
    proposer: Proposer | None = None,
    hold_back: bool = False,
    prefix_share: PrefixShare | None = None,
    **given,
) -> DecodeSession:
    """``SpecEngine.session`` for callers without a plan, as :func:`plain_generate` builds it."""
    proposer, k = _proposer(engine, prompt_ids, params, method, resources, proposer, given)
    return engine.session(list(prompt_ids), params, proposer, k, hold_back=hold_back, prefix_share=prefix_share)


def _proposer(engine, prompt_ids, params, method, resources, proposer, given) -> tuple[Proposer | None, int]:
    k = given.pop("k", None)
    if proposer is not None:  # a ready proposer: the default k of the method it drafts for
        spec = method_spec(proposer.name if proposer.name in CATALOGUE else method)
        return proposer, k if k is not None else spec.default_k
    plan = DecodePlan.plain(prompt_ids, params, method=method, k=k, **given)
    res = resources or ProposerResources(pair=engine.pair)
    res = replace(res, n_drafts=plan.n_drafts)
    return build_proposer(plan.spec, plan.options, res), plan.k


def plain_proposer(res: ProposerResources, method: str = "draft", *, n_drafts: int = 0, **options) -> Proposer | None:
    """``method``'s proposer over ``res`` with ``options`` (its options model's fields) and
    ``n_drafts`` rows, for callers without a plan (tests, benchmarks); its resources checked."""
    spec = method_spec(method)
    return build_proposer(spec, spec.parse_options(options), replace(res, n_drafts=n_drafts))

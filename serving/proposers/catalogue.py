"""The one catalogue of decoding methods: each method's name, default k, what it needs, and
how to build its proposer.

Everything that names a method derives from :data:`CATALOGUE`, read when asked (so a method
:func:`register`-ed at run time is everywhere at once): the API's and config's allowed values
(``specops.serving.http.schema``, ``specops.serving.http.config``), the CLI's ``--method`` choices, the
metrics labels, ``auto``'s candidates (:attr:`MethodSpec.joins_auto`), which artifact's live
acceptance a request feeds, and the engine's default k. What differs between methods is a
capability on its :class:`MethodSpec`, never a test of its name. Adding a method is one
:class:`MethodSpec` (here, or :func:`register` from anywhere) plus its proposer module.

A proposer is built per request from a :class:`ProposerResources`: the model pair with the
cluster's current draft, and whatever else the method needs (a datastore, references).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specops.core.errors import InvalidRequestError

if TYPE_CHECKING:  # the catalogue itself stays light: the CLI builds its --help from it without torch
    from specops.core.models import ModelPair
    from specops.serving.engine.types import RequestStats
    from specops.serving.proposers.base import Proposer

NEEDS = ("draft_model", "target_hidden", "references", "datastore")
"""What a method may need: a draft model (the cluster's), the target's last hidden state
after each step (retrieval keyed on it), reference texts given with the request, a datastore."""


@dataclass(frozen=True)
class ProposerResources:
    """What one request's proposer may draw on (the serving node builds one per request)."""

    pair: ModelPair
    """The target, and the cluster's current draft model (or None)."""
    cluster: str = "default"
    datastore: object | None = None
    """The cluster's retrieval datastore, for methods that need one."""
    references: tuple[tuple[int, ...], ...] = ()
    """Reference token ids given with the request (and earlier chat turns), for methods that
    copy from them."""
    retrieved: tuple[tuple[int, ...], ...] = ()
    """Passages a one-shot retrieval put before the prompt (copy sources labelled ``retrieved``)."""
    reference_indexes: tuple[object, ...] = ()
    """Prebuilt, shared copy sources (``specops.core.sessions.ngram.NgramIndex``): the cluster's
    past sessions."""
    versions: dict[str, str] = field(default_factory=dict)
    """Artifact kind -> registry version in use, e.g. ``{"draft": "3"}``."""
    policy: object | None = None
    """The replica's ``specops.core.auto_policy.AutoPolicy`` for method ``auto`` (None: the process's
    default policy)."""
    model_lm: Callable[[object], object] | None = None
    """Builds a request's cache over a draft model (``TargetBatcher.lm``: its passes run on the
    batcher's thread, batched across requests); None: a plain ``CachedLM`` on the request's thread."""


LLMA_MAX_N = 8
"""LLMA indexes n-grams up to this length; longer matches rank by extending back."""

MAX_DRAFTS = 64
"""Most rows one step may draft (a tree of up to ``MAX_DRAFTS * k`` nodes in one target pass)."""


@dataclass(frozen=True)
class ProposerConfig:
    """Per-request method settings: which method, and its knobs."""

    method: str = "draft"
    """One of :data:`METHODS`."""
    pld_max_ngram: int = 3
    """Longest trailing n-gram prompt lookup tries to match."""
    pld_min_ngram: int = 1
    """Shortest n-gram prompt lookup accepts."""
    draft_confidence: float = 0.0
    """Draft model: stop drafting when its top probability drops below this (0 = off)."""
    adaptive_k: bool = False
    """Draft model: adapt k per step within 1..k (+2 after full acceptance, -1 otherwise)."""
    n_drafts: int = 0
    """Rows drafted per step by multi-draft methods (DReSD); 0 = the datastore's measured shape
    (rows, and tokens per row at most), else the method's default."""
    search_k: int = 0
    """DReSD: neighbours searched before the first-token filter; 0 = max(32, 8 * n_drafts)."""
    llma_min_n: int = 1
    """LLMA: the shortest trailing match that triggers a copy (the paper's n; 1 was its best)."""
    llma_fixed_k: bool = False
    """LLMA: copy ``k`` tokens at every match (the paper's rule); False (serving's default): the
    copy grows with the match (``serving.proposers.llma.COPY_FACTOR``), at most ``k``, and stops
    where equally good matches disagree."""

    def __post_init__(self) -> None:
        method_spec(self.method)
        if not isinstance(self.n_drafts, int) or not 0 <= self.n_drafts <= MAX_DRAFTS:
            raise InvalidRequestError(
                f"n_drafts must be an integer in 0..{MAX_DRAFTS}, got {self.n_drafts!r}", "speculation.n_drafts"
            )
        if not isinstance(self.search_k, int) or not 0 <= self.search_k <= 4096:
            raise InvalidRequestError(
                f"search_k must be an integer in 0..4096, got {self.search_k!r}", "speculation.search_k"
            )
        if not isinstance(self.llma_min_n, int) or not 1 <= self.llma_min_n <= LLMA_MAX_N:
            raise InvalidRequestError(
                f"n must be an integer in 1..{LLMA_MAX_N}, got {self.llma_min_n!r}", "speculation.n"
            )


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method."""

    name: str
    description: str
    """One line, shown by ``--help`` and the API docs."""
    default_k: int
    """Tokens drafted per step when the request does not say."""
    needs: frozenset[str]
    """Of :data:`NEEDS`."""
    artifact: str | None
    """The registry artifact kind whose version labels this method's metrics and receives its
    live acceptance (``draft`` for the draft model); None when the method has no artifact."""
    default_n_drafts: int = 1
    """Rows per step when the request does not say (1: a chain)."""
    build: Callable[[ProposerConfig, ProposerResources], Proposer | None] = lambda cfg, res: None
    drafts: bool = True
    """False for target-only decoding: a request's ``speculation`` knobs then mean nothing."""
    copies_references: bool = False
    """It copies from reference texts: the request's ``references``, earlier chat turns, one-shot
    retrieved passages and the cluster's past sessions reach it, and ``speculation.n`` applies."""
    joins_auto: bool = False
    """``auto`` may choose it per step (``auto``'s candidates are the methods with this set)."""
    stats_block: Callable[[RequestStats], dict | None] = lambda stats: None
    """The method's own block of the response's ``speculation`` (under its name), or None."""
    parts: Callable[[RequestStats], dict[str, tuple[int, int]]] | None = None
    """For a method that decodes with other methods step by step (``auto``): (drafted, accepted)
    of each method it used, so artifacts, metrics and live acceptance go to the one that drafted."""
    count: Callable[[str, RequestStats, object], None] | None = None
    """The method's own Prometheus metrics for one request: ``count(cluster, stats, policy)``
    (``policy``: the replica's ``auto`` policy)."""
    served_n_drafts: Callable[[ProposerResources, int], int] | None = None
    """Rows per step it actually drafted, given the resources and the rows asked for (0: its default)."""

    def __post_init__(self) -> None:
        assert self.needs <= set(NEEDS), self.needs
        assert self.default_k >= 1, self.default_k

    @property
    def retrieval_loop(self) -> bool:
        """It can decode between the retrievals of a RaLM loop: one chain, no cluster datastore."""
        return self.default_n_drafts <= 1 and "datastore" not in self.needs

    def split(self, stats: RequestStats) -> dict[str, tuple[int, int]]:
        """(drafted, accepted) per method used in this request (itself, or its parts)."""
        if self.parts is not None:
            return self.parts(stats)
        return {self.name: (stats.num_drafted, stats.num_accepted)}


def _build_draft(cfg: ProposerConfig, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.draft_model import DraftModelProposer

    return DraftModelProposer(
        res.pair.draft, confidence_threshold=cfg.draft_confidence, adaptive_k=cfg.adaptive_k, lm_factory=res.model_lm
    )


def _build_pld(cfg: ProposerConfig, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.prompt_lookup import PromptLookupProposer

    return PromptLookupProposer(cfg.pld_max_ngram, cfg.pld_min_ngram)


def _build_dresd(cfg: ProposerConfig, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.dresd import DReSDProposer

    return DReSDProposer(res.datastore, n_drafts=cfg.n_drafts, search_k=cfg.search_k)  # 0: the datastore's shape


def _build_retrieval(cfg: ProposerConfig, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.retrieval import RetrievalProposer

    return RetrievalProposer(res.datastore, n_drafts=cfg.n_drafts, search_k=cfg.search_k)


def _build_llma(cfg: ProposerConfig, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.llma import LLMAProposer, ReferenceSet

    refs = ReferenceSet.from_docs(res.references, max_n=LLMA_MAX_N)
    refs = refs.plus(ReferenceSet.from_docs(res.retrieved, max_n=LLMA_MAX_N, source="retrieved"))
    past = ReferenceSet(res.reference_indexes, ["sessions"] * len(res.reference_indexes))
    from specops.serving.proposers.llma import SERVING_RULE

    adaptive = {} if cfg.llma_fixed_k else SERVING_RULE
    return LLMAProposer(refs.plus(past), min_n=cfg.llma_min_n, max_n=LLMA_MAX_N, n_drafts=cfg.n_drafts or 1, **adaptive)


def _llma_stats(stats: RequestStats) -> dict | None:
    return dict(stats.proposer) if stats.proposer else None  # steps, hits (per source), reference tokens


def _auto_stats(stats: RequestStats) -> dict | None:
    return stats.policy or None  # steps, drafted, accepted per method; the latest decision and its estimates


def _auto_parts(stats: RequestStats) -> dict[str, tuple[int, int]]:
    per = (stats.policy or {}).get("methods", {})
    return {m: (n["drafted"], n["accepted"]) for m, n in per.items()}


def _count_llma(cluster: str, stats: RequestStats, policy) -> None:
    from specops.serving.metrics import count_llma

    count_llma(cluster, stats)


def _count_auto(cluster: str, stats: RequestStats, policy) -> None:
    from specops.serving.metrics import count_auto

    count_auto(cluster, stats, policy)


def _dresd_rows(res: ProposerResources, n_drafts: int) -> int:
    from specops.serving.proposers.dresd import resolve_shape

    return resolve_shape(res.datastore, n_drafts)[0] if res.datastore is not None else n_drafts


def _build_auto(cfg: ProposerConfig, res: ProposerResources) -> Proposer:
    """``auto`` over its candidates: the methods with ``joins_auto`` (those in the policy's
    ``candidates`` when it restricts them), each built by its own ``build`` when ``res`` has
    what it needs."""
    from specops.serving.proposers.auto import AutoProposer, default_policy

    policy = res.policy or default_policy()
    allowed = getattr(policy, "candidates", None)
    specs = [s for s in CATALOGUE.values() if s.joins_auto and (allowed is None or s.name in allowed)]
    subs: dict[str, Proposer] = {}
    for spec in specs:
        try:
            check_resources(spec, res)
        except InvalidRequestError:  # not for this request (no draft model, no datastore): not a candidate
            continue
        sub = spec.build(cfg, res)
        if sub is not None:
            subs[spec.name] = sub
    return AutoProposer(policy, subs, {s.name: s for s in specs}, cluster=res.cluster)


# Default k: a model draft pays one draft forward per token, so it drafts few; a lookup copy
# is free, so it drafts as many as HF's prompt lookup does (``prompt_lookup_num_tokens=10``);
# LLMA's 16 is a cap (the paper's best k was 15-18): its copy length grows with the match.
# The draft's 3 is the k that measured fastest with the default SmolLM2 pair (k = 2, 3, 4 on
# held-out code: 1.13x, 1.24x, 1.01x target-only, 5 prompts; benchmarks/spec_decode.py's
# sweep re-measures it).
CATALOGUE: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            "target", "target-only decoding, the reference every method must equal", 1, frozenset(), None, drafts=False
        ),
        MethodSpec(
            "draft",
            "speculative decoding with the cluster's draft model (OSD)",
            3,
            frozenset({"draft_model"}),
            "draft",
            build=_build_draft,
            joins_auto=True,
        ),
        MethodSpec(
            "pld",
            "prompt-lookup decoding: copy what followed the trailing n-gram in the context",
            10,
            frozenset(),
            None,
            build=_build_pld,
        ),
        MethodSpec(
            "dresd",
            "DReSD: drafts retrieved from the cluster's datastore by the target's hidden state",
            10,
            frozenset({"datastore", "target_hidden"}),
            "datastore",
            default_n_drafts=3,
            build=_build_dresd,
            joins_auto=True,
            served_n_drafts=_dresd_rows,
        ),
        MethodSpec(
            "retrieval",
            "the datastore's exact suffix matches (REST's rule), with DReSD's dense neighbours where "
            "the match is short or absent, in one token tree",
            10,
            frozenset({"datastore", "target_hidden"}),
            "datastore",
            default_n_drafts=3,
            build=_build_retrieval,
            joins_auto=True,
            served_n_drafts=_dresd_rows,
        ),
        MethodSpec(
            "llma",
            "LLMA: copy from references, retrieved passages, past sessions and the context",
            16,
            frozenset(),
            None,
            build=_build_llma,
            copies_references=True,
            joins_auto=True,
            stats_block=_llma_stats,
            count=_count_llma,
        ),
        MethodSpec(
            "auto",
            "choose per step among target-only, the draft model, DReSD and LLMA copying (and "
            "k) by measured speed; speculation off when nothing pays",
            16,
            frozenset(),
            None,
            build=_build_auto,
            copies_references=True,
            stats_block=_auto_stats,
            parts=_auto_parts,
            count=_count_auto,
        ),
    )
}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to the catalogue at run time (a plugin, a test); its name must be new."""
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"register takes a MethodSpec, got {type(spec).__name__}")
    if spec.name in CATALOGUE:
        raise ValueError(f"method {spec.name!r} is already in the catalogue")
    CATALOGUE[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Take a :func:`register`-ed method out again (unknown names are ignored)."""
    CATALOGUE.pop(name, None)


def methods() -> tuple[str, ...]:
    """The method names, in catalogue order, as of now."""
    return tuple(CATALOGUE)


class _Names(Sequence):
    """:data:`METHODS`: the catalogue's names, read on every use (compares equal to the tuple)."""

    def __getitem__(self, i):
        return methods()[i]

    def __len__(self) -> int:
        return len(CATALOGUE)

    def __contains__(self, name) -> bool:
        return name in CATALOGUE

    def __eq__(self, other) -> bool:
        return methods() == (tuple(other) if isinstance(other, (tuple, list, _Names)) else other)

    def __hash__(self) -> int:
        return hash(methods())

    def __repr__(self) -> str:
        return repr(methods())


class _DefaultK(Mapping):
    """:data:`DEFAULT_K`: each method's default k, read from the catalogue on every use."""

    def __getitem__(self, name: str) -> int:
        return CATALOGUE[name].default_k

    def __iter__(self) -> Iterator[str]:
        return iter(methods())

    def __len__(self) -> int:
        return len(CATALOGUE)


METHODS: Sequence[str] = _Names()
DEFAULT_K: Mapping[str, int] = _DefaultK()


def method_spec(name: str) -> MethodSpec:
    """The catalogue entry of ``name``; an unknown name is the caller's error, naming the choices."""
    spec = CATALOGUE.get(name) if isinstance(name, str) else None
    if spec is None:
        raise InvalidRequestError(
            f"unknown method {name!r}; choose one of {', '.join(methods())}", "speculation.method"
        )
    return spec


def check_resources(spec: MethodSpec, res: ProposerResources) -> None:
    """Raise the caller's error when ``res`` lacks something ``spec`` needs."""
    if "draft_model" in spec.needs and res.pair.draft is None:
        raise InvalidRequestError(f"method {spec.name!r} needs a draft model; none is loaded", "speculation.method")
    if "datastore" in spec.needs and res.datastore is None:
        raise InvalidRequestError(
            f"method {spec.name!r} needs a datastore for cluster {res.cluster!r}; none is loaded", "speculation.method"
        )
    if "references" in spec.needs and not res.references:
        raise InvalidRequestError(
            f"method {spec.name!r} needs reference texts; the request gives none", "speculation.references"
        )


def build_proposer(cfg: ProposerConfig, res: ProposerResources) -> Proposer | None:
    """The proposer for ``cfg.method`` over ``res``, or None for target-only decoding."""
    spec = method_spec(cfg.method)
    check_resources(spec, res)
    return spec.build(cfg, res)


def describe() -> str:
    """``name: description`` lines, for ``--help``."""
    return "; ".join(f"{s.name}: {s.description} (k={s.default_k})" for s in CATALOGUE.values())

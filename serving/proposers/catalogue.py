"""The one catalogue of decoding methods: each method's name, default k, what it needs, and
how to build its proposer.

Everything that names a method derives from :data:`CATALOGUE`, read when asked (so a method
:func:`register`-ed at run time is everywhere at once): the API's and config's allowed values
(``specops.serving.http.schema``, ``specops.serving.http.config``), the CLI's ``--method`` choices, the
metrics labels, ``auto``'s candidates (:attr:`MethodSpec.joins_auto`), which artifact's live
acceptance a request feeds, the default k, the API's ``speculation`` schema and the docs' table
of methods (:func:`method_table`). What differs between methods is a capability on its
:class:`MethodSpec`, never a test of its name. Each method owns its request options: its
:attr:`MethodSpec.options` is a pydantic model (:class:`MethodOptions`) with their defaults and
bounds, which the plan validates once (:meth:`MethodSpec.parse_options`) and its proposer reads.
Adding a method is one module (its proposer, its options, its :class:`MethodSpec`, then
:func:`register`) plus its test (``docs/architecture.md``, "Adding a drafter").

A proposer is built per request from the plan (``specops.serving.plan.DecodePlan.proposer``):
``spec.build(options, res)`` over a :class:`ProposerResources`, the model pair with the
cluster's current draft and whatever else the method needs (a datastore, references).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specops.core.errors import InvalidRequestError

if TYPE_CHECKING:  # the catalogue itself stays light: the CLI builds its --help from it without torch
    from specops.core.models import ModelPair
    from specops.serving.engine.proposer import Proposer
    from specops.serving.engine.types import RequestStats

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
    n_drafts: int = 0
    """Rows per step the request asked for (the plan's ``n_drafts``; 0: the method's default)."""
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


class OptionError(ValueError):
    """What an options model's check across fields raises: ``field`` names the one to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class MethodOptions(BaseModel):
    """A method's own request options (``speculation.<field>`` in the API): each method's
    :attr:`MethodSpec.options` subclasses this with its fields, their defaults and bounds, and
    its proposer reads them. Types are strict, as the API's are; unknown fields are refused."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )


class NoOptions(MethodOptions):
    """A method without options of its own."""


class DraftOptions(MethodOptions):
    """The draft model's options."""

    draft_confidence: float = Field(0.0, ge=0.0, lt=1.0)
    """Stop drafting when the draft's top probability drops below this (0 = off)."""
    adaptive_k: bool = False
    """Adapt k per step within 1..k (+2 after full acceptance, -1 otherwise)."""


class PromptLookupOptions(MethodOptions):
    """Prompt lookup's options."""

    pld_max_ngram: int = Field(3, ge=1, le=64)
    """Longest trailing n-gram prompt lookup tries to match."""
    pld_min_ngram: int = Field(1, ge=1, le=64)
    """Shortest n-gram prompt lookup accepts (at most ``pld_max_ngram``)."""

    @model_validator(mode="after")
    def _ordered(self) -> PromptLookupOptions:
        if self.pld_min_ngram > self.pld_max_ngram:
            raise OptionError(
                "pld_min_ngram",
                f"pld_min_ngram ({self.pld_min_ngram}) is more than pld_max_ngram ({self.pld_max_ngram})",
            )
        return self


class DatastoreOptions(MethodOptions):
    """The options of the methods that draft from the cluster's datastore (DReSD, the hybrid)."""

    search_k: int = Field(0, ge=0, le=4096)
    """Neighbours searched before the first-token filter; 0 = max(32, 8 * n_drafts)."""


class RetrievalOptions(DatastoreOptions):
    """The hybrid's options: when DReSD's rows join, and how big its exact trie is."""

    dense_below: int | None = Field(None, ge=0, le=17)
    """DReSD's rows join where the longer exact match (datastore or context) is shorter than this
    (0: never, 17: always); null = serving's default, chosen on 2 CPU cores (on a GPU, where a
    verified node costs little, dense rows at 6 or 17 accept more)."""
    exact_nodes: int | None = Field(None, ge=1, le=256)
    """Trie nodes kept from the datastore's exact match (REST's ``choices``, 64 on a GPU); null = serving's default."""


class LlmaOptions(MethodOptions):
    """LLMA's options (``auto`` takes ``n`` too, for the LLMA copying it may choose)."""

    n: int = Field(1, ge=1, le=LLMA_MAX_N)
    """The shortest trailing match, in tokens, that triggers a copy (the paper's n; 1 was its best)."""
    fixed_k: bool = False
    """Copy ``k`` tokens at every match (the paper's rule); false (serving's default): every
    match length up to 64 tokens is scored by how often its continuations recur
    (SuffixDecoding's rule), the copy grows with the match, at most ``k``, and stops where its
    probability falls too low."""


class AutoOptions(MethodOptions):
    """``auto``'s options: handed on to the candidates whose options have the same field."""

    n: int = Field(1, ge=1, le=LLMA_MAX_N)
    """LLMA copying: the shortest trailing match that triggers a copy."""


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
    build: Callable[[Any, ProposerResources], Proposer | None] = lambda options, res: None
    """Its proposer for one request: ``build(options, res)`` (``options``: an instance of :attr:`options`)."""
    options: type[MethodOptions] = NoOptions
    """Its request options (``speculation.<field>``): fields, defaults and bounds; its proposer reads them."""
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

    def parse_options(self, given: Mapping[str, object] | None = None) -> MethodOptions:
        """Its options from a request's ``speculation`` fields (``given``; absent ones get their
        defaults); a value out of bounds, or a field another method owns, is the caller's 400
        naming ``speculation.<field>``."""
        given = dict(given or {})
        for name in given:
            if name not in self.options.model_fields:
                owners = " or ".join(repr(s.name) for s in CATALOGUE.values() if name in s.options.model_fields)
                what = f"an option of method {owners}" if owners else "not an option of any method"
                raise InvalidRequestError(
                    f"speculation.{name} is {what}; method {self.name!r} has none", f"speculation.{name}"
                )
        try:
            return self.options.model_validate(given)
        except ValidationError as exc:
            err = exc.errors()[0]
            cause = (err.get("ctx") or {}).get("error")
            where = cause.field if isinstance(cause, OptionError) else ".".join(str(p) for p in err.get("loc", ()))
            msg = str(cause) if isinstance(cause, OptionError) else f"{err.get('msg', 'invalid value')}"
            raise InvalidRequestError(
                f"speculation.{where}: {msg} (method {self.name!r})", f"speculation.{where}"
            ) from None


def _build_draft(opts: DraftOptions, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.draft_model import DraftModelProposer

    return DraftModelProposer(
        res.pair.draft, confidence_threshold=opts.draft_confidence, adaptive_k=opts.adaptive_k, lm_factory=res.model_lm
    )


def _build_pld(opts: PromptLookupOptions, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.prompt_lookup import PromptLookupProposer

    return PromptLookupProposer(opts.pld_max_ngram, opts.pld_min_ngram)


def _build_dresd(opts: DatastoreOptions, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.dresd import DReSDProposer

    return DReSDProposer(res.datastore, n_drafts=res.n_drafts, search_k=opts.search_k)  # 0: the datastore's shape


def _build_retrieval(opts: RetrievalOptions, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.retrieval import DENSE_BELOW, EXACT_NODES, RetrievalProposer

    return RetrievalProposer(
        res.datastore,
        n_drafts=res.n_drafts,
        search_k=opts.search_k,
        dense_below=DENSE_BELOW if opts.dense_below is None else opts.dense_below,
        exact_nodes=EXACT_NODES if opts.exact_nodes is None else opts.exact_nodes,
    )


def _build_llma(opts: LlmaOptions, res: ProposerResources) -> Proposer:
    from specops.serving.proposers.llma import SERVING_RULE, LLMAProposer, ReferenceSet

    refs = ReferenceSet.from_docs(res.references, max_n=LLMA_MAX_N)
    refs = refs.plus(ReferenceSet.from_docs(res.retrieved, max_n=LLMA_MAX_N, source="retrieved"))
    past = ReferenceSet(res.reference_indexes, ["sessions"] * len(res.reference_indexes))
    adaptive = {} if opts.fixed_k else SERVING_RULE
    return LLMAProposer(refs.plus(past), min_n=opts.n, max_n=LLMA_MAX_N, n_drafts=res.n_drafts or 1, **adaptive)


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


def _build_auto(opts: AutoOptions, res: ProposerResources) -> Proposer:
    """``auto`` over its candidates: the methods with ``joins_auto`` (those in the policy's
    ``candidates`` when it restricts them), each built by its own ``build`` when ``res`` has
    what it needs, with ``auto``'s options that its options model has too (the rest: defaults)."""
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
        shared = {f: getattr(opts, f) for f in type(opts).model_fields if f in spec.options.model_fields}
        sub = spec.build(spec.options(**shared), res)
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
            options=DraftOptions,
            joins_auto=True,
        ),
        MethodSpec(
            "pld",
            "prompt-lookup decoding: copy what followed the trailing n-gram in the context",
            10,
            frozenset(),
            None,
            build=_build_pld,
            options=PromptLookupOptions,
        ),
        MethodSpec(
            "dresd",
            "DReSD: drafts retrieved from the cluster's datastore by the target's hidden state",
            10,
            frozenset({"datastore", "target_hidden"}),
            "datastore",
            default_n_drafts=3,
            build=_build_dresd,
            options=DatastoreOptions,
            joins_auto=True,
            served_n_drafts=_dresd_rows,
        ),
        MethodSpec(
            "retrieval",
            "the datastore's exact suffix matches (REST's rule) and the request's own context (LLMA's "
            "scored rule), with DReSD's dense neighbours where both matches are short, in one token tree",
            10,
            frozenset({"datastore", "target_hidden"}),
            "datastore",
            default_n_drafts=3,
            build=_build_retrieval,
            options=RetrievalOptions,
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
            options=LlmaOptions,
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
            options=AutoOptions,
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


def build_proposer(spec: MethodSpec, options: MethodOptions, res: ProposerResources) -> Proposer | None:
    """``spec``'s proposer with ``options`` over ``res`` (its resources checked), or None for
    target-only decoding."""
    check_resources(spec, res)
    return spec.build(options, res)


def describe() -> str:
    """``name: description`` lines, for ``--help``."""
    return "; ".join(f"{s.name}: {s.description} (k={s.default_k})" for s in CATALOGUE.values())


def method_table() -> str:
    """The docs' table of methods (``docs/api.md``, between its ``methods`` markers): each method's
    default k, needs and request options with their defaults and bounds, from the catalogue."""
    rows = ["| method | k | needs | options (`speculation.<name>`) | what |", "|---|---|---|---|---|"]
    for spec in CATALOGUE.values():
        opts = []
        for name, prop in spec.options.model_json_schema().get("properties", {}).items():
            lo = prop.get("minimum", prop.get("exclusiveMinimum"))
            hi = prop.get("maximum", f"<{prop['exclusiveMaximum']}" if "exclusiveMaximum" in prop else None)
            bounds = f", {lo}..{hi}" if lo is not None and hi is not None else ""
            what = " ".join(prop.get("description", "").split()).replace("``", "`")
            opts.append(f"`{name}` ({json.dumps(prop.get('default'))}{bounds}): {what}")
        needs = ", ".join(sorted(spec.needs)) or "–"
        rows.append(f"| `{spec.name}` | {spec.default_k} | {needs} | {'<br>'.join(opts) or '–'} | {spec.description} |")
    return "\n".join(rows) + "\n"


TABLE_MARKERS = (
    "<!-- BEGIN methods (written by the method catalogue's method_table; edits inside are overwritten) -->\n",
    "<!-- END methods -->\n",
)


def write_method_table(text: str) -> str:
    """``text`` (a Markdown page) with :func:`method_table` between its :data:`TABLE_MARKERS`."""
    begin, end = TABLE_MARKERS
    head, rest = text.split(begin, 1)
    return head + begin + method_table() + end + rest.split(end, 1)[1]


if __name__ == "__main__":  # python -m specops.serving.proposers.catalogue docs/api.md: rewrite its table
    import sys
    from pathlib import Path

    for arg in sys.argv[1:]:
        Path(arg).write_text(write_method_table(Path(arg).read_text()))

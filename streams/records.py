"""Record schemas of the streams (what serving logs, what the trainer learns from).

Every record is a frozen dataclass with a ``schema`` version and a ``validate()`` that
raises :class:`~specops.streams.errors.RecordValidationError` naming the field and the problem.
Tensors are NumPy arrays with fixed dtypes, so this package never imports torch.
The wire format is in ``specops.streams.codec`` and ``docs/streams.md``.

Terms (the engine's, see ``serving/engine/types.py``): a **rejected position** is the first
drafted position a verification step did not keep; the target emitted its own token
there. Online distillation (OSD Algorithm 1, lines 14-15) learns from the target's
distribution at exactly those positions.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from specops.streams.errors import RecordValidationError

SCHEMA_VERSION = 2
"""Written into every record. Decoders accept this version and older ones.

- 1: the first wire format.
- 2: ``MissRecord`` and ``GenerationRecord`` say what the target saw: ``artifact_versions``
  (artifact kind -> version: the draft, a datastore, a knowledge base) and ``context_spans``
  (which tokens of the context are the prompt, reference texts, retrieved passages). A v1
  record decodes with no artifact versions beyond ``draft_version`` and one prompt span."""

CONTEXT_KINDS = ("prompt", "reference", "retrieved")
"""What a span of a request's context is (``specops.serving.engine.types.CONTEXT_KINDS``)."""
MAX_SPANS = 4096
MAX_ARTIFACTS = 16

DIST_TOPK = "topk"
DIST_FULL = "full"
LOGPROB_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
NORM_TOLERANCE = {np.dtype(np.float32): 1e-3, np.dtype(np.float16): 1e-2}
"""How far ``sum(p) + residual`` may be from 1, per stored log-prob dtype."""
MAX_TOKENS = 1 << 20
"""Sanity bound on the number of tokens in one record."""


def _fail(record: str, name: str, reason: str) -> None:
    raise RecordValidationError(record, name, reason)


def _check_array(record: str, name: str, a: object, dtypes: tuple, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        _fail(record, name, f"expected a numpy array, got {type(a).__name__}")
    assert isinstance(a, np.ndarray)
    if a.dtype not in dtypes:
        _fail(record, name, f"dtype {a.dtype} not allowed (expected {' or '.join(str(d) for d in dtypes)})")
    if a.ndim != ndim:
        _fail(record, name, f"expected {ndim} dimension(s), got shape {a.shape}")
    return a


def _check_ids(record: str, name: str, a: np.ndarray, vocab_size: int) -> None:
    if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab_size):
        _fail(record, name, f"token ids must be in [0, {vocab_size}), got range [{int(a.min())}, {int(a.max())}]")


def _check_str(record: str, name: str, value: object, *, empty_ok: bool = False, max_len: int = 256) -> None:
    if not isinstance(value, str):
        _fail(record, name, f"expected a string, got {type(value).__name__}")
    assert isinstance(value, str)
    if not empty_ok and not value:
        _fail(record, name, "must not be empty")
    if len(value) > max_len:
        _fail(record, name, f"longer than {max_len} characters")


def _check_int(record: str, name: str, value: object, low: int = 0, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(record, name, f"expected an integer, got {type(value).__name__}")
    assert isinstance(value, int)
    if value < low or (high is not None and value > high):
        _fail(record, name, f"{value} is outside [{low}, {high if high is not None else 'inf'}]")


def _check_time(record: str, value: object) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        _fail(record, "timestamp", f"expected finite seconds since the epoch, got {value!r}")


def _check_request(record: str, rec: MissRecord | GenerationRecord) -> None:
    """Fields every per-request record shares: schema, ids, method, drafter."""
    _check_int(record, "schema", rec.schema, 1, SCHEMA_VERSION)
    for name in ("request_id", "cluster", "method"):
        _check_str(record, name, getattr(rec, name))
    _check_str(record, "draft_model", rec.draft_model, empty_ok=True)
    _check_str(record, "draft_version", rec.draft_version, empty_ok=True)
    _check_int(record, "vocab_size", rec.vocab_size, 1, 1 << 24)


CHOICE_SEPARATOR = "#"
"""A request's choices (``n`` > 1) are logged as ``<request id>#<index>`` (a client's request id
never holds ``#``): the trainer's held-out split hashes the part before it, so every choice of a
prompt falls on the same side."""


@dataclass(frozen=True)
class SamplingInfo:
    """The request's sampling parameters (as the engine's ``SamplingParams``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int | None = None

    def validate(self, record: str) -> None:
        t, p = self.temperature, self.top_p
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            _fail(record, "sampling.temperature", f"must be a finite number >= 0, got {t!r}")
        if not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            _fail(record, "sampling.top_p", f"must be in (0, 1], got {p!r}")
        _check_int(record, "sampling.max_new_tokens", self.max_new_tokens, 1)
        if self.seed is not None and not isinstance(self.seed, int):
            _fail(record, "sampling.seed", f"must be an integer or null, got {self.seed!r}")


@dataclass(frozen=True)
class ContextSpan:
    """Tokens ``start .. end-1`` of the context the target saw are of one ``kind``."""

    kind: str
    start: int
    end: int


def _check_context(record: str, rec: MissRecord | GenerationRecord, num_context: int) -> None:
    """``artifact_versions`` is a small str -> str map; ``context_spans`` are sorted,
    non-overlapping spans of known kinds inside the context, one of them the prompt."""
    av = rec.artifact_versions
    if not isinstance(av, dict) or len(av) > MAX_ARTIFACTS:
        _fail(record, "artifact_versions", f"expected a map of at most {MAX_ARTIFACTS} kinds to versions")
    for k, v in av.items():
        _check_str(record, "artifact_versions", k, max_len=32)
        _check_str(record, "artifact_versions", v, empty_ok=True, max_len=64)
    spans = rec.context_spans
    if not isinstance(spans, tuple) or len(spans) > MAX_SPANS:
        _fail(record, "context_spans", f"expected a tuple of at most {MAX_SPANS} spans")
    if not spans:
        return
    end = 0
    for i, span in enumerate(spans):
        if not isinstance(span, ContextSpan) or span.kind not in CONTEXT_KINDS:
            _fail(record, "context_spans", f"span {i} must be a ContextSpan of kind {', '.join(CONTEXT_KINDS)}")
        if not (isinstance(span.start, int) and isinstance(span.end, int)) or not end <= span.start < span.end:
            _fail(record, "context_spans", f"span {i} [{span.start}, {span.end}) overlaps or is out of order")
        end = span.end
    if end > num_context:
        _fail(record, "context_spans", f"spans end at {end}, past the context's {num_context} tokens")
    if not any(s.kind == "prompt" for s in spans):
        _fail(record, "context_spans", "no span is the prompt")


def _spans(rec: MissRecord | GenerationRecord, num_context: int) -> tuple[ContextSpan, ...]:
    return rec.context_spans or (ContextSpan("prompt", 0, num_context),)


@dataclass(frozen=True)
class MissRecord:
    """One finished request and the target's distribution at each rejected position.

    ``token_ids[positions[i]]`` is the token the target emitted at the ``i``-th
    rejected position and ``drafted_tokens[i]`` the draft token it refused there; the
    context the draft should learn to continue is ``token_ids[:positions[i]]``.

    The target distribution at those positions is the target's raw softmax
    (temperature 1, no top-p; the request's own warping is in ``sampling``):

    - ``dist_kind == "topk"`` (default): ``topk_ids`` [m, k] and ``logprobs`` [m, k]
      hold the k most likely tokens and their log-probabilities, sorted from most
      likely down; ``residual`` [m] is the probability mass of every other token,
      ``1 - sum(exp(logprobs[i]))``.
    - ``dist_kind == "full"``: ``logprobs`` [m, vocab_size] is the whole
      log-distribution; ``topk_ids`` and ``residual`` are None.
    """

    TYPE: ClassVar[str] = "MissRecord"

    request_id: str
    cluster: str
    method: str
    """Speculation method that served the request (``draft``, ``pld``, ...)."""
    draft_model: str
    """Name of the drafter, e.g. ``draft-<cluster>``; empty for a draft-free method."""
    draft_version: str
    """Registry version of the drafter actually used; empty when unversioned."""
    sampling: SamplingInfo
    token_ids: np.ndarray
    """[num_prompt_tokens + num_generated] int32, prompt then output."""
    num_prompt_tokens: int
    vocab_size: int
    positions: np.ndarray
    """[m] int32 absolute indices (into ``token_ids``) of the rejected positions, increasing."""
    drafted_tokens: np.ndarray
    """[m] int32 the drafted token refused at each rejected position."""
    dist_kind: str
    logprobs: np.ndarray
    """[m, k] (topk) or [m, vocab_size] (full), float32 or float16."""
    topk_ids: np.ndarray | None
    """[m, k] int32 (topk only)."""
    residual: np.ndarray | None
    """[m] float32 remaining probability mass (topk only)."""
    num_drafted: int
    num_accepted: int
    timestamp: float = field(default_factory=time.time)
    """Seconds since the epoch when the request finished."""
    artifact_versions: dict[str, str] = field(default_factory=dict)
    """Artifact kind -> registry version the request used (``{"draft": "3", "datastore": "2"}``; v2)."""
    context_spans: tuple[ContextSpan, ...] = ()
    """The parts of the context ``token_ids[:num_prompt_tokens]`` (v2; empty: all prompt)."""
    schema: int = SCHEMA_VERSION
    engine: str = ""
    """Who served the request. Empty: our engine, which logged the target's distribution at every
    rejected position. A name (``vllm``): an external engine that hands out no distributions, so
    the record carries none (``m == 0``) and the trainer recomputes the target's distribution by
    a teacher forward (``specops.trainer.data.TargetTeacher``). An optional wire field (``eng``, left out
    when empty): consumers that predate it ignore it, so it needs no schema bump."""

    @property
    def spans(self) -> tuple[ContextSpan, ...]:
        """The context's spans (one prompt span when the record names none)."""
        return _spans(self, self.num_prompt_tokens)

    @property
    def scored(self) -> bool:
        """The record's rejected positions are the served ones, with the target's distribution
        there (our engine). False for an external engine's record: no position was logged, and
        the positions it carries (none) say nothing about where its draft was rejected."""
        return self.engine == ""

    @property
    def num_rejected(self) -> int:
        return int(self.positions.shape[0])

    @property
    def key(self) -> bytes:
        return self.cluster.encode()

    def validate(self) -> None:
        r = self.TYPE
        _check_request(r, self)
        if not isinstance(self.sampling, SamplingInfo):
            _fail(r, "sampling", f"expected SamplingInfo, got {type(self.sampling).__name__}")
        self.sampling.validate(r)
        ids = _check_array(r, "token_ids", self.token_ids, (np.dtype(np.int32),), 1)
        n = ids.shape[0]
        if n > MAX_TOKENS:
            _fail(r, "token_ids", f"{n} tokens exceed the limit of {MAX_TOKENS}")
        _check_ids(r, "token_ids", ids, self.vocab_size)
        _check_int(r, "num_prompt_tokens", self.num_prompt_tokens, 1, n)
        _check_context(r, self, self.num_prompt_tokens)
        pos = _check_array(r, "positions", self.positions, (np.dtype(np.int32),), 1)
        m = pos.shape[0]
        if m and (int(pos[0]) < self.num_prompt_tokens or int(pos[-1]) >= n):
            _fail(
                r,
                "positions",
                f"must lie in the output, [{self.num_prompt_tokens}, {n}); got [{int(pos[0])}, {int(pos[-1])}]",
            )
        if m > 1 and not bool(np.all(np.diff(pos) > 0)):
            _fail(r, "positions", "must be strictly increasing")
        drafted = _check_array(r, "drafted_tokens", self.drafted_tokens, (np.dtype(np.int32),), 1)
        if drafted.shape != (m,):
            _fail(r, "drafted_tokens", f"shape {drafted.shape} does not match positions ({m},)")
        _check_ids(r, "drafted_tokens", drafted, self.vocab_size)
        if m and bool(np.any(drafted == ids[pos])):
            i = int(np.flatnonzero(drafted == ids[pos])[0])
            _fail(
                r,
                "drafted_tokens",
                f"entry {i} equals the emitted token at position {int(pos[i])}; a rejected draft must differ",
            )
        _check_int(r, "num_drafted", self.num_drafted, 0)
        _check_int(r, "num_accepted", self.num_accepted, 0, self.num_drafted)
        if m > self.num_drafted - self.num_accepted:
            _fail(
                r,
                "positions",
                f"{m} rejected positions but only {self.num_drafted - self.num_accepted} drafted tokens were not accepted",
            )
        _check_time(r, self.timestamp)
        _check_str(r, "engine", self.engine, empty_ok=True, max_len=32)
        if self.engine and m:
            _fail(r, "positions", f"engine {self.engine!r} logs no distributions, yet {m} rejected positions came")
        self._validate_distribution(m)

    def _validate_distribution(self, m: int) -> None:
        r = self.TYPE
        lp = _check_array(r, "logprobs", self.logprobs, LOGPROB_DTYPES, 2)
        if lp.shape[0] != m:
            _fail(r, "logprobs", f"{lp.shape[0]} rows for {m} rejected positions")
        if not bool(np.all(np.isfinite(lp))) and self.dist_kind == DIST_TOPK:
            _fail(r, "logprobs", "contains NaN or infinite values")
        if bool(np.any(np.isnan(lp))) or bool(np.any(lp == np.inf)):
            _fail(r, "logprobs", "contains NaN or +inf values")
        tol = NORM_TOLERANCE[lp.dtype]
        if bool(np.any(lp > tol)):
            _fail(r, "logprobs", f"log-probabilities must be <= 0, max is {float(lp.max()):.4g}")
        probs = np.exp(lp.astype(np.float64))
        if self.dist_kind == DIST_TOPK:
            if self.topk_ids is None or self.residual is None:
                _fail(r, "topk_ids", "topk records need topk_ids and residual")
            k = lp.shape[1]
            if not 1 <= k <= self.vocab_size:
                _fail(r, "logprobs", f"k={k} must be in [1, vocab_size={self.vocab_size}]")
            tids = _check_array(r, "topk_ids", self.topk_ids, (np.dtype(np.int32),), 2)
            if tids.shape != lp.shape:
                _fail(r, "topk_ids", f"shape {tids.shape} does not match logprobs {lp.shape}")
            _check_ids(r, "topk_ids", tids, self.vocab_size)
            if m and k > 1 and bool(np.any(np.diff(np.sort(tids, axis=1), axis=1) == 0)):
                _fail(r, "topk_ids", "a row repeats a token id")
            res = _check_array(r, "residual", self.residual, (np.dtype(np.float32),), 1)
            if res.shape != (m,):
                _fail(r, "residual", f"shape {res.shape} does not match positions ({m},)")
            if not bool(np.all(np.isfinite(res))) or bool(np.any(res < 0)) or bool(np.any(res > 1)):
                _fail(r, "residual", "must be finite probabilities in [0, 1]")
            mass = probs.sum(axis=1) + res
        elif self.dist_kind == DIST_FULL:
            if self.topk_ids is not None or self.residual is not None:
                _fail(r, "dist_kind", "full records carry no topk_ids or residual")
            if lp.shape[1] != self.vocab_size:
                _fail(r, "logprobs", f"full distribution has {lp.shape[1]} columns for vocab_size {self.vocab_size}")
            mass = probs.sum(axis=1)
        else:
            _fail(r, "dist_kind", f"must be {DIST_TOPK!r} or {DIST_FULL!r}, got {self.dist_kind!r}")
            return
        if m:
            worst = int(np.argmax(np.abs(mass - 1.0)))
            if abs(float(mass[worst]) - 1.0) > tol:
                _fail(
                    r,
                    "logprobs",
                    f"row {worst} is not normalised: total mass {float(mass[worst]):.6f} (expected 1 +- {tol})",
                )


@dataclass(frozen=True)
class GenerationRecord:
    """Prompt and output of one finished request (for datastore and router rebuilds)."""

    TYPE: ClassVar[str] = "GenerationRecord"

    request_id: str
    cluster: str
    method: str
    draft_model: str
    draft_version: str
    prompt_ids: np.ndarray
    """[num_prompt_tokens] int32."""
    output_ids: np.ndarray
    """[num_generated] int32."""
    vocab_size: int
    finish_reason: str
    """``eos``, ``length`` or ``context`` (as in the engine's stats)."""
    timestamp: float = field(default_factory=time.time)
    artifact_versions: dict[str, str] = field(default_factory=dict)
    """Artifact kind -> registry version the request used (v2)."""
    context_spans: tuple[ContextSpan, ...] = ()
    """The parts of ``prompt_ids`` (the whole context the target saw; v2; empty: all prompt)."""
    policy: dict = field(default_factory=dict)
    """What ``auto`` chose for the request (``specops.serving.proposers.auto.AutoProposer.summary``: steps,
    drafted and accepted per method, the latest decision); empty for fixed methods. An optional
    wire field: consumers that predate it ignore it, so it needs no schema bump."""
    schema: int = SCHEMA_VERSION

    @property
    def spans(self) -> tuple[ContextSpan, ...]:
        return _spans(self, int(self.prompt_ids.shape[0]))

    @property
    def request_prompt_ids(self) -> np.ndarray:
        """The prompt's own tokens: ``prompt_ids`` without reference texts or retrieved passages
        (what routing embeds; the whole context is what the target saw)."""
        parts = [self.prompt_ids[s.start : s.end] for s in self.spans if s.kind == "prompt"]
        return np.concatenate(parts) if parts else self.prompt_ids[:0]

    @property
    def key(self) -> bytes:
        return self.cluster.encode()

    def validate(self) -> None:
        r = self.TYPE
        _check_request(r, self)
        _check_str(r, "finish_reason", self.finish_reason, empty_ok=True, max_len=32)
        for name in ("prompt_ids", "output_ids"):
            a = _check_array(r, name, getattr(self, name), (np.dtype(np.int32),), 1)
            if a.shape[0] > MAX_TOKENS:
                _fail(r, name, f"{a.shape[0]} tokens exceed the limit of {MAX_TOKENS}")
            _check_ids(r, name, a, self.vocab_size)
        if self.prompt_ids.shape[0] == 0:
            _fail(r, "prompt_ids", "must not be empty")
        _check_context(r, self, int(self.prompt_ids.shape[0]))
        _check_time(r, self.timestamp)
        _check_policy(r, self.policy)


POLICY_MAX_BYTES = 16384


def _check_policy(record: str, policy: object) -> None:
    """A small JSON object of string keys (numbers, strings, lists and objects inside)."""
    if not isinstance(policy, dict) or not all(isinstance(k, str) for k in policy):
        _fail(record, "policy", f"expected an object with string keys, got {type(policy).__name__}")
    try:
        size = len(json.dumps(policy, allow_nan=False))
    except (TypeError, ValueError) as exc:
        _fail(record, "policy", f"not JSON: {exc}")
        return
    if size > POLICY_MAX_BYTES:
        _fail(record, "policy", f"{size} bytes of JSON exceed the limit of {POLICY_MAX_BYTES}")


EVENT_KINDS = ("promotion", "rollback")


@dataclass(frozen=True)
class ModelEvent:
    """An alias change in the registry: the push half of hot-swap."""

    TYPE: ClassVar[str] = "ModelEvent"

    kind: str
    """``promotion`` or ``rollback``."""
    model_name: str
    """Registered model, e.g. ``draft-code``."""
    version: str
    """The version the alias points to now."""
    previous_version: str = ""
    alias: str = "champion"
    reason: str = ""
    timestamp: float = field(default_factory=time.time)
    schema: int = SCHEMA_VERSION

    @property
    def key(self) -> bytes:
        return self.model_name.encode()

    def validate(self) -> None:
        r = self.TYPE
        _check_int(r, "schema", self.schema, 1, SCHEMA_VERSION)
        if self.kind not in EVENT_KINDS:
            _fail(r, "kind", f"must be one of {EVENT_KINDS}, got {self.kind!r}")
        _check_str(r, "model_name", self.model_name)
        _check_str(r, "version", self.version)
        _check_str(r, "previous_version", self.previous_version, empty_ok=True)
        _check_str(r, "alias", self.alias)
        _check_str(r, "reason", self.reason, empty_ok=True, max_len=4096)
        _check_time(r, self.timestamp)


@dataclass(frozen=True)
class DeadLetter:
    """An invalid record, exactly as it was read, with where it came from and why."""

    TYPE: ClassVar[str] = "DeadLetter"

    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None
    value: bytes
    """The raw bytes that failed, unmodified."""
    reason: str
    error_type: str
    """Exception class that refused it, e.g. ``RecordValidationError``."""
    consumer_group: str = ""
    timestamp: float = field(default_factory=time.time)
    schema: int = SCHEMA_VERSION

    def validate(self) -> None:
        r = self.TYPE
        _check_int(r, "schema", self.schema, 1, SCHEMA_VERSION)
        _check_str(r, "source_topic", self.source_topic)
        _check_int(r, "source_partition", self.source_partition, 0)
        _check_int(r, "source_offset", self.source_offset, 0)
        if self.key is not None and not isinstance(self.key, bytes):
            _fail(r, "key", "must be bytes or null")
        if not isinstance(self.value, bytes):
            _fail(r, "value", "must be bytes")
        _check_str(r, "reason", self.reason, max_len=4096)
        _check_str(r, "error_type", self.error_type)
        _check_str(r, "consumer_group", self.consumer_group, empty_ok=True)
        _check_time(r, self.timestamp)


Record = MissRecord | GenerationRecord | ModelEvent | DeadLetter

"""Structured output: a request's grammar masks the target at every verified position.

A :class:`GrammarSpec` (a JSON schema, "any JSON object", a regular expression, a list of
choices, or a Lark grammar) is compiled by **llguidance** into a matcher over the model's
tokenizer (:class:`Grammars`, one per tokenizer). Each request gets its own
:class:`Constraint`, which the session uses in three places (and the draft model in a fourth:
``DecodeState.grammar``, its distribution masked at each drafted position, so it proposes only
allowed tokens and a sampled draft's ``q`` is the masked one):

- **before verification** (:meth:`Constraint.prune`): each drafted row is cut at the first
  token the grammar forbids given the tokens before it. Deterministic drafts (retrieval, copy,
  PLD) lose that token and everything after it: the target could never emit it. Drafts sampled
  from a draft model keep that one token (and lose what follows): its rejection then draws the
  bonus from the residual ``norm(max(0, p - q))``, as the rule requires. Dropping it would
  draw from ``p`` instead, which biases the output towards what the draft proposes.
- **in verification** (:meth:`Constraint.allowed`): row ``i`` of the target's pass, scoring the
  position after the committed output and ``d_1 .. d_i`` (a tree node: the path to it), gets
  the grammar's mask in that state; forbidden tokens' logits become ``-inf`` before the
  penalties, the warp and every acceptance rule. Target-only decoding masks its one row the
  same way, so the constrained distribution is the one every rule preserves: greedy outputs are
  identical and sampled ones distributed alike (``tests/serving/engine/test_grammar.py``). A
  row whose path holds a forbidden token (the one kept for a sampled draft) is never reached;
  it is left unmasked.
- **after the verdict** (:meth:`Constraint.commit`): the emitted tokens advance the matcher.
  When the grammar can take no further token (a JSON value closed) the request ends there with
  finish reason ``stop``: the only token left is an end-of-sequence token.

Raw log-probabilities (``logprobs_mode`` ``raw``) are of the masked logits, as vLLM's are (it
applies the grammar's bitmask before its sampler computes them).

Why llguidance (not xgrammar): it is a single self-contained wheel with no dependencies, it
builds a matcher for a new JSON schema in about a millisecond with no per-schema compile step
to cache, its masks take tens of microseconds, its ``validate_tokens`` answers "how many of
these drafted tokens may follow" without changing state (what pruning needs), and its
``rollback`` undoes a step. vLLM ships it as one of its structured-output backends.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass

import torch

from specops.core.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
"""What a :class:`GrammarSpec` holds: any JSON object; a JSON schema (its JSON text); a regular
expression (Rust ``regex`` syntax, anchored at both ends); a JSON list of the exact strings
allowed; a Lark grammar (llguidance's dialect, ``start`` rule first)."""

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON output is laid out: on one line, ``", "`` between items and ``": "`` after keys (Python's
``json.dumps``, what models mostly saw). Free whitespace lets a model pad without end (a small
one does: newlines until ``max_tokens``); a schema's ``x-guidance`` object overrides this."""

MAX_SOURCE_CHARS = 65536
"""Longest schema, expression or grammar a request may send."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint."""

    kind: str
    source: str = ""
    """The schema or the choices as JSON text, the expression, or the grammar (empty for ``json_object``)."""
    field: str = "response_format"
    """The request field it came from (what a 400 about it names)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"{self.field}: grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}", self.field
            )
        if len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(f"{self.field}: at most {MAX_SOURCE_CHARS} characters", self.field)

    def llguidance(self) -> str:
        """The llguidance grammar (its JSON form) this spec stands for."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return LLMatcher.grammar_from_lark(self.source)

    @classmethod
    def choice(cls, choices: list[str], field: str) -> GrammarSpec:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(f"{field}: a non-empty list of non-empty strings", field)
        return cls("choice", json.dumps(choices), field)


class Grammars:
    """Compiles :class:`GrammarSpec` s for one tokenizer (its llguidance view is built once)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        import llguidance.hf

        eos = [int(t) for t in eos_token_ids] or None
        self.vocab_size = int(vocab_size)
        self.eos = frozenset(eos or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []))
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos)

    def check(self, spec: GrammarSpec) -> str:
        """The llguidance grammar of ``spec``, or :class:`InvalidRequestError` naming its field."""
        from llguidance import LLMatcher

        try:
            grammar = spec.llguidance()
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"{spec.field}: {e}", spec.field) from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequestError(f"{spec.field}: {_first_line(error)}", spec.field)
        return grammar

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for one request."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.check(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.field}: {_first_line(matcher.get_error())}", spec.field)
        return Constraint(matcher, self.vocab_size, self.eos)


def _first_line(error: str) -> str:
    """llguidance's message without its source excerpt (the first line says what is wrong)."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    head = lines[0] if lines else "invalid grammar"
    detail = next((ln for ln in lines[1:] if ln.lower().startswith("error:")), "")
    return f"{head} {detail}".strip()


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def for_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | list[int] = ()) -> Grammars:
    """The :class:`Grammars` of ``tokenizer`` (built on first use, kept while the tokenizer lives)."""
    if tokenizer is None:
        raise InvalidRequestError("structured output needs the model's tokenizer, and this model pair has none")
    key = (int(vocab_size), tuple(int(t) for t in eos_token_ids))
    with _CACHE_LOCK:
        per = _CACHE.setdefault(tokenizer, {})
        if key not in per:
            per[key] = Grammars(tokenizer, vocab_size, eos_token_ids)
        return per[key]


_BITS = torch.arange(32, dtype=torch.int32)


class Constraint:
    """One request's grammar state: which tokens may come next (module docstring)."""

    def __init__(self, matcher, vocab_size: int, eos: frozenset[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = eos
        self.num_consumed = 0
        """Output tokens the matcher has taken (an end-of-sequence token is not one of them)."""
        self._words = (vocab_size + 31) // 32

    @property
    def stopped(self) -> bool:
        """The grammar is complete and takes no further token (only an end-of-sequence one)."""
        return bool(self.matcher.is_stopped())

    def _valid(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` may follow in the current state (an EOS ends them, and so does an
        id outside the vocabulary: llguidance would fail the matcher for good)."""
        n = next((i for i, t in enumerate(tokens) if t in self.eos or not 0 <= t < self.vocab_size), len(tokens))
        return int(self.matcher.validate_tokens(tokens[:n])) if n else 0

    def prune(self, proposals, keep_rejected: bool | None = None):
        """``proposals`` with each row cut at its first forbidden token (kept, as a leaf that is
        always rejected, when the drafts were sampled from a draft model: module docstring)."""
        rows = proposals.rows()
        keep = proposals.draft_probs is not None if keep_rejected is None else keep_rejected
        lengths = []
        for row in rows:
            n = self._valid(row)
            lengths.append(n + 1 if keep and n < len(row) else n)
        if lengths == [len(r) for r in rows]:
            return proposals
        return type(proposals)(tokens=proposals.tokens, draft_probs=proposals.draft_probs, lengths=lengths)

    def allowed(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), vocab] bool: the tokens the grammar allows after each path of drafted
        tokens (a path it forbids is unreachable: all allowed). The matcher ends where it began."""
        bitmask = torch.full((len(paths), self._words), -1, dtype=torch.int32)
        consumed: list[int] = []
        m = self.matcher
        try:
            for r, path in enumerate(paths):
                common = 0
                while common < min(len(consumed), len(path)) and consumed[common] == path[common]:
                    common += 1
                if common < len(consumed):
                    m.rollback(len(consumed) - common)
                    consumed = consumed[:common]
                rest = path[common:]
                if rest:
                    if self._valid(rest) < len(rest):
                        continue  # unreachable: left all ones
                    m.consume_tokens(rest)
                    consumed = list(path)
                row = bitmask[r]
                m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        finally:
            if consumed:
                m.rollback(len(consumed))
        if m.is_error():
            raise RuntimeError(f"grammar matcher: {m.get_error()}")
        bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
        return bits.reshape(len(paths), -1)[:, : self.vocab_size].bool()

    def mask(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``logits`` [rows, vocab] with what the grammar forbids after each path set to ``-inf``."""
        allowed = self.allowed(paths)
        if logits.shape[1] > allowed.shape[1]:  # columns past the tokenizer's vocabulary: never allowed
            pad = torch.zeros((allowed.shape[0], logits.shape[1] - allowed.shape[1]), dtype=torch.bool)
            allowed = torch.cat([allowed, pad], dim=1)
        return logits.float().masked_fill(~allowed[:, : logits.shape[1]], float("-inf"))

    def commit(self, tokens: list[int]) -> int:
        """Advance over emitted tokens (each was allowed: the verifier masked its row). Returns how
        many of them stand: up to an EOS, or to the token that completed the grammar, included."""
        for i, t in enumerate(tokens):
            if t in self.eos:
                return i + 1  # the request ends at it; the matcher keeps no history of it
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"grammar matcher refused emitted token {t}: {self.matcher.get_error()}")
            self.num_consumed += 1
            if self.matcher.is_stopped():
                return i + 1
        return len(tokens)

    def truncate(self, num_output_tokens: int) -> None:
        """Withdraw output tokens past the first ``num_output_tokens`` (the session rolled back)."""
        if num_output_tokens < self.num_consumed:
            self.matcher.rollback(self.num_consumed - num_output_tokens)
            self.num_consumed = num_output_tokens

"""Typed payloads that cross the engine's seams.

Vocabulary used across the engine (defined once, here):

- **committed** tokens: prompt plus every token already emitted. They never change.
- **drafted** tokens: what a proposer suggests for the next positions, ``k`` at most.
- **accepted** tokens: the leading drafted tokens the verifier keeps.
- **rejected** position: the first drafted position the verifier does not keep; the
  target's distribution there is what online distillation learns from.
- **bonus** token: the one token the target itself emits after the accepted prefix,
  at every verification step (the correction at a rejected position, or one extra
  token when every draft was accepted). A step therefore emits ``accepted + 1`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specops.core.errors import InvalidRequestError
from specops.serving.engine.grammar import GrammarSpec

MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for (OpenAI's ``top_logprobs`` bound)."""
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target and its most probable alternatives."""

    token: int
    logprob: float | None
    """None only for the first token of a prompt, which nothing before it predicts."""
    top: tuple[tuple[int, float], ...] = ()
    """``(token, logprob)`` of the ``SamplingParams.logprobs`` most probable tokens, most probable first."""


class Emitted(list):
    """Tokens that became final in one step, as an ``on_step`` callback gets them: a plain list
    of ids, with ``logprobs`` (one :class:`TokenLogprob` per token) when the request asked for
    them, else None. A list, so every ``on_step`` that only reads ids is unchanged."""

    def __init__(
        self,
        tokens=(),
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
        context_len: int = 0,
    ) -> None:
        super().__init__(tokens)
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        """The first step's only: the context's log-probabilities (``SamplingParams.prompt_logprobs``)."""
        self.context_len = context_len
        """With ``prompt_logprobs``: the context's length (they hold one per token after the first)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes."""

    temperature: float = 0.0
    """0 means greedy (argmax); otherwise the softmax temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it. Ignored when greedy."""
    max_new_tokens: int = 64
    """Upper bound on emitted tokens."""
    seed: int | None = None
    """Seed of the request's own random generator (sampling only)."""
    top_k: int = 0
    """Keep the ``top_k`` most probable tokens (ties with the last one kept too); 0 disables it."""
    min_p: float = 0.0
    """Keep tokens whose probability is at least ``min_p`` times the top token's, in [0, 1]; 0 disables it."""
    logprobs: int | None = None
    """None: off. ``n`` in 0..:data:`MAX_LOGPROBS`: each emitted token's log-probability under the
    target, with its ``n`` most probable alternatives, from the verification pass that emitted it
    (``specops.serving.engine.sampling.token_logprobs``)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the output holds, in [-2, 2] (``specops.serving.engine.processors``)."""
    frequency_penalty: float = 0.0
    """OpenAI's: times the token's count in the output, subtracted from its logit, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """vLLM's/HF's: a logit of a token in the context or the output divided by it (positive) or
    multiplied (not), in (0, 2]; 1 is off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's: ``(token, bias)`` pairs added to the logits, bias in [-100, 100]."""
    min_tokens: int = 0
    """vLLM's: the EOS tokens cannot be emitted before this many output tokens."""
    ignore_eos: bool = False
    """vLLM's: an EOS token does not end the request (it runs to ``max_new_tokens``)."""
    prompt_logprobs: int | None = None
    """None: off. ``n`` in 0..:data:`MAX_LOGPROBS`: the same for every prompt token after the first,
    from the prefill (``DecodeSession.start``; the completions API's ``echo`` with ``logprobs``)."""
    logprobs_mode: str = "raw"
    """``raw``: log-softmax of the target's logits (vLLM's default, ``raw_logprobs``); ``processed``:
    of the distribution the token was drawn from (temperature, min-p, top-k, top-p applied; a
    token they drop has ``-inf``). Greedy requests get ``raw`` either way, as vLLM's."""
    grammar: GrammarSpec | None = None
    """Structured output: the grammar every output token must follow (``specops.serving.engine.grammar``)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and -2.0 <= v <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not (isinstance(rp, (int, float)) and math.isfinite(rp) and 0.0 < rp <= 2.0):
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2] (1 = off), got {rp!r}")
        if any(not (math.isfinite(b) and -100.0 <= b <= 100.0) for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
            )
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


CONTEXT_KINDS = ("prompt", "reference", "retrieved")
"""What a span of the context is: the request's prompt, a reference text given with it (to
copy from), or a passage retrieved for it."""


@dataclass(frozen=True)
class ContextSpan:
    """Tokens ``start .. end-1`` of the context the target saw are of one ``kind``."""

    kind: str
    start: int
    end: int

    def __post_init__(self) -> None:
        assert self.kind in CONTEXT_KINDS, self.kind
        assert 0 <= self.start < self.end, (self.start, self.end)


@dataclass
class DecodeState:
    """One request's committed sequence, shared by proposer and verifier.

    ``token_ids`` is the **context** (``num_prompt_tokens`` tokens: references or retrieved
    passages and the prompt, described by ``context_spans``) followed by the **output**
    emitted so far. Output tokens ``0 .. num_final-1`` are **final**; the rest are
    **tentative**: a check that is still pending (a speculated retrieval) may roll them back,
    so a caller that streams output sends only final tokens.
    """

    token_ids: list[int]
    """Committed tokens: context followed by everything emitted so far."""
    num_prompt_tokens: int
    """Context length (every span, the prompt included)."""
    params: SamplingParams
    generator: torch.Generator | None = None
    """Per-request RNG for sampling; None when greedy."""
    context_spans: tuple[ContextSpan, ...] = ()
    """The context's parts; empty means one prompt span over the whole context."""
    num_final: int = 0
    """Output tokens that can no longer be rolled back."""
    grammar: object | None = None
    """The request's structured-output matcher (``specops.serving.engine.grammar.Constraint``), or None: a
    draft model drafts only what it allows (the session prunes every other proposer's drafts)."""

    def __post_init__(self) -> None:
        if not self.context_spans and self.num_prompt_tokens:
            self.context_spans = (ContextSpan("prompt", 0, self.num_prompt_tokens),)
        assert self.context_spans[-1].end == self.num_prompt_tokens if self.context_spans else True

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tentative(self) -> int:
        return self.num_generated - self.num_final


@dataclass
class Proposals:
    """Candidate continuations from one proposer call: one row (a chain) or several (a tree).

    Several rows are merged into a token tree (``specops.serving.engine.tree``): rows sharing a
    prefix share its nodes, and one target pass verifies them all.
    """

    tokens: torch.Tensor
    """[n_drafts, k] int64 drafted token ids (k may be 0: nothing to propose); rows shorter
    than k are right-padded (see ``lengths``)."""
    draft_probs: torch.Tensor | None = None
    """[n_drafts, k, vocab] float32 draft distributions the tokens were sampled from (rows
    drawn independently, so rows sharing a prefix are i.i.d. draws after it); None for
    deterministic (retrieval / copy) proposers."""
    lengths: list[int] | None = None
    """Valid tokens of each row (None: every row has k)."""

    def __post_init__(self) -> None:
        assert self.tokens.ndim == 2 and self.tokens.dtype == torch.long, self.tokens.shape
        if self.draft_probs is not None:
            assert self.draft_probs.ndim == 3, self.draft_probs.shape
            assert self.draft_probs.shape[:2] == self.tokens.shape, (self.draft_probs.shape, self.tokens.shape)
        if self.lengths is not None:
            assert len(self.lengths) == self.tokens.shape[0], (self.lengths, self.tokens.shape)
            assert all(0 <= n <= self.tokens.shape[1] for n in self.lengths), (self.lengths, self.tokens.shape)

    @property
    def num_drafts(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def k(self) -> int:
        """Longest row."""
        return max(self.lengths, default=0) if self.lengths is not None else int(self.tokens.shape[1])

    @property
    def is_chain(self) -> bool:
        return self.num_drafts == 1

    def rows(self) -> list[list[int]]:
        """Each row's valid tokens."""
        lengths = self.lengths if self.lengths is not None else [self.tokens.shape[1]] * self.num_drafts
        return [self.tokens[i, :n].tolist() for i, n in enumerate(lengths)]

    @classmethod
    def empty(cls) -> Proposals:
        return cls(tokens=torch.zeros((1, 0), dtype=torch.long))

    @classmethod
    def from_rows(cls, rows: list[list[int]], draft_probs: torch.Tensor | None = None) -> Proposals:
        """Candidate rows of any lengths (at least one row)."""
        assert rows, "at least one row"
        k = max(len(r) for r in rows)
        tokens = torch.zeros((len(rows), k), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return cls(tokens=tokens, draft_probs=draft_probs, lengths=[len(r) for r in rows])


@dataclass
class RejectedPosition:
    """A mis-speculated position and the target's distribution there."""

    index: int
    """Absolute position in the committed sequence (prompt included)."""
    drafted_token: int
    """What the proposer suggested there."""
    emitted_token: int
    """What the target emitted there instead (the bonus token)."""
    target_logits: torch.Tensor
    """[vocab] float32 raw target logits at that position (temperature 1, no top-p)."""


@dataclass(frozen=True)
class TargetPass:
    """The target forward pass that verified one request's step, as it really ran: how many
    requests shared it and how wide it was. The batcher (``engine.batching``) knows it; an
    unbatched target's pass is one row of its own tokens. ``auto`` prices its choices on it."""

    rows: int
    """Requests in the pass (1 unbatched)."""
    width: int
    """The widest row's new tokens (a padded pass computes every row this wide)."""
    mine: int
    """This request's new tokens in it (committed tokens it lacked + drafts or tree nodes)."""
    others: int
    """The other rows' new tokens, summed."""
    widest_other: int
    """The widest other row (0 alone)."""
    ms: float
    """Milliseconds the forward itself took (no queueing)."""
    packed: bool = False
    """The rows ran end to end (``engine.ragged``): the pass computed only their tokens."""

    @property
    def computed_tokens(self) -> int:
        """Token rows the pass's matrix products computed: every row's tokens when packed,
        rows x width when right-padded."""
        return self.mine + self.others if self.packed else self.rows * self.width


@dataclass
class Verdict:
    """Outcome of one verification step (one target forward pass)."""

    accepted: list[int]
    bonus: int
    num_drafted: int
    """Positions drafted: the chain's k; for a tree, its deepest row's length (the most one
    step could accept), so accepted / drafted stays a per-position acceptance rate."""
    rejected: RejectedPosition | None = None
    target_hidden: torch.Tensor | None = None
    """[hidden] target's last hidden state at the position that produced ``bonus``
    (only when the verifier was asked for it; DReSD keys on it)."""
    path: list[int] = field(default_factory=list)
    """The accepted tree nodes, root to leaf (``specops.serving.engine.tree`` numbering; for a
    chain, node ``i`` is draft ``i``, so ``path == [1 .. len(accepted)]``)."""
    num_nodes: int = 0
    """Distinct drafted tokens the target checked (tree nodes; ``num_drafted`` for a chain)."""
    target_pass: TargetPass | None = None
    """The pass that verified this step (rows and width as run), when the target reports it."""
    logprobs: list[TokenLogprob] | None = None
    """One per :attr:`emitted` token, when the request asked for them (``SamplingParams.logprobs``)."""

    @property
    def emitted(self) -> list[int]:
        return [*self.accepted, self.bonus]


def token_alpha(accepted: int, rejected_steps: int) -> float:
    """The OSD paper's per-token acceptance α (§3): the probability that a draft token is
    accepted given that the ones before it in its step were.

    Each step's drafted run is a sequence of Bernoulli(α) trials that stops at the first
    failure or at the end of the run (k tokens, or the request's end): Σ accepted successes
    and one failure per step that ended in a rejection. Their ratio,
    ``accepted / (accepted + rejected_steps)``, is the maximum-likelihood α of that
    truncated geometric process (``tests/serving/engine/test_token_alpha.py`` recovers a known α).
    Accepted ÷ drafted is smaller: it also counts the tokens drafted after a rejection,
    which were never tried. 0 when nothing was tried."""
    tried = accepted + rejected_steps
    return accepted / tried if tried else 0.0


@dataclass
class RequestStats:
    """Per-request counters and stage timings."""

    method: str
    num_prompt_tokens: int = 0
    num_generated: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_target_forwards: int = 0
    """Target forward passes (the first one is also the prefill)."""
    num_verify_steps: int = 0
    num_rejected_steps: int = 0
    """Verification steps that rejected a drafted token (the rest accepted all they checked)."""
    num_draft_forwards: int = 0
    num_rolled_back: int = 0
    """Emitted tokens later withdrawn by ``DecodeSession.rollback_to`` (not in ``num_generated``)."""
    num_prefill_shared: int = 0
    """Prompt tokens this choice loaded from its request's first choice instead of prefilling
    them (``specops.serving.engine.prefix``: ``n`` / ``best_of``)."""
    finish_reason: str = ""
    """``eos``, ``length`` (max_new_tokens), ``context`` (model context full) or ``stop`` (the caller's
    ``on_step`` ended it: a stop sequence)."""
    proposer: dict[str, int] = field(default_factory=dict)
    """The proposer's own counters (``Proposer.counters``; LLMA: steps, hits per copy source)."""
    policy: dict = field(default_factory=dict)
    """What ``auto`` chose (``specops.serving.proposers.auto.AutoProposer.summary``): steps, drafted and
    accepted per method, and the latest decision with its estimates; empty for fixed methods."""
    time_s: dict[str, float] = field(
        default_factory=lambda: {"first_step": 0.0, "propose": 0.0, "verify": 0.0, "total": 0.0}
    )
    """Wall seconds: ``propose`` and ``verify`` summed over steps (the first step of each
    includes its model's prefill), ``first_step`` from start to the first emitted
    tokens, ``total`` for the whole request."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def alpha_token(self) -> float:
        """The OSD paper's per-token α (:func:`token_alpha`)."""
        return token_alpha(self.num_accepted, self.num_rejected_steps)

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per verification step."""
        return self.num_accepted / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.num_generated / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        total = self.time_s.get("total", 0.0)
        return self.num_generated / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated": self.num_generated,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "num_target_forwards": self.num_target_forwards,
            "num_verify_steps": self.num_verify_steps,
            "num_rejected_steps": self.num_rejected_steps,
            "num_draft_forwards": self.num_draft_forwards,
            "num_rolled_back": self.num_rolled_back,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "alpha_token": round(self.alpha_token, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tokens_per_target_forward": round(self.tokens_per_target_forward, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "finish_reason": self.finish_reason,
            **({"policy": self.policy} if self.policy else {}),
            "time_s": {name: round(v, 6) for name, v in self.time_s.items()},
        }


@dataclass
class GenerationResult:
    """What ``SpecEngine.generate`` returns."""

    token_ids: list[int]
    """Emitted tokens only (prompt excluded)."""
    stats: RequestStats
    rejections: list[RejectedPosition] = field(default_factory=list)
    """Every rejected position (only when the engine was asked to collect them)."""
    text: str | None = None
    context_spans: tuple[ContextSpan, ...] = ()
    """The parts of the context the target saw (its first ``stats.num_prompt_tokens`` tokens)."""
    logprobs: list[TokenLogprob] | None = None
    """One per output token, when the request asked for them (``SamplingParams.logprobs``)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """One per context token after the first, when asked for (``SamplingParams.prompt_logprobs``)."""

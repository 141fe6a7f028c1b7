"""One request's decoding as a session of steps: ``start``, ``step``, ``rollback_to``, ``finish``.

A step is one propose + verify + commit (``specops.serving.engine.verifier`` defines the terms). The
session owns what a request needs between steps: its :class:`DecodeState`, the target's KV
cache (through the verifier), the proposer, the RNG, the counters and the stage timings.

**Tentative output.** Output tokens are *final* once nothing can withdraw them. By default
every step's tokens are final at once, which is what plain speculative decoding needs. A
caller that speculates something the target's output depends on (RaLMSpec: a retrieved
passage, checked against the real retrieval later) opens the session with
``hold_back=True``: emitted tokens stay *tentative* until :meth:`DecodeSession.finalize`,
and :meth:`DecodeSession.rollback_to` withdraws tentative ones, rolling the target's and the
proposer's caches back with them. Streaming sends only final tokens.

``SpecEngine.generate`` (``specops.serving.engine.spec``) is the short driver over a session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specops.serving.engine.grammar import Constraint
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.prefix import PrefixShare
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.sampling import token_logprobs
from specops.serving.engine.types import (
    ContextSpan,
    DecodeState,
    GenerationResult,
    Proposals,
    RejectedPosition,
    RequestStats,
    SamplingParams,
    TokenLogprob,
    Verdict,
)
from specops.serving.engine.verifier import Verifier

FINISH_REASONS = ("eos", "length", "context", "stop")


@dataclass(frozen=True)
class StepOutcome:
    """What one step did."""

    emitted: list[int]
    """Tokens this step committed (accepted drafts + bonus, cut after an EOS); empty only
    when the request had already run out of room before the step."""
    verdict: Verdict | None
    """The verifier's verdict (None when no verification ran)."""
    final: list[int] = field(default_factory=list)
    """Tokens that became final with this step: ``emitted`` unless the session holds output back."""
    finish_reason: str = ""
    """Set when the request is finished: ``eos``, ``length`` or ``context``."""
    propose_s: float = 0.0
    verify_s: float = 0.0
    final_logprobs: list[TokenLogprob] | None = None
    """One per ``final`` token, when the request asked for log-probabilities."""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)


@dataclass(frozen=True)
class SessionSetup:
    """How a session decodes, besides what and with which proposer (the engine fills it in)."""

    context_size: int
    """The target's context window: the session ends with ``context`` when it is full."""
    eos_token_ids: tuple[int, ...] = ()
    context_spans: tuple[ContextSpan, ...] = ()
    """What ``context_ids`` holds besides the prompt (retrieved passages, ...)."""
    collect_rejections: bool = False
    """Keep the target's distribution at every rejected position (the stream logger's records)."""
    want_hidden: bool = False
    """The verifier returns the target's last hidden state (the proposer keys on it)."""
    hold_back: bool = False
    """Keep emitted tokens tentative until :meth:`DecodeSession.finalize`."""
    grammar: Constraint | None = None
    """The request's structured-output matcher (``params.grammar`` compiled), or None."""
    prefix_share: PrefixShare | None = None
    """This choice's part in its request's shared prefill (``specops.serving.engine.prefix``), or None."""


class DecodeSession:
    """One request decoding over a target (and a proposer, unless target-only).

    ``target`` is the request's own ``CachedLM`` (or a batcher's ``BatchedCachedLM``).
    """

    def __init__(
        self,
        target: CachedLM,
        proposer: Proposer | None,
        context_ids: list[int],
        params: SamplingParams,
        k: int,
        setup: SessionSetup,
    ) -> None:
        """``k``: tokens drafted per step at most; the request's stats name ``proposer.name``
        (``target`` without one)."""
        grammar, prefix_share, context_spans = setup.grammar, setup.prefix_share, setup.context_spans
        context_size, hold_back, eos_token_ids = setup.context_size, setup.hold_back, setup.eos_token_ids
        collect_rejections, want_hidden = setup.collect_rejections, setup.want_hidden
        method = proposer.name if proposer is not None else "target"
        self.target = target
        self.prefix_share = prefix_share
        """This choice's part in its request's shared prefill (``specops.serving.engine.prefix``), or None."""
        self.grammar = grammar
        """The request's structured-output matcher (``params.grammar`` compiled), or None."""
        self.proposer = proposer
        self.k = k
        self.context_size = context_size
        self.hold_back = hold_back
        """Keep emitted tokens tentative until :meth:`finalize` (a pending check may undo them)."""
        eos = frozenset(int(t) for t in eos_token_ids)
        self.eos = frozenset() if params.ignore_eos else eos
        """Tokens that end the request (none with ``ignore_eos``)."""
        gen = None
        if not params.greedy:
            gen = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        self.state = DecodeState(
            token_ids=list(context_ids),
            num_prompt_tokens=len(context_ids),
            params=params,
            generator=gen,
            context_spans=tuple(context_spans),
            grammar=grammar,
        )
        self.stats = RequestStats(method=method, num_prompt_tokens=len(context_ids))
        self.rejections: list[RejectedPosition] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        """One per output token (``SamplingParams.logprobs``), kept in step with ``state.token_ids``."""
        self.prompt_logprobs: list[TokenLogprob] | None = None
        """One per context token after the first (``SamplingParams.prompt_logprobs``), set by :meth:`start`."""
        self.verifier = Verifier(target, collect_rejections=collect_rejections, want_hidden=want_hidden, eos=eos)
        self.finish_reason = ""
        self._t_start = 0.0
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> DecodeSession:
        assert not self._started, "start() once"
        self._started = True
        self._t_start = time.perf_counter()
        share, prefix = self.prefix_share, self.state.token_ids[: self.state.num_prompt_tokens - 1]
        if share is not None and not share.lead and self.state.params.prompt_logprobs is None and prefix:
            self.stats.num_prefill_shared = share.group.take(prefix, self.target)
        if self.state.params.prompt_logprobs is not None:
            self._prefill_with_logprobs()
        self._offer_prefix()
        if self.proposer is not None:
            self.proposer.start(self.state)
        return self

    def _offer_prefix(self) -> None:
        """The lead choice hands its prefill on once its target holds the context (after its first step)."""
        share, prefix_len = self.prefix_share, self.state.num_prompt_tokens - 1
        if share is not None and share.lead and prefix_len > 0 and self.target.num_cached >= prefix_len:
            share.group.offer(self.state.token_ids[:prefix_len], self.target)
            self.prefix_share = None

    PREFILL_CHUNK = 256
    """Context tokens per pass when the prefill keeps every row's logits (``prompt_logprobs``):
    bounds the logits held at once to this many rows of the vocabulary."""

    def _prefill_with_logprobs(self) -> None:
        """Prefill the target with every context token but the last (the first step feeds that
        one with its drafts, as always), keeping each row's logits: row ``i`` is the target's
        distribution for context token ``i + 1``. This is the prefill, in chunks, not an extra
        pass; a request without ``prompt_logprobs`` prefills in its first step instead."""
        ids = self.state.token_ids[: self.state.num_prompt_tokens]
        out: list[TokenLogprob] = []
        raw = SamplingParams(logprobs=self.state.params.prompt_logprobs)  # the prompt was not sampled: raw
        for lo in range(self.target.num_cached, len(ids) - 1, self.PREFILL_CHUNK):
            hi = min(lo + self.PREFILL_CHUNK, len(ids) - 1)
            logits, _ = self.target.forward(ids[lo:hi], logits_to_keep=0)
            out.extend(token_logprobs(logits, ids[lo + 1 : hi + 1], raw))
        self.prompt_logprobs = out

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def step(self, proposals: Proposals | None = None) -> StepOutcome:
        """Propose, verify and commit once; the outcome says whether the request is finished.

        ``proposals``: rows the caller drafts this step instead of the proposer (deterministic,
        verified by the one-hot rule; cut to the request's remaining length and context, not to
        ``k``): RaLMSpec's withdrawn interval re-verified under the true passage. The proposer
        still observes the verdict, as after a step it drafted nothing in."""
        assert self._started and not self._closed and not self.finished, "step() between start() and a finish"
        state, stats, params = self.state, self.stats, self.state.params
        remaining = params.max_new_tokens - state.num_generated
        room = self.context_size - len(state.token_ids)
        if remaining <= 0 or room <= 0:
            self.finish_reason = "length" if remaining <= 0 else "context"
            return StepOutcome([], None, [], self.finish_reason)
        # A step emits up to k + 1 tokens (accepted + bonus): never past either limit.
        k_step = min(self.k, remaining - 1, room - 1)
        t0 = time.perf_counter()
        if proposals is not None:
            cap = min(remaining - 1, room - 1)
            rows = [r[:cap] for r in proposals.rows()] if cap > 0 else []
            proposals = Proposals.from_rows(rows) if any(rows) else Proposals.empty()
        elif self.proposer is None or k_step <= 0:
            proposals = Proposals.empty()
        else:
            proposals = self.proposer.propose(state, k_step)
        if self.grammar is not None:
            proposals = self.grammar.prune(proposals)
        t1 = time.perf_counter()
        verdict = self.verifier.verify(state, proposals, self.grammar)
        t2 = time.perf_counter()
        if self.prefix_share is not None:
            self._offer_prefix()
        stats.time_s["propose"] += t1 - t0
        stats.time_s["verify"] += t2 - t1
        if stats.num_verify_steps == 0:
            stats.time_s["first_step"] = t2 - self._t_start  # includes both prefills

        emitted = verdict.emitted
        if self.grammar is not None:  # nothing after the token that completes the grammar (only an EOS could come)
            emitted = emitted[: self.grammar.commit(emitted)]
        for i, tok in enumerate(emitted):
            if tok in self.eos:
                emitted = emitted[: i + 1]  # nothing after an EOS counts, or is logged
                self.finish_reason = "eos"
                break
        stats.num_verify_steps += 1
        stats.num_drafted += verdict.num_drafted
        stats.num_accepted += min(len(verdict.accepted), len(emitted))
        if len(verdict.accepted) < verdict.num_drafted and len(emitted) > len(verdict.accepted):
            stats.num_rejected_steps += 1
            if verdict.rejected is not None:
                self.rejections.append(verdict.rejected)
        state.token_ids.extend(emitted)
        if self.grammar is not None:
            if self.grammar.stopped and not self.finished:
                self.finish_reason = "stop"  # nothing may follow but an end-of-sequence token
        if self.logprobs is not None:
            assert verdict.logprobs is not None and len(verdict.logprobs) >= len(emitted), "the verifier's logprobs"
            self.logprobs.extend(verdict.logprobs[: len(emitted)])
        first = state.num_final
        final = [] if self.hold_back else self.finalize()
        final_lp = self.logprobs[first : first + len(final)] if self.logprobs is not None else None
        if not self.finished and state.num_generated >= params.max_new_tokens:
            self.finish_reason = "length"
        elif not self.finished and len(state.token_ids) >= self.context_size:
            self.finish_reason = "context"
        if self.proposer is not None:
            if self.finished:
                self.proposer.observe_final(state, verdict)
            else:
                self.proposer.observe(state, verdict)
        return StepOutcome(emitted, verdict, final, self.finish_reason, t1 - t0, t2 - t1, final_lp)

    def stop(self, reason: str = "stop") -> None:
        """End the request here: a stop sequence was seen. It overrides a ``length`` or
        ``context`` finish of the same step (the stop matched first), never an ``eos``."""
        assert reason in FINISH_REASONS, reason
        if self.finish_reason in ("", "length", "context"):
            self.finish_reason = reason

    # ------------------------------------------------------------------ tentative output
    def finalize(self, position: int | None = None) -> list[int]:
        """Make output up to absolute ``position`` (default: all of it) final; returns the
        tokens that just became final."""
        state = self.state
        end = len(state.token_ids) if position is None else position
        first = state.num_prompt_tokens + state.num_final
        assert first <= end <= len(state.token_ids), (first, end, len(state.token_ids))
        state.num_final = end - state.num_prompt_tokens
        return state.token_ids[first:end]

    def rollback_to(self, position: int) -> None:
        """Withdraw every committed token at absolute position ``position`` or later.

        Only tentative output can be withdrawn. The target's cache and the proposer's state
        follow, rejected positions past the cut are dropped (they no longer describe what the
        target saw), and a finished request becomes unfinished again."""
        state = self.state
        lo = state.num_prompt_tokens + state.num_final
        assert lo <= position <= len(state.token_ids), f"can roll back only tentative output: {position} < {lo}"
        dropped = len(state.token_ids) - position
        if not dropped:
            return
        del state.token_ids[position:]
        if self.grammar is not None:
            self.grammar.truncate(position - state.num_prompt_tokens)
        if self.logprobs is not None:
            del self.logprobs[position - state.num_prompt_tokens :]
        self.stats.num_rolled_back += dropped
        # The target cache holds every committed token but the last (fed with the next drafts).
        self.target.rollback(min(self.target.num_cached, position - 1))
        if self.proposer is not None:
            self.proposer.rollback(state, position)
        self.rejections = [r for r in self.rejections if r.index < position]
        self.finish_reason = ""

    # ------------------------------------------------------------------ result
    def finish(self, tokenizer=None) -> GenerationResult:
        """Close the session: release the proposer and return the result (all output final)."""
        assert self._started and not self._closed, "finish() once, after start()"
        self._closed = True
        state, stats = self.state, self.stats
        if self.proposer is not None:
            stats.num_draft_forwards = self.proposer.num_forwards
            stats.proposer = self.proposer.counters()
            summary = getattr(self.proposer, "summary", None)
            if callable(summary):
                stats.policy = summary()
            self.proposer.finish()
        state.num_final = state.num_generated
        stats.num_generated = state.num_generated
        stats.num_target_forwards = self.target.num_forwards
        self._withdraw_prefix()
        self.target.close()
        stats.time_s["total"] = time.perf_counter() - self._t_start
        if not stats.finish_reason:
            stats.finish_reason = self.finish_reason
        out_ids = state.output_ids
        text = tokenizer.decode(out_ids) if tokenizer is not None else None
        return GenerationResult(
            token_ids=out_ids,
            stats=stats,
            rejections=self.rejections,
            text=text,
            context_spans=state.context_spans,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )

    def abort(self) -> None:
        """Release the proposer without a result (the caller went away)."""
        if not self._closed:
            self._closed = True
            self._withdraw_prefix()
            self.target.close()
            if self.proposer is not None:
                self.stats.num_draft_forwards = self.proposer.num_forwards
                self.proposer.finish()

    def _withdraw_prefix(self) -> None:
        """A lead that ends before it prefilled (an error, a client gone) lets its followers prefill on their own."""
        if self.prefix_share is not None and self.prefix_share.lead:
            self.prefix_share.group.withdraw()
        self.prefix_share = None

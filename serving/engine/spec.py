"""``SpecEngine.generate``: decode one request to the end, a short driver over a
:class:`~specops.serving.engine.session.DecodeSession` (propose, verify, commit, until EOS,
max_new_tokens, the context is full, or the caller stops it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specops.core import limits
from specops.core.models import ModelPair
from specops.serving.engine import grammar
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.prefix import PrefixShare
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.session import DecodeSession, SessionSetup
from specops.serving.engine.types import ContextSpan, Emitted, GenerationResult, SamplingParams


@dataclass(frozen=True)
class RequestHooks:
    """What a caller hooks into one request's decode (all optional)."""

    on_step: Callable[[Emitted], bool | None] | None = None
    """Called after every step with the tokens that became final (the HTTP API streams them);
    returning True ends the request there with finish reason ``stop`` (a stop sequence was
    seen), and an exception it raises (the client went away) ends it without logging."""
    meta: object | None = None
    """Names the request in a bare engine's :class:`ResultSink` records."""
    prefix_share: PrefixShare | None = None
    """This request's part in its choices' shared prefill (``specops.serving.engine.prefix``:
    ``n`` and ``best_of``)."""


class ResultSink(Protocol):
    """Where a bare engine hands each finished request (``specops.serving.fleet.stream_logger.StreamLogger``
    is one). The serving node does not give its engines one: it hands results over itself, for
    every decoding mode (``specops.serving.fleet.node.ServingNode.serve``)."""

    cfg: object
    """Its ``enabled`` says whether records are kept (then rejections are collected for them)."""

    def log(
        self, prompt_ids: list[int], result: GenerationResult, params: SamplingParams, meta: object = None
    ) -> bool: ...


log = logging.getLogger(__name__)


class SpecEngine:
    """Runs requests over a target/draft pair, one session per request.

    ``generate`` with method ``target`` is plain target-only decoding through the same
    KV-cached loop: every speculative method must equal it token for token when greedy.
    """

    def __init__(
        self,
        pair: ModelPair,
        *,
        collect_rejections: bool = False,
        logger: ResultSink | None = None,
        target_lm: Callable[[], CachedLM] | None = None,
    ) -> None:
        self.pair = pair
        self.target_lm = target_lm
        """Builds each request's target (default: a plain ``CachedLM``; the API passes a
        ``TargetBatcher.lm`` so concurrent requests share target forward passes)."""
        self.logger = logger
        # the logger needs the target's distribution at every rejected position
        self.collect_rejections = collect_rejections or (logger is not None and logger.cfg.enabled)

    @property
    def context_size(self) -> int:
        return limits.context_size(self.pair.target.config)

    def validate(self, prompt_ids: list[int], k: int) -> None:
        limits.check_prompt(prompt_ids, vocab_size=self.pair.vocab_size, context=self.context_size)
        limits.check_k(k)

    def session(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        proposer: Proposer | None,
        k: int,
        *,
        spans: tuple[ContextSpan, ...] = (),
        hold_back: bool = False,
        prefix_share: PrefixShare | None = None,
    ) -> DecodeSession:
        """A started session for one request (see ``generate`` for the arguments); ``hold_back``:
        its tokens stay tentative until finalized (``specops.serving.engine.session``)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, k)
        constraint = None
        if params.grammar is not None:
            grammars = grammar.for_tokenizer(self.pair.tokenizer, self.pair.vocab_size, self.pair.eos_token_ids)
            constraint = grammars.constraint(params.grammar)
        target = self.target_lm() if self.target_lm is not None else CachedLM(self.pair.target)
        setup = SessionSetup(
            context_size=self.context_size,
            eos_token_ids=tuple(self.pair.eos_token_ids),
            context_spans=tuple(spans),
            collect_rejections=self.collect_rejections,
            want_hidden=proposer is not None and bool(proposer.needs_hidden),
            hold_back=hold_back,
            grammar=constraint,
            prefix_share=prefix_share,
        )
        return DecodeSession(target, proposer, prompt_ids, params, k, setup).start()

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        proposer: Proposer | None,
        k: int,
        spans: tuple[ContextSpan, ...] = (),
        hooks: RequestHooks | None = None,
    ) -> GenerationResult:
        """Decode one request with ``proposer`` (None: target-only) drafting up to ``k`` tokens a step.

        The proposer is built by the caller (the serving node, from the request's plan:
        ``specops.serving.plan``); the engine never looks a method up. ``spans`` describe
        ``prompt_ids`` when it holds more than the prompt; ``hooks`` are the request's
        :class:`RequestHooks`.

        With a ``logger`` (a bare engine's :class:`ResultSink`), the finished request is handed
        to it (``hooks.meta`` names the request); that never blocks or raises. The serving node
        hands its requests over itself.
        """
        hooks = hooks or RequestHooks()
        session = self.session(prompt_ids, params, proposer, k, spans=spans, prefix_share=hooks.prefix_share)
        on_step = hooks.on_step
        prompt_lps = session.prompt_logprobs  # handed on with the first step's tokens
        try:
            while not session.finished:
                outcome = session.step()
                emitted = Emitted(outcome.final, outcome.final_logprobs, prompt_lps, session.state.num_prompt_tokens)
                prompt_lps = None
                if on_step is not None and outcome.emitted and on_step(emitted):
                    session.stop("stop")
        except BaseException:
            session.abort()
            raise
        result = session.finish(self.pair.tokenizer)
        if self.logger is not None:
            t_log = time.perf_counter()
            self.logger.log(session.state.token_ids[: session.state.num_prompt_tokens], result, params, hooks.meta)
            result.stats.time_s["log"] = time.perf_counter() - t_log
        return result

"""``SpecEngine.generate``: decode one request to the end, a short driver over a
:class:`~specops.serving.engine.session.DecodeSession` (propose, verify, commit, until EOS,
max_new_tokens, the context is full, or the caller stops it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from specops.core import limits
from specops.core.models import ModelPair
from specops.serving.engine import grammar
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.prefix import PrefixShare
from specops.serving.engine.session import DecodeSession
from specops.serving.engine.types import ContextSpan, Emitted, GenerationResult, SamplingParams
from specops.serving.proposers.base import Proposer
from specops.serving.proposers.catalogue import (  # noqa: F401  (re-exported: the engine's public names)
    DEFAULT_K,
    METHODS,
    ProposerConfig,
    ProposerResources,
    build_proposer,
    method_spec,
)


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
        *,
        method: str = "draft",
        k: int | None = None,
        proposer_cfg: ProposerConfig | None = None,
        proposer: Proposer | None = None,
        resources: ProposerResources | None = None,
        context_spans: tuple[ContextSpan, ...] = (),
        hold_back: bool = False,
        prefix_share: PrefixShare | None = None,
    ) -> DecodeSession:
        """A started session for one request (see ``generate`` for the arguments)."""
        cfg = proposer_cfg or ProposerConfig(method=method)
        method = proposer.name if proposer is not None else cfg.method
        if k is None:  # the default of the method actually used, a ready proposer's included
            k = DEFAULT_K.get(method, DEFAULT_K[cfg.method])
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, k)
        if proposer is None:
            proposer = build_proposer(cfg, resources or ProposerResources(pair=self.pair))
        spec = method_spec(method) if method in METHODS else None
        constraint = None
        if params.grammar is not None:
            grammars = grammar.for_tokenizer(self.pair.tokenizer, self.pair.vocab_size, self.pair.eos_token_ids)
            constraint = grammars.constraint(params.grammar)
        target = self.target_lm() if self.target_lm is not None else CachedLM(self.pair.target)
        return DecodeSession(
            target,
            proposer,
            prompt_ids,
            params,
            k=k,
            method=method,
            eos_token_ids=self.pair.eos_token_ids,
            context_size=self.context_size,
            context_spans=context_spans,
            collect_rejections=self.collect_rejections,
            want_hidden=(spec is not None and "target_hidden" in spec.needs)
            or bool(getattr(proposer, "needs_hidden", False)),
            hold_back=hold_back,
            grammar=constraint,
            prefix_share=prefix_share,
        ).start()

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        method: str = "draft",
        k: int | None = None,
        proposer_cfg: ProposerConfig | None = None,
        proposer: Proposer | None = None,
        resources: ProposerResources | None = None,
        context_spans: tuple[ContextSpan, ...] = (),
        meta: object | None = None,
        on_step: Callable[[list[int]], bool | None] | None = None,
        prefix_share: PrefixShare | None = None,
    ) -> GenerationResult:
        """Decode one request with ``method`` (or a full ``proposer_cfg``, or a ready ``proposer``).

        ``resources`` are what the method's proposer draws on (default: this engine's model
        pair); ``context_spans`` describe ``prompt_ids`` when it holds more than the prompt.
        ``on_step(final)`` is called after every step with the tokens that became final (the
        HTTP API streams them); returning True ends the request there with finish reason
        ``stop`` (a stop sequence was seen), and an exception it raises (the client went
        away) ends it without logging. ``prefix_share`` is this request's part in its choices' shared
        prefill (``specops.serving.engine.prefix``: ``n`` and ``best_of``).

        With a ``logger`` (a bare engine's :class:`ResultSink`), the finished request is handed
        to it (``meta`` names the request); that never blocks or raises. The serving node hands
        its requests over itself.
        """
        session = self.session(
            prompt_ids,
            params,
            method=method,
            k=k,
            proposer_cfg=proposer_cfg,
            proposer=proposer,
            resources=resources,
            context_spans=context_spans,
            prefix_share=prefix_share,
        )
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
            self.logger.log(session.state.token_ids[: session.state.num_prompt_tokens], result, params, meta)
            result.stats.time_s["log"] = time.perf_counter() - t_log
        return result

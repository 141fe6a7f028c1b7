"""The decode loop: propose, verify, commit, until EOS, max_new_tokens or the context is full."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from serving.errors import InvalidRequestError, PromptTooLongError
from serving.engine.kv import CachedLM
from serving.engine.models import ModelPair
from serving.proposers.base import Proposer
from serving.proposers.draft_model import DraftModelProposer
from serving.proposers.prompt_lookup import PromptLookupProposer
from serving.engine.types import DecodeState, GenerationResult, Proposals, RequestStats, SamplingParams
from serving.engine.verifier import Verifier

if TYPE_CHECKING:
    from serving.fleet.stream_logger import RequestMeta, StreamLogger

log = logging.getLogger(__name__)

METHODS = ("target", "draft", "pld")
"""``target``: target-only decoding, the reference; ``draft``: speculative decoding with
the draft model; ``pld``: prompt-lookup decoding."""

DEFAULT_K = {"target": 1, "draft": 3, "pld": 10}
"""Tokens drafted per step when the request does not say. A model draft pays one draft
forward per token, so it drafts few; a lookup copy is free, so it drafts as many as HF's
prompt lookup does (``prompt_lookup_num_tokens=10``). The draft's 3 is the k that measured
fastest with the default SmolLM2 pair (k = 2, 3, 4 on held-out code: 1.13x, 1.24x, 1.01x
target-only, 5 prompts; benchmarks/spec_decode.py's sweep re-measures it)."""


@dataclass(frozen=True)
class ProposerConfig:
    """What ``build_proposer`` needs besides the models."""

    method: str = "draft"
    """One of METHODS."""
    pld_max_ngram: int = 3
    """Longest trailing n-gram prompt lookup tries to match."""
    pld_min_ngram: int = 1
    """Shortest n-gram prompt lookup accepts."""
    draft_confidence: float = 0.0
    """Draft model: stop drafting when its top probability drops below this (0 = off)."""
    adaptive_k: bool = False
    """Draft model: adapt k per step within 1..k (+2 after full acceptance, -1 otherwise)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")


def build_proposer(cfg: ProposerConfig, pair: ModelPair) -> Proposer | None:
    """The proposer for a method, or None for target-only decoding."""
    if cfg.method == "target":
        return None
    if cfg.method == "draft":
        if pair.draft is None:
            raise InvalidRequestError("method 'draft' needs a draft model; none is loaded")
        return DraftModelProposer(pair.draft, confidence_threshold=cfg.draft_confidence, adaptive_k=cfg.adaptive_k)
    if cfg.method == "pld":
        return PromptLookupProposer(cfg.pld_max_ngram, cfg.pld_min_ngram)
    raise ValueError(f"unknown method {cfg.method!r}")


class SpecEngine:
    """Runs one request at a time over a target/draft pair.

    ``generate`` with method ``target`` is plain target-only decoding through the same
    KV-cached loop: every speculative method must equal it token for token when greedy.
    """

    def __init__(
        self, pair: ModelPair, *, collect_rejections: bool = False, logger: "StreamLogger | None" = None,
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
        return int(getattr(self.pair.target.config, "max_position_embeddings", 1 << 30))

    def validate(self, prompt_ids: list[int], k: int) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if not isinstance(k, int) or k <= 0:
            raise InvalidRequestError(f"k (tokens drafted per step) must be an integer >= 1, got {k!r}")
        vocab = self.pair.vocab_size
        bad = [t for t in prompt_ids if not (0 <= int(t) < vocab)]
        if bad:
            raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt_ids) >= self.context_size:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens but the model context is {self.context_size}; "
                f"shorten it to at most {self.context_size - 1} tokens"
            )

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        method: str = "draft",
        k: int | None = None,
        proposer_cfg: ProposerConfig | None = None,
        proposer: Proposer | None = None,
        meta: "RequestMeta | None" = None,
        on_step: Callable[[list[int]], bool | None] | None = None,
    ) -> GenerationResult:
        """Decode one request with ``method`` (or a full ``proposer_cfg``, or a ready ``proposer``).

        ``on_step(emitted)`` is called after every verification step with the tokens it
        emitted (the HTTP API streams them); returning True ends the request there with
        finish reason ``stop`` (a stop sequence was seen), and an exception it raises (the
        client went away) ends it without logging.

        With a stream logger, the finished request is handed to it (``meta`` names the
        request, its cluster and the draft version); that never blocks or raises.
        """
        cfg = proposer_cfg or ProposerConfig(method=method)
        if k is None:
            k = DEFAULT_K[cfg.method]
        method = proposer.name if proposer is not None else cfg.method
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, k)
        if proposer is None:
            proposer = build_proposer(cfg, self.pair)
        t_start = time.perf_counter()
        gen = None
        if not params.greedy:
            gen = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        state = DecodeState(token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids), params=params, generator=gen)
        stats = RequestStats(method=method, num_prompt_tokens=len(prompt_ids))
        rejections = []
        target = self.target_lm() if self.target_lm is not None else CachedLM(self.pair.target)
        verifier = Verifier(target, collect_rejections=self.collect_rejections)
        eos = set(self.pair.eos_token_ids)

        if proposer is not None:
            proposer.start(state)

        try:
            while True:
                remaining = params.max_new_tokens - state.num_generated
                room = self.context_size - len(state.token_ids)
                if remaining <= 0 or room <= 0:
                    stats.finish_reason = "length" if remaining <= 0 else "context"
                    break
                # A step emits up to k + 1 tokens (accepted + bonus): never past either limit.
                k_step = min(k, remaining - 1, room - 1)
                t0 = time.perf_counter()
                if proposer is None or k_step <= 0:
                    proposals = Proposals.empty()
                else:
                    proposals = proposer.propose(state, k_step)
                t1 = time.perf_counter()
                verdict = verifier.verify(state, proposals)
                t2 = time.perf_counter()
                stats.time_s["propose"] += t1 - t0
                stats.time_s["verify"] += t2 - t1

                if stats.num_verify_steps == 0:
                    stats.time_s["first_step"] = t2 - t_start  # includes both prefills
                emitted = verdict.emitted
                finished = None
                for i, tok in enumerate(emitted):
                    if tok in eos:
                        emitted = emitted[: i + 1]  # nothing after an EOS counts, or is logged
                        finished = "eos"
                        break
                stats.num_verify_steps += 1
                stats.num_drafted += verdict.num_drafted
                stats.num_accepted += min(len(verdict.accepted), len(emitted))
                if len(verdict.accepted) < verdict.num_drafted and len(emitted) > len(verdict.accepted):
                    stats.num_rejected_steps += 1
                    if verdict.rejected is not None:
                        rejections.append(verdict.rejected)
                state.token_ids.extend(emitted)
                if on_step is not None and on_step(emitted) and not finished:
                    finished = "stop"
                if finished:
                    stats.finish_reason = finished
                    break
                if proposer is not None:
                    proposer.observe(state, verdict)
        finally:
            if proposer is not None:
                stats.num_draft_forwards = proposer.num_forwards
                proposer.finish()

        stats.num_generated = state.num_generated
        stats.num_target_forwards = target.num_forwards
        stats.time_s["total"] = time.perf_counter() - t_start
        out_ids = state.token_ids[len(prompt_ids):]
        text = self.pair.tokenizer.decode(out_ids) if self.pair.tokenizer is not None else None
        result = GenerationResult(token_ids=out_ids, stats=stats, rejections=rejections, text=text)
        if self.logger is not None:
            from serving.fleet.stream_logger import RequestMeta

            t_log = time.perf_counter()
            self.logger.log(prompt_ids, result, params, meta or RequestMeta())
            stats.time_s["log"] = time.perf_counter() - t_log
        return result

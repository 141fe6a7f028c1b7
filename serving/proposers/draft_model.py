"""Draft-model proposer (OSD / Leviathan et al.): a small causal LM with its own KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from specops.serving.engine.kv import CachedLM
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.sampling import draw, warp
from specops.serving.engine.types import DecodeState, Proposals, Verdict


class DraftModelProposer(Proposer):
    """Proposes ``k`` tokens autoregressively from a draft model.

    Cache invariant: after ``observe``, the draft cache holds a prefix of the committed
    tokens, and the next ``propose`` feeds only the committed tokens it lacks (one or
    two), never the whole prefix. Greedy drafts take the argmax; sampled drafts draw
    from the draft's warped distribution and return it as ``draft_probs``.
    """

    name = "draft"

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        confidence_threshold: float = 0.0,
        adaptive_k: bool = False,
        lm_factory: Callable[[PreTrainedModel], CachedLM] | None = None,
    ) -> None:
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model
        self.confidence_threshold = confidence_threshold
        """Stop drafting early once the draft's top probability falls below this (0 = never)."""
        self.adaptive_k = adaptive_k
        """Grow k by 2 after a fully accepted step, shrink by 1 otherwise (within 1..k)."""
        self.lm: CachedLM | None = None
        self._k_cur: int | None = None
        self.lm_factory = lm_factory or CachedLM
        """Builds the request's draft cache: a batcher's (``TargetBatcher.lm``) batches the draft's
        forwards across requests."""

    @property
    def num_forwards(self) -> int:  # type: ignore[override]
        return self.lm.num_forwards if self.lm is not None else 0

    def start(self, state: DecodeState) -> None:
        self.lm = self.lm_factory(self.model)
        self._k_cur = None
        # Prefill lazily in the first propose(), which feeds every uncached committed token.

    def propose(self, state: DecodeState, k: int) -> Proposals:
        assert self.lm is not None, "start() first"
        lm = self.lm
        room = lm.context_size - len(state.token_ids)
        if self.adaptive_k:
            self._k_cur = k if self._k_cur is None else max(1, min(self._k_cur, k))
            k = self._k_cur
        k = min(k, room)
        if k <= 0:
            return Proposals.empty()
        pending = state.token_ids[lm.num_cached :]  # committed tokens not in the draft cache
        assert pending, "the draft cache never holds the last committed token"
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        feed = pending
        constraint = state.grammar
        for _ in range(k):
            logits, _ = lm.forward(feed, logits_to_keep=1)  # [1, vocab]
            if constraint is not None:  # structured output: only what the grammar allows after the drafts so far
                logits = constraint.mask(logits, [tokens])  # q is then the masked one: verification stays exact
                if not bool(torch.isfinite(logits).any()):
                    break  # nothing the draft can say is allowed (its vocabulary lacks every allowed token)
            # Early stop on low draft confidence. The test uses the distribution's top
            # probability, never the drawn token's, so a sampled draft stays an unbiased
            # draw from q and rejection sampling stays exact.
            if state.params.greedy:
                if self.confidence_threshold and tokens:
                    if float(torch.softmax(logits[0], -1).max()) < self.confidence_threshold:
                        break
                tok = int(logits[0].argmax())
            else:
                q = warp(logits, state.params)[0]  # [vocab]
                if self.confidence_threshold and tokens and float(q.max()) < self.confidence_threshold:
                    break
                tok = draw(q, state.generator)
                dists.append(q)
            tokens.append(tok)
            feed = [tok]
        if not tokens:
            return Proposals.empty()
        # The last drafted token is fed only when drafting stopped early.
        out = torch.tensor([tokens], dtype=torch.long)  # [1, k]
        probs = torch.stack(dists)[None] if dists else None  # [1, k, vocab]
        return Proposals(tokens=out, draft_probs=probs)

    def observe(self, state: DecodeState, verdict: Verdict) -> None:
        assert self.lm is not None
        # The cache holds the committed-before-this-step prefix plus the drafts that were
        # fed. Of those, exactly the accepted ones are still true; the bonus is fed next.
        before = len(state.token_ids) - len(verdict.emitted)
        self.lm.rollback(min(before + len(verdict.accepted), self.lm.num_cached))
        if self.adaptive_k and self._k_cur is not None:
            full = verdict.num_drafted > 0 and len(verdict.accepted) == verdict.num_drafted
            self._k_cur = self._k_cur + 2 if full else max(1, self._k_cur - 1)

    def rollback(self, state: DecodeState, position: int) -> None:
        assert self.lm is not None
        # Keep the invariant: the cache never holds the last committed token.
        self.lm.rollback(min(self.lm.num_cached, position - 1))

    def finish(self) -> None:
        if self.lm is not None:
            self.lm.close()  # a batcher's cache gives its slot back
        self.lm = None

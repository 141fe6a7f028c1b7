"""A causal LM plus its own KV cache, advanced and rolled back by position.

Every model in the engine (target and draft) runs through ``CachedLM``: a forward
pass feeds only tokens that are not cached yet, so no step recomputes the prefix, and
``rollback`` drops cached positions after a rejection.

A model that carries a draft vocabulary (``serving.engine.draft_vocab``) scores only those rows
of its LM head; its logits are ``-inf`` elsewhere.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from serving.engine import draft_vocab, limits


class CachedLM:
    """One model and one request's KV cache."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.num_cached = 0
        """Positions 0 .. num_cached-1 are in the cache."""
        self.num_forwards = 0
        self.vocab = draft_vocab.of(model)
        """The model's draft vocabulary, or None (every row of the head)."""

    @property
    def context_size(self) -> int:
        return limits.context_size(self.model.config)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.num_cached = 0
        self.num_forwards = 0

    @torch.inference_mode()
    def forward(
        self, input_ids: list[int], *, logits_to_keep: int = 0, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``input_ids`` at positions num_cached.. and return their logits.

        Returns ``(logits, hidden)``: logits ``[n_keep, vocab]`` float32 for the last
        ``logits_to_keep`` fed tokens (all of them when 0), and the final hidden states
        ``[n_keep, hidden]`` when ``want_hidden``.
        """
        n = len(input_ids)
        assert n > 0, "forward needs at least one token"
        assert self.num_cached + n <= self.context_size, (self.num_cached, n, self.context_size)
        ids = torch.tensor([input_ids], dtype=torch.long)  # [1, n]
        pos = torch.arange(self.num_cached, self.num_cached + n, dtype=torch.long)[None]  # [1, n]
        if self.vocab is not None:
            return self._forward_subset(ids, pos, logits_to_keep or n, want_hidden)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=want_hidden,
        )
        self.num_cached += n
        self.num_forwards += 1
        logits = out.logits[0].float()  # [n_keep, vocab]
        hidden = None
        if want_hidden:
            keep = logits.shape[0]
            hidden = out.hidden_states[-1][0, -keep:].float()  # [n_keep, hidden]
        return logits, hidden

    def _forward_subset(self, ids: torch.Tensor, pos: torch.Tensor, keep: int,
                        want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base model's last hidden states, then only the draft vocabulary's head rows."""
        out = self.model.base_model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True)
        self.num_cached += ids.shape[1]
        self.num_forwards += 1
        hidden = out.last_hidden_state[0, -keep:]  # [n_keep, hidden]
        logits = self.vocab.logits(self.model.get_output_embeddings(), hidden).float()  # [n_keep, vocab]
        return logits, hidden.float() if want_hidden else None

    def rollback(self, length: int) -> None:
        """Keep only positions ``0 .. length-1`` in the cache."""
        assert 0 <= length <= self.num_cached, (length, self.num_cached)
        drop = self.num_cached - length
        if drop:
            # transformers 5.x: crop() takes a negative count of tokens to remove.
            self.cache.crop(-drop)
            self.num_cached = length
        assert self.cache.get_seq_length() == self.num_cached, (self.cache.get_seq_length(), self.num_cached)

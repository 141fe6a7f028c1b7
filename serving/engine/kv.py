"""A causal LM plus its own KV cache, advanced and rolled back by position.

Every model in the engine (target and draft) runs through ``CachedLM``: a forward
pass feeds only tokens that are not cached yet, so no step recomputes the prefix, and
``rollback`` drops cached positions after a rejection.

A model that carries a draft vocabulary (``specops.core.draft_vocab``) scores only those rows
of its LM head; its logits are ``-inf`` elsewhere.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel

from specops.core import draft_vocab, limits
from specops.serving.engine import tree as tree_mod
from specops.serving.engine.tree import TokenTree
from specops.serving.engine.types import TargetPass


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
        self.last_pass: TargetPass | None = None
        """The latest forward as it ran (one row of its own tokens here; the batcher's rows and
        width in ``engine.batching``): the verifier puts it in the step's verdict."""

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
        device = self.model.device
        ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # [1, n]
        pos = torch.arange(self.num_cached, self.num_cached + n, dtype=torch.long, device=device)[None]  # [1, n]
        if self.vocab is not None:
            return self._forward_subset(ids, pos, logits_to_keep or n, want_hidden)
        t0 = time.perf_counter()
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
        logits = out.logits[0].float().cpu()  # [n_keep, vocab]: the acceptance rules run on the CPU
        self.last_pass = TargetPass(1, n, n, 0, 0, (time.perf_counter() - t0) * 1000.0)
        hidden = None
        if want_hidden:
            keep = logits.shape[0]
            hidden = out.hidden_states[-1][0, -keep:].float().cpu()  # [n_keep, hidden]
        return logits, hidden

    def _forward_subset(
        self, ids: torch.Tensor, pos: torch.Tensor, keep: int, want_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base model's last hidden states, then only the draft vocabulary's head rows."""
        out = self.model.base_model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True)
        self.num_cached += ids.shape[1]
        self.num_forwards += 1
        hidden = out.last_hidden_state[0, -keep:]  # [n_keep, hidden]
        logits = self.vocab.logits(self.model.get_output_embeddings(), hidden).float().cpu()  # [n_keep, vocab]
        return logits, hidden.float().cpu() if want_hidden else None

    @torch.inference_mode()
    def forward_tree(
        self, committed: list[int], tree: TokenTree, *, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append the uncached ``committed`` tokens, then every node of ``tree``, in one pass.

        Each node sits at its own position (``specops.serving.engine.tree.positions``) and attends
        only to the committed tokens and its ancestors. Returns logits ``[1 + num_nodes,
        vocab]`` float32: row 0 at the last committed token (the root), row ``i`` at node
        ``i``; and the matching final hidden states when ``want_hidden``. Afterwards call
        :meth:`keep_path` to keep only the accepted nodes in the cache.
        """
        c, n = len(committed), tree.num_nodes
        assert c > 0, "the last committed token is fed with the tree (its logits judge depth 1)"
        base = self.num_cached + c
        assert base + tree.max_depth <= self.context_size, (base, tree.max_depth, self.context_size)
        device = self.model.device
        ids = torch.tensor([committed + tree.tokens[1:]], dtype=torch.long, device=device)  # [1, c + n]
        pos = tree_mod.positions(base, c, tree).to(device)[None]  # [1, c + n]
        mask = tree_mod.attention_mask(self.num_cached, c, tree, self.model.dtype, device)  # [1, 1, c+n, cached+c+n]
        keep = n + 1
        t0 = time.perf_counter()
        if self.vocab is not None:
            out = self.model.base_model(
                input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=self.cache, use_cache=True
            )
            hidden = out.last_hidden_state[0, -keep:]  # [1 + n, hidden]
            logits = self.vocab.logits(self.model.get_output_embeddings(), hidden).float().cpu()
        else:
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=mask,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=want_hidden,
            )
            logits = out.logits[0].float().cpu()  # [1 + n, vocab]
            hidden = out.hidden_states[-1][0, -keep:] if want_hidden else None
        self.num_cached += c + n
        self.num_forwards += 1
        self.last_pass = TargetPass(1, c + n, c + n, 0, 0, (time.perf_counter() - t0) * 1000.0)
        return logits, hidden.float().cpu() if want_hidden and hidden is not None else None

    @torch.inference_mode()
    def keep_path(self, base: int, path: list[int]) -> None:
        """After :meth:`forward_tree`: keep positions ``0 .. base-1`` and the tree nodes on
        ``path`` (node numbers, root excluded, root to leaf), moved to ``base, base+1, ...``."""
        assert base <= self.num_cached, (base, self.num_cached)
        for j, node in enumerate(path):
            assert node >= j + 1, (j, node)  # nodes are numbered parents first: copies never overwrite a source
            src, dst = base + node - 1, base + j
            if src != dst:
                for layer in self.cache.layers:
                    layer.keys[:, :, dst] = layer.keys[:, :, src]
                    layer.values[:, :, dst] = layer.values[:, :, src]
        self.rollback(base + len(path))

    @torch.inference_mode()
    def prefix(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the cached keys and values of positions ``0 .. length-1``, per layer
        ``[kv_heads, length, head_dim]`` (``specops.serving.engine.prefix``: a request's choices share a prefill)."""
        assert 0 < length <= self.num_cached, (length, self.num_cached)
        return [(layer.keys[0, :, :length].clone(), layer.values[0, :, :length].clone()) for layer in self.cache.layers]

    @torch.inference_mode()
    def load_prefix(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start this (empty) cache from another's :meth:`prefix`: its positions become ``0 .. length-1`` here."""
        assert self.num_cached == 0 and len(kv) == len(self.cache.layers), (self.num_cached, len(kv))
        for i, (keys, values) in enumerate(kv):
            self.cache.update(keys[None].clone(), values[None].clone(), i)
        self.num_cached = int(kv[0][0].shape[1])

    def close(self) -> None:
        """The request is done with this cache (a batched target gives its slot back)."""

    def rollback(self, length: int) -> None:
        """Keep only positions ``0 .. length-1`` in the cache."""
        assert 0 <= length <= self.num_cached, (length, self.num_cached)
        drop = self.num_cached - length
        if drop:
            # transformers 5.x: crop() takes a negative count of tokens to remove.
            self.cache.crop(-drop)
            self.num_cached = length
        assert self.cache.get_seq_length() == self.num_cached, (self.cache.get_seq_length(), self.num_cached)

"""Step costs of a model as the engine runs it: a cached forward of ``n`` new tokens.

``c`` in OSD Eq. 2 is a draft's 1-token step over the target's; a verification step feeds
``k + 1`` tokens. Both are measured here the same way everywhere (the bootstrap's
``manifest.json``, the ``auto`` policy's priors and ``benchmarks/spec_decode.py``): median wall
time of the forward pass the engine's ``CachedLM`` runs (``specops.serving.engine.kv``: the whole LM head,
or only a draft vocabulary's rows) after a cached context, the cache rolled back after every step.
The shared core sits below the engine, so :class:`CachedForward` is that pass on its own;
``tests/core/test_cost.py`` checks that both give the same logits.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache, PreTrainedModel

from specops.core import draft_vocab


class CachedForward:
    """One model, its KV cache, and the forward pass of ``CachedLM.forward`` (no hidden states,
    no trees): what one engine step of ``n`` tokens costs."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.num_cached = 0
        self.vocab = draft_vocab.of(model)

    @torch.inference_mode()
    def forward(self, input_ids: list[int], *, logits_to_keep: int) -> torch.Tensor:
        """Append ``input_ids`` and return the logits ``[logits_to_keep, vocab]`` (float32, CPU)."""
        n = len(input_ids)
        device = self.model.device
        ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # [1, n]
        pos = torch.arange(self.num_cached, self.num_cached + n, dtype=torch.long, device=device)[None]  # [1, n]
        if self.vocab is not None:
            out = self.model.base_model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True)
            hidden = out.last_hidden_state[0, -logits_to_keep:]  # [n_keep, hidden]
            logits = self.vocab.logits(self.model.get_output_embeddings(), hidden).float().cpu()
        else:
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
            logits = out.logits[0].float().cpu()  # [n_keep, vocab]
        self.num_cached += n
        return logits

    def rollback(self, length: int) -> None:
        """Keep only positions ``0 .. length-1`` in the cache."""
        drop = self.num_cached - length
        if drop:
            self.cache.crop(-drop)  # transformers 5.x: a negative count of tokens to remove
            self.num_cached = length


def step_ms(
    model: PreTrainedModel,
    context_ids: list[int],
    n: int = 1,
    *,
    reps: int = 50,
    warmup: int = 5,
    best: bool = False,
    keep: int | None = None,
) -> float:
    """Median milliseconds of one cached forward of ``n`` new tokens after ``context_ids`` (the
    fastest rep with ``best``: the machine's cost when nothing else competes for it), computing
    the logits of the last ``keep`` of them (default all ``n``: a verify pass; 1: a prefill)."""
    assert context_ids and n >= 1 and reps >= 1
    lm = CachedForward(model)
    lm.forward(context_ids, logits_to_keep=1)
    base = lm.num_cached
    feed = (context_ids * n)[:n]
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        lm.forward(feed, logits_to_keep=n if keep is None else keep)
        elapsed = time.perf_counter() - t0
        lm.rollback(base)
        if i >= warmup:
            times.append(elapsed)
    return (min(times) if best else statistics.median(times)) * 1000.0

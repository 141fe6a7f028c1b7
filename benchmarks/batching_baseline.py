"""The target batcher as it was before issue 15, kept as the baseline of ``benchmarks/batching.py``.

Every batched step copies each request's whole KV cache into a freshly allocated padded cache
and appends the new keys back by concatenation. ``serving/engine/batching.py`` replaced it
with a slot pool written in place; this copy exists only to measure the difference side by
side. Not used by serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from specops.serving.engine.kv import CachedLM

log = logging.getLogger(__name__)


@dataclass
class _Step:
    lm: BatchedCachedLM
    input_ids: list[int]
    logits_to_keep: int
    want_hidden: bool
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    error: BaseException | None = None


class TargetBatcher:
    """Owns the target's forward passes for every request of a replica."""

    def __init__(self, model: PreTrainedModel, *, max_batch: int = 8, window_s: float = 0.002) -> None:
        assert max_batch >= 1 and window_s >= 0
        self.model = model
        self.max_batch = max_batch
        self.window_s = window_s
        self.num_batches = 0
        self.num_steps = 0
        self.active = 0
        """Requests decoding now: the batcher waits for more steps only if others could come."""
        self._active_lock = threading.Lock()
        self._queue: queue.Queue[_Step | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="target-batcher", daemon=True)
        self._thread.start()

    def lm(self) -> BatchedCachedLM:
        """A fresh per-request target (its own KV cache) whose forwards go through this batcher."""
        return BatchedCachedLM(self.model, self)

    def begin(self) -> None:
        """A request starts decoding (its steps may now join batches)."""
        with self._active_lock:
            self.active += 1

    def end(self) -> None:
        with self._active_lock:
            self.active -= 1

    def submit(self, step: _Step) -> None:
        self._queue.put(step)
        step.done.wait()
        if step.error is not None:
            raise step.error

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the steps already queued (none is left waiting)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    close = stop

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.window_s
            while len(batch) < min(self.max_batch, self.active):  # a lone request never waits
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            try:
                if len(batch) == 1:
                    s = first
                    s.logits, s.hidden = CachedLM.forward(
                        s.lm, s.input_ids, logits_to_keep=s.logits_to_keep, want_hidden=s.want_hidden
                    )
                else:
                    self._forward_batch(batch)
            except BaseException as exc:  # every waiting request gets the error, none hangs
                log.exception("batched target forward failed for %d requests", len(batch))
                for s in batch:
                    s.error = exc
            self.num_batches += 1
            self.num_steps += len(batch)
            for s in batch:
                s.done.set()

    @torch.inference_mode()
    def _forward_batch(self, batch: list[_Step]) -> None:
        b = len(batch)
        past = [s.lm.num_cached for s in batch]
        new = [len(s.input_ids) for s in batch]
        p_max, n_max = max(past), max(new)
        num_layers = len(batch[0].lm.cache.layers) if p_max else 0
        # 1. pad: caches left-aligned into [b, heads, p_max, dim], inputs right-padded to n_max
        ddp = []
        for layer in range(num_layers):
            ref = next(s.lm.cache.layers[layer] for s in batch if s.lm.num_cached)
            shape = (b, ref.keys.shape[1], p_max, ref.keys.shape[3])
            keys = ref.keys.new_zeros(shape)
            values = ref.values.new_zeros(shape)
            for i, s in enumerate(batch):
                if past[i]:
                    keys[i, :, : past[i]] = s.lm.cache.layers[layer].keys[0]
                    values[i, :, : past[i]] = s.lm.cache.layers[layer].values[0]
            ddp.append((keys, values))
        cache = DynamicCache(ddp, config=self.model.config) if ddp else DynamicCache(config=self.model.config)
        ids = torch.zeros((b, n_max), dtype=torch.long)
        pos = torch.zeros((b, n_max), dtype=torch.long)
        mask = torch.zeros((b, p_max + n_max), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : new[i]] = torch.tensor(s.input_ids, dtype=torch.long)
            pos[i] = torch.arange(past[i], past[i] + n_max)
            mask[i, : past[i]] = 1
            mask[i, p_max : p_max + new[i]] = 1
        # 2. one forward pass
        want_hidden = any(s.want_hidden for s in batch)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        # 3. split: own logits, own new keys/values appended to the request's own cache
        for i, s in enumerate(batch):
            keep = s.logits_to_keep or new[i]
            s.logits = out.logits[i, new[i] - keep : new[i]].float()  # [keep, vocab]
            if s.want_hidden:
                s.hidden = out.hidden_states[-1][i, new[i] - keep : new[i]].float()
            for layer, lay in enumerate(cache.layers):
                k = lay.keys[i : i + 1, :, p_max : p_max + new[i]]
                v = lay.values[i : i + 1, :, p_max : p_max + new[i]]
                s.lm.cache.update(k.clone(), v.clone(), layer)
            s.lm.num_cached += new[i]
            s.lm.num_forwards += 1


class BatchedCachedLM(CachedLM):
    """A request's target with its own KV cache, whose forward passes are batched across requests."""

    def __init__(self, model: PreTrainedModel, batcher: TargetBatcher) -> None:
        super().__init__(model)
        self.batcher = batcher

    def forward(
        self, input_ids: list[int], *, logits_to_keep: int = 0, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert len(input_ids) > 0, "forward needs at least one token"
        assert self.num_cached + len(input_ids) <= self.context_size, (self.num_cached, len(input_ids))
        step = _Step(self, list(input_ids), logits_to_keep, want_hidden)
        self.batcher.submit(step)
        return step.logits, step.hidden

"""The KV slot pool a ``TargetBatcher`` keeps per model, and the cache of a right-padded pass over it.

Per layer, one preallocated key and one value buffer ``[slots, kv_heads, capacity, head_dim]``;
a request holds one row (slot) from its first forward until it closes (``engine.batching``).
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class SlotPool:
    """Preallocated per-layer key/value buffers, one row (slot) per request."""

    def __init__(self, model: PreTrainedModel, *, slots: int, capacity: int = 256) -> None:
        cfg = model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.max_capacity = int(getattr(cfg, "max_position_embeddings", 1 << 20))
        self.dtype, self.device = model.dtype, model.device
        self.capacity = min(capacity, self.max_capacity)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._alloc(slots, self.capacity)
        self.free = list(range(slots))
        self.lock = threading.RLock()
        """Held by a forward pass for its whole duration and by every reallocation, so the
        buffers never move under a pass or under a request copying within its own row."""
        self.num_grows = 0

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def _alloc(self, slots: int, capacity: int) -> None:
        shape = (slots, self.heads, capacity, self.head_dim)
        old_k, old_v = self.keys, self.values
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for layer in range(len(old_k)):
            s, c = old_k[layer].shape[0], old_k[layer].shape[2]
            self.keys[layer][:s, :, :c] = old_k[layer]
            self.values[layer][:s, :, :c] = old_v[layer]
        self.capacity = capacity

    def acquire(self) -> int:
        """A free slot, the lowest first (so requests stepping together sit in consecutive rows)."""
        with self.lock:
            if not self.free:
                n = self.num_slots
                self._alloc(2 * n, self.capacity)
                self.free = list(range(n, 2 * n))
                self.num_grows += 1
                log.info("target KV pool grown to %d slots x %d positions", 2 * n, self.capacity)
            self.free.sort()
            return self.free.pop(0)

    def release(self, slot: int) -> None:
        with self.lock:
            self.free.append(slot)

    def ensure(self, length: int) -> None:
        """Room for ``length`` positions in every row (the batcher thread, or a request loading a
        shared prefill: both under :attr:`lock`, so the buffers never move under a pass)."""
        if length <= self.capacity:
            return
        assert length <= self.max_capacity, (length, self.max_capacity)
        cap = self.capacity
        while cap < length:
            cap *= 2
        with self.lock:
            self._alloc(self.num_slots, min(cap, self.max_capacity))
            self.num_grows += 1
        log.info("target KV pool grown to %d positions per slot", self.capacity)


class SlotCache:
    """A ``transformers`` cache over some rows of a :class:`SlotPool` for one forward pass.

    ``update`` writes the new keys/values of row ``i`` at positions ``lengths[i] ..`` of its
    slot and returns the ``[rows, heads, span, head_dim]`` keys/values to attend over."""

    is_compileable = False

    def __init__(self, pool: SlotPool, slots: list[int], lengths: list[int], span: int) -> None:
        self.pool, self.slots, self.lengths, self.span = pool, slots, lengths, span
        first = slots[0]
        self.view = slots == list(range(first, first + len(slots)))  # consecutive rows: a view, no copy
        self.index = None if self.view else torch.tensor(slots, device=pool.device)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        k_buf, v_buf = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        n = key_states.shape[2]
        for i, (slot, start) in enumerate(zip(self.slots, self.lengths)):
            k_buf[slot, :, start : start + n] = key_states[i]
            v_buf[slot, :, start : start + n] = value_states[i]
        if self.view:
            first = self.slots[0]
            rows = slice(first, first + len(self.slots))
            return k_buf[rows, :, : self.span], v_buf[rows, :, : self.span]
        return k_buf.index_select(0, self.index)[:, :, : self.span], v_buf.index_select(0, self.index)[
            :, :, : self.span
        ]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.span, 0

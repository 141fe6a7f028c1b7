"""Packed (ragged) target passes: the rows of a batch laid end to end, nothing padded.

A batch of requests with 1, 1, 4 and 100 new tokens runs as **one sequence of 106 tokens**
(``[1, T]``, each token at its own request's position), so every linear layer multiplies
exactly the tokens there are: a right-padded batch would compute ``4 x 100`` rows, almost
four times the work, whenever a prompt's prefill joins a batch of decode steps.

The only layer where the requests must not meet is attention. ``transformers`` lets a model
name its attention function (``config._attn_implementation``); the target gets
``"specops_ragged"`` (:func:`install`), which is SDPA unchanged unless the forward carries
``specops_rows`` (a :class:`Rows`). Then, per request, its queries attend over **its own
slot of the KV pool, as a view** (no copy, no gather): the request's cached positions and,
causally, its own new tokens. :class:`PackedCache` is the ``transformers`` cache of such a
pass: it writes every request's new keys and values into its slot in one indexed store per
layer and hands the pool to the attention.

Any model whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` and a ``Cache`` (Llama,
Qwen2/3, Mistral, Gemma, Phi-3 and most others in ``transformers`` 5) packs this way; the
batcher checks once at load (:func:`supported`) and keeps right-padded passes otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

log = logging.getLogger(__name__)

NAME = "specops_ragged"
WIDE_MAX = 17
"""Most new tokens a request may have to attend in a run with its neighbours (a verification
step of k <= 16 drafts and the bonus's position); a longer one (a prefill) attends alone."""


@dataclass
class Rows:
    """Where each request of a packed pass sits: in the pass (``offsets``) and in the pool."""

    slots: list[int]
    past: list[int]
    """Positions each request has cached before the pass."""
    new: list[int]
    """Its new tokens in the pass."""
    offsets: list[int]
    """Where its tokens start in the packed sequence."""
    masks: list[torch.Tensor | None]
    """Per request with more than one new token: ``[new, past + new]`` bool, True where a
    query may attend (its cache, and its own new tokens causally); None for one token."""
    slot_index: torch.Tensor
    """``[T]`` the slot of every packed token (one indexed store per layer writes them all)."""
    pos_index: torch.Tensor
    """``[T]`` its position in the slot."""
    runs: list[tuple[int, int, torch.Tensor | None]] = field(default_factory=list)
    """The requests grouped for attention: ``(first, count, key mask)``. A run of requests in
    consecutive slots with at most :data:`WIDE_MAX` new tokens each (decode steps, verification
    steps) attends in one SDPA call over a view of those slots (mask ``[count, 1, widest,
    longest]``: each query its own request's cache and, causally, its own new tokens); anything
    else (a prefill, a lone request) is a run of one."""
    gathers: list[tuple[torch.Tensor, torch.Tensor, int] | None] = field(default_factory=list)
    """Per run: None when each of its requests has one new token; else ``(q_index, keep,
    widest)``: the packed position each padded query ``(request, j < widest)`` reads (a short
    request's padding repeats its last token), and which padded rows are real, in order."""

    @classmethod
    def build(cls, slots: list[int], past: list[int], new: list[int], device) -> Rows:
        offsets, at = [], 0
        for n in new:
            offsets.append(at)
            at += n
        masks: list[torch.Tensor | None] = []
        for p, n in zip(past, new):
            if n == 1:
                masks.append(None)
                continue
            q = torch.arange(n, device=device)[:, None]
            kv = torch.arange(p + n, device=device)[None, :]
            masks.append(kv <= p + q)
        slot_index = torch.tensor([s for s, n in zip(slots, new) for _ in range(n)], device=device)
        pos_index = torch.cat([torch.arange(p, p + n, device=device) for p, n in zip(past, new)])
        runs: list[tuple[int, int, torch.Tensor | None]] = []
        gathers: list[tuple[torch.Tensor, torch.Tensor, int] | None] = []
        i = 0
        while i < len(slots):
            j = i + 1
            if new[i] <= WIDE_MAX:
                while j < len(slots) and new[j] <= WIDE_MAX and slots[j] == slots[j - 1] + 1:
                    j += 1
            if j - i == 1:
                runs.append((i, 1, None))
                gathers.append(None)
                i = j
                continue
            widest = max(new[i:j])
            if widest == 1:  # decode steps: one query each
                lengths = torch.tensor([p + 1 for p in past[i:j]], device=device)
                mask = torch.arange(int(lengths.max()), device=device)[None, :] < lengths[:, None]
                runs.append((i, j - i, mask[:, None, None, :]))
                gathers.append(None)
                i = j
                continue
            # query q of request r sees positions < past_r + min(q, new_r - 1) + 1 (padding repeats the last)
            seen = torch.tensor(
                [[p + min(q, n - 1) + 1 for q in range(widest)] for p, n in zip(past[i:j], new[i:j])], device=device
            )  # [count, widest]
            mask = torch.arange(int(seen.max()), device=device)[None, None, :] < seen[:, :, None]
            q_index = torch.tensor(
                [o + min(q, n - 1) for o, n in zip(offsets[i:j], new[i:j]) for q in range(widest)], device=device
            )
            keep = torch.tensor([r * widest + q for r, n in enumerate(new[i:j]) for q in range(n)], device=device)
            runs.append((i, j - i, mask[:, None]))
            gathers.append((q_index, keep, widest))
            i = j
        return cls(slots, past, new, offsets, masks, slot_index, pos_index, runs, gathers)

    @property
    def positions(self) -> torch.Tensor:
        """``[1, T]`` each token's position in its own request."""
        return self.pos_index[None]


class PackedCache:
    """A ``transformers`` cache over a packed pass: new keys/values go to their requests'
    slots of the pool; the attention (:func:`ragged_attention`) reads the slots back as views."""

    is_compileable = False

    def __init__(self, pool, rows: Rows) -> None:
        self.pool, self.rows = pool, rows

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        k_buf, v_buf = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        # [1, heads, T, dim] -> [T, heads, dim]: one store for every request's new positions
        k_buf[self.rows.slot_index, :, self.rows.pos_index] = key_states[0].transpose(0, 1)
        v_buf[self.rows.slot_index, :, self.rows.pos_index] = value_states[0].transpose(0, 1)
        return k_buf, v_buf

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(p + n for p, n in zip(self.rows.past, self.rows.new))

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


def ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA per request over its own slot (``specops_rows``), or plain SDPA without it."""
    rows: Rows | None = kwargs.pop("specops_rows", None)
    if rows is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    h, d = key.shape[1], query.shape[-1]
    outs = []
    for run, (first, count, run_mask) in enumerate(rows.runs):
        gather = rows.gathers[run] if rows.gathers else None
        if gather is not None:  # requests with a few new tokens each, consecutive slots: one call over a view
            q_index, keep, widest = gather
            slot, span = rows.slots[first], run_mask.shape[-1]
            q = query[0].index_select(1, q_index)  # [heads, count * widest, dim], padded per request
            # each kv head's query groups as extra query rows (no repeat of the keys): [count, kv_heads, groups * widest, dim]
            q = q.view(h, groups, count, widest, d).permute(2, 0, 1, 3, 4).reshape(count, h, groups * widest, d)
            mask = run_mask.repeat(1, 1, groups, 1) if groups > 1 else run_mask  # [count, 1, groups * widest, span]
            k = key[slot : slot + count, :, :span]
            v = value[slot : slot + count, :, :span]
            o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
            o1 = o1.view(count, h, groups, widest, d).permute(1, 2, 0, 3, 4).reshape(h * groups, count * widest, d)
            outs.append(o1.index_select(1, keep)[None])  # [1, heads, its tokens, dim]
            continue
        if count > 1:  # one-token requests in consecutive slots: one call over a view of their slots
            slot, o = rows.slots[first], rows.offsets[first]
            q = query[0, :, o : o + count].transpose(0, 1)  # [count, heads, 1, dim] as [count, heads, dim]
            k = key[slot : slot + count, :, : run_mask.shape[-1]]  # [count, kv_heads, longest, dim]: a view
            v = value[slot : slot + count, :, : run_mask.shape[-1]]
            o1 = F.scaled_dot_product_attention(q.reshape(count, h, groups, d), k, v, attn_mask=run_mask, scale=scaling)
            outs.append(o1.reshape(count, h * groups, d).transpose(0, 1)[None])  # [1, heads, count, dim]
            continue
        slot, p, n, o, mask = (x[first] for x in (rows.slots, rows.past, rows.new, rows.offsets, rows.masks))
        q = query[:, :, o : o + n]  # [1, heads, n, dim]
        k = key[slot : slot + 1, :, : p + n]  # [1, kv_heads, p + n, dim]: a view of the pool
        v = value[slot : slot + 1, :, : p + n]
        if n == 1 and groups > 1:  # one query per head: the kv heads' groups as queries (no repeat)
            o1 = F.scaled_dot_product_attention(q.reshape(1, h, groups, d), k, v, scale=scaling)
            outs.append(o1.reshape(1, h * groups, 1, d))
        else:
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, heads, T, dim]
    return out.transpose(1, 2).contiguous(), None


def install(model: PreTrainedModel) -> bool:
    """Route ``model``'s attention through :func:`ragged_attention` (SDPA unless a pass is
    packed); False, leaving the model as it was, where it does not use SDPA or cannot."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if model.config._attn_implementation not in ("sdpa", NAME):
        log.info("packed target passes off: the target's attention is %r, not sdpa", model.config._attn_implementation)
        return False
    AttentionInterface.register(NAME, ragged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    try:
        model.set_attn_implementation(NAME)
    except Exception as exc:  # an architecture that refuses custom attention keeps its padded passes
        log.info("packed target passes off: %s", exc)
        return False
    return True

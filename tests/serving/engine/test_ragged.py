"""Packed target passes (``engine.ragged``) and how the batcher gathers a batch."""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F

from specops.serving.engine import ragged
from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.kv import CachedLM
from tests.conftest import random_prompts


def test_ragged_attention_equals_sdpa_per_request():
    """Each request's queries see its own cached positions and, causally, its own new tokens:
    the packed attention equals SDPA run on each request alone (GQA, 1 and several new tokens)."""
    torch.manual_seed(0)
    heads, kv_heads, dim, slots, cap = 6, 2, 8, 6, 32
    k_pool, v_pool = torch.randn(slots, kv_heads, cap, dim), torch.randn(slots, kv_heads, cap, dim)
    slot_ids, past, new = [0, 1, 2, 4, 5], [5, 9, 3, 0, 7], [1, 1, 4, 3, 1]
    rows = ragged.Rows.build(slot_ids, past, new, "cpu")
    assert rows.offsets == [0, 1, 2, 6, 9]
    assert rows.positions.tolist() == [[5, 9, 3, 4, 5, 6, 0, 1, 2, 7]]
    # consecutive slots attend in one call each (0-2: two decode steps beside a 4-token step, padded
    # to 4 queries a request; 4-5: a 3-token step beside a decode step)
    assert [(first, count) for first, count, _ in rows.runs] == [(0, 3), (3, 2)]
    assert rows.gathers[0][2] == 4 and rows.gathers[1][2] == 3
    q = torch.randn(1, heads, sum(new), dim)

    class Module:  # what transformers hands the attention function
        num_key_value_groups = heads // kv_heads

    out, _ = ragged.ragged_attention(Module(), q, k_pool, v_pool, None, scaling=0.3, specops_rows=rows)
    assert out.shape == (1, sum(new), heads, dim)
    for slot, p, n, o in zip(slot_ids, past, new, rows.offsets):
        k = k_pool[slot : slot + 1, :, : p + n].repeat_interleave(heads // kv_heads, dim=1)
        v = v_pool[slot : slot + 1, :, : p + n].repeat_interleave(heads // kv_heads, dim=1)
        mask = torch.arange(p + n)[None, :] <= p + torch.arange(n)[:, None]
        want = F.scaled_dot_product_attention(q[:, :, o : o + n], k, v, attn_mask=mask, scale=0.3)
        torch.testing.assert_close(out[:, o : o + n], want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_wide_runs_and_prefills_attend_as_each_request_alone():
    """Verification steps of several widths in consecutive slots share one SDPA call, a prefill longer
    than WIDE_MAX attends alone, a gap in the slots starts a new run: the same values as SDPA per request."""
    torch.manual_seed(1)
    heads, kv_heads, dim, slots, cap = 9, 3, 8, 8, 64
    k_pool, v_pool = torch.randn(slots, kv_heads, cap, dim), torch.randn(slots, kv_heads, cap, dim)
    slot_ids, past, new = [0, 1, 2, 3, 5, 6], [9, 4, 0, 12, 7, 3], [5, 1, ragged.WIDE_MAX + 3, 2, 4, 4]
    rows = ragged.Rows.build(slot_ids, past, new, "cpu")
    assert [(first, count) for first, count, _ in rows.runs] == [(0, 2), (2, 1), (3, 1), (4, 2)]
    q = torch.randn(1, heads, sum(new), dim)
    out, _ = ragged.ragged_attention(None, q, k_pool, v_pool, None, scaling=0.2, specops_rows=rows)
    for slot, p, n, o in zip(slot_ids, past, new, rows.offsets):
        k = k_pool[slot : slot + 1, :, : p + n].repeat_interleave(heads // kv_heads, dim=1)
        v = v_pool[slot : slot + 1, :, : p + n].repeat_interleave(heads // kv_heads, dim=1)
        mask = torch.arange(p + n)[None, :] <= p + torch.arange(n)[:, None]
        want = F.scaled_dot_product_attention(q[:, :, o : o + n], k, v, attn_mask=mask, scale=0.2)
        torch.testing.assert_close(out[:, o : o + n], want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_a_packed_pass_computes_only_its_tokens_and_writes_each_slot(close_pair):
    """A prefill beside a 1-token step: one pass of their tokens (no padding row), each request's
    keys in its own slot, equal to an unbatched model's cache."""
    target = close_pair.target
    batcher = TargetBatcher(target, max_batch=2, window_s=0.5)
    try:
        seqs = [random_prompts(1, seed=8, lo=12, hi=13)[0], [5]]
        plain, batched = [CachedLM(target) for _ in seqs], [batcher.lm() for _ in seqs]
        plain[1].forward([9, 10]), batcher.begin()
        batched[1].forward([9, 10])
        batcher.end()
        for _ in seqs:
            batcher.begin()
        got: list = [None, None]
        threads = [
            threading.Thread(target=lambda i=i: got.__setitem__(i, batched[i].forward(seqs[i]))) for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        want = [p.forward(s) for p, s in zip(plain, seqs)]
        for (wl, _), (gl, _) in zip(want, got):
            torch.testing.assert_close(gl, wl, rtol=1e-4, atol=1e-4)
        passes = [b.last_pass for b in batched]
        if passes[0].rows == 2:  # shared one pass
            assert passes[0].packed and passes[0].computed_tokens == 13
        for p, b in zip(plain, batched):
            for lp, lb in zip(p.cache.layers, b.cache.layers):
                torch.testing.assert_close(lb.keys, lp.keys, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(lb.values, lp.values, rtol=1e-4, atol=1e-4)
    finally:
        batcher.close()


def test_the_batcher_waits_for_requests_just_back_from_a_pass(close_pair):
    """Four requests that each do some work between steps (longer than ``window_s``) still share
    their passes: the batcher waits for the requests it just served (``straggle`` x a pass)."""
    batcher = TargetBatcher(close_pair.target, max_batch=4, window_s=0.0, straggle=2000.0)
    steps = 12
    try:
        lms = [batcher.lm() for _ in range(4)]
        for _ in lms:
            batcher.begin()

        def run(i: int) -> None:
            lms[i].forward([1, 2, 3])
            for t in range(steps):
                time.sleep(0.003 * (1 + i % 2))  # propose, commit, stream: off the batcher
                lms[i].forward([4 + t])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert batcher.num_steps == 4 * (steps + 1)
        # without waiting for the stragglers, window_s = 0 runs nearly every step alone
        assert batcher.num_batches <= 2 * (steps + 1), batcher.num_batches
    finally:
        for _ in range(4):
            batcher.end()
        batcher.close()


def test_a_draft_batched_on_the_batcher_scores_its_vocabulary_like_a_plain_cache(served_pair):
    """serving's draft (bfloat16, a draft vocabulary: ``served_pair``) through the batcher's own
    pool for it: the same logits (``-inf`` off its vocabulary) as its plain ``CachedLM``."""
    draft = served_pair.draft
    batcher = TargetBatcher(served_pair.target, max_batch=4, window_s=0.5)
    try:
        seqs = random_prompts(2, seed=11, lo=5, hi=9)
        lms = [batcher.lm(draft) for _ in seqs]
        assert all(lm.pool is batcher.pool_for(draft)[0] is not batcher.pool for lm in lms)
        for _ in seqs:
            batcher.begin()
        got: list = [None, None]

        def run(i: int) -> None:
            got[i] = [lms[i].forward(seqs[i], logits_to_keep=1)[0], lms[i].forward([7])[0]]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for s, g in zip(seqs, got):
            plain = CachedLM(draft)
            want = [plain.forward(s, logits_to_keep=1)[0], plain.forward([7])[0]]
            for w, x in zip(want, g):
                assert torch.equal(torch.isinf(w), torch.isinf(x))
                finite = torch.isfinite(w)
                torch.testing.assert_close(x[finite], w[finite], rtol=5e-2, atol=5e-2)  # bfloat16
        for lm in lms:
            lm.close()
        assert len(batcher.pool_for(draft)[0].free) == batcher.pool_for(draft)[0].num_slots
    finally:
        for _ in range(2):
            batcher.end()
        batcher.close()

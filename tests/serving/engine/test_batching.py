"""Cross-request batching of target forwards: a batched step computes what an unbatched one does."""

from __future__ import annotations

import threading

import pytest
import torch

from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from tests.conftest import random_prompts


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_batched_steps_match_unbatched(close_pair, packed):
    """Three requests at different cache lengths, stepped together: same logits, same caches,
    in packed passes (engine.ragged) and in right-padded ones (a target without SDPA)."""
    target = close_pair.target
    batcher = TargetBatcher(target, max_batch=8, window_s=0.5)
    assert batcher.packed, "the tiny Llama target uses SDPA: its passes pack"
    batcher.packed = packed
    try:
        seqs = random_prompts(3, seed=2, lo=3, hi=20)
        plain = [CachedLM(target) for _ in seqs]
        batched = [batcher.lm() for _ in seqs]
        feeds = [[s, [7, 8, 9], [1], [4, 5, 6, 7, 8]] for s in seqs]  # prefill, then steps of different sizes
        for _ in seqs:
            batcher.begin()
        for step in range(4):
            want = [p.forward(f[step], logits_to_keep=2 if step else 0) for p, f in zip(plain, feeds)]
            got: list = [None] * len(seqs)

            def run(i: int, step: int = step, got: list = got) -> None:
                got[i] = batched[i].forward(feeds[i][step], logits_to_keep=2 if step else 0)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(seqs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            for (wl, _), (gl, _) in zip(want, got):
                assert gl.shape == wl.shape
                torch.testing.assert_close(gl, wl, rtol=1e-4, atol=1e-4)
        for p, b in zip(plain, batched):
            assert b.num_cached == p.num_cached and b.num_forwards == p.num_forwards == 4
            for lp, lb in zip(p.cache.layers, b.cache.layers):
                torch.testing.assert_close(lb.keys, lp.keys, rtol=1e-4, atol=1e-4)
        b = batched[0]
        b.rollback(b.num_cached - 2)  # the verifier's rollback works on a batched request's cache
        assert b.cache.get_seq_length() == b.num_cached
        assert batcher.num_batches <= 4 + 3, "steps were not batched"
    finally:
        batcher.close()


@pytest.mark.parametrize(
    "packed,drafts_batched", [(True, False), (False, False), (True, True)], ids=["packed", "padded", "drafts-batched"]
)
def test_concurrent_greedy_requests_stay_lossless(close_pair, packed, drafts_batched):
    """Many concurrent speculative requests through one batcher: every output is the target's,
    the draft model's forwards batched across requests on the batcher's thread too."""
    from specops.serving.proposers.catalogue import ProposerResources

    batcher = TargetBatcher(close_pair.target, max_batch=8, window_s=0.01)
    batcher.packed = packed
    resources = ProposerResources(pair=close_pair, model_lm=batcher.lm if drafts_batched else None)
    params = SamplingParams(max_new_tokens=24)
    prompts = random_prompts(8, seed=4, lo=3, hi=16)
    want = [plain_generate(SpecEngine(close_pair), p, params, method="target").token_ids for p in prompts]
    got: list = [None] * len(prompts)

    def run(i: int) -> None:
        batcher.begin()
        try:
            engine = SpecEngine(close_pair, target_lm=batcher.lm)
            got[i] = plain_generate(engine, prompts[i], params, method="draft", k=4, resources=resources).token_ids
        finally:
            batcher.end()

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == want
        assert batcher.num_steps > batcher.num_batches, "no two requests ever shared a forward pass"
        draft_pool = batcher.pool_for(close_pair.draft)[0]
        assert draft_pool is not batcher.pool
        if drafts_batched:  # every request gave its draft slot back
            assert len(draft_pool.free) == draft_pool.num_slots
    finally:
        batcher.close()


def test_slots_are_reused_grown_and_rolled_back_in_place(close_pair):
    """A closed request's slot is reused; more requests than slots and longer contexts than the
    pool grow it; a rollback inside a slot then more steps equals an unbatched cache."""
    target = close_pair.target
    batcher = TargetBatcher(target, max_batch=2, window_s=0.0, capacity=8)
    try:
        pool = batcher.pool
        buffers = [id(t) for t in pool.keys]
        a, b = batcher.lm(), batcher.lm()
        assert (a.slot, b.slot) == (0, 1)
        c = batcher.lm()  # a third request: the pool doubles its rows
        assert c.slot == 2 and pool.num_slots == 4 and pool.num_grows == 1
        a.close()
        assert batcher.lm().slot == 0  # the lowest free slot is reused
        plain = CachedLM(target)
        prompt = random_prompts(1, seed=5, lo=20, hi=21)[0]
        for lm in (plain, b):
            lm.forward(prompt)  # 20 tokens > capacity 8: the pool grows to 32
            lm.forward([3, 4, 5, 6])
            lm.rollback(lm.num_cached - 3)
        assert pool.capacity >= 24 and b.num_cached == plain.num_cached == 21
        want, _ = plain.forward([9, 10], logits_to_keep=2)
        got, _ = b.forward([9, 10], logits_to_keep=2)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for lp, lb in zip(plain.cache.layers, b.cache.layers):
            torch.testing.assert_close(lb.keys, lp.keys, rtol=1e-4, atol=1e-4)
        assert [id(t) for t in pool.keys] != buffers  # grown: new buffers, the content copied
    finally:
        batcher.close()


def test_steps_write_in_place_without_reallocating(close_pair):
    """Once the pool is big enough, steps allocate no new cache buffers: the same tensors every step."""
    batcher = TargetBatcher(close_pair.target, max_batch=4, window_s=0.0, capacity=64)
    try:
        lm = batcher.lm()
        lm.forward([1, 2, 3])
        buffers = [t.data_ptr() for t in batcher.pool.keys]
        for i in range(10):
            lm.forward([4 + i])
        assert [t.data_ptr() for t in batcher.pool.keys] == buffers and batcher.pool.num_grows == 0
    finally:
        batcher.close()


def test_a_token_tree_runs_through_the_batcher(close_pair):
    """A tree step over a slot gives what the same tree gives over a plain cache."""
    from specops.serving.engine.tree import build

    batcher = TargetBatcher(close_pair.target, max_batch=4, window_s=0.0)
    try:
        tree = build([[7, 1, 2], [7, 4], [9]])
        prompt = random_prompts(1, seed=6, lo=8, hi=9)[0]
        plain, b = CachedLM(close_pair.target), batcher.lm()
        plain.forward(prompt[:4])
        b.forward(prompt[:4])
        want, _ = plain.forward_tree(prompt[4:], tree)
        got, _ = b.forward_tree(prompt[4:], tree)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        plain.keep_path(len(prompt), [1, 4])
        b.keep_path(len(prompt), [1, 4])
        torch.testing.assert_close(b.forward([5])[0], plain.forward([5])[0], rtol=1e-4, atol=1e-4)
    finally:
        batcher.close()


def test_a_prefill_beside_decodes_scores_only_the_kept_columns_and_reports_the_pass(close_pair):
    """A long prompt's prefill shares a pass with 1-token steps: the head scores only the columns
    some row keeps (the prefill's last, the others' first: not contiguous), the logits equal an
    unbatched forward's, and each step learns the pass as it ran (rows, width, the others)."""
    target = close_pair.target
    batcher = TargetBatcher(target, max_batch=4, window_s=0.5)
    try:
        seqs = random_prompts(3, seed=5, lo=4, hi=9)
        plain = [CachedLM(target) for _ in seqs]
        batched = [batcher.lm() for _ in seqs]
        for p, b, s in zip(plain, batched, seqs):  # every request prefilled alone first
            p.forward(s, logits_to_keep=1)
            batcher.begin()
            b.forward(s, logits_to_keep=1)
            batcher.end()
        assert batched[0].last_pass.rows == 1 and plain[0].last_pass.rows == 1
        long_prompt = random_prompts(1, seed=6, lo=30, hi=31)[0]
        feeds = [long_prompt, [3], [4, 5]]
        want = [p.forward(f, logits_to_keep=1) for p, f in zip(plain, feeds)]
        got: list = [None] * 3
        for _ in seqs:
            batcher.begin()

        def run(i: int) -> None:
            got[i] = batched[i].forward(feeds[i], logits_to_keep=1)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for (wl, _), (gl, _) in zip(want, got):
            assert gl.shape == wl.shape == (1, wl.shape[1])
            torch.testing.assert_close(gl, wl, rtol=1e-4, atol=1e-4)
        passes = [b.last_pass for b in batched]
        if all(p.rows == 3 for p in passes):  # they shared one pass (the window is long enough)
            assert [p.width for p in passes] == [30, 30, 30]
            assert [p.mine for p in passes] == [30, 1, 2]
            assert [p.others for p in passes] == [3, 32, 31]
            assert [p.widest_other for p in passes] == [2, 30, 30]
            assert passes[0].ms > 0
            # packed (engine.ragged): 33 token rows computed; right-padded: 3 x 30
            assert passes[0].computed_tokens == (33 if batcher.packed else 90)
        assert sum(p.mine for p in passes) == 33
    finally:
        batcher.close()

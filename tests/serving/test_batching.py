"""Cross-request batching of target forwards: a batched step computes what an unbatched one does."""

from __future__ import annotations

import threading

import torch

from serving.engine.batching import TargetBatcher
from serving.engine.spec import SpecEngine
from serving.engine.kv import CachedLM
from serving.engine.types import SamplingParams
from tests.conftest import random_prompts


def test_batched_steps_match_unbatched(close_pair):
    """Three requests at different cache lengths, stepped together: same logits, same caches."""
    target = close_pair.target
    batcher = TargetBatcher(target, max_batch=8, window_s=0.5)
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


def test_concurrent_greedy_requests_stay_lossless(close_pair):
    """Many concurrent speculative requests through one batcher: every output is the target's."""
    batcher = TargetBatcher(close_pair.target, max_batch=8, window_s=0.01)
    params = SamplingParams(max_new_tokens=24)
    prompts = random_prompts(8, seed=4, lo=3, hi=16)
    want = [SpecEngine(close_pair).generate(p, params, method="target").token_ids for p in prompts]
    got: list = [None] * len(prompts)

    def run(i: int) -> None:
        batcher.begin()
        try:
            engine = SpecEngine(close_pair, target_lm=batcher.lm)
            got[i] = engine.generate(prompts[i], params, method="draft", k=4).token_ids
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
    finally:
        batcher.close()

"""A request's choices share the prompt's prefill (``specops.serving.engine.prefix``): choice 0 prefills,
the others load its keys and values; every choice's output stays the target's, over a plain
cache and over the batcher's slots; a lead that fails, or a context that differs, costs only
the sharing."""

from __future__ import annotations

import threading

import pytest

from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.prefix import SharedPrefix
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate, plain_session
from tests.conftest import random_prompts

PARAMS = SamplingParams(max_new_tokens=12)


def _choices(engine: SpecEngine, prompt: list[int], n: int, method: str, begin=None, end=None) -> list:
    """``n`` choices of one request on threads, as the API decodes them: choice 0 leads."""
    group, out = SharedPrefix(wait_s=60), [None] * n

    def run(i: int) -> None:
        if begin is not None:
            begin()
        try:
            out[i] = plain_generate(engine, prompt, PARAMS, method=method, k=3, prefix_share=group.handle(lead=i == 0))
        finally:
            if end is not None:
                end()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in reversed(threads):  # the followers first: they wait for the lead
        t.start()
    for t in threads:
        t.join(120)
    assert group.num_taken == n - 1
    return out


@pytest.mark.parametrize("method", ["target", "draft", "pld"])
def test_followers_load_the_leads_prefill_and_stay_the_targets(close_pair, method):
    prompt = random_prompts(1, seed=11, lo=40, hi=41)[0]
    want = plain_generate(SpecEngine(close_pair), prompt, PARAMS, method="target")
    results = _choices(SpecEngine(close_pair), prompt, 3, method)
    assert [r.token_ids for r in results] == [want.token_ids] * 3
    assert [r.stats.num_prefill_shared for r in results] == [0, len(prompt) - 1, len(prompt) - 1]


def test_followers_share_through_the_batchers_slots(close_pair):
    batcher = TargetBatcher(close_pair.target, max_batch=4, window_s=0.01, capacity=16)
    try:
        engine = SpecEngine(close_pair, target_lm=batcher.lm)
        prompt = random_prompts(1, seed=12, lo=40, hi=41)[0]  # longer than the pool's rows: loading grows it
        want = plain_generate(SpecEngine(close_pair), prompt, PARAMS, method="target").token_ids
        results = _choices(engine, prompt, 4, "draft", begin=batcher.begin, end=batcher.end)
        assert [r.token_ids for r in results] == [want] * 4
        assert batcher.pool.capacity >= len(prompt) + 12
        assert len(batcher.pool.free) == batcher.pool.num_slots  # every choice gave its slot back
    finally:
        batcher.close()


def test_a_lead_that_fails_lets_the_followers_prefill(close_pair):
    """The lead ends before its first step (its client went away): followers stop waiting."""
    prompt = random_prompts(1, seed=13, lo=20, hi=21)[0]
    engine, group = SpecEngine(close_pair), SharedPrefix(wait_s=60)
    want = plain_generate(engine, prompt, PARAMS, method="target").token_ids
    lead = plain_session(engine, prompt, PARAMS, method="draft", prefix_share=group.handle(lead=True))
    got: list = []
    follower = threading.Thread(
        target=lambda: got.append(
            plain_generate(engine, prompt, PARAMS, method="draft", prefix_share=group.handle(False))
        )
    )
    follower.start()
    lead.abort()
    follower.join(60)
    assert got[0].token_ids == want and got[0].stats.num_prefill_shared == 0 and group.num_taken == 0


def test_a_follower_with_another_context_prefills_its_own(close_pair):
    a, b = random_prompts(2, seed=14, lo=20, hi=21)
    engine, group = SpecEngine(close_pair), SharedPrefix(wait_s=60)
    plain_generate(engine, a, PARAMS, method="draft", prefix_share=group.handle(lead=True))
    other = plain_generate(engine, b, PARAMS, method="draft", prefix_share=group.handle(lead=False))
    assert other.stats.num_prefill_shared == 0 and group.num_taken == 0
    assert other.token_ids == plain_generate(engine, b, PARAMS, method="target").token_ids

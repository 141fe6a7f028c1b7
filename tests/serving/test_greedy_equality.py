"""Release gate: at temperature 0 every method equals target-only greedy, token for token."""

from __future__ import annotations

import pytest
import torch

from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from tests.conftest import random_prompts


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy with no KV cache at all: full recompute every token."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_target_method_equals_full_recompute(tiny_pair):
    engine = SpecEngine(tiny_pair)
    for prompt in random_prompts(6, seed=10):
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=20), method="target")
        assert out.token_ids == reference_greedy(tiny_pair.target, prompt, 20)
        assert out.stats.num_target_forwards == 20  # one forward per token, prefill included


def test_target_method_equals_hf_generate(tiny_pair):
    engine = SpecEngine(tiny_pair)
    for prompt in random_prompts(4, seed=11):
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=16), method="target")
        hf = tiny_pair.target.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert out.token_ids == hf


@pytest.mark.parametrize("pair_name", ["tiny_pair", "close_pair", "twin_pair", "served_pair"])
@pytest.mark.parametrize("method", ["draft", "pld"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_every_method_equals_target_greedy(request, pair_name, method, k):
    pair = request.getfixturevalue(pair_name)
    engine = SpecEngine(pair)
    for prompt in random_prompts(8, seed=100 + k):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method="target")
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method=method, k=k)
        assert out.token_ids == ref.token_ids, (prompt, k)
        assert out.stats.num_generated == 24
        assert out.stats.num_accepted <= out.stats.num_drafted


def test_twin_draft_is_always_accepted(twin_pair):
    engine = SpecEngine(twin_pair)
    for prompt in random_prompts(4, seed=7):
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=25), method="draft", k=4)
        assert out.stats.acceptance_rate == 1.0
        # 25 tokens = 5 steps of (4 accepted + 1 bonus): the target ran 5 times, not 25.
        assert out.stats.num_target_forwards == 5
        assert out.stats.tokens_per_target_forward == 5.0


def test_close_draft_accepts_partially(close_pair):
    engine = SpecEngine(close_pair)
    rates = [
        plain_generate(engine, p, SamplingParams(max_new_tokens=30), method="draft", k=4).stats.acceptance_rate
        for p in random_prompts(6, seed=8)
    ]
    mean = sum(rates) / len(rates)
    assert 0.15 < mean < 0.9, rates


def test_pld_copies_repeated_text(tiny_pair):
    """On a prompt that repeats, and with the target itself repeating, lookup drafts get accepted."""
    engine = SpecEngine(tiny_pair)
    prompt = random_prompts(1, seed=9, lo=6, hi=7)[0]
    ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=60), method="target").token_ids
    looped = prompt + ref  # the target's own continuation, so lookup has something true to copy
    out = plain_generate(engine, looped * 2, SamplingParams(max_new_tokens=40), method="pld", k=6)
    assert (
        out.token_ids
        == plain_generate(engine, looped * 2, SamplingParams(max_new_tokens=40), method="target").token_ids
    )
    assert out.stats.num_accepted > 0


def test_lookup_prefers_recent_match_with_full_continuation():
    import numpy as np

    from specops.serving.proposers.prompt_lookup import lookup

    # "7 8" occurs at 0, 4 and 8; the continuation after 8 is short (loop of period 4).
    toks = np.array([7, 8, 1, 2, 7, 8, 3, 4, 7, 8, 5, 7, 8])
    assert lookup(toks, 3, max_ngram=2) == [5, 7, 8]  # most recent hit with 3 tokens after it
    assert lookup(toks, 4, max_ngram=2) == [3, 4, 7, 8]  # hit at 4: the latest with 4 after it
    assert lookup(np.array([1, 2, 3, 9, 2, 3]), 2, max_ngram=3) == [9, 2]  # falls back to a 2-gram
    assert lookup(np.array([5, 6, 7]), 3, max_ngram=3) == []  # no earlier occurrence


def test_a_draft_vocabulary_drafts_only_its_tokens(served_pair):
    from specops.serving.engine.types import DecodeState
    from specops.serving.proposers.draft_model import DraftModelProposer
    from tests.conftest import SUBSET

    for prompt in random_prompts(4, seed=13):
        state = DecodeState(token_ids=list(prompt), num_prompt_tokens=len(prompt), params=SamplingParams())
        proposer = DraftModelProposer(served_pair.draft)
        proposer.start(state)
        drafted = proposer.propose(state, 6).tokens[0].tolist()
        assert len(drafted) == 6 and set(drafted) <= set(SUBSET)
    out = plain_generate(
        SpecEngine(served_pair), random_prompts(1, seed=14)[0], SamplingParams(max_new_tokens=24), method="draft"
    )
    assert out.stats.num_accepted > 0  # the subset still drafts what the target says, often

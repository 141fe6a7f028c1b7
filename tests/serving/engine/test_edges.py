"""EOS, max-length and context edges, and clear errors for bad input."""

from __future__ import annotations

import copy

import pytest

from specops.core.errors import InvalidRequestError, PromptTooLongError, TokenizerMismatchError, http_status
from specops.core.models import ModelPair
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from tests.conftest import tiny_llama


@pytest.mark.parametrize("method", ["target", "draft", "pld"])
def test_stops_at_eos_inclusive(close_pair, method):
    prompt = [11, 12, 13, 11, 12]
    free = plain_generate(SpecEngine(close_pair), prompt, SamplingParams(max_new_tokens=30), method="target").token_ids
    eos_at = 7
    pair = copy.copy(close_pair)
    pair.target = copy.deepcopy(close_pair.target)
    pair.target.generation_config.eos_token_id = free[eos_at]
    first = free.index(free[eos_at])  # EOS stops at its first occurrence
    out = plain_generate(SpecEngine(pair), prompt, SamplingParams(max_new_tokens=30), method=method, k=5)
    assert out.token_ids == free[: first + 1]
    assert out.stats.finish_reason == "eos"
    # Every step but the last emits a bonus; the last may end on an accepted EOS. Nothing past EOS counts.
    assert out.stats.num_accepted <= len(out.token_ids) - (out.stats.num_verify_steps - 1)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
@pytest.mark.parametrize("method", ["draft", "pld"])
def test_max_new_tokens_exact(twin_pair, n, method):
    prompt = [4, 5, 6, 4, 5]
    out = plain_generate(SpecEngine(twin_pair), prompt, SamplingParams(max_new_tokens=n), method=method, k=8)
    ref = plain_generate(SpecEngine(twin_pair), prompt, SamplingParams(max_new_tokens=n), method="target")
    assert out.token_ids == ref.token_ids and len(out.token_ids) == n
    assert out.stats.finish_reason == "length"


@pytest.mark.parametrize("method", ["target", "draft", "pld"])
def test_stops_when_context_is_full(method):
    target = tiny_llama(32, 1, seed=5, context=16)
    pair = ModelPair(target=target, draft=copy.deepcopy(target), tokenizer=None)
    out = plain_generate(SpecEngine(pair), list(range(1, 14)), SamplingParams(max_new_tokens=10), method=method, k=4)
    assert len(out.token_ids) == 3  # 13 prompt tokens + 3 = the 16-token context
    assert out.stats.finish_reason == "context"


def test_empty_prompt_is_rejected(tiny_pair):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        plain_generate(SpecEngine(tiny_pair), [], SamplingParams(), method="draft")


@pytest.mark.parametrize("k", [0, -1])
def test_bad_k_is_rejected(tiny_pair, k):
    with pytest.raises(InvalidRequestError, match="k .* must be an integer >= 1"):
        plain_generate(SpecEngine(tiny_pair), [1, 2], SamplingParams(), method="draft", k=k)


def test_prompt_longer_than_context_is_rejected(tiny_pair):
    context = tiny_pair.target.config.max_position_embeddings
    with pytest.raises(PromptTooLongError, match=f"model context is {context}") as info:
        plain_generate(SpecEngine(tiny_pair), [1] * context, SamplingParams(), method="target")
    assert http_status(info.value) == 413


def test_out_of_vocab_and_bad_params_are_rejected(tiny_pair):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        plain_generate(SpecEngine(tiny_pair), [1, 10_000], SamplingParams(), method="target")
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="unknown method"):
        plain_generate(SpecEngine(tiny_pair), [1, 2], SamplingParams(), method="medusa")


def test_draft_with_other_vocabulary_is_rejected(tiny_target):
    other = tiny_llama(32, 1, seed=2, vocab=101)
    with pytest.raises(TokenizerMismatchError, match="share one tokenizer"):
        ModelPair(target=tiny_target, draft=other, tokenizer=None)

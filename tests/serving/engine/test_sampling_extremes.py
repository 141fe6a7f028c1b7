"""Sampling at the edges of what a request may ask: ``top_p`` down to 5e-324 (0 in float32),
temperatures from the smallest double to far above the API's 2.0, and distributions that are
not distributions (all zero, NaN, infinite, negative) reaching a draw. Whatever the setting,
warping keeps at least the most probable token and a draw returns a token instead of raising;
the ordinary settings are untouched (``test_verifier.py`` checks the distributions)."""

from __future__ import annotations

import pytest
import torch

from specops.serving.engine import tree as tree_mod
from specops.serving.engine.sampling import draw, tempered_softmax, warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.engine.verifier import decide, decide_tree
from specops.serving.plan import plain_generate
from specops.serving.ralm.knnlm.decode import next_token

TOP_PS = (5e-324, 1e-300, 1e-46, 1e-40, 1e-8, 0.3, 1.0 - 1e-12, 1.0)
TEMPERATURES = (5e-324, 1e-300, 1e-45, 1e-38, 1e-30, 1e-8, 0.01, 1.0, 2.0, 1e30, 1e300)
VOCAB = 97


def _logits(seed: int, scale: float = 8.0) -> torch.Tensor:
    """[4, vocab]: random rows, one with a masked (-inf) half, one with a two-way tie at the top."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, VOCAB, generator=g) * scale
    x[1, ::2] = float("-inf")
    x[2, 5] = x[2, 7] = x[2].max() + 1.0
    x[3] = x[3] * 1e4  # logits far apart: tempered, they overflow float32 sooner
    return x


@pytest.mark.parametrize("top_p", TOP_PS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_warp_is_a_distribution_that_keeps_the_top_token(temperature, top_p):
    logits = _logits(0)
    probs = warp(logits, SamplingParams(temperature=temperature, top_p=top_p))
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    assert torch.allclose(probs.sum(-1), torch.ones(4), atol=1e-5), probs.sum(-1)
    tempered = tempered_softmax(logits, temperature)
    most = tempered == tempered.amax(-1, keepdim=True)  # the most probable tokens (all of them when T is huge)
    assert bool(((probs > 0) & most).any(-1).all())  # one of them always stays
    assert bool((probs[1, ::2] == 0).all())  # a masked token never comes back
    g = torch.Generator().manual_seed(1)
    for row in probs:
        tok = draw(row, g)
        assert 0 <= tok < VOCAB and float(row[tok]) > 0


@pytest.mark.parametrize("top_p", (5e-324, 1e-300, 1e-46))
def test_a_top_p_below_float32_keeps_exactly_the_top_token(top_p):
    """``top_p`` rounds to 0 in float32: before the fix every token was dropped, the row was 0/0
    and ``torch.multinomial`` raised (a 500 for every method)."""
    logits = _logits(3)[[0, 3]]
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=top_p))
    expected = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("temperature", (5e-324, 1e-300, 1e-45, 1e-38))
def test_a_vanishing_temperature_is_the_argmax_and_ties_share_it(temperature):
    """``logits / T`` overflows float32 (or ``T`` is 0 in float32): the limit, not NaN."""
    logits = _logits(4)
    probs = warp(logits, SamplingParams(temperature=temperature))
    greedy = warp(logits, SamplingParams(temperature=0.0))
    for r in (0, 1, 3):
        assert torch.equal(probs[r], greedy[r]), r
    assert float(probs[2, 5]) == float(probs[2, 7]) == 0.5  # the two tied top tokens


def test_a_huge_temperature_is_uniform_over_the_unmasked_tokens():
    probs = warp(_logits(5), SamplingParams(temperature=1e300))
    assert torch.allclose(probs[0], torch.full((VOCAB,), 1 / VOCAB))
    assert torch.allclose(probs[1, 1::2], torch.full((VOCAB // 2,), 1 / (VOCAB // 2)))


def test_ordinary_settings_are_computed_as_before():
    """The finite path is the plain float32 softmax, bit for bit (seeded outputs do not move)."""
    logits = _logits(6, scale=2.0)
    for t in (0.3, 1.0, 2.0):
        assert torch.equal(tempered_softmax(logits, t), torch.softmax(logits.float() / t, dim=-1))


@pytest.mark.parametrize(
    "weights, allowed",
    [
        (torch.zeros(VOCAB), {0}),
        (torch.full((VOCAB,), float("nan")), set(range(VOCAB))),
        (torch.tensor([float("nan"), 0.0, 2.0, 0.0]), {2}),
        (torch.tensor([-1.0, 0.0, 0.5, 0.0]), {2}),
        (torch.tensor([0.2, float("inf"), 0.5, float("inf")]), {1, 3}),
        (torch.tensor([3e38, 3e38, 0.0]), {0, 1}),  # float32 sum overflows
    ],
)
def test_draw_never_raises_on_weights_that_are_not_a_distribution(weights, allowed):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert draw(weights, g) in allowed


def test_residuals_that_are_zero_or_not_finite_still_emit_a_token_of_p():
    """Speculative rejection sampling's residual ``norm(max(0, p - q))``: zero when ``q == p``
    (float noise can still reject), NaN when ``q`` is; the bonus then comes from ``p``."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, VOCAB, generator=g), -1)
    p_peaky = torch.zeros(3, VOCAB)
    p_peaky[:, 4] = 1.0
    for q in (p[:2].clone(), torch.full((2, VOCAB), float("nan")), torch.ones(2, VOCAB) * 5):
        for target in (p, p_peaky):
            for _ in range(10):
                accepted, bonus = decide(target, [4, 9], q, greedy=False, generator=g)
                assert 0 <= bonus < VOCAB and float(target[len(accepted), bonus]) > 0
    tree = tree_mod.build([[4, 9], [5, 9]])
    n = tree.num_nodes
    for node_q in (torch.full((1 + n, VOCAB), float("nan")), torch.zeros(1 + n, VOCAB)):
        target = torch.softmax(torch.randn(1 + n, VOCAB, generator=g), -1)
        path, bonus = decide_tree(tree, target, node_q, greedy=False, generator=g)
        assert 0 <= bonus < VOCAB and float(target[path[-1] if path else 0, bonus]) > 0


@pytest.mark.parametrize("top_p", TOP_PS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_knnlm_next_token_is_defined_everywhere(temperature, top_p):
    logits = _logits(7)[3]
    p_knn = torch.zeros(VOCAB)
    p_knn[11] = 1.0
    params = SamplingParams(temperature=temperature, top_p=top_p)
    for lam, knn in ((0.0, None), (0.5, p_knn)):
        for u in (0.0, 0.5, 1.0 - 1e-12):
            tok = next_token(logits, knn, lam, params, u)
            assert 0 <= tok < VOCAB
            if top_p < 1e-40 and knn is None and temperature <= 2.0:  # (a huge T ties every token)
                assert tok == int(logits.argmax())


def test_knnlm_next_token_applies_min_p_and_top_k_to_the_mixture():
    """kNN-LM samples from λ·p_kNN + (1-λ)·p_LM by inverse CDF: the filters apply to that mixture."""
    logits = _logits(5)[0] / 8.0
    p_knn = torch.zeros(VOCAB)
    p_knn[11] = 1.0
    mix = 0.5 * p_knn + 0.5 * tempered_softmax(logits, 1.0)
    us = [i / 200 for i in range(200)]
    top1 = {next_token(logits, p_knn, 0.5, SamplingParams(temperature=1.0, top_k=1), u) for u in us}
    assert top1 == {int(mix.argmax())} == {11}
    top3 = {next_token(logits, p_knn, 0.5, SamplingParams(temperature=1.0, top_k=3), u) for u in us}
    assert top3 == set(mix.topk(3).indices.tolist())
    kept = {next_token(logits, p_knn, 0.5, SamplingParams(temperature=1.0, min_p=0.02), u) for u in us}
    assert kept <= set((mix >= 0.02 * mix.max()).nonzero().flatten().tolist()) and len(kept) > 1


@pytest.mark.parametrize("method", ("target", "draft", "pld", "llma", "auto"))
def test_every_method_decodes_at_extreme_settings(close_pair, method):
    """The engine end to end (the HTTP grid in ``test_api_hardening2.py`` adds DReSD)."""
    engine = SpecEngine(close_pair)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]
    for temperature, top_p in ((1.0, 1e-300), (1e-300, 1.0), (5e-324, 5e-324), (2.0, 1e-46), (1e30, 0.5)):
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=8, seed=5)
        out = plain_generate(engine, prompt, params, method=method)
        assert len(out.token_ids) == 8 and all(0 <= t < VOCAB for t in out.token_ids), (temperature, top_p)
        if top_p < 1e-40 or temperature < 1e-40:  # one token left at every step: the greedy output
            greedy = plain_generate(engine, prompt, SamplingParams(max_new_tokens=8), method=method)
            assert out.token_ids == greedy.token_ids, (temperature, top_p)

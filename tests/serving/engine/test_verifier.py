"""Acceptance rules: exact values for greedy, and distribution preservation for sampling.

The sampling checks are statistical tests that can fail: each also runs a deliberately
broken rule and asserts the same test rejects it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specops.serving.engine.sampling import warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.engine.verifier import decide
from specops.serving.plan import plain_generate

V = 6
P = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
        [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
        [0.30, 0.10, 0.10, 0.10, 0.10, 0.30],
    ]
)  # target distribution per position (context-free, so the joint is a product)
Q_POOR = torch.tensor(
    [
        [0.02, 0.03, 0.05, 0.10, 0.30, 0.50],  # mass where the target has little
        [0.60, 0.20, 0.05, 0.05, 0.05, 0.05],
    ]
)


def pooled_chisquare(observed: np.ndarray, expected_p: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value, pooling cells whose expected count is below ``min_expected``."""
    n = observed.sum()
    expected_p = np.asarray(expected_p, dtype=np.float64)
    exp = expected_p / expected_p.sum() * n
    if observed[exp == 0].sum() > 0:
        return 0.0  # a token the target can never emit was emitted
    observed, exp = observed[exp > 0], exp[exp > 0]
    keep = exp >= min_expected
    obs_k = list(observed[keep]) + ([observed[~keep].sum()] if (~keep).any() else [])
    exp_k = list(exp[keep]) + ([exp[~keep].sum()] if (~keep).any() else [])
    return float(chisquare(obs_k, exp_k).pvalue)


def second_token_counts(
    engine, prompt: list[int], first: int, seeds: int, params: dict, vocab: int = 97, **generate_kwargs
) -> tuple[np.ndarray, int, int]:
    """Over requests seeded 0..seeds-1 (sampling ``params``) whose first token is ``first``:
    the counts of their second token, how many there were, and how many drafted anything."""
    counts = np.zeros(vocab, dtype=np.int64)
    n = drafted = 0
    for seed in range(seeds):
        out = plain_generate(engine, prompt, SamplingParams(seed=seed, **params), **generate_kwargs)
        if out.token_ids[0] != first:
            continue
        n += 1
        counts[out.token_ids[1]] += 1
        drafted += out.stats.num_drafted > 0
    return counts, n, drafted


def simulate_two_tokens(
    n: int, use_q: bool, rule=decide, seed: int = 0, p: torch.Tensor = P, q: torch.Tensor = Q_POOR
) -> np.ndarray:
    """Counts of (t0, t1) from speculative sampling with a poor draft ``q`` against ``p``, k=2 then k=1."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(n):
        d = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        if not use_q:
            d = [5, 0]  # deterministic drafts, both unlikely under the target
        accepted, bonus = rule(p, d, q if use_q else None, greedy=False, generator=gen)
        out = [*accepted, bonus]
        if len(out) < 2:  # next step: one fresh draft for position 1
            d1 = int(torch.multinomial(q[1], 1, generator=gen)) if use_q else 0
            acc2, bonus2 = rule(p[1:], [d1], q[1:] if use_q else None, greedy=False, generator=gen)
            out += [*acc2, bonus2]
        counts[out[0], out[1]] += 1
    return counts


def always_accept(probs, drafts, draft_probs, *, greedy, generator):
    """A wrong rule: trusts the draft blindly."""
    return list(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=generator))


def test_greedy_rule_values():
    probs = torch.eye(V)[[2, 4, 1, 3]]  # argmax per row: 2, 4, 1, 3
    assert decide(probs, [2, 4, 1], None, greedy=True, generator=None) == ([2, 4, 1], 3)
    assert decide(probs, [2, 5, 1], None, greedy=True, generator=None) == ([2], 4)
    assert decide(probs, [0, 4, 1], None, greedy=True, generator=None) == ([], 2)
    assert decide(probs[:1], [], None, greedy=True, generator=None) == ([], 2)


@pytest.mark.parametrize("use_q", [True, False], ids=["rejection-sampling", "sample-then-match"])
def test_sampling_preserves_target_joint_distribution(use_q):
    n = 20000
    expected = torch.outer(P[0], P[1]).flatten().numpy()
    counts = simulate_two_tokens(n, use_q)
    assert pooled_chisquare(counts.flatten(), expected) > 1e-3
    # The same test must catch a rule that is wrong.
    bad = simulate_two_tokens(n, use_q, rule=always_accept)
    assert pooled_chisquare(bad.flatten(), expected) < 1e-6


def test_identical_draft_is_always_accepted():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        d = [int(torch.multinomial(P[i], 1, generator=gen)) for i in range(2)]
        accepted, _ = decide(P, d, P[:2], greedy=False, generator=gen)
        assert accepted == d


def test_warp_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    greedy = warp(logits, SamplingParams(temperature=0.0))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("method, pair_name", [("draft", "tiny_pair"), ("pld", "tiny_pair"), ("draft", "served_pair")])
def test_engine_sampling_matches_target_first_token(request, method, pair_name):
    """End to end on real models: the first sampled token follows the target's warped distribution
    (``served_pair``: a draft that gives zero probability to half the vocabulary)."""
    tiny_pair = request.getfixturevalue(pair_name)
    engine = SpecEngine(tiny_pair)
    params_kw = dict(temperature=1.3, top_p=0.95, max_new_tokens=2)
    prompt = [5, 17, 42, 5, 17]  # pld finds the n-gram "5 17" and drafts 42
    with torch.inference_mode():
        logits = tiny_pair.target(input_ids=torch.tensor([prompt])).logits[0, -1:]
    expected = warp(logits, SamplingParams(**params_kw))[0].numpy()
    n = 800
    counts = np.zeros(len(expected), dtype=np.int64)
    drafted = 0
    for seed in range(n):
        out = plain_generate(engine, prompt, SamplingParams(seed=seed, **params_kw), method=method, k=1)
        counts[out.token_ids[0]] += 1
        drafted += out.stats.num_drafted
    assert drafted >= n  # the draft really took part in every request
    assert pooled_chisquare(counts, expected) > 1e-3
    # Power check: the draft-only distribution (what a broken verifier would emit) is rejected.
    if method == "draft":
        from specops.serving.engine.kv import CachedLM

        q_logits, _ = CachedLM(tiny_pair.draft).forward(prompt, logits_to_keep=1)  # as the engine drafts
        q = warp(q_logits, SamplingParams(**params_kw))[0].double().numpy()
        q /= q.sum()  # float32 probabilities can sum past 1 in float64, which numpy refuses
        fake = np.random.default_rng(0).multinomial(n, q)
        assert pooled_chisquare(fake, expected) < 1e-6


# ---------------------------------------------------------------- top-k and min-p
FILTERED = SamplingParams(temperature=1.0, top_k=3, min_p=0.18)
"""Min-p keeps tokens at >= 0.18 x the top one, then top-k the 3 most probable (ties with the third kept)."""
Q_OVERLAP = torch.tensor(
    [
        [0.10, 0.35, 0.05, 0.30, 0.15, 0.05],  # filtered: tokens 1, 3, 4 (the target keeps 0, 1, 2)
        [0.05, 0.40, 0.15, 0.25, 0.10, 0.05],  # filtered: tokens 1, 2, 3 (the target keeps 2, 3, 4, 5)
    ]
)


def test_warp_min_p_then_top_k_values():
    # P[0]: min-p drops 0.06 and 0.04 (< 0.18 x 0.40), top-k 3 then drops 0.10
    assert torch.allclose(warp(P.log(), FILTERED)[0], torch.tensor([0.5, 0.3125, 0.1875, 0, 0, 0]))
    # P[1]: min-p drops the two 0.05; the third largest, 0.10, is tied: both stay (vLLM's rule)
    assert torch.allclose(warp(P.log(), FILTERED)[1], torch.tensor([0, 0, 0.5, 0.2, 0.1, 0.1]) / 0.9)
    only_min_p = warp(P.log(), SamplingParams(temperature=1.0, min_p=0.5))  # >= 0.20 at P[0]: two tokens
    assert torch.allclose(only_min_p[0], torch.tensor([0.40, 0.25, 0, 0, 0, 0]) / 0.65)
    only_top_k = warp(P.log(), SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(only_top_k[2], torch.tensor([0.5, 0, 0, 0, 0, 0.5]))  # a tie at the top: both
    # then top-p, over what is left: of [0.5, 0.3125, 0.1875] the smallest prefix with mass >= 0.6
    both = warp(P.log(), SamplingParams(temperature=1.0, top_k=3, min_p=0.18, top_p=0.6))
    assert torch.allclose(both[0], torch.tensor([0.5, 0.3125, 0, 0, 0, 0]) / 0.8125)
    # off: -1 and 0 never reach here (the API maps them to 0), and top_k past the vocabulary changes nothing
    assert torch.equal(warp(P.log(), SamplingParams(temperature=1.0, top_k=V)), warp(P.log(), SamplingParams(1.0)))
    assert torch.equal(
        warp(P.log(), SamplingParams(temperature=0.0, top_k=2, min_p=0.9)), warp(P.log(), SamplingParams())
    )


def target_unfiltered(probs, drafts, draft_probs, *, greedy, generator):
    """A wrong rule: the draft's distribution is filtered by top-k and min-p, the target's is not."""
    return decide(P[-probs.shape[0] :], drafts, draft_probs, greedy=greedy, generator=generator)


@pytest.mark.parametrize("use_q", [True, False], ids=["rejection-sampling", "sample-then-match"])
def test_sampling_with_top_k_and_min_p_preserves_the_filtered_target(use_q):
    """Target and draft both warped with the request's top-k and min-p: the output follows the
    target's filtered distribution (drafts the target filtered out are rejected, tokens the draft
    filtered out come from the residual). Filtering one side only is caught."""
    p, q = warp(P.log(), FILTERED), warp(Q_OVERLAP.log(), FILTERED)
    expected = torch.outer(p[0], p[1]).flatten().numpy()
    counts = simulate_two_tokens(8000, use_q, p=p, q=q)
    assert pooled_chisquare(counts.flatten(), expected) > 1e-3
    bad = simulate_two_tokens(2000, use_q, rule=target_unfiltered, p=p, q=q)
    assert pooled_chisquare(bad.flatten(), expected) < 1e-6


@pytest.mark.parametrize("method", ["draft", "pld"])
@pytest.mark.parametrize("filters", [{"top_k": 1}, {"min_p": 1.0}], ids=["top_k=1", "min_p=1"])
def test_a_filter_that_keeps_one_token_samples_the_greedy_output(close_pair, method, filters):
    engine = SpecEngine(close_pair)
    prompt = [5, 17, 42, 5, 17, 42, 5]
    greedy = plain_generate(engine, prompt, SamplingParams(max_new_tokens=10), method=method, k=3).token_ids
    for seed in range(3):
        params = SamplingParams(temperature=1.5, seed=seed, max_new_tokens=10, **filters)
        assert plain_generate(engine, prompt, params, method=method, k=3).token_ids == greedy


def test_engine_sampling_with_top_k_and_min_p_matches_the_filtered_target(close_pair, monkeypatch):
    """End to end with a draft model (a perturbed target: drafts are accepted and rejected): the
    first token follows the target's distribution after min-p (11 tokens kept of the target's
    97, 6 of the draft's) and top-k (8). The negative control runs the same engine with a verifier
    that leaves the filters out of the target's side."""
    from specops.serving.engine import verifier
    from specops.serving.engine.kv import CachedLM

    params_kw = dict(temperature=1.0, top_k=8, min_p=0.3, max_new_tokens=2)  # 2: a step drafts one token
    prompt = [5, 17, 42, 5, 17]
    target_logits, _ = CachedLM(close_pair.target).forward(prompt, logits_to_keep=1)
    expected = warp(target_logits, SamplingParams(**params_kw))[0].numpy()
    assert (expected > 0).sum() == 8

    def first_tokens(n: int) -> tuple[np.ndarray, int, int]:
        engine, counts, drafted, accepted = SpecEngine(close_pair), np.zeros(len(expected), dtype=np.int64), 0, 0
        for seed in range(n):
            out = plain_generate(engine, prompt, SamplingParams(seed=seed, **params_kw), method="draft", k=1)
            counts[out.token_ids[0]] += 1
            drafted, accepted = drafted + out.stats.num_drafted, accepted + out.stats.num_accepted
        return counts, drafted, accepted

    counts, drafted, accepted = first_tokens(300)
    assert drafted == 300 and 0 < accepted < drafted  # the draft took part, and both branches of the rule ran
    assert pooled_chisquare(counts, expected) > 1e-3
    unfiltered = SamplingParams(temperature=1.0)
    monkeypatch.setattr(verifier, "warp", lambda logits, params: warp(logits, unfiltered))
    bad, _, _ = first_tokens(100)
    assert pooled_chisquare(bad, expected) < 1e-6

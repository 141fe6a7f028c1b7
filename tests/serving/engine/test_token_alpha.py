"""The per-token α estimator against a process whose α is known."""

from __future__ import annotations

import random

import pytest

from specops.serving.engine.types import RequestStats, token_alpha


def simulate(alpha: float, k: int, steps: int, seed: int) -> tuple[int, int, int]:
    """Steps of speculative decoding whose draft tokens are each accepted with probability
    ``alpha`` given the earlier ones were: (accepted, drafted, steps that ended in a rejection)."""
    rng = random.Random(seed)
    accepted = drafted = rejected = 0
    for _ in range(steps):
        drafted += k
        for _ in range(k):
            if rng.random() < alpha:
                accepted += 1
            else:
                rejected += 1
                break
    return accepted, drafted, rejected


@pytest.mark.parametrize("alpha", [0.1, 0.35, 0.6, 0.9])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_recovers_a_known_alpha(alpha: float, k: int) -> None:
    accepted, drafted, rejected = simulate(alpha, k, steps=20_000, seed=int(alpha * 100) + k)
    est = token_alpha(accepted, rejected)
    tried = accepted + rejected
    se = (alpha * (1 - alpha) / tried) ** 0.5  # the MLE's standard error, ~ a binomial's
    assert abs(est - alpha) < 5 * se + 1e-9, (est, alpha)


def test_accepted_over_drafted_is_a_different_and_smaller_number() -> None:
    """The negative control: accepted ÷ drafted does not estimate α on a k > 1 chain."""
    accepted, drafted, rejected = simulate(0.35, 3, steps=20_000, seed=1)
    assert accepted / drafted < 0.2  # (α + α² + α³)/3 ≈ 0.172 for α = 0.35
    assert abs(token_alpha(accepted, rejected) - 0.35) < 0.02


def test_edges_and_request_stats() -> None:
    assert token_alpha(0, 0) == 0.0
    assert token_alpha(5, 0) == 1.0
    assert token_alpha(0, 4) == 0.0
    st = RequestStats(method="draft", num_drafted=9, num_accepted=4, num_rejected_steps=2, num_verify_steps=3)
    assert st.alpha_token == pytest.approx(4 / 6)
    assert st.to_dict()["alpha_token"] == round(4 / 6, 4)

"""A copy's tokens priced at the match length each would be drafted at (``AutoPolicy.copy_chain``):
once its first tokens are accepted the context matches the source over more tokens, and the
next is likelier to be right than the first was. OSD's geometric chain (one acceptance for every
position) prices a copy that starts at a short match as if it stayed short."""

from __future__ import annotations

import pytest

from specops.core.auto_fits import chain_evidence, chain_tokens, copy_keys, expected_tokens
from specops.core.auto_policy import AutoPolicy, Choice, Counts


def test_each_token_of_a_copy_has_the_key_of_its_match_length():
    assert copy_keys("llma", "request", 1, 5) == [
        "llma.request@m1",
        "llma.request@m2",
        "llma.request@m2",
        "llma.request@m4",
        "llma.request@m4",
    ]
    assert chain_tokens([0.5] * 4, 3) == pytest.approx(expected_tokens(0.5, 3))
    assert chain_tokens([0.2, 1.0, 1.0], 3) == pytest.approx(1 + 0.2 * 3)
    assert chain_tokens([0.9], 0) == 1.0
    # accepted positions count for their keys; the first rejected one against its own
    keys = copy_keys("llma", "context", 1, 4)
    assert chain_evidence(keys, 2, True) == {"llma.context@m1": [1.0, 0.0], "llma.context@m2": [1.0, 1.0]}
    assert chain_evidence(keys, 4, False) == {
        "llma.context@m1": [1.0, 0.0],
        "llma.context@m2": [2.0, 0.0],
        "llma.context@m4": [1.0, 0.0],
    }


def _policy() -> AutoPolicy:
    """A copy's first token at a match of 1 is right 30 % of the time; once 2 tokens match, 90 %;
    from 4, 97 %. Verifying costs 20 ms + 3 ms per token."""
    policy = AutoPolicy(verify_ms=(20.0, 3.0), explore=False, realized_check=False)
    for key, (acc, rej) in {
        "llma.request@m1": (30, 70),
        "llma.request@m2": (90, 10),
        "llma.request@m4": (97, 3),
    }.items():
        policy.counts[("c", key, "greedy")] = Counts(acc, rej)
    return policy


def test_a_copy_from_a_short_match_is_priced_by_the_lengths_it_grows_to():
    policy = _policy()
    chain = {"llma": {"key": "llma.request@m1", "keys": copy_keys("llma", "request", 1, 8), "max_k": 8, "sunk": True}}
    geometric = {"llma": {"key": "llma.request@m1", "max_k": 8, "sunk": True}}
    c = policy.choose("c", "greedy", available=chain, own={}, k_cap=16)
    assert c.method == "llma" and c.k >= 6 and c.keys == tuple(copy_keys("llma", "request", 1, c.k))
    g = policy.choose("c", "greedy", available=geometric, own={}, k_cap=16)
    # at 0.3 per token the first token alone may pay, and no long copy does
    assert g.method == "target" or g.k <= 2, g
    assert c.expected > 2.5 > g.expected


def test_a_copy_step_counts_each_position_under_its_own_key():
    policy = _policy()
    keys = tuple(copy_keys("llma", "request", 1, 4))
    choice = Choice("llma", 4, 1.0, key=keys[0], keys=keys, n_verify=5)
    before = {k: (c.accepted, c.rejected) for (_, k, _), c in policy.counts.items()}
    policy.record(
        "c", "greedy", choice, accepted=2, drafted=4, emitted=3, n_verified=5, verify_ms=None, propose_ms=None
    )
    after = {k: (c.accepted, c.rejected) for (cl, k, t), c in policy.counts.items() if cl == "c"}
    d = policy.decay
    assert after["llma.request@m1"] == pytest.approx(
        (before["llma.request@m1"][0] * d + 1, before["llma.request@m1"][1] * d)
    )
    assert after["llma.request@m2"] == pytest.approx(
        (before["llma.request@m2"][0] * d + 1, before["llma.request@m2"][1] * d + 1)
    )
    assert after["llma.request@m4"] == pytest.approx(before["llma.request@m4"])  # never reached
    assert after["llma.request"] == pytest.approx((2.0, 1.0))  # the parents count each position too


def test_the_realized_speed_check_does_not_penalize_a_method_for_the_spread_of_its_steps():
    """A copy's steps emit 1 or 5 tokens, 3 on average, each in the time the model said: the
    method is exactly as fast as modelled, and its factor stays 1. Control: the geometric mean
    of the same per-step ratios (the check's old estimator) reads 0.75 and would have held
    ``auto`` off it."""
    import math

    from specops.core.auto_fits import SpeedCheck

    check = SpeedCheck(prior_steps=0.0, estimator="sum")
    ratios = [1 / 3, 5 / 3] * 200  # realized / modelled speed: 1 or 5 tokens where 3 were expected
    for r in ratios:
        check.observe(r, promised=3.0)
    assert check.factor == pytest.approx(1.0, abs=0.01)
    old = SpeedCheck(prior_steps=0.0, estimator="geometric")
    for r in ratios:
        old.observe(r, promised=3.0)
    assert old.factor == pytest.approx(math.sqrt(5) / 3, abs=0.01) and old.factor < 0.76
    # a method that really is slower reads so: its steps take 25 % longer than modelled
    slow = SpeedCheck(prior_steps=0.0, estimator="sum")
    for r in ratios:
        slow.observe(r / 1.25, promised=3.0 * 1.25)
    assert slow.factor == pytest.approx(0.8, abs=0.01)


def test_the_mean_estimator_neither_penalizes_spread_nor_lets_a_long_wait_weigh_its_length():
    """``mean``: each step one vote. A copy's 1-or-5 steps read 1 (as ``sum``, not as
    ``geometric``); and where one step in 20 waits 10x its modelled time in the batcher, ``sum``
    weights that step by its length (the method reads about a third slower) while ``mean`` counts
    it once (about 5 % slower: 19 steps at 1, one at the clip's floor)."""
    from specops.core.auto_fits import REALIZED_CLIP, SpeedCheck

    spread = SpeedCheck(prior_steps=0.0, estimator="mean")
    for r in [1 / 3, 5 / 3] * 200:
        spread.observe(r, promised=3.0)
    assert spread.factor == pytest.approx(1.0, abs=0.01)
    waits = {e: SpeedCheck(prior_steps=0.0, decay=1.0, estimator=e) for e in ("mean", "sum")}
    for i in range(400):
        long = i % 20 == 0  # its time 10x the model's: ratio 0.1, promised 10x the tokens
        for check in waits.values():
            check.observe(0.1 if long else 1.0, promised=10.0 if long else 1.0)
    floor = 1 / REALIZED_CLIP
    assert waits["mean"].factor == pytest.approx((19 + floor) / 20, abs=0.01)
    assert waits["sum"].factor == pytest.approx((19 + floor * 10) / 29, abs=0.01) and waits["sum"].factor < 0.75


def test_an_unknown_estimator_is_refused():
    from specops.core.auto_fits import SpeedCheck

    with pytest.raises(ValueError, match="estimator"):
        SpeedCheck(estimator="median")

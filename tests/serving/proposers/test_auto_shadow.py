"""``auto`` learns from the copies it declined (``specops.serving.proposers.auto_shadow``): a
followed copy counts what verification would have accepted (exactly when greedy; with the real
step's distribution when sampling, against a fixed LLMA arm, with a negative control), and an
estimate that starts low is no longer frozen by never being tried."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specops.core.auto_policy import AutoPolicy, CostFit, Counts
from specops.core.models import ModelPair
from specops.serving.engine.sampling import warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.proposers.auto_shadow import MAX_PENDING, CopyShadows
from tests.conftest import random_prompts


def test_a_followed_copy_counts_each_token_under_its_key_until_a_mismatch_or_its_end():
    s = CopyShadows()
    s.open(["c@m4", "c@m4", "c@m4", "c@m4"], [1, 2, 3, 4])
    first = s.advance([1, 2])  # two match; the copy goes on
    assert [(e.key, e.accepted, e.rejected, e.opened) for e in first] == [("c@m4", 2, 0.0, True)]
    s.open(["c@m1", "c@m2"], [3, 7])
    second = s.advance([3, 9])  # the first matches 3 then mismatches 9; the second matches 3, then 9 != 7
    got = [(e.key, e.accepted, e.rejected, e.opened) for e in second]
    assert got == [("c@m4", 1, 1.0, False), ("c@m1", 1, 0.0, True), ("c@m2", 0, 1.0, True)]
    assert s.pending == []
    s.open(["r@m8", "r@m8"], [5, 6])
    assert [(e.accepted, e.rejected) for e in s.advance([5, 6, 7])] == [(2, 0.0)]  # all accepted: no rejection
    assert s.pending == [] and s.summary() == {"followed": 3, "accepted": 6, "rejected": 2}
    for i in range(MAX_PENDING + 3):
        s.open(["k"], [100 + i])
    assert len(s.pending) == MAX_PENDING  # the oldest are dropped
    s.clear()
    assert s.pending == []


def _pessimistic(shadows: bool) -> AutoPolicy:
    """A policy that thinks copying is bad (a cluster record of 2 accepted in 42) and whose costs
    are pinned so that only a copy accepted at about 0.3 or better pays: without news of the
    copies, it never copies."""
    policy = AutoPolicy(seed=0, explore=False, realized_check=False, copy_shadows=shadows)
    policy.verify[0] = CostFit(5.0, 2.0, prior_weight=1e12)
    policy.counts[("default", "llma", "greedy")] = Counts(2.0, 40.0)
    return policy


def test_an_estimate_that_starts_low_learns_from_the_copies_it_declined(tiny_target):
    from specops.serving.proposers.catalogue import ProposerResources

    pair = ModelPair(target=tiny_target, draft=None, tokenizer=None)
    engine = SpecEngine(pair)
    prompt = random_prompts(1, seed=9)[0]
    ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=40), method="target").token_ids
    quote = (tuple(prompt[-8:] + ref),)  # a reference that holds the continuation: its copies are right
    steps = {}
    for shadows in (False, True):
        policy = _pessimistic(shadows)
        res = ProposerResources(pair=pair, policy=policy, references=quote)
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=40), method="auto", resources=res)
        assert out.token_ids == ref  # lossless either way
        per = out.stats.policy["methods"]
        steps[shadows] = per.get("llma", {}).get("steps", 0)
        if shadows:
            news = out.stats.policy["shadows"]
            assert news["followed"] >= 1 and news["accepted"] > news["rejected"]
            learned = [k for (c, k, t) in policy.counts if k.startswith("llma.") and "@m" in k]
            assert learned, policy.counts  # the copies' own keys, not only the parent
        else:
            assert out.stats.policy["shadows"] is None
            assert all("@m" not in k for (_, k, _) in policy.counts)
    assert steps[False] == 0 and steps[True] > 0, steps


def test_sampled_shadows_count_what_verification_accepts_with_a_negative_control(tiny_target):
    """A request at T=0.3 whose context offers a copy of token 89 at its first step. ``auto``
    (costs pinned so that target-only runs) follows the copy; how often it counts it accepted
    must match how often a fixed LLMA arm's verification accepts the same draft (two-sample test,
    both near p(89) = 0.67). Control: the greedy rule (accept the copy when it is the argmax)
    counts it accepted every time, and fails the same test."""
    from specops.serving.proposers.catalogue import ProposerResources

    pair = ModelPair(target=tiny_target, draft=None, tokenizer=None)
    engine = SpecEngine(pair)
    prompt = [5, 17, 89, 9, 5, 17]
    with torch.inference_mode():
        p = warp(tiny_target(torch.tensor([prompt])).logits[0, -1:], SamplingParams(temperature=0.3))[0]
    assert int(p.argmax()) == 89 and 0.4 < float(p[89]) < 0.9  # the setting the test relies on
    policy = AutoPolicy(seed=0, explore=False, realized_check=False)
    policy.verify[0] = CostFit(1.0, 1000.0, prior_weight=1e12)  # a drafted token costs a second: never copy
    n = 200
    shadow, real = np.zeros(n), np.zeros(n)
    for seed in range(n):
        params = SamplingParams(temperature=0.3, max_new_tokens=2, seed=seed)
        out = plain_generate(
            engine, prompt, params, method="auto", resources=ProposerResources(pair=pair, policy=policy)
        )
        news = out.stats.policy["shadows"]
        assert out.stats.num_drafted == 0 and news["accepted"] + news["rejected"] == 1
        shadow[seed] = news["accepted"]
        fixed = plain_generate(engine, prompt, params, method="llma", k=1)
        assert fixed.stats.num_drafted == 1
        real[seed] = fixed.stats.num_accepted

    def same(a, b) -> bool:  # two proportions, 4 standard errors
        pooled = (a.sum() + b.sum()) / (len(a) + len(b))
        se = np.sqrt(max(pooled * (1 - pooled), 1e-9) * (1 / len(a) + 1 / len(b)))
        return abs(a.mean() - b.mean()) < 4 * se

    assert same(shadow, real), (shadow.mean(), real.mean())
    assert shadow.mean() == pytest.approx(float(p[89]), abs=0.12)
    greedy_rule = np.ones(n)  # 89 is the argmax: the greedy rule always counts it accepted
    assert not same(greedy_rule, real)

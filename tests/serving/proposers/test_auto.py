"""``speculation.method = "auto"``: the policy's choices on synthetic costs and acceptance (the
faster method, exploration, off when nothing pays, off under load), losslessness when it
switches methods inside a request (greedy equality, exact sampling with a negative control),
and its priors artifact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specops.core.auto_policy import AutoPolicy, CostFit, Counts, expected_tokens, temp_bucket
from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.models import ModelPair
from specops.serving.engine.sampling import warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.proposers.auto import calibrate
from specops.serving.proposers.catalogue import ProposerResources
from tests.conftest import random_prompts
from tests.serving.engine.test_verifier import pooled_chisquare

AUTO = dict(method="auto")


def synthetic(counts: dict, *, verify=(20.0, 1.0), draft=(0.2, 2.0), explore=False, seed=0, load=None) -> AutoPolicy:
    """A policy with set costs (ms: a + b * tokens) and set acceptance counts per key."""
    policy = AutoPolicy(verify_ms=verify, propose_ms={"draft": draft}, explore=explore, seed=seed, load=load)
    for key, (acc, rej) in counts.items():
        policy.counts[("c", key, "greedy")] = Counts(acc, rej)
    return policy


def choose(policy, available, k_cap=16, own=None):
    return policy.choose("c", "greedy", available=available, own=own or {}, k_cap=k_cap)


DRAFT = {"draft": {"key": "draft", "max_k": 8, "rows": 1}}


def test_expected_tokens_is_osd_eq_2s_numerator():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert temp_bucket(0) == "greedy" and temp_bucket(0.7) == "low" and temp_bucket(1.0) == "high"


def test_cost_fit_learns_a_line_and_starts_from_its_prior():
    fit = CostFit(10.0, 1.0)
    assert fit.predict(1) == pytest.approx(11.0) and fit.predict(9) == pytest.approx(19.0)
    for _ in range(300):  # the truth: 4 ms + 3 ms per token
        for n in (1, 4, 8):
            fit.observe(n, 4.0 + 3.0 * n)
    # ~100 decayed observations outweigh the prior's 6 pseudo-observations
    assert fit.b == pytest.approx(3.0, rel=0.1) and fit.predict(4) == pytest.approx(16.0, rel=0.05)
    fit.observe(1, float("nan"))  # a broken timing is ignored
    assert np.isfinite(fit.predict(2))


def test_it_picks_the_faster_method_and_its_best_k():
    good = synthetic({"draft": (90.0, 10.0)}, draft=(0.2, 2.0))
    c = choose(good, DRAFT)
    assert c.method == "draft" and 3 <= c.k <= 8, c
    assert c.alternatives["draft"] > c.alternatives["target"]
    # the same acceptance with a draft that costs as much as the target: drafting does not pay
    dear = synthetic({"draft": (90.0, 10.0)}, draft=(0.0, 25.0))
    assert choose(dear, DRAFT).method == "target"
    # a copy with a long match beats a mediocre draft, and a copy is never longer than what matched
    copy = synthetic({"draft": (50.0, 50.0), "llma.request@m8": (95.0, 5.0)})
    avail = {**DRAFT, "llma": {"key": "llma.request@m8", "max_k": 6, "rows": 1, "sunk": True}}
    c = choose(copy, avail)
    assert c.method == "llma" and c.k == 6


def test_it_turns_speculation_off_when_nothing_pays():
    bad = synthetic({"draft": (5.0, 95.0), "llma.context@m1": (2.0, 98.0)}, verify=(20.0, 3.0))
    avail = {**DRAFT, "llma": {"key": "llma.context@m1", "max_k": 4, "rows": 1, "sunk": True}}
    assert {choose(bad, avail).method for _ in range(20)} == {"target"}


def test_it_turns_speculation_off_under_load_from_measured_costs():
    """Verification costs 2 ms per token (a compute-bound batch): at one request in flight a
    good draft pays; with 8 in flight, the batch's other tokens make every extra one a loss."""
    load = {"n": 1}
    policy = synthetic({"draft": (70.0, 30.0)}, verify=(10.0, 2.0), draft=(0.2, 1.0), load=lambda: load["n"])
    policy.emitted_per_step = 2.0
    alone = choose(policy, DRAFT)
    assert alone.method == "draft" and alone.k >= 2
    load["n"] = 8
    busy = choose(policy, DRAFT)
    assert busy.method == "target" or busy.k < alone.k, (alone, busy)
    load["n"] = 64
    assert choose(policy, DRAFT).method == "target"


def test_under_load_it_counts_the_whole_pass():
    """Three other requests copy 8 tokens each into the same pass: one more copy that will
    mostly be accepted still raises the pass's throughput, a bad one does not. (Fitting the
    verify cost on a request's own tokens, when the others' choices move with it, would charge
    it for theirs and turn copying off.)"""
    policy = synthetic(
        {"llma.context@m16": (97.0, 3.0), "llma.context@m1": (10.0, 90.0)}, verify=(50.0, 6.7), load=lambda: 4
    )
    for sid in (1, 2, 3):
        policy.active[sid] = (9.0, 7.0)
    long = {"llma": {"key": "llma.context@m16", "max_k": 8, "rows": 1, "sunk": True}}
    short = {"llma": {"key": "llma.context@m1", "max_k": 8, "rows": 1, "sunk": True}}
    c = policy.choose("c", "greedy", available=long, own={}, k_cap=16, session=4)
    assert c.method == "llma" and c.k >= 6 and c.n_others == 27.0
    assert policy.choose("c", "greedy", available=short, own={}, k_cap=16, session=4).method == "target"
    assert policy.active[4][0] == 1.0  # its latest choice is what the others see


def test_in_padded_batches_a_draft_as_wide_as_the_others_is_nearly_free():
    """Right-padded batches cost rows x widest row: when the others verify 9 tokens each, a
    mediocre copy of up to 8 costs nothing more, while alone among 1-token rows it widens all 4."""
    counts = {"llma.context@m2": (55.0, 45.0)}
    wide = synthetic(counts, verify=(50.0, 3.0), load=lambda: 4)
    wide.padded_batches = True
    for sid in (1, 2, 3):
        wide.active[sid] = (9.0, 3.0)
    copy = {"llma": {"key": "llma.context@m2", "max_k": 8, "rows": 1, "sunk": True}}
    c = wide.choose("c", "greedy", available=copy, own={}, k_cap=16, session=4)
    assert c.method == "llma" and c.k == 8
    narrow = synthetic(counts, verify=(50.0, 3.0), load=lambda: 4)
    narrow.padded_batches = True
    for sid in (1, 2, 3):
        narrow.active[sid] = (1.0, 1.0)
    assert narrow.choose("c", "greedy", available=copy, own={}, k_cap=16, session=4).method == "target"


def test_the_real_pass_prices_the_next_and_fits_the_verify_cost():
    """The batcher reports each pass as it ran: the verify fit regresses on its real rows x width
    (not on the other sessions' latest choices), and the next choice is priced on it."""
    from specops.serving.engine.types import TargetPass

    policy = synthetic({"llma.context@m2": (55.0, 45.0)}, verify=(50.0, 3.0), load=lambda: 4)
    policy.padded_batches = True
    for sid in (1, 2, 3):  # the others' latest choices say: 1-token rows
        policy.active[sid] = (1.0, 1.0)
    copy = {"llma": {"key": "llma.context@m2", "max_k": 8, "rows": 1, "sunk": True}}
    assert policy.choose("c", "greedy", available=copy, own={}, k_cap=16, session=4).method == "target"
    # ...but the pass really ran 4 rows 9 tokens wide: a copy of up to 8 is nearly free in it
    seen = TargetPass(rows=4, width=9, mine=1, others=27, widest_other=9, ms=60.0)
    c = policy.choose("c", "greedy", available=copy, own={}, k_cap=16, session=4, seen=seen)
    assert c.method == "llma" and c.k == 8 and (c.rows, c.widest_other, c.n_others) == (4, 9.0, 27.0)
    # the verify fit observes the real shape: rows x width of the pass that ran
    fit = policy._verify_fit(2)  # load bucket of 4 rows
    n0, sx0 = fit.n_obs, fit.sx
    ran = TargetPass(rows=4, width=9, mine=9, others=12, widest_other=6, ms=70.0)
    policy.record(
        "c",
        "greedy",
        c,
        accepted=3,
        drafted=8,
        emitted=4,
        n_verified=9,
        verify_ms=70.0,
        propose_ms=None,
        target_pass=ran,
    )
    assert fit.n_obs == n0 + 1 and fit.sx == pytest.approx(fit.decay * sx0 + 36.0)
    # a pass that ran alone is fitted in the 1-row bucket, whatever the load said
    alone = TargetPass(rows=1, width=3, mine=3, others=0, widest_other=0, ms=20.0)
    policy.record(
        "c",
        "greedy",
        c,
        accepted=2,
        drafted=2,
        emitted=3,
        n_verified=3,
        verify_ms=22.0,
        propose_ms=None,
        target_pass=alone,
    )
    assert policy._verify_fit(0).n_obs == 1


def test_a_draft_that_sat_out_steps_pays_its_catch_up():
    """A draft model behind by ``gap`` tokens first feeds them: priced (spread over a few steps),
    so a long gap can make target-only the faster option, and measured into its own fit."""
    policy = synthetic({"draft": (60.0, 40.0)}, verify=(20.0, 1.0), draft=(0.2, 2.0))
    policy.calibrated((20.0, 1.0), {}, {"draft_model": (1.0, 0.5)})
    policy.kinds["draft"] = "draft_model"
    in_step = choose(policy, {"draft": {"key": "draft", "max_k": 8, "rows": 1}})
    behind = choose(policy, {"draft": {"key": "draft", "max_k": 8, "rows": 1, "catchup": 400}})
    assert in_step.method == "draft" and behind.method == "target"
    assert behind.alternatives["draft"] < in_step.alternatives["draft"]
    near_end = policy.choose(
        "c",
        "greedy",
        available={"draft": {"key": "draft", "max_k": 8, "rows": 1, "catchup": 40}},
        own={},
        k_cap=16,
        remaining=2,
    )
    spread = choose(policy, {"draft": {"key": "draft", "max_k": 8, "rows": 1, "catchup": 40}})
    assert near_end.alternatives["draft"] < spread.alternatives["draft"]  # fewer steps left to spread it over
    # a measured catch-up goes to the catch-up fit; the call's own fit stays clean
    pfit, cfit = policy.propose["draft"], policy._catchup_fit("draft")
    p_obs, c_obs = pfit.n_obs, cfit.n_obs
    policy.record(
        "c",
        "greedy",
        in_step,
        accepted=1,
        drafted=in_step.k,
        emitted=2,
        n_verified=1 + in_step.k,
        verify_ms=None,
        propose_ms=pfit.predict(in_step.k) + 30.0,
        catchup=60,
    )
    assert pfit.n_obs == p_obs and cfit.n_obs == c_obs + 1
    policy.record(
        "c",
        "greedy",
        in_step,
        accepted=1,
        drafted=in_step.k,
        emitted=2,
        n_verified=1 + in_step.k,
        verify_ms=None,
        propose_ms=5.0,
    )
    assert pfit.n_obs == p_obs + 1


def test_it_explores_a_method_that_was_bad_once():
    """Thompson sampling: a draft with a poor but thin record is still tried now and then; a
    request's own evidence then settles it, and a stale record fades with time."""
    policy = synthetic({"draft": (1.0, 3.0)}, explore=True, seed=1, draft=(0.2, 1.0))
    picks = [choose(policy, DRAFT).method for _ in range(400)]
    tried = picks.count("draft")
    assert 10 < tried < 390, tried
    own = {"draft": Counts(0.0, 40.0)}  # this request's drafts were all rejected
    assert [choose(policy, DRAFT, own=own).method for _ in range(200)].count("draft") < tried / 4
    strong = synthetic({"draft": (1.0, 200.0)}, explore=True, seed=2, draft=(0.2, 1.0))
    strong.counts[("c", "draft", "greedy")].updated -= 4 * 3600  # four hours without news
    assert [choose(strong, DRAFT).method for _ in range(400)].count("draft") > 10


def test_a_swapped_draft_is_judged_on_its_own_record_not_the_old_ones():
    """A hot-swap re-seeds the draft's counts (issue 55): the old draft's poor record would keep
    ``auto`` off a draft that has since learned the cluster's traffic."""
    policy = synthetic({"draft": (20.0, 80.0), "llma.context@m4": (60.0, 40.0)}, explore=True, seed=3, draft=(0.2, 8.0))
    policy.counts[("c", "draft", "low")] = Counts(5.0, 20.0)
    policy.counts[("other", "draft", "greedy")] = Counts(1.0, 9.0)
    before = [choose(policy, DRAFT).method for _ in range(200)].count("draft")
    policy.reseed("c", ["draft"], 0.75)
    after = [choose(policy, DRAFT).method for _ in range(200)].count("draft")
    assert before < 20 and after > 180, (before, after)
    c = policy.counts[("c", "draft", "greedy")]
    assert c.accepted / c.trials == pytest.approx(0.75) and c.trials == pytest.approx(policy.prior_trials)
    assert ("c", "draft", "low") not in policy.counts  # another temperature: no evidence until measured
    assert policy.counts[("c", "llma.context@m4", "greedy")].trials == 100.0  # other methods keep theirs
    assert policy.counts[("other", "draft", "greedy")].trials == 10.0  # and other clusters
    # no measurement of the new draft (or a nonsense one): no evidence at all, so it is explored
    for alpha in (None, float("nan"), 1.5):
        policy.reseed("c", ["draft"], alpha)
        assert ("c", "draft", "greedy") not in policy.counts
    assert policy.posterior("c", "draft", "greedy", None) == (1.0, 1.0)


def test_the_gate_score_seeds_only_when_it_is_the_served_alpha():
    from specops.serving.fleet.node import gate_alpha

    assert gate_alpha({"gate_metric": "served", "gate_candidate_acceptance": "0.612000"}) == pytest.approx(0.612)
    assert gate_alpha({"gate_metric": "sampling", "gate_candidate_acceptance": "0.9"}) is None
    assert gate_alpha({"gate_metric": "served", "gate_candidate_acceptance": "x"}) is None
    assert gate_alpha({"gate_metric": "served", "gate_candidate_acceptance": "2"}) is None
    assert gate_alpha({}) is None


def _looped(pair, prompt, n=40):
    """The prompt followed by the target's own continuation twice: copying pays on the second pass."""
    ref = plain_generate(SpecEngine(pair), prompt, SamplingParams(max_new_tokens=n), method="target").token_ids
    return prompt + ref + prompt


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_target_while_switching_methods(close_pair, tiny_target, seed):
    docs = [
        p + plain_generate(SpecEngine(close_pair), p, SamplingParams(max_new_tokens=24), method="target").token_ids
        for p in random_prompts(12, seed=5)
    ]
    store, _ = Datastore.build(tiny_target, docs, DatastoreConfig(dims=16, value_len=8))
    policy = AutoPolicy(seed=seed)
    policy.verify[0] = CostFit(5.0, 0.2, prior_weight=1e12)  # pinned: the choices follow acceptance alone
    policy.propose["draft"] = CostFit(0.1, 0.3, prior_weight=1e12)
    engine = SpecEngine(close_pair)
    used: set[str] = set()
    for prompt in random_prompts(3, seed=20 + seed) + [_looped(close_pair, random_prompts(1, seed=9)[0])]:
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=48), method="target")
        # a reference that quotes the first half of the answer: copies pay there, then run out
        quote = (tuple(prompt[-6:] + ref.token_ids[:24]),)
        res = ProposerResources(pair=close_pair, policy=policy, datastore=store, references=quote)
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=48), **AUTO, resources=res)
        assert out.token_ids == ref.token_ids
        assert out.stats.method == "auto" and out.stats.num_generated == 48
        per = out.stats.policy["methods"]
        assert sum(m["steps"] for m in per.values()) == out.stats.num_verify_steps
        assert sum(m["accepted"] for m in per.values()) == out.stats.num_accepted
        used |= set(per)
    assert {"draft", "llma"} <= used and len(used) >= 3, used  # it switched between methods


def test_sampling_is_exact_with_a_negative_control(close_pair):
    """First token of requests sampled at T=0.6 under ``auto``, whose first step drafts (with
    the model, or by copying from the prompt, whichever it picks): the target's distribution
    (chi-square). Control: the draft's own distribution (a rule that accepts every draft)
    fails the same test."""
    prompt = [5, 17, 42, 5, 17]
    params = SamplingParams(temperature=0.6, max_new_tokens=3)
    with torch.inference_mode():
        p1 = warp(close_pair.target(torch.tensor([prompt])).logits[0, -1:], params)[0]
        q1 = warp(close_pair.draft(torch.tensor([prompt])).logits[0, -1:], params)[0]
    policy = AutoPolicy(seed=0, realized_check=False)
    # costs pinned (a prior no measurement moves, no realized-speed check) and acceptance high:
    # drafting pays, so it drafts
    policy.verify[0] = CostFit(10.0, 0.1, prior_weight=1e12)
    policy.propose["draft"] = CostFit(0.1, 0.1, prior_weight=1e12)
    policy.counts[("default", "draft", "low")] = Counts(900.0, 100.0)
    res = ProposerResources(pair=close_pair, policy=policy)
    engine = SpecEngine(close_pair)
    n = 500
    counts = np.zeros(97, dtype=np.int64)
    drafted = 0
    for seed in range(n):
        out = plain_generate(
            engine, prompt, SamplingParams(temperature=0.6, max_new_tokens=3, seed=seed), **AUTO, k=2, resources=res
        )
        counts[out.token_ids[0]] += 1
        drafted += out.stats.num_drafted > 0
    assert drafted > n / 2
    expected = p1.double().numpy() / float(p1.sum())
    assert pooled_chisquare(counts, expected) > 1e-3
    g = torch.Generator().manual_seed(0)
    wrong = np.bincount(torch.multinomial(q1, n, replacement=True, generator=g).numpy(), minlength=97)
    assert pooled_chisquare(wrong, expected) < 1e-6


def test_priors_round_trip_and_bad_files_are_refused(close_pair):
    policy = AutoPolicy(seed=0)
    engine = SpecEngine(close_pair)
    for prompt in random_prompts(3, seed=3):
        plain_generate(
            engine,
            prompt,
            SamplingParams(max_new_tokens=24),
            **AUTO,
            resources=ProposerResources(pair=close_pair, policy=policy),
        )
    priors = policy.priors()
    assert priors["format"] == "specops-auto-priors/1" and priors["counts"] and priors["verify"]
    fresh = AutoPolicy()
    fresh.load_priors(priors)
    for row in priors["counts"]:
        c = fresh.counts[(row["cluster"], row["key"], row["temperature"])]
        assert c.trials <= fresh.prior_trials + 1e-9  # a prior never outweighs a request's own evidence for long
    assert fresh.verify[0].a == pytest.approx(policy.verify[0].a, rel=1e-3)
    with pytest.raises(ValueError, match="not an auto-policy priors"):
        fresh.load_priors({"format": "something else"})


def test_a_candidate_joins_with_the_newest_of_its_loaded_and_calibrated_cost_priors():
    """Candidates join the policy when ``auto`` builds them: a method's loaded prior and its
    kind's calibration wait for it, and the newer one wins (serving loads, then calibrates)."""
    propose = {"draft": {"a_ms": 7.0, "b_ms": 7.0}, "llma": {"a_ms": 0.5, "b_ms": 0.0}}
    priors = {"format": "specops-auto-priors/1", "counts": [], "propose": propose}
    policy = AutoPolicy()
    policy.load_priors(priors)
    policy.calibrated((10.0, 1.0), {"draft_model": (1.0, 1.0)})
    policy.join("draft", (2.0, 4.0), kind="draft_model")
    policy.join("llma", (0.05, 0.0), kind="copy")
    policy.join("toy", (1.0, 0.0), kind="search")
    assert [policy.propose[m].a for m in ("draft", "llma", "toy")] == [1.0, 0.5, 1.0]
    later = AutoPolicy()
    later.calibrated((10.0, 1.0), {"draft_model": (1.0, 1.0)})
    later.load_priors(priors)
    later.join("draft", (2.0, 4.0), kind="draft_model")
    assert later.propose["draft"].a == 7.0
    later.calibrated((10.0, 1.0), {"draft_model": (3.0, 1.0)})  # a joined method of the kind starts over
    assert later.propose["draft"].a == 3.0


def test_calibration_measures_the_models_and_the_snapshot_shows_the_state(close_pair):
    policy = AutoPolicy(seed=0)
    costs = calibrate(policy, close_pair, reps=2)
    assert costs["verify_ms_1"] > 0 and costs["draft_ms_1"] > 0
    plain_generate(
        SpecEngine(close_pair),
        [1, 2, 3],
        SamplingParams(max_new_tokens=12),
        **AUTO,
        resources=ProposerResources(pair=close_pair, policy=policy, cluster="code"),
    )
    snap = policy.snapshot()
    state = snap["clusters"]["code"]
    assert sum(state["decisions"].values()) >= 1 and state["last"]["method"] in ("target", "draft", "llma")
    assert "target" in state["last"]["estimates"] and snap["verify_ms"]["1"]["observations"] >= 1
    assert snap["in_flight"] == 0  # finished sessions leave


def test_no_draft_model_means_copy_or_target_only(tiny_target):
    pair = ModelPair(target=tiny_target, draft=None, tokenizer=None)
    prompt = random_prompts(1, seed=4)[0]
    ref = plain_generate(SpecEngine(pair), prompt, SamplingParams(max_new_tokens=20), method="target")
    out = plain_generate(
        SpecEngine(pair),
        prompt,
        SamplingParams(max_new_tokens=20),
        **AUTO,
        resources=ProposerResources(pair=pair, policy=AutoPolicy(seed=0)),
    )
    assert out.token_ids == ref.token_ids and set(out.stats.policy["methods"]) <= {"target", "llma"}


def test_it_learns_per_load_which_method_pays():
    """The model says the draft pays at 1 and at 4 requests in flight; at 4 its steps really
    run at 0.4 of the model's speed (what the model does not name: its forwards contend with the
    other requests' threads, the batch waits for it), the target's as modelled. The realized-speed
    check at load 4 turns the draft off there within a few steps, and leaves load 1 alone."""
    load = {"n": 4}
    policy = synthetic({"draft": (90.0, 10.0)}, verify=(20.0, 1.0), draft=(0.2, 1.0), load=lambda: load["n"])
    first = choose(policy, DRAFT)
    assert first.method == "draft" and first.alternatives["draft"] > 1.2 * first.alternatives["target"], first
    picks = []
    for _ in range(40):
        c = choose(policy, DRAFT)
        picks.append(c.method)
        slow = 2.5 if c.method == "draft" else 1.0
        emitted = c.expected if c.method == "draft" else 1.0
        step_ms = (emitted + c.others_emitted) / c.modelled * 1000.0 * slow
        kw = dict(accepted=0, drafted=0, emitted=emitted, n_verified=c.n_verify, verify_ms=None, propose_ms=None)
        policy.record("c", "greedy", c, step_ms=step_ms, **kw)
    assert picks[:3] == ["draft"] * 3 and set(picks[-20:]) == {"target"}, picks
    snap = policy.snapshot()["realized"]
    assert snap["draft@4"]["factor"] < 0.85 and snap["target@4"]["factor"] == pytest.approx(1.0, abs=0.01)
    load["n"] = 1
    assert choose(policy, DRAFT).method == "draft"
    # the verdict fades: an hour later the draft is tried at load 4 again
    policy.realized[("draft", 2)].updated -= 3600.0
    load["n"] = 4
    assert choose(policy, DRAFT).method == "draft"
    # a broken timing is ignored
    policy.realized[("draft", 2)].observe(float("nan"))
    assert policy.realized[("draft", 2)].n_obs == sum(p == "draft" for p in picks)


def test_a_draft_that_holds_up_the_others_steps_is_charged_for_it():
    """Four requests in flight; one may draft, three run target-only. The draft's own steps run
    as modelled, and the model says it pays (a little), but while it drafts the others' steps take
    1/0.6 as long (its forwards hold the pass they wait for). Its own check cannot see that; the
    co-running check does, and the request stops drafting. A negative control without the
    co-running effect keeps drafting: the change is the charge, not the own check."""

    def run(slowdown: float) -> tuple[list[str], AutoPolicy]:
        policy = synthetic({"draft": (60.0, 40.0)}, verify=(20.0, 1.0), draft=(0.2, 1.0), load=lambda: 4)
        picks = []
        for _ in range(80):
            for sid in (1, 2, 3, 4):
                c = policy.choose("c", "greedy", available=DRAFT if sid == 1 else {}, own={}, k_cap=16, session=sid)
                if sid == 1:
                    picks.append(c.method)
                emitted = c.expected if c.method == "draft" else 1.0
                ratio = slowdown if "draft" in c.co else 1.0
                step_ms = (emitted + c.others_emitted) / c.modelled * 1000.0 / ratio
                kw = dict(
                    accepted=0, drafted=0, emitted=emitted, n_verified=c.n_verify, verify_ms=None, propose_ms=None
                )
                policy.record("c", "greedy", c, step_ms=step_ms, **kw)
        return picks, policy

    picks, policy = run(0.6)
    assert picks[0] == "draft" and set(picks[-30:]) == {"target"}, picks
    co = policy.snapshot()["co_running"]
    assert co["draft@4"]["factor"] < 0.75 and co["draft@4"]["with"] > 0, co
    # the others' target steps were slow only beside the draft: the target's own check is not blamed
    assert policy.snapshot()["realized"]["target@4"]["factor"] > 0.9
    control, _ = run(1.0)
    assert set(control[-30:]) == {"draft"}, control

"""Per-request counts recomputed from a vLLM request's output, the copy proposer's rule, and
``auto``'s per-request choice of server: the parts that need no vLLM server."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.vllm.choice import MIN_TRIALS, RequestPolicy
from specops.serving.vllm.plugin.specops_vllm_copy import join_refs, propose_copy, split_refs
from specops.serving.vllm.replay import Replayed, ngram_draft, replay, replay_draft


def _kmp_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's n-gram rule as its proposer states it (KMP over the reversed context, the longest
    match in [min_n, max_n], ties to the match found last in the reversed scan): written out
    independently here, to check the vectorised port against."""
    total = len(tokens)
    if total < min_n:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start : start + min(k, total - start)]


def test_ngram_port_matches_vllms_rule_on_random_contexts():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 40)
        toks = [rng.randint(0, rng.choice([2, 3, 5])) for _ in range(n)]
        got = ngram_draft(np.asarray(toks, dtype=np.int64), 3, 2, 4).tolist()
        assert got == _kmp_ngram(toks, 2, 4, 3), toks


def test_replay_counts_steps_as_the_engine_does():
    # output 10 tokens; the proposer always proposes the true next 2 tokens, then a wrong one
    out = list(range(100, 110))

    def oracle(ctx, pos):
        return [*out[pos : pos + 2], -5]

    r = replay([1, 2, 3], out, oracle, 3)
    # steps at pos 1, 4, 7: each accepts 2, rejects 1 and emits 3; the last (pos 7) compares 3 known tokens
    assert r == Replayed(drafted=9, accepted=6, rejected_steps=3, steps=3)
    # a perfect proposer is truncated at the request's end, with no rejection there
    perfect = replay([1], out, lambda ctx, pos: out[pos : pos + 3], 3)
    assert perfect.rejected_steps == 0 and perfect.accepted == perfect.drafted == 9 - 2
    # no proposal: one token per step (target-only steps)
    assert replay([1], out, lambda ctx, pos: [], 3) == Replayed(0, 0, 0, 9)


def test_draft_replay_is_what_our_engine_counts_for_the_same_greedy_request(close_pair):
    """Our engine's draft-model speculation (greedy chain of k, full head) is vLLM's: the replay of
    its output must give the engine's own counts."""
    pair = close_pair
    engine = SpecEngine(pair)
    for prompt in ([5, 9, 12, 7], [3, 3, 3, 3, 3, 3]):
        res = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method="draft", k=3)
        r = replay_draft(pair.draft, prompt, res.token_ids, 3)
        st = res.stats
        assert (r.accepted, r.rejected_steps) == (st.num_accepted, st.num_rejected_steps), (r, st.to_dict())


def test_copy_rule_copies_longest_match_from_references_first():
    refs = [np.array([9, 1, 2, 3, 4, 5, 6, 7]), np.array([2, 3, 8, 8])]
    ctx = np.array([5, 6, 7, 1, 2, 3])
    assert propose_copy(ctx, refs, 4) == [4, 5, 6, 7]  # "1 2 3" in the first reference: copy 1 + 3, at most k
    assert propose_copy(ctx, refs, 2) == [4, 5]
    assert propose_copy(np.array([1, 2, 3, 1, 2]), [], 4) == [3, 1, 2]  # the request's own context
    assert propose_copy(np.array([4, 4, 0]), refs, 4, min_n=2) == []  # "4 0" nowhere; min_n 2 refuses "0"
    assert [a.tolist() for a in split_refs(join_refs([[1, 2], [], [3]]))] == [[1, 2], [3]]
    assert split_refs([]) == [] and join_refs([]) == []


def test_auto_explores_each_server_then_takes_the_fastest_per_kind():
    pol = RequestPolicy(("target", "pld", "draft"), k=3, seed=0, explore=True)
    speed = {"target": 10.0, "pld": 12.0, "draft": 8.0}  # ms per step
    alpha = {("plain", "pld"): 0.05, ("plain", "draft"): 0.7, ("refs", "pld"): 0.9, ("refs", "draft"): 0.5}
    rng = np.random.default_rng(0)
    chosen = {"plain": [], "refs": []}
    for i in range(300):
        kind = "plain" if i % 2 else "refs"
        c = pol.choose("c", temperature=0.0, kind=kind, load=1)
        chosen[kind].append(c.method)
        a = alpha.get((kind, c.method), 0.0)
        steps, acc, rej = 20, 0, 0
        for _ in range(steps):  # k = 3 per step
            m = 0
            while m < 3 and rng.random() < a:
                m += 1
            acc, rej = acc + m, rej + (m < 3)
        if c.method == "target":
            acc = rej = 0
        pol.record(
            "c",
            c.method,
            temperature=0.0,
            kind=kind,
            load=1,
            accepted=acc,
            rejected_steps=rej,
            steps=steps,
            decode_s=steps * speed[c.method] / 1000,
        )
    for kind, best in (("plain", "draft"), ("refs", "pld")):
        assert chosen[kind][: 3 * MIN_TRIALS].count(best) == MIN_TRIALS  # each server tried first
        tail = chosen[kind][-60:]
        assert tail.count(best) >= 50, (kind, tail)
    summary = pol.summary()
    assert summary["level"] == "request" and summary["decisions"]
    # only what a request may use is chosen (sampling with top_k: target-only)
    assert pol.choose("c", temperature=1.0, kind="plain", load=1, allowed=("target",)).method == "target"
    with pytest.raises(ValueError):
        pol.choose("c", temperature=0.0, kind="plain", load=1, allowed=())


def test_reseed_forgets_a_replaced_drafts_counts():
    pol = RequestPolicy(("target", "draft"), k=3, seed=1)
    pol.record("c", "draft", temperature=0.0, kind="plain", load=1, accepted=5, rejected_steps=5, steps=5, decode_s=0.1)
    assert any(k[1] == "draft" for k in pol.counts)
    pol.reseed("c", "draft")
    assert not any(k[1] == "draft" for k in pol.counts)
    assert torch.tensor(1)  # keeps torch imported for the fixture's models


def _node(speculation, sessions=None, copy_k=None):
    from specops.serving.vllm.node import VLLMNode

    return VLLMNode(
        None,
        None,
        speculation=speculation,
        k=3,
        copy_k=copy_k,
        served_name="t",
        request_timeout_s=5.0,
        sessions=sessions,
    )


def _plan(method="auto", **fields):
    from specops.serving.plan import DecodePlan

    params = fields.pop("params", SamplingParams(max_new_tokens=8))
    return DecodePlan.plain([1, 2, 3], params, method=method, **fields)


def test_what_the_vllm_servers_cannot_do_is_a_400_naming_the_field():
    from specops.core.errors import InvalidRequestError

    node = _node(("draft", "copy", "none"))
    assert node.methods == ("draft", "llma", "target") and node.fixed_method == "auto"
    assert _node(("ngram",)).fixed_method == "pld"  # one server: a request that names none is decoded as it

    def refused(plan, field, **kw):
        with pytest.raises(InvalidRequestError) as exc:
            node.check_plan(plan, explicit_method=kw.get("m", True), explicit_k=kw.get("k", False))
        assert exc.value.param == field, exc.value

    refused(_plan("pld"), "speculation.method")  # no n-gram server here
    refused(_plan("draft", k=5), "speculation.k", k=True)
    refused(_plan("draft", params=SamplingParams(max_new_tokens=8, temperature=1.0, top_k=5)), "top_k")
    for ok in (_plan("llma", references=((4, 5, 6),)), _plan("target", k=5), _plan("auto")):
        node.check_plan(ok, explicit_method=True, explicit_k=ok.k == 5)
    # auto with a top_k sampler: only the target-only server can take it
    sampled = _plan("auto", params=SamplingParams(max_new_tokens=8, temperature=1.0, top_k=5))
    node.check_plan(sampled, explicit_method=True, explicit_k=False)
    assert node._allowed(sampled) == ("target",)
    # the copy server drafts up to vllm_copy_k tokens a step: llma's k is that one, the others' vllm_k
    long_copies = _node(("draft", "copy"), copy_k=8)
    assert long_copies.ks == {"draft": 3, "llma": 8} and long_copies.request_policy.ks == long_copies.ks
    long_copies.check_plan(_plan("llma", k=8), explicit_method=True, explicit_k=True)
    with pytest.raises(InvalidRequestError, match="llma 8") as exc:
        long_copies.check_plan(_plan("llma", k=3), explicit_method=True, explicit_k=True)
    assert exc.value.param == "speculation.k"
    no_copy = _node(("draft",))
    with pytest.raises(InvalidRequestError) as exc:
        no_copy.check_plan(_plan("draft", references=((4, 5),)), explicit_method=True, explicit_k=False)
    assert exc.value.param == "references"


def test_copy_sources_hold_the_requests_texts_and_only_its_tenants_sessions():
    from specops.core.sessions.cache import SessionCacheConfig
    from specops.serving.proposers.session_cache import SessionCache

    sessions = SessionCache(SessionCacheConfig(max_tokens=1000))
    sessions.add("c", list(range(100, 120)), "tenant-a")
    sessions.add("c", list(range(200, 220)), "tenant-b")
    node = _node(("copy",), sessions=sessions)
    refs = node._copy_sources(_plan("llma", references=((7, 8, 9),), cluster="c", session_scope="tenant-a"), ((5, 6),))
    docs = [d.tolist() for d in split_refs(refs)]
    assert docs[:2] == [[7, 8, 9], [5, 6]]
    flat = [t for d in docs for t in d]
    assert set(range(100, 120)) <= set(flat) and not set(range(200, 220)) & set(flat)
    other = node._copy_sources(_plan("llma", cluster="c", session_scope="tenant-c"), ())
    assert other == []  # a tenant with no sessions gets none of the others'


def _feed(pol: RequestPolicy, method: str, kind: str, *, accepted: int, ms: float, load: int = 1, shared=False, n=5):
    """``n`` finished requests of 10 steps at ``ms`` per step (``accepted`` of 30 drafted positions)."""
    for _ in range(n):
        pol.record(
            "c",
            method,
            temperature=0.0,
            kind=kind,
            load=load,
            accepted=accepted if method != "target" else 0,
            rejected_steps=max(0, 10 - accepted // 3) if method != "target" else 0,
            steps=10,
            decode_s=ms * 10 / 1000,
            shared=shared,
        )


def _mixed_policy(shared_factor: float) -> RequestPolicy:
    """``plain`` requests: target 10 ms a step, pld 14 ms copying nothing (target is faster for
    them alone); ``refs`` requests: pld copies 27 of 30. A step beside another busy server costs
    ``shared_factor`` times more (a CPU: 2 or more, each server reading the weights for its own batch; a GPU with room: about 1)."""
    pol = RequestPolicy(("target", "pld"), k=3, explore=False)
    for load in (1, 4):
        for method, ms in (("target", 10.0), ("pld", 14.0)):
            for kind, accepted in (("plain", 0), ("refs", 27)):
                _feed(pol, method, kind, accepted=accepted, ms=ms, load=load)
                _feed(pol, method, kind, accepted=accepted, ms=ms * shared_factor, load=load, shared=True)
    return pol


def _route(pol: RequestPolicy, kinds: list[str], load: int, busy=None) -> list:
    return [pol.choose("c", temperature=0.0, kind=k, load=load, busy=busy) for k in kinds]


def test_one_request_at_a_time_goes_to_its_own_fastest_server():
    pol = _mixed_policy(shared_factor=3.0)
    first, second = _route(pol, ["plain", "refs"], load=1)
    assert (first.method, first.reason) == ("target", "alone"), first.to_dict()
    assert (second.method, second.reason) == ("pld", "alone"), second.to_dict()


def test_concurrent_traffic_goes_to_the_server_that_serves_the_mix_fastest():
    """On a CPU, plain requests sent to target-only while refs requests stay on pld would make the
    two servers share the cores for as long as both kinds arrive: both go to the mix's home (pld),
    even when only target-only happens to be busy (the momentary snapshot that misled the
    previous rule, 0.84× the best single server at concurrency 4)."""
    pol = _mixed_policy(shared_factor=3.0)
    chosen = _route(pol, ["plain", "refs"] * 10, load=4, busy={"target": 1})
    assert {(c.method, c.reason) for c in chosen[2:]} == {("pld", "home")}, [c.to_dict() for c in chosen]
    assert pol.summary()["home"] == "pld"
    plain = chosen[-2]
    assert plain.alternatives["pld"] > plain.alternatives["target"], plain.to_dict()  # the mix's tokens/s
    # The traffic turns to plain requests only: target-only becomes home, once it is HOME_GAIN faster.
    later = _route(pol, ["plain"] * 80, load=4)
    assert later[0].method == "pld" and later[-1].method == "target", [c.method for c in later]
    assert pol.summary()["home"] == "target"


def test_a_group_moves_off_home_when_the_servers_do_not_contend():
    """Where a step beside another server costs what it costs alone (a GPU with room), the mix is
    served faster split: plain requests on target-only, refs on pld."""
    pol = _mixed_policy(shared_factor=1.0)
    chosen = _route(pol, ["plain", "refs"] * 10, load=4)
    assert {(c.method, c.reason) for c in chosen[-10:] if c.kind == "plain"} == {("target", "split")}
    assert {c.method for c in chosen[-10:] if c.kind == "refs"} == {"pld"}


def test_home_is_kept_through_a_near_tie():
    """pld (copying a little) is home; target-only's steps then get a little faster, by less than
    HOME_GAIN: the traffic stays on pld rather than moving the servers' load back and forth."""
    from specops.serving.vllm.choice import HOME_GAIN

    pol = RequestPolicy(("target", "pld"), k=3, explore=False)
    for load in (1, 4):
        _feed(pol, "target", "plain", accepted=0, ms=10.0, load=load)
        _feed(pol, "pld", "plain", accepted=0, ms=10.0, load=load)  # the prior's α: pld a little faster
    assert _route(pol, ["plain"], load=4)[0].method == "pld"
    _feed(pol, "target", "plain", accepted=0, ms=9.3, load=4, n=40)
    stay = pol.choose("c", temperature=0.0, kind="plain", load=4)
    assert (stay.method, stay.reason) == ("pld", "home"), stay.to_dict()
    t_pld, t_target = pol._mix_time("pld", bucket=2), pol._mix_time("target", bucket=2)
    assert t_target < t_pld < HOME_GAIN * t_target  # target-only is faster now, within the gain
    _feed(pol, "target", "plain", accepted=0, ms=7.0, load=4, n=60)  # then clearly faster: it is home
    assert _route(pol, ["plain"], load=4)[0].method == "target"


def test_an_unmeasured_load_is_priced_by_how_the_other_servers_slow_down():
    """pld was measured at load 1 only; target-only's step costs twice as much at load 4 as at 1:
    pld's cost at load 4 is its cost at 1 times two, not its lighter-load cost."""
    pol = RequestPolicy(("target", "pld"), k=3, explore=False)
    _feed(pol, "target", "plain", accepted=0, ms=10.0, load=1)
    _feed(pol, "target", "plain", accepted=0, ms=20.0, load=4)
    _feed(pol, "pld", "plain", accepted=3, ms=12.0, load=1)
    assert pol._step_ms("pld", 2, 0) == pytest.approx(24.0)
    assert pol._step_ms("pld", 0, 0) == pytest.approx(12.0)
    assert pol._step_ms("pld", 2, 1) == pytest.approx(48.0)  # never beside another: alone times two


def test_settled_options_are_chosen_by_their_mean_not_a_draw():
    """Thompson draws while an option is new; once each has served SETTLED_TRIALS requests the
    posterior mean decides, so a near-tie no longer sends a stray request to the slower server
    (under concurrent load that request would share the cores with all the others)."""
    from specops.serving.vllm.choice import SETTLED_TRIALS

    pol = RequestPolicy(("target", "pld"), k=3, seed=0)  # explore on: draws while unsettled
    for _ in range(20):
        for method in ("target", "pld"):
            pol.record(
                "c",
                method,
                temperature=0.0,
                kind="plain",
                load=1,
                accepted=3 if method == "pld" else 0,
                rejected_steps=7 if method == "pld" else 0,
                steps=10,
                decode_s=0.10 if method == "target" else 0.12,
            )
    early = [pol.choose("c", temperature=0.0, kind="plain", load=1).method for _ in range(SETTLED_TRIALS + 2)]
    assert {"target", "pld"} <= set(early)  # MIN_TRIALS each, then draws: both get requests
    late = {pol.choose("c", temperature=0.0, kind="plain", load=1).method for _ in range(200)}
    assert late == {"pld"}, late  # pld's mean is ahead (≈1.3 against 1 token per 10-12 ms)


def test_a_request_is_filed_under_the_load_it_decoded_at_not_its_arrival():
    """The first request of a burst arrives alone and decodes beside the rest: its mean load over
    its life is what its cost is filed under, and it shared the cores when another server was
    busy for most of it."""
    from specops.serving.vllm.choice import LoadMeter

    now = [0.0]
    meter = LoadMeter(clock=lambda: now[0])
    a, load_a, _ = meter.arrive()
    meter.start("llma")
    assert load_a == 1
    now[0] = 1.0
    meter.arrive()
    meter.start("llma")
    now[0] = 2.0
    c, load_c, busy = meter.arrive()
    assert (load_c, busy) == (3, {"llma": 2})
    meter.start("target")
    now[0] = 4.0
    meter.leave("target")
    assert meter.since(c, "target") == (3, True)  # llma busy throughout
    now[0] = 5.0
    meter.leave("llma")
    # 1 s at 1, 1 s at 2, 2 s at 3, 1 s at 2: 11 / 5 = 2.2; target busy 2 of 5 s: not shared
    assert meter.since(a, "llma") == (2, False)
    meter.leave(None)  # a request that never reached a server
    assert meter.in_flight == 0 and meter.busy == {"llma": 1, "target": 0}


def test_one_stalled_request_moves_a_step_cost_by_a_bounded_step():
    from specops.serving.vllm.choice import CLIP, _Cost

    cost = _Cost()
    for _ in range(5):
        cost.add(10.0, 0.98)
    cost.add(10_000.0, 0.98)  # vLLM compiling a new batch shape
    assert cost.ms < 10.0 + (CLIP * 10.0 - 10.0) / 5

"""DecodeSession: steps equal generate, rollback restores exact target-only output, tentative
tokens stay unreported until final, context spans travel with the result."""

from __future__ import annotations

import pytest

from specops.core import limits
from specops.core.errors import InvalidRequestError, PromptTooLongError
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import ContextSpan, SamplingParams
from specops.serving.plan import plain_generate, plain_session
from specops.serving.proposers.catalogue import DEFAULT_K
from specops.serving.proposers.prompt_lookup import PromptLookupProposer
from tests.conftest import random_prompts

GREEDY = SamplingParams(max_new_tokens=24)


def drive(session) -> list[int]:
    while not session.finished:
        session.step()
    return session.finish().token_ids


@pytest.mark.parametrize("method", ["target", "draft", "pld"])
def test_steps_equal_generate(close_pair, method):
    engine = SpecEngine(close_pair)
    for prompt in random_prompts(3, seed=31):
        ref = plain_generate(engine, prompt, GREEDY, method=method, k=3)
        assert drive(plain_session(engine, prompt, GREEDY, method=method, k=3)) == ref.token_ids


@pytest.mark.parametrize("method", ["target", "draft", "pld"])
def test_rollback_then_continue_equals_target_only(close_pair, method):
    """Withdraw tentative output mid-request (as a failed retrieval check would), decode on:
    the output is still exactly target-only greedy, so both caches followed the cut."""
    engine = SpecEngine(close_pair)
    for prompt in random_prompts(4, seed=32):
        ref = plain_generate(engine, prompt, GREEDY, method="target").token_ids
        s = plain_session(engine, prompt, GREEDY, method=method, k=3, hold_back=True)
        while s.state.num_generated < 10 and not s.finished:
            s.step()
        cut = len(prompt) + 4
        s.rollback_to(cut)
        assert s.state.output_ids == ref[:4] and s.state.num_generated == 4
        assert s.target.num_cached == cut - 1  # every committed token but the last
        if method == "draft":
            assert s.proposer.lm.num_cached <= cut - 1
        out = drive(s)
        assert out == ref, (prompt, method)
        assert s.stats.num_rolled_back >= 6


@pytest.mark.parametrize("method", ["target", "draft"])
def test_a_callers_rows_are_verified_in_one_pass_and_change_nothing(close_pair, method):
    """``step(proposals)``: the caller's draft (RaLMSpec's withdrawn interval) is verified in one
    target pass; its right prefix is kept, a wrong token is replaced by the target's, and the
    output stays target-only's (the proposer, if any, catches up)."""
    from specops.serving.engine.types import Proposals

    engine = SpecEngine(close_pair)
    for prompt in random_prompts(3, seed=34):
        ref = plain_generate(engine, prompt, GREEDY, method="target").token_ids
        right = plain_session(engine, prompt, GREEDY, method=method, k=3)
        first = right.step(Proposals.from_rows([ref[:6]]))
        assert first.emitted == ref[:7] and right.target.num_forwards == 1  # 6 accepted + the target's own
        assert drive(right) == ref
        wrong = plain_session(engine, prompt, GREEDY, method=method, k=3)
        bad = ref[:2] + [(ref[2] + 1) % 50] + ref[3:6]
        assert wrong.step(Proposals.from_rows([bad])).emitted == ref[:3]
        assert drive(wrong) == ref
    capped = plain_session(engine, prompt, SamplingParams(max_new_tokens=3), method="target", k=1)
    assert capped.step(Proposals.from_rows([ref[:6]])).emitted == ref[:3]  # cut to the request's length


def test_tentative_tokens_are_final_only_when_finalized(close_pair):
    engine = SpecEngine(close_pair)
    prompt = random_prompts(1, seed=33)[0]
    ref = plain_generate(engine, prompt, GREEDY, method="target").token_ids
    s = plain_session(engine, prompt, GREEDY, method="draft", k=3, hold_back=True)
    outcome = s.step()
    assert outcome.emitted and outcome.final == [] and s.state.num_tentative == len(outcome.emitted)
    n = len(outcome.emitted)
    assert s.finalize(len(prompt) + 1) == ref[:1]
    assert s.state.num_final == 1 and s.state.num_tentative == n - 1
    with pytest.raises(AssertionError, match="only tentative"):
        s.rollback_to(len(prompt))  # a final token cannot be withdrawn
    assert s.finalize() == ref[1:n]
    s.abort()


def test_without_hold_back_every_step_is_final(close_pair):
    s = plain_session(SpecEngine(close_pair), random_prompts(1, seed=34)[0], GREEDY, method="draft", k=3)
    outcome = s.step()
    assert outcome.final == outcome.emitted and s.state.num_tentative == 0
    s.abort()


def test_rollback_drops_rejections_past_the_cut(close_pair):
    engine = SpecEngine(close_pair, collect_rejections=True)
    prompt = random_prompts(1, seed=35)[0]
    s = plain_session(engine, prompt, SamplingParams(max_new_tokens=40), method="draft", k=4, hold_back=True)
    while not s.finished:
        s.step()
    assert s.rejections, "the close pair rejects some drafts"
    cut = s.rejections[0].index + 1
    s.rollback_to(cut)
    assert all(r.index < cut for r in s.rejections) and not s.finished
    s.abort()


def test_context_spans_travel_with_the_result(close_pair):
    prompt = random_prompts(1, seed=36, lo=12, hi=13)[0]
    spans = (ContextSpan("reference", 0, 8), ContextSpan("prompt", 8, len(prompt)))
    out = plain_generate(SpecEngine(close_pair), prompt, GREEDY, method="pld", context_spans=spans)
    assert out.context_spans == spans
    plain = plain_generate(SpecEngine(close_pair), prompt, GREEDY, method="pld")
    assert plain.context_spans == (ContextSpan("prompt", 0, len(prompt)),)


def test_a_ready_proposer_gets_its_own_methods_default_k(close_pair):
    """Regression: a ready pld proposer without k drafted the draft model's default k."""
    asked: list[int] = []

    class Spy(PromptLookupProposer):
        def propose(self, state, k):
            asked.append(k)
            return super().propose(state, k)

    out = plain_generate(
        SpecEngine(close_pair), random_prompts(1, seed=38)[0], SamplingParams(max_new_tokens=30), proposer=Spy()
    )
    assert out.stats.method == "pld"
    assert max(asked) == DEFAULT_K["pld"] == 10


def test_a_stop_overrides_length_but_never_eos(close_pair):
    engine = SpecEngine(close_pair)
    prompt = random_prompts(1, seed=37)[0]
    out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=1), method="target", on_step=lambda toks: True)
    assert out.stats.finish_reason == "stop"
    s = plain_session(engine, prompt, SamplingParams(max_new_tokens=1), method="target")
    s.step()
    assert s.finish_reason == "length"
    s.finish_reason = "eos"
    s.stop()
    assert s.finish_reason == "eos"
    s.abort()


def test_one_prompt_check_for_engine_and_server():
    with pytest.raises(InvalidRequestError, match="prompt is empty") as e:
        limits.check_prompt([], vocab_size=10, context=8)
    assert e.value.param == "prompt"
    with pytest.raises(PromptTooLongError, match="model context is 8"):
        limits.check_prompt(list(range(8)), vocab_size=10, context=8)
    with pytest.raises(PromptTooLongError, match="the limit is 3:"):
        limits.check_prompt(list(range(4)), vocab_size=10, context=8, limit=3)
    with pytest.raises(PromptTooLongError, match="the limit is 7:"):  # the context decides
        limits.check_prompt(list(range(8)), vocab_size=10, context=8, limit=100)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        limits.check_prompt([3, 10], vocab_size=10, context=8)
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(InvalidRequestError, match="k \\(tokens drafted per step\\)"):
            limits.check_k(bad)

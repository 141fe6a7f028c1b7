"""Per-token log-probabilities from the verification pass (``SamplingParams.logprobs``): for every
method they equal target-only decoding's, token by token, and the target's own distribution at
each output position (a full forward over prompt + output), raw and processed."""

from __future__ import annotations

import pytest
import torch

from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.errors import InvalidRequestError
from specops.core.index import IndexConfig
from specops.serving.engine.sampling import LOGPROB_FLOOR, token_logprobs, warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate, plain_session
from specops.serving.proposers.catalogue import CATALOGUE, ProposerResources
from tests.conftest import random_prompts

ATOL = 1e-4
"""float32 logits of a KV-cached pass of k+1 rows against one row at a time, or a full forward."""
TOP = 5


@pytest.fixture(scope="module")
def served(close_pair):
    """The target's greedy outputs for a few prompts: what DReSD's datastore and LLMA's references hold."""
    engine = SpecEngine(close_pair)
    prompts = random_prompts(6, seed=11)
    return [
        p + plain_generate(engine, p, SamplingParams(max_new_tokens=24), method="target").token_ids for p in prompts
    ]


@pytest.fixture(scope="module")
def resources(close_pair, served):
    cfg = DatastoreConfig(dims=8, value_len=6, index=IndexConfig(kind="flat"))
    store, _ = Datastore.build(close_pair.target, served, cfg)
    return ProposerResources(pair=close_pair, datastore=store, references=tuple(tuple(d) for d in served[:3]))


def _reference(target, prompt: list[int], out: list[int], params: SamplingParams):
    """Each output token's log-probability and top alternatives from one full forward."""
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return token_logprobs(logits, out, params)


def _close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.token == w.token
        assert g.logprob == pytest.approx(w.logprob, abs=ATOL)
        assert len(g.top) == len(w.top)
        # alternatives: the same values in order; ids may swap only between (near-)ties
        for (gt, gv), (wt, wv) in zip(g.top, w.top, strict=True):
            assert gv == pytest.approx(wv, abs=ATOL)
            assert gt == wt or abs(gv - wv) <= ATOL


def _runs(method: str):
    """(the method and its rows, k) per method: trees for the retrieval methods, so the tree rows are covered."""
    n = 3 if method in ("dresd", "retrieval") else 0
    return dict(method=method, n_drafts=n), 4


@pytest.mark.parametrize("method", list(CATALOGUE))
def test_greedy_logprobs_equal_target_only_for_every_method(close_pair, served, resources, method):
    engine = SpecEngine(close_pair)
    params = SamplingParams(max_new_tokens=20, logprobs=TOP)
    cfg, k = _runs(method)
    drafted = 0
    for prompt in [d[:8] for d in served[:3]] + random_prompts(2, seed=5):
        ref = plain_generate(engine, prompt, params, method="target")
        out = plain_generate(engine, prompt, params, **cfg, k=k, resources=resources)
        assert out.token_ids == ref.token_ids
        assert len(out.logprobs) == len(out.token_ids)
        _close(out.logprobs, ref.logprobs)
        _close(out.logprobs, _reference(close_pair.target, prompt, out.token_ids, params))
        assert all(x.top[0][0] == x.token for x in out.logprobs)  # greedy: the chosen token is the top one
        drafted += out.stats.num_accepted
    if method not in ("target", "auto"):  # (auto may find that drafting does not pay here)
        assert drafted > 0  # the method really drafted, so the rows checked include verified drafts


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("method", ["draft", "dresd", "llma", "auto"])
def test_sampled_logprobs_are_the_targets_at_each_position(close_pair, served, resources, method, mode):
    """Sampled outputs differ by method (their random streams differ); each token's numbers are
    still the target's distribution at its position: raw log-softmax, or the warped one it was drawn from."""
    engine = SpecEngine(close_pair)
    params = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=20, seed=3, logprobs=TOP, logprobs_mode=mode
    )
    cfg, k = _runs(method)
    for prompt in [d[:8] for d in served[:2]]:
        out = plain_generate(engine, prompt, params, **cfg, k=k, resources=resources)
        _close(out.logprobs, _reference(close_pair.target, prompt, out.token_ids, params))
        if mode == "processed":  # drawn from the warped distribution: never from a filtered-out token
            assert all(x.logprob > LOGPROB_FLOOR for x in out.logprobs)
            assert all(x.logprob <= 0.0 for x in out.logprobs)


def test_processed_is_the_log_of_the_warped_distribution_and_raw_the_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=2, logprobs=3, logprobs_mode="processed")
    got = token_logprobs(logits, [1], params)[0]
    p = warp(logits, params)[0]
    assert got.logprob == pytest.approx(float(p[1].log()))
    assert [t for t, _ in got.top[:2]] == [0, 1] and got.top[2][1] == LOGPROB_FLOOR  # the rest dropped by top-k
    raw = token_logprobs(logits, [1], SamplingParams(temperature=0.5, logprobs=0))[0]
    assert raw.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1])) and raw.top == ()
    greedy = token_logprobs(logits, [0], SamplingParams(logprobs=1, logprobs_mode="processed"))[0]
    assert greedy.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))  # greedy: raw, as vLLM


def test_logprobs_stop_with_the_output_at_eos_and_follow_a_rollback(close_pair):
    engine = SpecEngine(close_pair)
    prompt = [3, 9, 27, 3, 9]
    params = SamplingParams(max_new_tokens=12, logprobs=2)
    session = plain_session(engine, prompt, params, method="draft", k=4, hold_back=True)
    while not session.finished:
        session.step()
    n = session.state.num_generated
    session.rollback_to(len(prompt) + n // 2)
    assert len(session.logprobs) == session.state.num_generated == n // 2
    while not session.finished:
        session.step()
    result = session.finish()
    assert [x.token for x in result.logprobs] == result.token_ids


def test_off_by_default_and_bounded():
    assert SamplingParams().logprobs is None
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(InvalidRequestError, match="logprobs"):
            SamplingParams(logprobs=bad)
    with pytest.raises(InvalidRequestError, match="logprobs_mode"):
        SamplingParams(logprobs=1, logprobs_mode="logits")


@pytest.mark.parametrize("method", ["target", "draft", "dresd", "llma"])
def test_prompt_logprobs_come_from_the_prefill_and_equal_a_full_forward(close_pair, resources, method):
    """``prompt_logprobs`` (the API's echo): one per context token after the first, the same under
    every method, with a prefill in chunks (a context longer than ``PREFILL_CHUNK``) changing nothing."""
    engine = SpecEngine(close_pair)
    prompt = random_prompts(1, seed=9, lo=20, hi=21)[0]
    params = SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=TOP)
    cfg, k = _runs(method)
    out = plain_generate(engine, prompt, params, **cfg, k=k, resources=resources)
    with torch.inference_mode():
        logits = close_pair.target(torch.tensor([prompt])).logits[0, :-1].float()
    want = token_logprobs(logits, prompt[1:], SamplingParams(logprobs=TOP))
    _close(out.prompt_logprobs, want)
    ref = plain_generate(engine, prompt, params, method="target")
    assert out.token_ids == ref.token_ids
    _close(out.logprobs, ref.logprobs)


def test_a_chunked_prefill_keeps_every_row(close_pair, monkeypatch):
    from specops.serving.engine.session import DecodeSession

    prompt = random_prompts(1, seed=4, lo=23, hi=24)[0]
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=1)
    whole = plain_generate(SpecEngine(close_pair), prompt, params, method="draft", k=3)
    monkeypatch.setattr(DecodeSession, "PREFILL_CHUNK", 5)
    chunked = plain_generate(SpecEngine(close_pair), prompt, params, method="draft", k=3)
    assert len(chunked.prompt_logprobs) == len(prompt) - 1 and chunked.token_ids == whole.token_ids
    for a, b in zip(chunked.prompt_logprobs, whole.prompt_logprobs, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=ATOL)

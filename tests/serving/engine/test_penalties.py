"""Penalties, ``logit_bias`` and ``min_tokens`` under speculation (``specops.serving.engine.processors``):
applied row by row in the verifier, counting the drafts before each row, so greedy outputs equal
target-only's for every method and sampled ones follow the adjusted distribution (chi-square),
with a negative control that counts only the tokens committed before the step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.errors import InvalidRequestError
from specops.core.index import IndexConfig
from specops.serving.engine import processors
from specops.serving.engine.sampling import warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.engine.verifier import Verifier
from specops.serving.plan import plain_generate
from specops.serving.proposers.catalogue import CATALOGUE, ProposerResources
from tests.conftest import random_prompts
from tests.serving.engine.test_verifier import pooled_chisquare, second_token_counts

PENALTIES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.2),
    "repetition": dict(repetition_penalty=1.8),
    "bias": dict(logit_bias=((5, 4.0), (7, -100.0))),
    "mixed": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=10),
}


def _naive(target, prompt: list[int], params: SamplingParams, eos=()) -> list[int]:
    """Target-only greedy decoding by full forwards, the adjustment applied to each last row."""
    out: list[int] = []
    for _ in range(params.max_new_tokens):
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + out])).logits[0, -1:].float()
        row = processors.adjust(logits, params, prompt + out, len(prompt), [[]], eos)
        tok = int(row[0].argmax())
        out.append(tok)
        if tok in eos:
            break
    return out


@pytest.fixture(scope="module")
def resources(close_pair):
    engine = SpecEngine(close_pair)
    prompts = random_prompts(6, seed=11)
    docs = [
        p + plain_generate(engine, p, SamplingParams(max_new_tokens=24), method="target").token_ids for p in prompts
    ]
    store, _ = Datastore.build(close_pair.target, docs, DatastoreConfig(dims=8, value_len=6, index=IndexConfig("flat")))
    return ProposerResources(pair=close_pair, datastore=store, references=tuple(tuple(d) for d in docs[:3])), docs


@pytest.mark.parametrize("kind", list(PENALTIES))
def test_target_only_applies_them_as_a_naive_loop_does(close_pair, kind):
    params = SamplingParams(max_new_tokens=16, **PENALTIES[kind])
    for prompt in random_prompts(3, seed=2):
        got = plain_generate(SpecEngine(close_pair), prompt, params, method="target").token_ids
        assert got == _naive(close_pair.target, prompt, params)
    plain = plain_generate(SpecEngine(close_pair), prompt, SamplingParams(max_new_tokens=16), method="target").token_ids
    assert got != plain  # the adjustment changes this output: the equality below is not vacuous


@pytest.mark.parametrize("kind", list(PENALTIES))
@pytest.mark.parametrize("method", [m for m in CATALOGUE if m != "target"])
def test_greedy_outputs_equal_target_only_for_every_method(close_pair, resources, method, kind):
    res, docs = resources
    engine = SpecEngine(close_pair)
    params = SamplingParams(max_new_tokens=16, **PENALTIES[kind])
    n = 3 if method in ("dresd", "retrieval") else 0
    for prompt in [d[:8] for d in docs[:2]] + random_prompts(2, seed=5):
        ref = plain_generate(engine, prompt, params, method="target").token_ids
        out = plain_generate(engine, prompt, params, method=method, n_drafts=n, k=4, resources=res)
        assert out.token_ids == ref, (method, kind)


def test_min_tokens_holds_eos_back_and_ignore_eos_runs_to_the_end(close_pair):
    import copy

    prompt = [11, 12, 13, 11, 12]
    free = plain_generate(SpecEngine(close_pair), prompt, SamplingParams(max_new_tokens=30), method="target").token_ids
    pair = copy.copy(close_pair)
    pair.target = copy.deepcopy(close_pair.target)
    pair.target.generation_config.eos_token_id = free[3]  # EOS comes 4th when nothing holds it back
    engine = SpecEngine(pair)
    first = free.index(free[3])
    assert (
        plain_generate(engine, prompt, SamplingParams(max_new_tokens=30), method="draft").token_ids == free[: first + 1]
    )
    held = SamplingParams(max_new_tokens=30, min_tokens=8)
    out = plain_generate(engine, prompt, held, method="draft", k=4)
    assert out.token_ids == plain_generate(engine, prompt, held, method="target").token_ids
    assert len(out.token_ids) >= 8 and free[3] not in out.token_ids[:7]
    run = plain_generate(engine, prompt, SamplingParams(max_new_tokens=20, ignore_eos=True), method="pld", k=4)
    assert len(run.token_ids) == 20 and run.stats.finish_reason == "length"


def _p2(target, prompt: list[int], first: int, params: SamplingParams, count_first: bool) -> np.ndarray:
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + [first]])).logits[0, -1:].float()
    ctx = prompt + [first] if count_first else prompt
    row = processors.adjust(logits, params, ctx, len(prompt), [[]])
    p = warp(row, params)[0].double().numpy()
    return p / p.sum()


def test_sampling_follows_the_adjusted_distribution_with_a_negative_control(twin_pair, monkeypatch):
    """Twin draft: its first token is always accepted (no penalty applies before any output), and
    the second, drafted in the same step, is judged by the target's row after it. Counting that
    first token (the rule) gives the penalised distribution; counting only the tokens committed
    before the step (the control: a penalty applied after the step) does not."""
    params = dict(temperature=0.7, max_new_tokens=2, frequency_penalty=2.0, presence_penalty=2.0)
    sp = SamplingParams(**params)
    prompt, first = None, None
    for cand in random_prompts(40, seed=31):
        with torch.inference_mode():
            p1 = warp(twin_pair.target(torch.tensor([cand])).logits[0, -1:].float(), sp)[0]
        f = int(p1.argmax())
        if float(p1[f]) >= 0.3 and _p2(twin_pair.target, cand, f, sp, False)[f] >= 0.1:
            prompt, first = cand, f
            break
    assert prompt is not None, "no prompt whose first token is likely again second"
    engine = SpecEngine(twin_pair)
    right, wrong = _p2(twin_pair.target, prompt, first, sp, True), _p2(twin_pair.target, prompt, first, sp, False)
    counts, n, drafted = second_token_counts(engine, prompt, first, 1500, params, method="draft", k=2)
    assert n > 300 and drafted == n
    assert pooled_chisquare(counts, right) > 1e-3
    assert pooled_chisquare(counts, wrong) < 1e-6  # the test tells the two apart

    original = Verifier._adjusted

    def after_the_step(self, logits, state, extras):  # the control: drafts before a row not counted
        return original(self, logits, state, [[] for _ in extras])

    monkeypatch.setattr(Verifier, "_adjusted", after_the_step)
    bad, n_bad, _ = second_token_counts(engine, prompt, first, 1500, params, method="draft", k=2)
    assert n_bad > 300 and pooled_chisquare(bad, right) < 1e-6


def test_bounds():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))
    assert not processors.adjusts(SamplingParams(ignore_eos=True))

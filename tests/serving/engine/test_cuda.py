"""The engine on a GPU (``pytest -m cuda``): greedy equality of every drafter, the token-tree
verifier, exact sampling with its negative control, and concurrent requests through the batcher.

The CPU tests' machinery, with the models on the device (``tests.cuda_support``): the same
tiny random models and prompts, ``benchmarks.tree_check``'s checks, the verifier tests' rules.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from benchmarks.tree_check import chisquare_p, greedy_identical, sampling_p_values
from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.index import IndexConfig
from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.sampling import warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.proposers.catalogue import ProposerResources
from tests import cuda_support as cs
from tests.conftest import random_prompts

pytestmark = cs.MARKS

NEW = 24


@pytest.fixture(scope="module")
def target():
    return cs.tiny_target()


@pytest.fixture(scope="module")
def pairs(target):
    return {"tiny": cs.tiny_pair(target), "close": cs.close_pair(target), "twin": cs.twin_pair(target)}


@pytest.fixture(scope="module")
def datastore(target):
    """The target's own greedy continuations of 8 prompts (an in-distribution datastore). Its index
    is FAISS's, which the GPU machine of ``benchmarks/gpu_check.py`` does not have: skipped there."""
    pytest.importorskip("faiss", reason="faiss is not installed (the datastore index)")
    engine = SpecEngine(cs.close_pair(target))
    docs = [
        p + plain_generate(engine, p, SamplingParams(max_new_tokens=NEW), method="target").token_ids
        for p in random_prompts(8, seed=5)
    ]
    store, _ = Datastore.build(target, docs, DatastoreConfig(dims=16, value_len=12, index=IndexConfig(kind="flat")))
    return store, docs


def pooled_p(counts: np.ndarray, expected_p: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value of ``counts`` against ``expected_p``, pooling cells expected below 5
    (``tests/serving/engine/test_verifier.py``'s ``pooled_chisquare`` without scipy)."""
    n = counts.sum()
    exp = np.asarray(expected_p, dtype=np.float64) / float(np.sum(expected_p)) * n
    if counts[exp == 0].sum() > 0:
        return 0.0  # a token the target can never emit was emitted
    counts, exp = counts[exp > 0], exp[exp > 0]
    keep = exp >= min_expected
    obs = list(counts[keep]) + ([counts[~keep].sum()] if (~keep).any() else [])
    ex = list(exp[keep]) + ([exp[~keep].sum()] if (~keep).any() else [])
    return chisquare_p(obs, ex)


def test_models_are_on_the_device(pairs):
    for pair in pairs.values():
        assert pair.target.device.type == torch.device(cs.DEVICE).type
        assert pair.draft.device.type == torch.device(cs.DEVICE).type


def test_target_loop_equals_full_recompute_and_hf_generate(pairs):
    pair = pairs["tiny"]
    engine = SpecEngine(pair)
    for prompt in random_prompts(2, seed=11):
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=16), method="target").token_ids
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(16):  # no KV cache at all
                ids.append(int(pair.target(input_ids=torch.tensor([ids], device=cs.DEVICE)).logits[0, -1].argmax()))
            hf = pair.target.generate(
                torch.tensor([prompt], device=cs.DEVICE), max_new_tokens=16, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert out == ids[len(prompt) :] == hf


@pytest.mark.parametrize(
    "method, pair_name, k",
    [
        ("draft", "tiny", 1),
        ("draft", "close", 3),
        ("draft", "twin", 8),
        ("pld", "close", 10),
        ("llma", "close", 16),
        ("auto", "close", None),
    ],
)
def test_every_drafter_equals_target_greedy(pairs, method, pair_name, k):
    """Each drafter of the catalogue (the datastore ones below) at one k each: the CPU tests sweep k."""
    pair = pairs[pair_name]
    engine = SpecEngine(pair)
    params = SamplingParams(max_new_tokens=NEW)
    for prompt in random_prompts(3, seed=100 + (k or 0)):
        ref = plain_generate(engine, prompt, params, method="target").token_ids
        res = ProposerResources(pair=pair, references=(tuple(prompt + ref),))  # llma and auto copy from it
        out = plain_generate(engine, prompt, params, method=method, k=k, resources=res)
        assert out.token_ids == ref, (method, prompt, k)
        assert out.stats.num_accepted <= out.stats.num_drafted
        if pair_name == "twin":
            assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("method", ["draft", "pld", "llma"])
def test_bfloat16_drafters_equal_target_greedy_up_to_rounding_ties(method):
    """Serving's GPU precision: equal to target-only greedy, or diverging first at an exact tie."""
    pair = cs.bfloat16_pair()
    engine = SpecEngine(pair)
    params = SamplingParams(max_new_tokens=NEW)
    for prompt in random_prompts(3, seed=41):
        ref = plain_generate(engine, prompt, params, method="target").token_ids
        res = ProposerResources(pair=pair, references=(tuple(prompt + ref),))
        out = plain_generate(engine, prompt, params, method=method, k=3, resources=res).token_ids
        assert len(out) == len(ref)
        assert out == ref or cs.first_divergence_is_a_rounding_tie(pair.target, prompt, ref, out), method


@pytest.mark.parametrize("method", ["dresd", "retrieval"])
def test_datastore_drafters_equal_target_greedy(pairs, datastore, method):
    store, docs = datastore
    engine = SpecEngine(pairs["close"])
    res = ProposerResources(pair=engine.pair, datastore=store)
    accepted = 0
    for prompt in [d[:8] for d in docs[:3]] + random_prompts(1, seed=77):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=NEW), method="target").token_ids
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=NEW), method=method, k=6, resources=res)
        assert out.token_ids == ref
        accepted += out.stats.num_accepted
    assert accepted > 10  # the datastore really drafted, and was accepted, on the prompts it has served


@pytest.mark.parametrize("pair_name", ["tiny", "close"])
def test_token_trees_equal_target_greedy(pairs, pair_name):
    """Many candidate rows per step verified as one tree pass on the device (``tree_check``)."""
    assert greedy_identical(num_prompts=3, new_tokens=NEW, seed=3, pair=pairs[pair_name])


def test_tree_sampler_is_exact_and_the_biased_rule_is_not():
    """``benchmarks/tree_check.py``'s chi-square (this machine's torch draws the samples)."""
    ps = sampling_p_values(3000)
    assert ps["ours"] > 1e-3
    assert ps["biased"] < 1e-6  # the negative control: the test has the power to fail


def test_engine_sampling_matches_the_target_and_a_broken_verifier_would_not(pairs):
    """The first sampled token follows the target's warped distribution computed on the device;
    the draft's own distribution (what a verifier that accepts everything emits) is rejected."""
    pair = pairs["tiny"]
    engine = SpecEngine(pair)
    params = dict(temperature=1.3, top_p=0.95, max_new_tokens=2)
    prompt = [5, 17, 42, 5, 17]
    with torch.inference_mode():
        logits = pair.target(input_ids=torch.tensor([prompt], device=cs.DEVICE)).logits[0, -1:].float().cpu()
    expected = warp(logits, SamplingParams(**params))[0].double().numpy()
    n = 400
    counts = np.zeros(len(expected), dtype=np.int64)
    drafted = 0
    for seed in range(n):
        out = plain_generate(engine, prompt, SamplingParams(seed=seed, **params), method="draft", k=1)
        counts[out.token_ids[0]] += 1
        drafted += out.stats.num_drafted
    assert drafted >= n  # the draft took part in every request
    assert pooled_p(counts, expected) > 1e-3
    q_logits, _ = CachedLM(pair.draft).forward(prompt, logits_to_keep=1)  # as the engine drafts
    q = warp(q_logits, SamplingParams(**params))[0].double().numpy()
    fake = np.random.default_rng(0).multinomial(n, q / q.sum())
    assert pooled_p(fake, expected) < 1e-6


def test_concurrent_requests_through_the_batcher_stay_lossless(pairs):
    """Eight speculative requests sharing target passes (``TargetBatcher``, KV slots on the device)."""
    pair = pairs["close"]
    batcher = TargetBatcher(pair.target, max_batch=8, window_s=0.01)
    params = SamplingParams(max_new_tokens=NEW)
    prompts = random_prompts(8, seed=4, lo=3, hi=16)
    want = [plain_generate(SpecEngine(pair), p, params, method="target").token_ids for p in prompts]
    got: list = [None] * len(prompts)

    def run(i: int) -> None:
        batcher.begin()
        try:
            got[i] = plain_generate(
                SpecEngine(pair, target_lm=batcher.lm), prompts[i], params, method="draft", k=4
            ).token_ids
        finally:
            batcher.end()

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == want
        assert batcher.num_steps > batcher.num_batches, "no two requests ever shared a forward pass"
        assert batcher.pool.keys[0].device.type == torch.device(cs.DEVICE).type
    finally:
        batcher.close()

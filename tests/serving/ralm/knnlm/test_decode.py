"""kNN-LM (``specops.serving.ralm.knnlm.decode``): the datastore, its two searchers, and speculative decoding.

The release gate: RaLMSpec's speculative kNN-LM emits the baseline's tokens (a real search at
every token), for both searchers, fixed strides and OS³, with mismatches and rollbacks along
the way, greedy and sampled. Everything runs on the tiny random target of ``tests/conftest.py``
(hidden 64, vocabulary 97) over a datastore of its own greedy continuations (so speculation
from the cache mostly holds) and random token documents.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specops.core.errors import InvalidRequestError
from specops.core.models import ModelPair
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.ralm.knnlm.decode import KnnConfig, KnnLM, LocalKnnCache, knnlm_generate
from specops.serving.ralm.knnlm.search import search_keys, select_nearest
from specops.serving.ralm.knnlm.store import (
    DATA_FILE,
    INDEX_FILE,
    META_FILE,
    KnnBuildConfig,
    KnnDatastore,
    KnnDatastoreError,
    build_knnlm,
)
from tests.conftest import random_prompts, tiny_llama

GEN = SamplingParams(max_new_tokens=32)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, seed=11, lo=3, hi=10)


@pytest.fixture(scope="module")
def docs(tiny_target, prompts) -> list[list[int]]:
    """The target's own greedy continuations of the prompts (and of longer random prefixes),
    plus random documents: kNN-LM finds its neighbours, and their next entries, in them."""
    engine = SpecEngine(ModelPair(target=tiny_target, draft=None, tokenizer=None))
    heads = prompts + random_prompts(6, seed=12, lo=4, hi=12)
    return [
        p + plain_generate(engine, p, SamplingParams(max_new_tokens=60), method="target").token_ids for p in heads
    ] + random_prompts(30, seed=13, lo=20, hi=90)


@pytest.fixture(scope="module")
def stores(tiny_target, docs) -> dict[str, KnnDatastore]:
    return {
        "exact": build_knnlm(tiny_target, docs, progress=False),
        "exact32": build_knnlm(tiny_target, docs, cfg=KnnBuildConfig(key_dtype="float32"), progress=False),
        "ivfpq": build_knnlm(tiny_target, docs, cfg=KnnBuildConfig(index="ivfpq", nprobe=4), progress=False),
    }


def run(target, store, prompt, params=GEN, **cfg):
    return KnnLM(target, store, KnnConfig(**cfg)).generate(prompt, params)


# ---------------------------------------------------------------- the release gate
@pytest.mark.parametrize("searcher", ["exact", "ivfpq"])
@pytest.mark.parametrize("stride", [1, 3, 0])
def test_speculative_equals_baseline(tiny_target, stores, prompts, searcher, stride):
    from specops.serving.ralm.knnlm.decode import KNN_OS3

    store, spoken = stores[searcher], 0
    os3 = replace(KNN_OS3, pay_margin=-1.0)  # OS³'s strides every round: its off rule has its own test below
    for k in (1, 48):  # 48: far more neighbours than a cache hit set reproduces exactly; the tokens still match
        for prompt in prompts:
            base = run(tiny_target, store, prompt, mode="baseline", k=k)
            spec = KnnLM(tiny_target, store, KnnConfig(k=k, speculation_stride=stride), os3=os3).generate(prompt, GEN)
            assert spec.token_ids == base.token_ids, (searcher, stride, k, prompt)
            assert base.stats.kb_searches == base.stats.kb_queries == len(base.token_ids)
            assert spec.stats.kb_searches == 1 + spec.stats.verification_batches + spec.stats.unspeculated
            assert sum(spec.stats.strides) == spec.stats.speculations
            if stride:
                assert set(spec.stats.strides[:-1]) <= {stride} and not spec.stats.unspeculated
            spoken += spec.stats.speculations
    assert spoken > 0


@pytest.mark.parametrize("margin", [100.0, -1.0])
def test_the_off_rule_decodes_as_the_baseline(tiny_target, stores, prompts, margin):
    """OS³'s off rule in the kNN-LM loop: rounds it turns off decode one token with a real
    search, as the baseline does. With a margin nothing can clear, the first round scores the
    cache's guess (nothing measured yet) and every later one skips the cache: the baseline's own
    work. With a margin everything clears, speculation starts after that first measured round."""
    from specops.serving.ralm.knnlm.decode import KNN_OS3

    os3 = replace(KNN_OS3, pay_margin=margin)
    for prompt in prompts[:2]:
        base = run(tiny_target, stores["exact"], prompt, mode="baseline", k=8)
        spec = KnnLM(tiny_target, stores["exact"], KnnConfig(k=8), os3=os3).generate(prompt, GEN)
        assert spec.token_ids == base.token_ids
        st = spec.stats
        assert st.shadowed == 1 and st.unspeculated + st.speculations - st.rolled_back_tokens + 1 == st.tokens
        if margin > 0:
            assert st.unspeculated == st.tokens - 1 and not st.strides and st.kb_searches == st.tokens
            assert st.cache_search_s == 0.0 or st.cache_size > 0
        else:
            assert st.unspeculated == 1 and st.strides and st.kb_searches < st.tokens


def test_mismatches_roll_back_and_the_output_still_matches(tiny_target, stores):
    """Random prompts far from the documents, k = 1: the cache's nearest is often not the
    datastore's, speculation fails, the KV cache rolls back, and the tokens are still equal."""
    rolled = mismatches = 0
    for prompt in random_prompts(4, seed=21, lo=2, hi=6):
        for name in ("exact", "ivfpq"):
            base = run(tiny_target, stores[name], prompt, mode="baseline", k=1, lam=0.9)
            spec = run(tiny_target, stores[name], prompt, k=1, lam=0.9, speculation_stride=4)
            assert spec.token_ids == base.token_ids
            rolled += spec.stats.rolled_back_tokens
            mismatches += spec.stats.mismatches
    assert mismatches > 0 and rolled > mismatches  # a mismatch past a stride's first step drops several tokens


def test_a_high_hit_rate_saves_searches(tiny_target, stores, prompts):
    """The prompts' own continuations are in the datastore: their next entries in the cache
    predict the next tokens, and one batched search verifies 4 of them."""
    total = searches = 0
    for prompt in prompts:
        base = run(tiny_target, stores["exact"], prompt, mode="baseline", k=8)
        spec = run(tiny_target, stores["exact"], prompt, k=8, speculation_stride=4)
        assert spec.token_ids == base.token_ids
        total += len(spec.token_ids)
        searches += spec.stats.kb_searches
        assert spec.stats.hit_rate > 0.8 and 0 < spec.stats.cache_size <= KnnConfig().cache_size
    assert searches < total / 2


def test_lambda_zero_is_the_target_alone(tiny_target, stores, prompts):
    engine = SpecEngine(ModelPair(target=tiny_target, draft=None, tokenizer=None))
    for prompt in prompts[:2]:
        want = plain_generate(engine, prompt, GEN, method="target").token_ids
        for mode in ("baseline", "speculative"):
            assert run(tiny_target, stores["exact"], prompt, mode=mode, lam=0.0).token_ids == want


def test_sampling_is_exact_too(tiny_target, stores, prompts):
    """One seeded uniform per position, the inverse-CDF token of the interpolated p: the
    speculative run samples the baseline's tokens."""
    outs = set()
    for seed in (1, 2, 3):
        params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, seed=seed)
        for name in ("exact", "ivfpq"):
            base = run(tiny_target, stores[name], prompts[0], params, mode="baseline", k=16)
            spec = run(tiny_target, stores[name], prompts[0], params, k=16, speculation_stride=3)
            assert spec.token_ids == base.token_ids
            outs.add(tuple(base.token_ids))
    assert len(outs) > 1  # the seed matters: it is sampling


def test_sampling_with_top_k_and_min_p_is_exact_and_filtered(tiny_target, stores, prompts):
    """The filters apply to the interpolated p in both modes: the speculative run still samples the
    baseline's tokens, and a filter that keeps one token gives the greedy output."""
    filtered = SamplingParams(temperature=1.0, top_k=5, min_p=0.05, max_new_tokens=16, seed=4)
    base = run(tiny_target, stores["exact"], prompts[0], filtered, mode="baseline", k=16)
    assert (
        run(tiny_target, stores["exact"], prompts[0], filtered, k=16, speculation_stride=3).token_ids == base.token_ids
    )
    greedy = run(tiny_target, stores["exact"], prompts[0], SamplingParams(max_new_tokens=16), k=16)
    one = SamplingParams(temperature=1.5, top_k=1, max_new_tokens=16, seed=4)
    assert run(tiny_target, stores["exact"], prompts[0], one, k=16).token_ids == greedy.token_ids


def test_float16_keys_give_the_float32_greedy_outputs(tiny_target, stores, prompts):
    assert stores["exact"].stored_keys.dtype == torch.float16 and stores["exact32"].stored_keys.dtype == torch.float32
    assert stores["exact"].bytes_per_entry < 0.6 * stores["exact32"].bytes_per_entry
    for prompt in prompts:
        for k in (1, 32):
            assert (
                run(tiny_target, stores["exact"], prompt, mode="baseline", k=k).token_ids
                == run(tiny_target, stores["exact32"], prompt, mode="baseline", k=k).token_ids
            )


def test_a_capped_cache_and_final_tokens(tiny_target, stores, prompts):
    chunks: list[list[int]] = []
    lm = KnnLM(tiny_target, stores["exact"], KnnConfig(k=8, cache_size=40))
    spec = lm.generate(prompts[1], GEN, on_final=chunks.append)
    assert spec.stats.cache_size <= 40
    assert (
        [t for c in chunks for t in c]
        == spec.token_ids
        == run(tiny_target, stores["exact"], prompts[1], mode="baseline", k=8).token_ids
    )
    stats = spec.stats.to_dict()
    assert stats["tokens"] == 32 and stats["total_s"] >= stats["lm_s"] > 0 and 0.0 <= stats["hit_rate"] <= 1.0


def test_eos_stops_both_modes_unless_ignored(tiny_target, stores, prompts):
    base = run(tiny_target, stores["exact"], prompts[0], mode="baseline", k=8)
    eos = base.token_ids[5]
    for mode in ("baseline", "speculative"):
        lm = KnnLM(tiny_target, stores["exact"], KnnConfig(mode=mode, k=8, speculation_stride=3), eos_token_ids=[eos])
        out = lm.generate(prompts[0], GEN)
        assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(eos) + 1]
        full = lm.generate(prompts[0], replace(GEN, ignore_eos=True))  # the API's ignore_eos: to the limit
        assert full.finish_reason == "length" and full.token_ids == base.token_ids


def test_bad_config_is_refused():
    for bad in ({"k": 0}, {"k": 2048}, {"lam": 1.5}, {"mode": "fast"}, {"speculation_stride": -1}, {"cache_size": 0}):
        with pytest.raises(InvalidRequestError):
            KnnConfig(**bad)


# ---------------------------------------------------------------- the searchers
def test_search_does_not_depend_on_the_batch(stores):
    torch.manual_seed(0)
    queries = torch.randn(40, 64) * 3
    for name in ("exact", "ivfpq"):
        store = stores[name]
        together = store.search(queries, 24)
        for i in range(0, 40, 7):
            alone = store.search(queries[i : i + 1], 24)
            assert torch.equal(alone.ids[0], together.ids[i]) and torch.equal(alone.dists[0], together.dists[i]), name
        assert (together.ids >= 0).all() and (together.dists[:, 1:] >= together.dists[:, :-1]).all()


def test_exact_search_is_exact_and_the_cache_reproduces_it(stores):
    store = stores["exact32"]
    torch.manual_seed(1)
    queries = torch.randn(5, 64) * 3
    got = store.search(queries, 10)
    keys = store.stored_keys.float()
    want = torch.cdist(queries.double(), keys.double()).pow(2).topk(10, largest=False)
    assert torch.equal(got.ids, want.indices)
    assert torch.allclose(got.dists.double(), want.values, rtol=1e-4)
    # a cache holding the true neighbours (and more) finds them, at the same distances, bit for bit
    cache = LocalKnnCache(store, 4096, next_entries=10)
    cache.add(store.search(queries, 64).ids)
    assert torch.equal(cache.search(queries, 10).ids, got.ids) and torch.equal(
        cache.search(queries, 10).dists, got.dists
    )


def test_ties_go_to_the_lower_id_however_the_candidates_come():
    d = torch.tensor([[3.0, 1.0, 2.0, 1.0, 1.0, 5.0, 2.0]])
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    dist, idx = select_nearest(d, ids, 4)
    assert idx.tolist() == [[11, 13, 14, 12]] and dist.tolist() == [[1.0, 1.0, 1.0, 2.0]]
    perm = torch.tensor([6, 4, 2, 0, 1, 3, 5])
    assert select_nearest(d[:, perm], ids[perm], 4)[1].tolist() == idx.tolist()
    g = torch.Generator().manual_seed(0)  # many ties, infinities, any order: always the (distance, id) order
    for _ in range(50):
        m = int(torch.randint(2, 60, (1,), generator=g))
        k = int(torch.randint(1, m + 1, (1,), generator=g))
        d = (
            torch.randint(0, 5, (2, m), generator=g)
            .float()
            .masked_fill_(torch.rand(2, m, generator=g) < 0.2, float("inf"))
        )
        ids = torch.randperm(m, generator=g)
        got = select_nearest(d, ids, k)
        for r in range(2):
            want = sorted(zip(d[r].tolist(), ids.tolist()))[:k]
            assert list(zip(got[0][r].tolist(), got[1][r].tolist())) == want
    # a duplicated key (same hidden state, two documents) is found at the lower entry id first
    keys = torch.cat([torch.randn(3, 4), torch.randn(1, 4).repeat(2, 1)])
    from specops.serving.ralm.knnlm.search import padded_keys

    padded, norms = padded_keys(keys)
    nb = search_keys(keys[3:4], padded, norms, torch.arange(padded.shape[0]), 2)
    assert nb.ids.tolist() == [[3, 4]]


def test_the_cache_evicts_the_oldest_and_keeps_the_nearest(stores):
    store = stores["exact"]
    cache = LocalKnnCache(store, 5, next_entries=0)
    cached = lambda: {int(i) for i in cache._entry if i >= 0}  # noqa: E731
    cache.add(torch.tensor([[1, 2, 3]]))  # nearest first: 3 is the least precious
    cache.add(torch.tensor([[4, 5, 6]]))
    assert cached() == {1, 2, 4, 5, 6} and len(cache) == 5
    cache.add(torch.tensor([[2, -1]]))  # 2 is fresh again
    cache.add(torch.tensor([[7, 8]]))
    assert cached() == {2, 4, 5, 7, 8}
    nb = cache.search(store.stored_keys[[3, 7]].float(), 3)
    assert set(nb.ids.flatten().tolist()) <= cached() and nb.ids[1, 0] == 7 and nb.dists[1, 0] < 1e-3


def test_next_entries_stay_in_the_document(stores):
    store = stores["exact"]
    doc = store.entry_doc
    last_of_first = int((doc == 0).sum()) - 1
    got = store.next_entries(torch.tensor([last_of_first - 2, -1]), 10)
    assert got.tolist() == [last_of_first - 2, last_of_first - 1, last_of_first]


# ---------------------------------------------------------------- files
def test_save_load_round_trip(tiny_target, stores, prompts, tmp_path):
    for name in ("exact", "ivfpq"):
        stores[name].save(tmp_path / name)
        files = sorted(p.name for p in (tmp_path / name).iterdir())
        assert files == sorted([DATA_FILE, META_FILE] + ([INDEX_FILE] if name == "ivfpq" else []))
        loaded = KnnDatastore.load(tmp_path / name, target=tiny_target)
        assert loaded.num_entries == stores[name].num_entries and loaded.searcher.kind == name
        want = run(tiny_target, stores[name], prompts[0], k=8).token_ids
        assert run(tiny_target, loaded, prompts[0], k=8).token_ids == want
        assert json.loads((tmp_path / name / META_FILE).read_text())["format"] == "specops-knnlm/1"


@pytest.mark.parametrize("victim", [DATA_FILE, INDEX_FILE, META_FILE])
def test_a_flipped_byte_is_refused(stores, tmp_path, victim):
    path = stores["ivfpq"].save(tmp_path / "ds")
    blob = bytearray((path / victim).read_bytes())
    blob[len(blob) // 2] ^= 0x01
    (path / victim).write_bytes(bytes(blob))
    with pytest.raises(KnnDatastoreError, match="not a usable kNN-LM datastore"):
        KnnDatastore.load(path)


def test_another_target_is_refused(stores, tmp_path):
    path = stores["exact"].save(tmp_path / "ds")
    with pytest.raises(KnnDatastoreError, match="built with target"):
        KnnDatastore.load(path, target=tiny_llama(64, 2, seed=5))  # same shape, other weights
    with pytest.raises(KnnDatastoreError, match="hidden states of size 64"):
        KnnDatastore.load(path, target=tiny_llama(32, 1, seed=2))
    stores["exact"].tokenizer_sha256 = "a" * 64
    try:
        with pytest.raises(KnnDatastoreError, match="tokenizer"):
            stores["exact"].check_fits(tiny_llama(64, 2, seed=1), tokenizer_sha256="b" * 64)
    finally:
        stores["exact"].tokenizer_sha256 = ""


def test_knnlm_generate_is_the_one_call(tiny_target, stores, prompts):
    out = knnlm_generate(tiny_target, stores["exact"], prompts[2], GEN, cfg=KnnConfig(k=4))
    assert out.token_ids == run(tiny_target, stores["exact"], prompts[2], mode="baseline", k=4).token_ids
    assert out.finish_reason == "length" and out.stats.mode == "speculative" and out.stats.searcher == "exact"


def test_on_final_can_stop_the_request(tiny_target, stores, prompts):
    want = run(tiny_target, stores["exact"], prompts[3], mode="baseline", k=8).token_ids
    for mode in ("baseline", "speculative"):
        seen: list[int] = []

        def on_final(tokens: list[int]) -> bool:
            seen.extend(tokens)
            return len(seen) >= 5  # a stop sequence showed up in the final text

        out = KnnLM(tiny_target, stores["exact"], KnnConfig(mode=mode, k=8, speculation_stride=3)).generate(
            prompts[3], GEN, on_final=on_final
        )
        assert out.finish_reason == "stop" and out.token_ids == seen == want[: len(seen)] and 5 <= len(seen) < 32

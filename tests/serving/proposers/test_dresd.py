"""DReSD: keys, datastore files, the proposer's greedy equality and exact sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specops.core import datastore as ds_module
from specops.core.datastore import DATA_FILE, INDEX_FILE, META_FILE, Datastore, DatastoreConfig
from specops.core.errors import DatastoreError, InvalidRequestError
from specops.core.index import INDEX_KINDS, IndexConfig, build_index, load_index
from specops.core.keys import Projection, target_hidden_states
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.sampling import warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import DecodePlan, plain_generate
from specops.serving.proposers.catalogue import ProposerResources
from tests.conftest import random_prompts
from tests.serving.engine.test_verifier import pooled_chisquare, second_token_counts


def _generations(target, prompts, n=24):
    engine = SpecEngine_for(target)
    return [p + plain_generate(engine, p, SamplingParams(max_new_tokens=n), method="target").token_ids for p in prompts]


def SpecEngine_for(target):
    from specops.core.models import ModelPair

    return SpecEngine(ModelPair(target=target, draft=None, tokenizer=None))


@pytest.fixture(scope="module")
def served_docs(tiny_target):
    """The target's own greedy outputs for 24 prompts: an in-distribution datastore's documents."""
    return _generations(tiny_target, random_prompts(24, seed=5))


@pytest.fixture(scope="module", params=INDEX_KINDS)
def datastore(request, tiny_target, served_docs):
    # ScaNN searches every leaf here: which 8 of its 28 leaves a query reaches depends on a k-means that
    # differs between CPUs (a CI machine once missed the query's own key), and these tests are about
    # drafting, not recall (test_every_index_finds_the_nearest_key_and_reloads_from_bytes is).
    index = IndexConfig(kind=request.param, scann_leaves_to_search=1 << 20)
    cfg = DatastoreConfig(dims=16, value_len=12, index=index)
    store, stats = Datastore.build(tiny_target, served_docs, cfg)
    assert stats.num_entries == sum(len(d) - 1 for d in served_docs) == store.num_entries
    return store


def test_projection_is_znorm_then_pca_then_unit_length():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 12)).astype(np.float32) * np.arange(1, 13) + 5
    p = Projection.fit(x, 4)
    keys = p.apply(x)
    assert keys.shape == (500, 4) and np.allclose(np.linalg.norm(keys, axis=1), 1, atol=1e-5)
    z = (x - x.mean(0)) / x.std(0)
    pca = np.linalg.svd(z - z.mean(0), full_matrices=False)[2][:4].T  # [12, 4]
    assert np.allclose(np.abs(pca.T @ p.components), np.eye(4), atol=1e-3)  # the same directions
    assert 0 < p.explained.sum() <= 1 and (np.diff(p.explained) <= 1e-6).all()
    assert np.array_equal(Projection.fit(x, 4).components, p.components)  # refits agree, signs included


def test_hidden_states_batched_equal_one_at_a_time(tiny_target):
    docs = random_prompts(5, seed=1, lo=3, hi=30)
    batched = dict(target_hidden_states(tiny_target, docs, batch_tokens=64))
    for i, d in enumerate(docs):
        _, alone = CachedLM(tiny_target).forward(d, want_hidden=True)
        assert np.allclose(batched[i], alone.numpy(), atol=1e-4)


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_every_index_finds_the_nearest_key_and_reloads_from_bytes(kind):
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((3000, 16)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    index = build_index(keys, IndexConfig(kind=kind))
    q = keys[:40] + 0.01 * rng.standard_normal((40, 16)).astype(np.float32)
    ids, sims = index.search(q / np.linalg.norm(q, axis=1, keepdims=True), 5)
    assert (ids[:, 0] == np.arange(40)).mean() >= 0.95
    assert (np.diff(sims, axis=1) <= 1e-3).all() and (sims[:, 0] > 0.9).mean() >= 0.95  # cosine, nearest first
    again = load_index(index.cfg, index.files, 16, 3000)
    assert np.array_equal(again.search(q / np.linalg.norm(q, axis=1, keepdims=True), 5)[0], ids)


def test_drafts_follow_the_first_token_filter(datastore, served_docs, tiny_target):
    doc = served_docs[0]
    _, hidden = CachedLM(tiny_target).forward(doc[:10], want_hidden=True)
    rows = datastore.drafts(hidden[-1], doc[10], n_drafts=3, length=5)
    assert rows and rows[0] == doc[11:16]  # its own continuation, nearest
    assert all(1 <= len(r) <= 5 for r in rows) and len({tuple(r) for r in rows}) == len(rows)
    assert datastore.drafts(hidden[-1], (doc[10] + 1) % 97, n_drafts=3, length=5) != rows


@pytest.mark.parametrize("sizes", [(3, 10), (10, 6), (1, 4)])
def test_dresd_equals_target_greedy(datastore, tiny_target, served_docs, sizes):
    """On prompts it has served (long accepted runs) and on new ones (mostly empty drafts)."""
    engine = SpecEngine_for(tiny_target)
    res = ProposerResources(pair=engine.pair, datastore=datastore)
    n_drafts, k = sizes
    cfg = dict(method="dresd", n_drafts=n_drafts)
    accepted = 0
    for prompt in [d[:8] for d in served_docs[:4]] + random_prompts(4, seed=77):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method="target").token_ids
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), **cfg, k=k, resources=res)
        assert out.token_ids == ref
        accepted += out.stats.num_accepted
    assert accepted > 20  # the datastore really drafted (and was accepted) on the served prompts


def test_dresd_sampling_is_exact_with_a_negative_control(tiny_target):
    """Second token of a sampled request, where several retrieved rows are verified as a tree:
    its distribution is the target's (chi-square). Control: emitting the drafted token
    whenever one was drafted (a verifier that accepts everything) fails the same test."""
    prompt = [5, 17, 42, 5, 17]
    params = dict(temperature=0.6, max_new_tokens=3)  # the likeliest first token often enough to count
    with torch.inference_mode():
        first = int(tiny_target(torch.tensor([prompt])).logits[0, -1].argmax())
        p2 = warp(tiny_target(torch.tensor([prompt + [first]])).logits[0, -1:], SamplingParams(**params))[0]
    # Rows after `first`: the three likeliest second tokens, so the tree has three branches.
    likely = p2.argsort(descending=True)[:3].tolist()
    docs = [prompt + [first, t, 1, 2] for t in likely]
    store, _ = Datastore.build(tiny_target, docs, DatastoreConfig(dims=8, value_len=4, index=IndexConfig(kind="flat")))
    engine = SpecEngine_for(tiny_target)
    res = ProposerResources(pair=engine.pair, datastore=store)
    cfg = dict(method="dresd", n_drafts=3)
    counts, n, drafted = second_token_counts(engine, prompt, first, 3000, params, **cfg, k=2, resources=res)
    assert n > 300 and drafted == n  # every counted request verified a drafted tree at its second token
    assert pooled_chisquare(counts, p2.double().numpy() / float(p2.sum())) > 1e-3
    accept_all = np.zeros(97, dtype=np.int64)
    accept_all[likely[0]] = n  # what "accept the nearest draft" would emit
    assert pooled_chisquare(accept_all, p2.double().numpy() / float(p2.sum())) < 1e-6


def test_datastore_files_round_trip_and_refuse_corruption(datastore, tmp_path, served_docs, tiny_target):
    path = datastore.save(tmp_path / "ds")
    assert sorted(p.name for p in path.iterdir()) == sorted([DATA_FILE, INDEX_FILE, META_FILE])
    again = Datastore.load(path)
    _, hidden = CachedLM(tiny_target).forward(served_docs[1][:9], want_hidden=True)
    assert again.drafts(hidden[-1], served_docs[1][9], n_drafts=3, length=6) == datastore.drafts(
        hidden[-1], served_docs[1][9], n_drafts=3, length=6
    )
    assert again.describe()["num_entries"] == datastore.num_entries
    # One flipped byte of the index: refused, naming the file.
    blobs = load_file(str(path / INDEX_FILE))
    name = sorted(blobs)[0]
    blobs[name][len(blobs[name]) // 2] ^= 0xFF
    save_file(blobs, str(path / INDEX_FILE))
    with pytest.raises(DatastoreError, match=f"{INDEX_FILE} does not match its sha256.*corrupt"):
        Datastore.load(path)
    # Entries pointing past the tokens: refused, even with checksums rewritten to match.
    datastore.save(tmp_path / "ds2")
    data = load_file(str(tmp_path / "ds2" / DATA_FILE))
    data["entry_pos"][0] = 10**6
    save_file(data, str(tmp_path / "ds2" / DATA_FILE))
    with pytest.raises(DatastoreError, match=f"{DATA_FILE} does not match its sha256"):
        Datastore.load(tmp_path / "ds2")
    rehashed = json.loads((tmp_path / "ds2" / META_FILE).read_text())
    rehashed["files"][DATA_FILE] = ds_module.sha256_file(tmp_path / "ds2" / DATA_FILE)
    rehashed["json_sha256"] = ds_module._json_sha(rehashed)
    (tmp_path / "ds2" / META_FILE).write_text(json.dumps(rehashed))
    with pytest.raises(DatastoreError, match="outside the tokens"):
        Datastore.load(tmp_path / "ds2")
    meta = json.loads((path / META_FILE).read_text())
    meta["format"] = "pickle"
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(DatastoreError, match="format"):
        Datastore.load(path)


def test_a_datastore_for_another_target_is_refused(datastore, tiny_draft):
    with pytest.raises(DatastoreError, match="hidden states of size 64.*32"):
        datastore.check_fits(tiny_draft)


def test_dresd_needs_a_datastore_and_valid_shape(tiny_target):
    engine = SpecEngine_for(tiny_target)
    with pytest.raises(InvalidRequestError, match="needs a datastore"):
        plain_generate(engine, [1, 2, 3], SamplingParams(max_new_tokens=2), method="dresd")
    with pytest.raises(InvalidRequestError, match="n_drafts"):
        DecodePlan.plain([1], SamplingParams(), method="dresd", n_drafts=1000)


def test_dresd_drafts_the_datastores_measured_shape(datastore, tiny_target, served_docs):
    """n_drafts 0 (the API's default) takes the rows and row length the rebuild measured; an
    explicit n_drafts wins; a datastore without a shape drafts the default."""
    from specops.serving.proposers.dresd import DEFAULT_SHAPE, DReSDProposer

    assert DReSDProposer(datastore).n_drafts == DEFAULT_SHAPE[0]  # no measured shape
    datastore.meta["shape"] = {"n_drafts": 2, "k": 5}
    try:
        p = DReSDProposer(datastore)
        assert (p.n_drafts, p.max_row) == (2, 5)
        assert DReSDProposer(datastore, n_drafts=7).n_drafts == 7
        engine = SpecEngine_for(tiny_target)
        res = ProposerResources(pair=engine.pair, datastore=datastore)
        accepted = 0
        for prompt in [d[:8] for d in served_docs[:4]]:
            ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method="target").token_ids
            out = plain_generate(
                engine,
                prompt,
                SamplingParams(max_new_tokens=24),
                method="dresd",
                k=10,
                resources=res,
            )
            assert out.token_ids == ref
            assert out.stats.num_drafted <= 5 * out.stats.num_target_forwards  # rows cut to the measured 5 tokens
            accepted += out.stats.num_accepted
        assert accepted > 0  # it drafted (ScaNN's approximate search may miss on one prompt, not on four)
    finally:
        del datastore.meta["shape"]

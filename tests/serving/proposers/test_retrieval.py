"""The hybrid ``retrieval`` method: REST's exact suffix rule over the datastore's tokens, LLMA's
scored rule over the request's own context, DReSD's dense rows where both matches are short, one
tree; greedy equality and exact sampling."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.index import IndexConfig
from specops.core.suffix import SuffixIndex
from specops.serving.engine import tree as tree_mod
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.sampling import warp
from specops.serving.engine.types import DecodeState, SamplingParams, Verdict
from specops.serving.plan import plain_generate
from specops.serving.proposers.catalogue import CATALOGUE, ProposerResources
from specops.serving.proposers.retrieval import RetrievalProposer, merge_rows
from tests.conftest import random_prompts
from tests.serving.engine.test_verifier import pooled_chisquare, second_token_counts
from tests.serving.proposers.test_dresd import SpecEngine_for, _generations


def _brute_longest(docs: list[list[int]], ctx: list[int], max_n=16, min_n=2) -> tuple[int, list[list[int]]]:
    """The longest suffix of ctx (max_n..min_n) occurring in a doc with a token after it, and the
    continuations (up to 4 tokens) after its occurrences."""
    for n in range(min(max_n, len(ctx)), min_n - 1, -1):
        q = ctx[-n:]
        conts = [d[i + n : i + n + 4] for d in docs for i in range(len(d) - n) if d[i : i + n] == q]
        if conts:
            return n, conts
    return 0, []


def test_suffix_index_finds_rests_longest_match_and_never_crosses_a_document():
    rng = random.Random(0)
    docs = [[rng.randrange(6) for _ in range(rng.randrange(2, 60))] for _ in range(40)]
    lengths = np.array([len(d) for d in docs])
    index = SuffixIndex(np.array([t for d in docs for t in d], np.int32), np.cumsum(lengths))
    for trial in range(300):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
        if trial % 3 == 0:  # a context ending in a document's own text
            d = docs[trial % len(docs)]
            ctx = d[: rng.randrange(1, len(d) + 1)]
        want_n, conts = _brute_longest(docs, ctx)
        n, lo, hi = index.longest(ctx)
        assert n == want_n, (ctx, n, want_n)
        match = index.lookup(ctx, 4, max_nodes=10_000, max_matches=10_000)
        assert match.length == want_n
        if want_n:
            in_range = [
                tuple(index._toks[p + n : min(p + n + 4, int(index.end[p]))]) for p in index.order[lo:hi].tolist()
            ]
            assert sorted(map(tuple, conts)) == sorted(c for c in in_range if c), "the range holds the occurrences"
            q = ctx[-n:]
            assert match.occurrences == sum(d[i : i + n] == q for d in docs for i in range(len(d) - n + 1))
            assert all(tuple(r) in {tuple(c[: len(r)]) for c in conts} for r in match.rows)
            assert match.shares == sorted(match.shares, reverse=True)
        else:
            assert match.rows == []


def test_lookup_ranks_continuations_by_frequency_and_keeps_a_subtree():
    docs = [[1, 2, 3, 7, 8]] * 5 + [[1, 2, 3, 9, 9]] * 2 + [[4, 2, 3, 5]]
    index = SuffixIndex(np.array([t for d in docs for t in d], np.int32), np.cumsum([len(d) for d in docs]))
    m = index.lookup([0, 1, 2, 3], 3)
    assert m.length == 3 and m.occurrences == 7  # [1, 2, 3] (not [2, 3], which also follows 4)
    assert m.rows == [[7, 8], [9, 9]] and m.shares == [5 / 7, 2 / 7]
    assert index.lookup([0, 1, 2, 3], 3, max_nodes=2).rows == [[7, 8]]  # the two most frequent nodes
    assert index.lookup([6, 2, 3], 3).rows[0] == [7, 8]  # [2, 3]: 8 occurrences, 5 of them go on with 7
    assert index.lookup([3, 5], 3).length == 0  # [3, 5] ends its document: nothing follows it
    assert index.lookup([9, 9], 3).length == 0  # [9, 9] ends its documents (one-token matches are not REST's)
    assert index.lookup([9, 9], 3, min_n=1).rows == [[9]]


def test_merge_rows_drops_repeats_and_prefixes():
    assert merge_rows([[1, 2, 3], [4]], [[1, 2], [4, 5], [], [6]]) == [[1, 2, 3], [4, 5], [6]]
    assert merge_rows([[1, 2]], [[1, 2, 3]], max_rows=1) == [[1, 2, 3]]
    rows = merge_rows([[1, 2, 3], [1, 4]], [[1, 2, 5], [7]])
    tree = tree_mod.build(rows)
    assert tree.num_nodes == 6 and sorted(tree.children(0)) == [1, 7]  # one trie: shared [1] and [1, 2]


@pytest.fixture(scope="module")
def served_docs(tiny_target):
    return _generations(tiny_target, random_prompts(24, seed=5))


@pytest.fixture(scope="module")
def store(tiny_target, served_docs):
    cfg = DatastoreConfig(dims=16, value_len=12, index=IndexConfig(kind="flat"))
    return Datastore.build(tiny_target, served_docs, cfg)[0]


def test_the_hybrid_adds_dense_rows_only_where_the_exact_match_is_short(store, served_docs, tiny_target):
    doc = served_docs[3]
    state = DecodeState(token_ids=list(doc[:12]), num_prompt_tokens=8, params=SamplingParams(max_new_tokens=8))
    exact_only = RetrievalProposer(store, n_drafts=2, dense_below=0, use_context=False)
    exact_only.start(state)
    p = exact_only.propose(state, 5)
    assert exact_only.last_match >= 2 and p.rows()[0] == doc[12:17]  # its own document, matched verbatim
    hybrid = RetrievalProposer(store, n_drafts=2, dense_below=17, use_context=False)  # always add the dense rows
    hybrid.start(state)
    _, h = CachedLM(tiny_target).forward(doc[:11], want_hidden=True)
    hybrid.observe(state, Verdict(accepted=[], bonus=doc[11], num_drafted=0, target_hidden=h[-1]))
    rows = hybrid.propose(state, 5).rows()
    dense = store.drafts(h[-1], doc[11], n_drafts=2, length=5)
    assert rows == merge_rows(p.rows(), dense) and hybrid.counters()["dense_steps"] == 1
    # A context no document contains: no exact rows, dense rows only.
    state2 = DecodeState(token_ids=[96, 95, 94, doc[11]], num_prompt_tokens=4, params=SamplingParams(max_new_tokens=8))
    hybrid.start(state2)
    hybrid.observe(state2, Verdict(accepted=[], bonus=doc[11], num_drafted=0, target_hidden=h[-1]))
    out = hybrid.propose(state2, 5)
    assert hybrid.last_match < 2 and out.rows() == merge_rows(hybrid.suffix.lookup(state2.token_ids, 5).rows, dense)


def test_the_context_drafts_what_no_document_holds_and_competes_with_the_datastore(store, served_docs):
    params = SamplingParams(max_new_tokens=8)
    # A pattern the request repeats, in no document (ids above the served documents' are rare;
    # the assertion checks the datastore has no match).
    pattern = [91, 92, 93, 94, 95, 96]
    ctx = [90] + pattern + [89, 88] + pattern[:4]
    state = DecodeState(token_ids=list(ctx), num_prompt_tokens=len(ctx), params=params)
    on = RetrievalProposer(store, n_drafts=2, dense_below=0)
    off = RetrievalProposer(store, n_drafts=2, dense_below=0, use_context=False)
    for p in (on, off):
        p.start(state)
    assert on.suffix.lookup(ctx[-16:], 5).rows == []
    assert off.propose(state, 5).k == 0
    rows = on.propose(state, 5).rows()
    assert rows == [[95, 96, 89, 88, 91]] and on.last_match == 4  # a 4-token match copies 4 + 1 tokens
    assert on.counters()["context_steps"] == 1 and on.counters()["exact_steps"] == 0
    # The index grows with the output, and a rollback past its end drops it (rebuilt next step).
    state.token_ids += [95, 96, 89]
    assert on.propose(state, 5).rows() == [[88, 91, 92, 93, 94]] and on.last_match == 7  # 91 .. 96, 89
    on.rollback(state, len(ctx))
    state.token_ids = state.token_ids[: len(ctx)]
    assert on._context is None and on.propose(state, 5).rows() == [[95, 96, 89, 88, 91]]
    # A document's own text: the datastore's rows and the context's (if any) in one tree.
    doc = served_docs[3]
    state = DecodeState(token_ids=list(doc[:12]), num_prompt_tokens=8, params=params)
    on.start(state)
    off.start(state)
    both, exact = on.propose(state, 5).rows(), off.propose(state, 5).rows()
    assert all(any(r[: len(e)] == e for r in both) for e in exact)  # every datastore row is still drafted


@pytest.mark.parametrize(
    "dense_below,use_context", [(0, False), (0, True), (17, True)]
)  # exact rows only; with the context; dense rows every step (the default: via the catalogue)
def test_retrieval_equals_target_greedy(store, tiny_target, served_docs, dense_below, use_context):
    engine = SpecEngine_for(tiny_target)
    res = ProposerResources(pair=engine.pair, datastore=store)
    accepted = 0
    for prompt in [d[:8] for d in served_docs[:4]] + random_prompts(4, seed=78):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method="target").token_ids
        out = plain_generate(
            engine,
            prompt,
            SamplingParams(max_new_tokens=24),
            proposer=RetrievalProposer(store, n_drafts=3, dense_below=dense_below, use_context=use_context),
            k=8,
        )
        assert out.token_ids == ref
        accepted += out.stats.num_accepted
        via_cfg = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method="retrieval", resources=res)
        assert via_cfg.token_ids == ref
    assert accepted > 20


def test_retrieval_sampling_is_exact_with_a_negative_control(tiny_target):
    prompt = [5, 17, 42, 5, 17]
    params = dict(temperature=0.6, max_new_tokens=3)
    with torch.inference_mode():
        first = int(tiny_target(torch.tensor([prompt])).logits[0, -1].argmax())
        p2 = warp(tiny_target(torch.tensor([prompt + [first]])).logits[0, -1:], SamplingParams(**params))[0]
    likely = p2.argsort(descending=True)[:3].tolist()
    docs = [prompt + [first, t, 1, 2] for t in likely]
    store, _ = Datastore.build(tiny_target, docs, DatastoreConfig(dims=8, value_len=4, index=IndexConfig(kind="flat")))
    engine = SpecEngine_for(tiny_target)
    res = ProposerResources(pair=engine.pair, datastore=store)
    cfg = dict(method="retrieval", n_drafts=3)
    counts, n, drafted = second_token_counts(engine, prompt, first, 1500, params, **cfg, k=2, resources=res)
    assert n > 150 and drafted == n  # the exact match [.., 5, 17, first] drafts all three branches
    assert pooled_chisquare(counts, p2.double().numpy() / float(p2.sum())) > 1e-3
    accept_all = np.zeros(97, dtype=np.int64)
    accept_all[likely[0]] = n
    assert pooled_chisquare(accept_all, p2.double().numpy() / float(p2.sum())) < 1e-6


def test_retrieval_is_in_the_catalogue_and_joins_auto(store):
    from specops.serving.proposers.retrieval import DENSE_BELOW, EXACT_NODES

    spec = CATALOGUE["retrieval"]
    assert spec.joins_auto and {"datastore", "target_hidden"} <= spec.needs and spec.artifact == "datastore"
    res = ProposerResources(pair=None, datastore=store, n_drafts=2)
    default = spec.build(spec.parse_options({}), res)
    assert (default.dense_below, default.exact_nodes) == (DENSE_BELOW, EXACT_NODES)
    chosen = spec.build(spec.parse_options({"dense_below": 17, "exact_nodes": 64}), res)
    assert (chosen.dense_below, chosen.exact_nodes) == (17, 64)
    with pytest.raises(ValueError, match="dense_below"):
        RetrievalProposer(None, dense_below=40)

"""LLMA: the incremental n-gram index against a brute-force search, greedy equality with
copying that pays, and sampling exactness (chi-square, with a negative control)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specops.core.errors import InvalidRequestError
from specops.core.sessions.ngram import NgramIndex
from specops.serving.engine.sampling import warp
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import DecodeState, SamplingParams
from specops.serving.plan import DecodePlan, plain_generate, plain_proposer
from specops.serving.proposers.catalogue import ProposerResources, method_spec
from specops.serving.proposers.llma import (
    MIN_AGREEMENT,
    MIN_PATH,
    SERVING_RULE,
    WIDEN_MARGIN,
    LLMAProposer,
    ReferenceSet,
    best_rows,
    frequency_rows,
)
from tests.conftest import random_prompts
from tests.serving.engine.test_verifier import pooled_chisquare, second_token_counts


def brute_force(docs: list[list[int]], tail: list[int], k: int, max_n: int, min_n: int = 1):
    """Every (doc, end) where the longest trailing n-gram of ``tail`` (max_n..min_n) occurs
    with at least one token after it in its document: by scanning every document."""
    for n in range(min(max_n, len(tail)), min_n - 1, -1):
        gram = tail[len(tail) - n :]
        hits = [(d, e) for d, doc in enumerate(docs) for e in range(n, len(doc)) if doc[e - n : e] == gram]
        if hits:
            return n, hits
    return 0, []


def test_index_finds_what_a_brute_force_scan_finds():
    rng = random.Random(0)
    for trial in range(60):
        vocab = rng.choice([3, 5, 12])
        docs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 5))]
        index = NgramIndex(max_n=4, max_positions=10**6)
        for d in docs:
            index.add(d)
        assert len(index) == sum(map(len, docs))
        starts = np.cumsum([0] + [len(d) + 1 for d in docs])  # where each doc starts in the flat list
        for _ in range(20):
            tail = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
            k = rng.randrange(1, 6)
            n, hits = brute_force(docs, tail, k, max_n=4)
            found = index.matches(tail, k)
            assert sorted(m.pos for m in found) == sorted(int(starts[d]) + e for d, e in hits), (trial, tail)
            for m in found:
                d = int(np.searchsorted(starts, m.pos, side="right") - 1)
                e = m.pos - int(starts[d])
                assert m.length >= n and index.copy(m, k) == docs[d][e : e + k]  # never crosses a document
                back = 0  # the ranked match length: how far the match really extends (capped)
                while back < len(tail) and e - 1 - back >= 0 and docs[d][e - 1 - back] == tail[-1 - back]:
                    back += 1
                assert m.length == back
            assert [m.length for m in found] == sorted((m.length for m in found), reverse=True)


def test_appending_token_by_token_equals_indexing_at_once():
    rng = random.Random(1)
    toks = [rng.randrange(6) for _ in range(300)]
    whole, grown = NgramIndex(max_n=3), NgramIndex(max_n=3)
    whole.add(toks)
    for t in toks:
        grown.extend([t])
    assert whole.table == grown.table and whole.tokens == grown.tokens


def test_positions_and_tokens_are_bounded():
    index = NgramIndex(max_n=2, max_positions=3, max_tokens=10)
    index.add([1, 1, 1, 1, 1, 1])
    assert index.table[(1,)] == [4, 5, 6] and index.table[(1, 1)] == [4, 5, 6]  # the most recent 3
    assert not index.room(5) and index.room(4)
    with pytest.raises(ValueError, match="index full"):
        index.add([2] * 5)


def rows_of(index: NgramIndex, tail: list[int], n_drafts: int, k: int = 4) -> list[list[int]]:
    return [row for _, row in best_rows([(index, m) for m in index.matches(tail, k)], k, n_drafts)]


def test_the_longest_match_wins_and_ties_become_rows():
    ref = ReferenceSet.from_docs([[9, 1, 2, 3, 4, 5], [7, 2, 3, 6, 6], [8, 2, 3, 7, 7]])
    (index,) = ref.indexes
    # Tail ... 1 2 3: doc 0 matches 3 tokens back, the others 2: doc 0's continuation only.
    assert rows_of(index, [1, 2, 3], n_drafts=3) == [[4, 5]]
    # Tail ... 0 2 3: all three match 2 tokens: three rows (newest first).
    assert sorted(rows_of(index, [0, 2, 3], n_drafts=3)) == [[4, 5], [6, 6], [7, 7]]
    assert len(rows_of(index, [0, 2, 3], n_drafts=2)) == 2
    # A continuation that is a prefix of another adds nothing.
    dup = ReferenceSet.from_docs([[1, 2, 3, 4], [1, 2, 3, 4, 5]]).indexes[0]
    assert rows_of(dup, [2, 3], n_drafts=4) == [[4, 5]]


def test_proposer_copies_from_references_and_from_its_growing_context(tiny_pair):
    proposer = LLMAProposer(ReferenceSet.from_docs([[10, 11, 12, 13, 14]]), n_drafts=2)
    state = DecodeState(token_ids=[1, 2, 10, 11], num_prompt_tokens=4, params=SamplingParams())
    proposer.start(state)
    assert proposer.propose(state, 2).tokens.tolist() == [[12, 13]]
    state.token_ids += [40, 41, 42, 40]  # no reference has "... 40"; the context does
    assert proposer.propose(state, 3).tokens.tolist() == [[41, 42, 40]]
    proposer.rollback(state, 4)
    del state.token_ids[4:]
    state.token_ids += [50]
    assert proposer.propose(state, 3).tokens.numel() == 0  # the withdrawn 40 41 42 40 are forgotten
    assert proposer.num_steps == 3 and proposer.num_hits == 2
    assert proposer.counters() == {
        "steps": 3,
        "hits": 2,
        "hits_request": 1,
        "hits_retrieved": 0,
        "hits_sessions": 0,
        "hits_context": 1,
        "reference_tokens": 5,
    }


@pytest.mark.parametrize("k", [1, 4, 15])
@pytest.mark.parametrize("n_drafts", [1, 3])
@pytest.mark.parametrize("fixed_k", [False, True], ids=["serving-rule", "paper-rule"])
def test_greedy_output_equals_target_only(tiny_pair, k, n_drafts, fixed_k):
    engine = SpecEngine(tiny_pair)
    for prompt in random_prompts(5, seed=200 + k):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=30), method="target").token_ids
        # References: the target's own output (what cache-assisted generation copies), a
        # perturbed copy, and noise; copying must pay and never change a token.
        noisy = list(ref)
        noisy[len(noisy) // 2] = (noisy[len(noisy) // 2] + 1) % 97
        res = ProposerResources(
            pair=tiny_pair, references=(tuple(ref), tuple(noisy), tuple(random_prompts(1, seed=k)[0]))
        )
        out = plain_generate(
            engine,
            prompt,
            SamplingParams(max_new_tokens=30),
            k=k,
            resources=res,
            method="llma",
            n_drafts=n_drafts,
            fixed_k=fixed_k,
        )
        assert out.token_ids == ref
        if k > 1:
            assert out.stats.num_target_forwards < 30  # the copies were accepted


def test_copy_length_grows_with_the_match_and_stops_where_matches_disagree(tiny_pair):
    """Serving's rule: 1 + match/2 tokens, at most k; the paper's: k at every match. A draft
    stops where the equally long matches that agree so far continue differently."""
    doc = list(range(100, 140))
    rule = dict(copy_factor=0.5, copy_offset=1.0, min_agreement=0.5)
    for tail, expected in (([1, 2, 3, 100], 1), ([1, 104, 105, 106, 107], 3), (list(range(100, 120)), 11)):
        state = DecodeState(token_ids=tail, num_prompt_tokens=len(tail), params=SamplingParams())
        adaptive = LLMAProposer(ReferenceSet.from_docs([doc]), max_n=8, use_context=False, **rule)
        fixed = LLMAProposer(ReferenceSet.from_docs([doc]), max_n=8, use_context=False)
        assert adaptive.propose(state, 12).tokens.shape[1] == expected, tail  # match 1 -> 1, 4 -> 3, 20 -> 11
        assert fixed.propose(state, 12).tokens.shape[1] == 12
    # three references continue "7 8" as 9 10 12 / 9 10 13 / 9 10 11 13: the draft is cut where
    # no continuation has half of them (the paper's rule copies the longest continuation whole)
    refs = ReferenceSet.from_docs([[7, 8, 9, 10, 12], [7, 8, 9, 10, 13], [7, 8, 9, 10, 11, 13]])
    state = DecodeState(token_ids=[5, 7, 8], num_prompt_tokens=3, params=SamplingParams())
    cut = LLMAProposer(refs, max_n=8, use_context=False, copy_factor=10.0, min_agreement=0.5).propose(state, 4)
    assert cut.tokens.tolist() == [[9, 10]]
    whole = LLMAProposer(refs, max_n=8, use_context=False, copy_factor=10.0).propose(state, 4)
    assert whole.tokens.tolist() == [[9, 10, 11, 13]]
    served = plain_proposer(ProposerResources(pair=tiny_pair), method="llma")
    assert (served.copy_factor, served.copy_offset, served.min_prob) == (
        SERVING_RULE["copy_factor"],
        SERVING_RULE["copy_offset"],
        SERVING_RULE["min_prob"],
    )
    assert plain_proposer(ProposerResources(pair=tiny_pair), method="llma", fixed_k=True).copy_factor is None


def freq_rows(docs: list[list[int]], tail: list[int], n_drafts: int = 1, k: int = 4, max_n: int = 2) -> list[list[int]]:
    (index,) = ReferenceSet.from_docs(docs, max_n=max_n).indexes
    found = [(index, m) for m in index.matches(tail, k)]
    return [row for _, row in frequency_rows(found, k, n_drafts, MIN_AGREEMENT, MIN_PATH)]


def test_frequency_picks_the_most_frequent_continuation_over_the_most_recent():
    # "7 8 9" is followed by 1 2 twice and by 3 4 once, most recently: equally long matches
    docs = [[7, 8, 9, 1, 2], [7, 8, 9, 1, 2], [7, 8, 9, 3, 4]]
    assert freq_rows(docs, [5, 7, 8, 9]) == [[1, 2]]
    assert rows_of(ReferenceSet.from_docs(docs).indexes[0], [5, 7, 8, 9], n_drafts=1) == [[3, 4]]  # the paper's
    state = DecodeState(token_ids=[5, 7, 8, 9], num_prompt_tokens=4, params=SamplingParams())
    # through the proposer, with the frequent copies in another source: the reported source is
    # the one row 0 was copied from
    refs = ReferenceSet.from_docs(docs[2:]).plus(ReferenceSet.from_docs(docs[:2], source="retrieved"))
    freq = LLMAProposer(refs, use_context=False, copy_factor=10.0, min_agreement=MIN_AGREEMENT)
    assert freq.propose(state, 4).tokens.tolist() == [[1, 2]] and freq.last_source == "retrieved"
    paper = LLMAProposer(refs, use_context=False, copy_factor=10.0)
    assert paper.propose(state, 4).tokens.tolist() == [[3, 4]] and paper.last_source == "request"


def test_a_longest_match_found_once_is_weighed_against_slightly_shorter_ones():
    # "6 7 8 9" matches 4 tokens back once (then 1 1), "0 7 8 9" 3 tokens back (then 2 2)
    longest, shorter = [6, 7, 8, 9, 1, 1], [0, 7, 8, 9, 2, 2]
    tail = [6, 7, 8, 9]
    assert freq_rows([longest, shorter], tail) == [[1, 1]]  # 1 against 1/2
    assert freq_rows([longest] + [shorter] * 2, tail) == [[1, 1]]  # a tie goes to the longer match
    assert freq_rows([longest] + [shorter] * 3, tail) == [[2, 2]]  # 1 against 3/2
    # matches more than WIDEN_MARGIN tokens shorter have no say, however many
    far = [3, 4, 5, 6, 7, 8, 9, 1, 1]
    tail = far[:7]
    assert 7 - 3 > WIDEN_MARGIN and freq_rows([far] + [shorter] * 10, tail) == [[1, 1]]
    # two equally long matches are counted on their own: shorter ones do not join them
    assert freq_rows([longest, [6, 7, 8, 9, 1, 3]] + [shorter] * 5, [6, 7, 8, 9]) == [[1, 3]]


def test_the_draft_is_cut_where_matches_disagree_and_not_where_they_agree():
    head = [7, 8]
    tail = [5, 7, 8]
    three_ways = [head + [9, 10, t] for t in (11, 12, 13)]
    assert freq_rows(three_ways, tail) == [[9, 10]]  # 1/3 < 1/2
    assert freq_rows(three_ways[:1] * 2 + three_ways[1:2], tail) == [[9, 10, 11]]  # 2/3
    assert freq_rows(three_ways[:2], tail) == [[9, 10, 12]]  # 1/2 is not below: the most recent
    assert freq_rows([head + [9, 10], head + [9, 10, 11, 12]], tail) == [[9, 10, 11, 12]]  # an end has no say
    assert freq_rows([head + [t] for t in (1, 2, 3)], tail) == [[3]]  # the first token is always drafted
    (index,) = ReferenceSet.from_docs(three_ways).indexes
    found = [(index, m) for m in index.matches(tail, 4)]
    assert frequency_rows(found, 4, 1, 0.3)[0][1] == [9, 10, 13]  # a lower bar lets 1/3 through


def test_the_draft_is_cut_where_its_probability_falls_below_min_path():
    """Splits in a row, each just above half, multiply: 3/5 * 3/5 * 3/5 * 3/5 = 0.13, one more 0.08."""
    tail = [5, 7, 8]
    # five references continue "7 8"; at each depth fewer of those that agree so far continue alike
    conts = [
        [10, 11, 12, 13, 14, 15],
        [10, 11, 12, 13, 14, 16],
        [10, 11, 12, 13, 24, 25],
        [10, 11, 22, 23, 24, 25],
        [10, 21, 22, 23, 24, 25],
    ]
    docs = [[7, 8] + c for c in conts]
    (index,) = ReferenceSet.from_docs(docs, max_n=2).indexes
    found = [(index, m) for m in index.matches(tail, 6)]
    # shares: 10 (5/5), 11 (4/5), 12 (3/4), 13 (3/3), 14 (2/3): path 1, .8, .6, .6, .4; then 15/16 split 1/2 (.2)
    assert frequency_rows(found, 6, 1, 0.5)[0][1] == [10, 11, 12, 13, 14, 16]
    assert frequency_rows(found, 6, 1, 0.5, 0.3)[0][1] == [10, 11, 12, 13, 14]  # .2 < .3
    assert frequency_rows(found, 6, 1, 0.5, 0.5)[0][1] == [10, 11, 12, 13]  # .4 < .5
    assert frequency_rows(found, 6, 1, 0.0, 0.99)[0][1] == [10]  # the first token is always drafted


def test_frequency_rows_are_distinct_and_none_is_a_prefix_of_another():
    tail = [5, 7, 8]
    docs = [[7, 8, 1, 2, 3]] * 2 + [[7, 8, 1, 2, 4]] + [[7, 8, 5, 6]] * 2
    assert freq_rows(docs, tail, n_drafts=3) == [[1, 2, 3], [5, 6], [1, 2, 4]]  # 3/5 > 2/5 > 1/5
    # row 0 cut at "1 2": the continuations that extend it add nothing beside it
    docs = [[7, 8, 1, 2, t] for t in (3, 4, 5)] + [[7, 8, 9]]
    assert freq_rows(docs, tail, n_drafts=4) == [[1, 2], [9]]
    rng = random.Random(7)
    for trial in range(300):
        docs = [[rng.randrange(4) for _ in range(rng.randrange(2, 30))] for _ in range(rng.randrange(1, 6))]
        (index,) = ReferenceSet.from_docs(docs, max_n=3).indexes
        tail = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        k, n_drafts = rng.randrange(1, 7), rng.randrange(1, 5)
        found = [(index, m) for m in index.matches(tail, k)]
        rows = [r for _, r in frequency_rows(found, k, n_drafts, MIN_AGREEMENT)]
        assert len(rows) <= n_drafts and all(1 <= len(r) <= k for r in rows), trial
        assert not any(i != j and a == b[: len(a)] for i, a in enumerate(rows) for j, b in enumerate(rows)), trial
        copies = [index.copy(m, k) for _, m in found]
        assert all(any(c[: len(r)] == r for c in copies) for r in rows), trial  # every row is a copy
        assert rows[:1] == [r for _, r in frequency_rows(found, k, 1, MIN_AGREEMENT)], trial


@pytest.mark.parametrize("n_drafts", [1, 3])
def test_greedy_output_equals_target_only_when_frequent_copies_are_wrong(tiny_pair, n_drafts):
    """Serving's rule (the catalogue's llma, the scored rule) where the most frequent
    continuation is wrong at places: three references share a wrong token, one is the target's output."""
    cfg = dict(method="llma", n_drafts=n_drafts)
    assert plain_proposer(ProposerResources(pair=tiny_pair), **cfg).min_prob == SERVING_RULE["min_prob"]
    engine = SpecEngine(tiny_pair)
    for i, prompt in enumerate(random_prompts(4, seed=300)):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=30), method="target").token_ids
        wrong = list(ref)
        for j in range(3 + i, len(wrong), 7):
            wrong[j] = (wrong[j] + 1) % 97
        split = list(ref)
        split[len(split) // 2] = (split[len(split) // 2] + 2) % 97
        res = ProposerResources(pair=tiny_pair, references=(tuple(wrong),) * 3 + (tuple(ref), tuple(split)))
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=30), k=8, resources=res, **cfg)
        assert out.token_ids == ref
        assert out.stats.num_drafted > 0 and out.stats.num_target_forwards < 30


def test_llma_with_no_references_still_equals_target(tiny_pair):
    engine = SpecEngine(tiny_pair)
    for prompt in random_prompts(4, seed=5):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=20), method="target").token_ids
        assert plain_generate(engine, prompt, SamplingParams(max_new_tokens=20), method="llma", k=5).token_ids == ref


def test_sampling_is_exact_with_a_negative_control(tiny_target):
    """Second token of a sampled request, where three copied continuations are verified as a
    tree by the one-hot rule: its distribution is the target's (chi-square). Control:
    emitting the copied token whenever one was copied fails the same test."""
    from tests.serving.proposers.test_dresd import SpecEngine_for

    prompt = [5, 17, 42, 5, 17]
    params = dict(temperature=0.6, max_new_tokens=3)
    with torch.inference_mode():
        first = int(tiny_target(torch.tensor([prompt])).logits[0, -1].argmax())
        p2 = warp(tiny_target(torch.tensor([prompt + [first]])).logits[0, -1:], SamplingParams(**params))[0]
    likely = p2.argsort(descending=True)[:3].tolist()
    engine = SpecEngine_for(tiny_target)
    res = ProposerResources(pair=engine.pair, references=tuple((90, first, t, 1) for t in likely))
    cfg = dict(method="llma", n_drafts=3)
    counts, n, drafted = second_token_counts(engine, prompt, first, 1500, params, **cfg, k=2, resources=res)
    assert n > 200 and drafted == n
    expected = p2.double().numpy() / float(p2.sum())
    assert pooled_chisquare(counts, expected) > 1e-3
    accept_all = np.zeros(97, dtype=np.int64)
    accept_all[likely[0]] = n
    assert pooled_chisquare(accept_all, expected) < 1e-6


def test_bad_settings_are_the_callers_error(tiny_pair):
    with pytest.raises(InvalidRequestError) as e:
        method_spec("llma").parse_options({"n": 0})
    assert e.value.param == "speculation.n"
    assert plain_proposer(ProposerResources(pair=tiny_pair), method="llma", n=3).min_n == 3


def test_session_cache_is_bounded_and_keeps_the_newest():
    from specops.core.sessions.cache import SessionCacheConfig
    from specops.serving.proposers.session_cache import SessionCache

    cache = SessionCache(SessionCacheConfig(max_tokens=100, max_n=3, min_output_tokens=4, max_clusters=2))
    assert not cache.add("a", [1, 2, 3])  # too short to copy from
    assert cache.index("a") is None
    for i in range(12):
        assert cache.add("a", [100 + i] * 5 + list(range(10 * i, 10 * i + 15)))  # 20 tokens each
        assert len(cache.index("a")) <= 100
    assert cache.num_rebuilds >= 2
    index = cache.index("a")
    newest = [100 + 11] * 5 + list(range(110, 125))
    (m, *_) = index.matches(newest[:8], 4)
    assert index.copy(m, 4) == newest[8:12]  # the newest output is always kept
    assert index.matches([100, 0, 1], 2) == []  # the oldest output (the only one with 0 and 1) went
    cache.add("b", list(range(10)))
    cache.add("c", list(range(10)))  # a third cluster evicts the least recently used ("a")
    assert cache.index("a") is None and set(cache.stats()) == {"b", "c"}
    assert cache.stats()["b"] == {"outputs": 1, "tokens": 10}


def test_past_sessions_feed_llma_through_the_node(tiny_pair, tmp_path):
    from specops.serving.fleet.hotswap import DraftFollower
    from specops.serving.fleet.node import ServingNode
    from specops.serving.proposers.session_cache import SessionCache

    follower = DraftFollower(None, tiny_pair.draft, target_vocab=97, target_tokenizer_sha256="", cache_dir=tmp_path)
    node = ServingNode(tiny_pair, follower, sessions=SessionCache())
    prompt = random_prompts(1, seed=31)[0]
    first = node.generate(DecodePlan.plain(prompt, SamplingParams(max_new_tokens=30), method="target")).result
    assert node.sessions.stats()["default"]["outputs"] == 1
    again = node.generate(
        DecodePlan.plain(prompt[:-1] + [(prompt[-1] + 1) % 97], SamplingParams(max_new_tokens=30), method="llma", k=8)
    )
    ref = node.generate(
        DecodePlan.plain(prompt[:-1] + [(prompt[-1] + 1) % 97], SamplingParams(max_new_tokens=30), method="target")
    )
    assert again.result.token_ids == ref.result.token_ids
    assert first.token_ids and again.result.stats.num_drafted > 0

"""LLMA's scored rule (SuffixDecoding's, over our n-gram indexes): equal to a brute-force
suffix search, matches up to 64 tokens, and lossless through the engine."""

from __future__ import annotations

import random

import pytest

from specops.core.sessions.ngram import MAX_EXTEND, NgramIndex
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import DecodeState, SamplingParams
from specops.serving.plan import plain_generate, plain_proposer
from specops.serving.proposers.catalogue import ProposerResources
from specops.serving.proposers.llma import SERVING_RULE, LLMAProposer, ReferenceSet, scored_rows
from tests.conftest import random_prompts


def brute_force(docs, tail, k, copy_factor, copy_offset, min_prob, min_n=1):
    """SuffixDecoding's ``speculate`` by scanning every document: for every match length L,
    the places the last L tokens occur with a next token vote a path of at most
    ``copy_factor * L + copy_offset`` tokens; the best score wins (a tie: the longer L). The
    votes at each depth come from the places that agree so far and have a next token; a tie
    goes to the longest match, then the most recent place."""
    places = []  # (extent, flat position, doc, start of the continuation)
    flat = 0
    for d, doc in enumerate(docs):
        for e in range(1, len(doc)):
            ext = 0
            while ext < min(len(tail), MAX_EXTEND) and e - 1 - ext >= 0 and doc[e - 1 - ext] == tail[-1 - ext]:
                ext += 1
            if ext:
                places.append((ext, flat + e, d, e))
        flat += len(doc) + 1
    places.sort(key=lambda p: (p[0], p[1]), reverse=True)
    best = (0.0, 0, [])
    for length in range(max(min_n, 1), min(len(tail), MAX_EXTEND) + 1):
        cap = max(1, min(k, int(copy_factor * length + copy_offset + 1e-9)))
        conts = [docs[d][e : e + cap] for ext, _, d, e in places if ext >= length]
        group, row, prob, score = list(range(len(conts))), [], 1.0, 0.0
        for j in range(cap):
            say = [c for c in group if len(conts[c]) > j]
            if not say:
                break
            votes: dict[int, int] = {}
            for c in say:
                votes[conts[c][j]] = votes.get(conts[c][j], 0) + 1
            top = max(votes, key=votes.__getitem__)
            if prob * votes[top] / len(say) < min_prob:
                break
            prob *= votes[top] / len(say)
            score += prob
            row.append(top)
            group = [c for c in say if conts[c][j] == top]
        if row and score >= best[0]:
            best = (score, length, row)
    return best


def test_scored_rows_equal_a_brute_force_suffix_search():
    rng = random.Random(0)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 9])
        motif = [rng.randrange(vocab) for _ in range(rng.randrange(5, 80))]
        docs = []
        for _ in range(rng.randrange(1, 5)):  # documents share long pieces, so matches run past max_n
            doc = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
            if rng.random() < 0.7:
                a = rng.randrange(len(motif))
                doc += motif[a : a + rng.randrange(1, 80)]
            docs.append(doc + [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))])
        docs = [d for d in docs if d] or [[0, 1]]
        tail = ([rng.randrange(vocab) for _ in range(rng.randrange(0, 4))] + motif)[-rng.randrange(1, 90) :]
        k = rng.randrange(1, 20)
        rule = dict(
            copy_factor=rng.choice([0.5, 1.0, 2.0]),
            copy_offset=rng.choice([0.0, 1.0]),
            min_prob=rng.choice([0.0, 0.1, 0.3]),
        )
        index = NgramIndex(max_n=rng.choice([1, 4, 8]), max_positions=10**6)
        min_n = min(index.max_n, rng.choice([1, 1, 2, 3]))  # the proposer asks min_n <= max_n
        for d in docs:
            index.add(d)
        got = scored_rows([index], tail, k, 1, min_n=min_n, **rule)
        score, length, row = brute_force(docs, tail, k, min_n=min_n, **rule)
        assert (got.length, [r for _, r in got.rows]) == (length, [row] if row else []), trial
        assert got.score == pytest.approx(score), trial


def test_a_pool_of_indexes_counts_as_one_tree():
    """References split over several indexes (request, retrieved, sessions) vote together, as
    one tree would; a tie between indexes goes to the first of the pool."""
    rng = random.Random(1)
    for trial in range(200):
        docs = [[rng.randrange(3) for _ in range(rng.randrange(2, 25))] for _ in range(rng.randrange(2, 6))]
        tail = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        rule = dict(copy_factor=1.0, copy_offset=1.0, min_prob=0.1)
        first, second = NgramIndex(max_n=4, max_positions=10**6), NgramIndex(max_n=4, max_positions=10**6)
        for d in docs[0::2]:
            first.add(d)
        for d in docs[1::2]:
            second.add(d)
        got = scored_rows([first, second], tail, 8, 1, **rule)
        # one tree of the same documents, the first index's the most recent (ties go to them)
        score, length, row = brute_force(docs[1::2] + docs[0::2], tail, 8, **rule)
        assert (got.length, [r for _, r in got.rows]) == (length, [row] if row else []), trial
        assert got.score == pytest.approx(score), trial


def test_a_long_match_outscores_frequent_short_ones_and_the_copy_grows_with_it():
    passage = list(range(100, 300))
    noise = [[7, 100 + i, 1000 + i] for i in range(30)]  # 30 short matches of "... 1xx" continuing elsewhere
    refs = ReferenceSet.from_docs([passage, *noise], max_n=8)
    rule = dict(copy_factor=1.0, copy_offset=1.0, min_prob=0.1)
    for match in (1, 5, 40, 70):
        tail = [5] + passage[120 - match : 120]
        prop = LLMAProposer(refs, max_n=8, use_context=False, **rule)
        out = prop.propose(DecodeState(token_ids=tail, num_prompt_tokens=len(tail), params=SamplingParams()), 32)
        expected = min(32, 1 + min(match, MAX_EXTEND))  # 1 + match tokens, at most k
        assert out.tokens.tolist() == [passage[120 : 120 + expected]], match
        assert prop.last_match == min(match, MAX_EXTEND) and prop.last_source == "request"
    # "7 100" occurs once (-> 1000); "100" twice (-> 101 in the passage, -> 1000): the 2-token
    # match scores 1, the 1-token one 1/2
    state = DecodeState(token_ids=[7, 100], num_prompt_tokens=2, params=SamplingParams())
    for min_prob in (0.1, 1.0):
        prop = LLMAProposer(refs, max_n=8, use_context=False, **{**rule, "min_prob": min_prob})
        assert prop.propose(state, 8).tokens.tolist() == [[1000]] and prop.last_match == 2
    # "9 100": only "100" matches, split 1/2: drafted at min_prob 0.1, not at 0.6
    state = DecodeState(token_ids=[9, 100], num_prompt_tokens=2, params=SamplingParams())
    low = LLMAProposer(refs, max_n=8, use_context=False, **rule).propose(state, 8)
    assert low.tokens.tolist() in ([[101]], [[1000]])
    high = LLMAProposer(refs, max_n=8, use_context=False, **{**rule, "min_prob": 0.6}).propose(state, 8)
    assert high.tokens.numel() == 0


def test_the_context_and_the_references_compete_by_score():
    # the context repeats "1 2 3 4 5 6" (a long own match); a reference has "5 6" -> 9 once
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6]
    refs = ReferenceSet.from_docs([[5, 6, 9]], max_n=8)
    prop = LLMAProposer(refs, max_n=8, copy_factor=1.0, copy_offset=1.0, min_prob=0.1)
    prop.start(DecodeState(token_ids=ctx, num_prompt_tokens=len(ctx), params=SamplingParams()))
    out = prop.propose(DecodeState(token_ids=ctx, num_prompt_tokens=len(ctx), params=SamplingParams()), 8)
    assert out.tokens.tolist()[0][:2] == [7, 8] and prop.last_source == "context" and prop.last_match == 6
    alone = LLMAProposer(refs, max_n=8, use_context=False, copy_factor=1.0, copy_offset=1.0, min_prob=0.1)
    assert alone.propose(
        DecodeState(token_ids=ctx, num_prompt_tokens=len(ctx), params=SamplingParams()), 8
    ).tokens.tolist() == [[9]]


def test_rows_beyond_the_first_are_other_continuations_of_the_winning_matches():
    docs = [[7, 8, 1, 2, 3]] * 3 + [[7, 8, 5, 6]] * 2
    (index,) = ReferenceSet.from_docs(docs, max_n=4).indexes
    got = scored_rows([index], [0, 7, 8], 4, 3, copy_factor=2.0, copy_offset=0.0, min_prob=0.1)
    assert [r for _, r in got.rows] == [[1, 2, 3], [5, 6]] and got.length == 2


def test_bad_scored_settings_are_refused():
    with pytest.raises(ValueError, match="min_prob"):
        LLMAProposer(min_prob=0.1)  # no copy factor
    with pytest.raises(ValueError, match="min_prob"):
        LLMAProposer(copy_factor=1.0, min_prob=1.5)


@pytest.mark.parametrize("n_drafts", [1, 3])
def test_greedy_output_equals_target_only_under_the_scored_rule(tiny_pair, n_drafts):
    """References that are right, wrong at places, or split, through the engine."""
    engine = SpecEngine(tiny_pair)
    rule = dict(copy_factor=1.0, copy_offset=1.0, min_prob=0.1)
    for i, prompt in enumerate(random_prompts(4, seed=310)):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=40), method="target").token_ids
        wrong = list(ref)
        for j in range(3 + i, len(wrong), 7):
            wrong[j] = (wrong[j] + 1) % 97
        refs = ReferenceSet.from_docs([wrong, wrong, list(ref)], max_n=8)
        prop = LLMAProposer(refs, max_n=8, n_drafts=n_drafts, **rule)
        out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=40), proposer=prop, k=16)
        assert out.token_ids == ref
        assert out.stats.num_drafted > 0 and out.stats.num_target_forwards < 40


def test_serving_uses_the_scored_rule(tiny_pair):
    served = plain_proposer(ProposerResources(pair=tiny_pair), method="llma")
    assert served.min_prob == SERVING_RULE["min_prob"] and served.copy_factor == SERVING_RULE["copy_factor"]

"""Token trees: the trie, the tree attention mask against running each path alone, greedy
equality with many drafts, and the exact tree sampler against a biased rule (chi-square)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tree_check import Synthetic, biased, chi2_p, greedy_identical, ours, pair_counts
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.tree import build
from specops.serving.engine.types import DecodeState, Proposals, SamplingParams
from specops.serving.engine.verifier import Verifier

ATOL = 1e-4  # float32 logits of the same model, computed in different shapes (CI CPUs differ)


def full(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and last hidden states of ``ids`` with no cache at all."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states[-1][0].float()


def test_rows_merge_into_a_trie_keeping_sample_multiplicity():
    tree = build([[5, 6, 7], [5, 6], [5, 8], [9], [5, 6, 7]])
    assert tree.tokens[1:] == [5, 6, 7, 8, 9] and tree.parent[1:] == [0, 1, 2, 1, 0]
    assert tree.depth[1:] == [1, 2, 3, 2, 1] and tree.max_depth == 3
    assert tree.samples[0] == [1, 1, 1, 5, 1]  # four rows drew 5 first, one drew 9
    assert tree.samples[1] == [2, 2, 4, 2] and tree.samples[2] == [3, 3]
    assert tree.children(1) == {6: 2, 8: 4}


@pytest.mark.parametrize("cached", [0, 5])
def test_tree_pass_equals_each_path_run_alone(tiny_target, cached):
    prefix = [3, 14, 15, 92, 65, 35, 89, 79]
    rows = [[7, 1, 2], [7, 1, 5], [7, 4], [9, 9, 9, 9], [7, 1, 2]]
    tree = build(rows)
    lm = CachedLM(tiny_target)
    if cached:
        lm.forward(prefix[:cached])
    logits, hidden = lm.forward_tree(prefix[cached:], tree, want_hidden=True)
    assert logits.shape == (tree.num_nodes + 1, tiny_target.config.vocab_size)
    ref_logits, ref_hidden = full(tiny_target, prefix)
    assert torch.allclose(logits[0], ref_logits[-1], atol=ATOL)
    assert torch.allclose(hidden[0], ref_hidden[-1], atol=ATOL)
    for node in range(1, tree.num_nodes + 1):
        path, n = [], node
        while n:
            path.insert(0, tree.tokens[n])
            n = tree.parent[n]
        ref_logits, ref_hidden = full(tiny_target, prefix + path)
        assert torch.allclose(logits[node], ref_logits[-1], atol=ATOL), (node, path)
        assert torch.allclose(hidden[node], ref_hidden[-1], atol=ATOL), (node, path)


def test_keeping_a_path_leaves_the_cache_a_chain_would(tiny_target):
    prefix = [3, 14, 15, 92, 65, 35]
    tree = build([[7, 1, 2], [7, 4, 4], [9, 9]])
    path = [1, 4, 5]  # 7 -> 4 -> 4
    lm = CachedLM(tiny_target)
    lm.forward(prefix[:2])
    lm.forward_tree(prefix[2:], tree)
    lm.keep_path(len(prefix), path)
    chain = CachedLM(tiny_target)
    chain.forward(prefix + tree.path_tokens(path))
    assert lm.num_cached == chain.num_cached == len(prefix) + 3
    for a, b in zip(lm.cache.layers, chain.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=ATOL) and torch.allclose(a.values, b.values, atol=ATOL)
    nxt_a, _ = lm.forward([11, 12])
    nxt_b, _ = chain.forward([11, 12])
    assert torch.allclose(nxt_a, nxt_b, atol=ATOL)


def test_verdict_names_the_path_and_the_hidden_row_by_value(tiny_target):
    prompt = [3, 14, 15, 92, 65]
    truth = full(tiny_target, prompt)[0][-1].argmax().item()
    verifier = Verifier(CachedLM(tiny_target), want_hidden=True, collect_rejections=True)
    state = DecodeState(token_ids=list(prompt), num_prompt_tokens=len(prompt), params=SamplingParams())
    wrong = (truth + 1) % tiny_target.config.vocab_size
    verdict = verifier.verify(state, Proposals.from_rows([[wrong, 1], [truth, wrong], [truth]]))
    assert verdict.accepted[0] == truth and verdict.path[0] == 3  # node 3 is `truth` (after wrong, 1)
    assert verdict.num_drafted == 2 and verdict.num_nodes == 4
    ref_logits, ref_hidden = full(tiny_target, prompt + verdict.accepted)
    assert verdict.bonus == int(ref_logits[-1].argmax())
    assert torch.allclose(verdict.target_hidden, ref_hidden[-1], atol=ATOL)
    assert verifier.target.num_cached == len(prompt) + len(verdict.accepted)
    if verdict.rejected is not None:
        assert verdict.rejected.index == len(prompt) + len(verdict.accepted)
        assert torch.allclose(verdict.rejected.target_logits, ref_logits[-1], atol=ATOL)


@pytest.mark.parametrize("pair_name", ["tiny_pair", "close_pair"])
def test_many_drafts_equal_target_greedy(request, pair_name):
    assert greedy_identical(num_prompts=5, new_tokens=24, seed=3, pair=request.getfixturevalue(pair_name))


@pytest.mark.parametrize("case", ["identical", "mixed", "sampled"])
def test_tree_sampler_is_exact_and_the_biased_rule_is_not(case):
    """First two emitted tokens against the target's joint distribution. Our rule must pass;
    the DReSD/REST public code's rule is the negative control and must fail where it is
    biased (ten identical drafts of a p = 0.10 token get it accepted about 65% of the time)."""
    syn = Synthetic(seed=0)
    expected = syn.expected_pairs()
    n = 4000
    assert chi2_p(pair_counts(ours, syn, n, case, seed=11), expected) > 1e-3
    if case == "identical":
        counts = pair_counts(biased, syn, n, case, seed=11)
        assert chi2_p(counts, expected) < 1e-9
        first_is_0 = counts.reshape(5, 5)[0].sum() / n
        assert 0.6 < first_is_0 < 0.7  # 1 - 0.9**10 = 0.65, not p = 0.10

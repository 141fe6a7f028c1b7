"""Exactness checks of the token-tree verifier, for ``benchmarks/spec_decode.py``'s summary
and for ``tests/serving/engine/test_tree.py``.

- ``tree_greedy_identical``: on a tiny random model, greedy decoding with many candidate
  rows per step (the right continuation corrupted at random places, its siblings,
  duplicates, rows of different lengths) equals target-only decoding token for token.
- ``tree_chi2_p``: the chi-square p-value that the first two tokens the tree sampler emits
  follow the target's distribution, on a synthetic target and draft over a 5-token
  vocabulary (ten identical deterministic drafts of an unlikely token, and trees of rows
  sampled from a draft ``q != p``). It should look like a draw from U(0, 1).
- ``biased_rule_chi2_p``: the same test applied to the rule of the DReSD/REST public code
  (each row draws its own tokens, the longest match wins), the negative control: tiny.

Run alone: ``python benchmarks/tree_check.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specops.serving.engine.tree import TokenTree, build  # noqa: E402
from specops.serving.engine.verifier import decide_tree  # noqa: E402
from specops.serving.plan import plain_generate

V = 5
"""Vocabulary of the synthetic case."""


class Synthetic:
    """A target ``p(. | prefix)`` and a draft ``q(. | prefix)`` over V tokens, fixed by a seed."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._cache: dict[tuple, torch.Tensor] = {}

    def dist(self, who: str, prefix: tuple[int, ...]) -> torch.Tensor:
        key = (who, prefix)
        if key not in self._cache:
            rng = np.random.default_rng([self.seed, who == "q", *prefix, len(prefix)])
            d = rng.dirichlet(np.full(V, 0.7 if who == "p" else 1.5))
            if who == "p" and not prefix:
                d = np.array([0.10, 0.35, 0.25, 0.2, 0.1])  # token 0 at p = 0.10, the case
            self._cache[key] = torch.tensor(d / d.sum(), dtype=torch.float32)
        return self._cache[key]

    def node_probs(self, tree: TokenTree, who: str) -> torch.Tensor:
        """[1 + num_nodes, V]: the distribution after the root and after each node."""
        rows = []
        for node in range(tree.num_nodes + 1):
            path, n = [], node
            while n > 0:
                path.append(tree.tokens[n])
                n = tree.parent[n]
            rows.append(self.dist(who, tuple(reversed(path))))
        return torch.stack(rows)

    def expected_pairs(self) -> np.ndarray:
        """[V * V] the target's probability of each first two tokens."""
        p0 = self.dist("p", ())
        return np.array([float(p0[a]) * float(self.dist("p", (a,))[b]) for a in range(V) for b in range(V)])


def finish_pair(syn: Synthetic, out: list[int], gen: torch.Generator) -> tuple[int, int]:
    """The first two tokens, drawing the second from the target when the step emitted one."""
    while len(out) < 2:
        out.append(int(torch.multinomial(syn.dist("p", tuple(out)), 1, generator=gen)))
    return out[0], out[1]


def sample_rows(
    syn: Synthetic, m: int, depth: int, gen: torch.Generator
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """``m`` rows drawn independently from the draft, with the q each token was drawn from."""
    rows, qs = [], []
    for _ in range(m):
        row, q = [], []
        for _ in range(depth):
            d = syn.dist("q", tuple(row))
            q.append(d)
            row.append(int(torch.multinomial(d, 1, generator=gen)))
        rows.append(row)
        qs.append(q)
    return rows, qs


def ours(syn: Synthetic, rows: list[list[int]], sampled: bool, gen: torch.Generator) -> list[int]:
    tree = build(rows)
    probs = syn.node_probs(tree, "p")
    node_q = syn.node_probs(tree, "q") if sampled else None
    path, bonus = decide_tree(tree, probs, node_q, greedy=False, generator=gen)
    return [*tree.path_tokens(path), bonus]


def biased(syn: Synthetic, rows: list[list[int]], sampled: bool, gen: torch.Generator) -> list[int]:
    """The DReSD/REST public code's rule: each row draws its own tokens; the longest match wins."""
    best: list[int] | None = None
    for row in rows:
        out: list[int] = []
        accepted = 0
        for tok in row:
            y = int(torch.multinomial(syn.dist("p", tuple(out)), 1, generator=gen))
            out.append(y)
            if y != tok:
                break
            accepted += 1
        else:
            out.append(int(torch.multinomial(syn.dist("p", tuple(out)), 1, generator=gen)))
        if best is None or accepted > best[0]:
            best = [accepted, *out]
    return best[1:]


def pair_counts(rule, syn: Synthetic, n: int, case: str, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(V * V, dtype=np.int64)
    for _ in range(n):
        if case == "identical":  # ten identical deterministic drafts of token 0 (p = 0.10)
            rows, sampled = [[0, 1]] * 10, False
        elif case == "mixed":  # deterministic rows sharing prefixes, duplicates, different lengths
            rows, sampled = [[0, 1], [0, 2], [0], [3, 3], [0, 1], [4]], False
        else:  # four rows of depth 2 sampled from the draft
            rows, _ = sample_rows(syn, 4, 2, gen)
            sampled = True
        a, b = finish_pair(syn, rule(syn, rows, sampled, gen), gen)
        counts[a * V + b] += 1
    return counts


def chi2_p(counts: np.ndarray, expected_p: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness-of-fit p-value, pooling cells expected below ``min_expected``."""
    n = counts.sum()
    exp = expected_p / expected_p.sum() * n
    keep = exp >= min_expected
    obs = list(counts[keep]) + ([counts[~keep].sum()] if (~keep).any() else [])
    ex = list(exp[keep]) + ([exp[~keep].sum()] if (~keep).any() else [])
    return chisquare_p(obs, ex)


def chisquare_p(observed, expected) -> float:
    """Pearson's chi-square p-value (``scipy.stats.chisquare``; without scipy, as on the GPU machine of
    ``benchmarks/gpu_check.py``, the same survival function from torch: Q(df / 2, stat / 2))."""
    try:
        from scipy.stats import chisquare
    except ImportError:
        obs = torch.tensor([float(x) for x in observed], dtype=torch.float64)
        exp = torch.tensor([float(x) for x in expected], dtype=torch.float64)
        stat = float(((obs - exp) ** 2 / exp).sum())
        df = len(obs) - 1
        return float(
            torch.special.gammaincc(
                torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
            )
        )
    return float(chisquare(observed, expected).pvalue)


def sampling_p_values(n: int, seed: int = 0) -> dict[str, float]:
    """The smallest p-value over the three cases, for our rule and for the biased one."""
    syn = Synthetic(seed)
    expected = syn.expected_pairs()
    out = {}
    for name, rule in (("ours", ours), ("biased", biased)):
        out[name] = min(
            chi2_p(pair_counts(rule, syn, n, case, seed + i), expected)
            for i, case in enumerate(("identical", "mixed", "sampled"))
        )
    return out


def greedy_identical(num_prompts: int = 4, new_tokens: int = 24, seed: int = 0, pair=None) -> bool:
    """Tree proposals on a tiny random Llama (or ``pair``) decode exactly what target-only decoding does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specops.core.models import ModelPair
    from specops.serving.engine.proposer import Proposer
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import Proposals, SamplingParams

    if pair is None:
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        pair = ModelPair(target=LlamaForCausalLM(cfg).eval(), draft=None, tokenizer=None)
    engine = SpecEngine(pair)
    vocab = pair.vocab_size
    rng = np.random.default_rng(seed)

    class Oracle(Proposer):
        """Rows around the true continuation: corrupted copies, siblings, duplicates."""

        name = "oracle-tree"

        def __init__(self, truth: list[int]) -> None:
            self.truth = truth

        def propose(self, state, k):
            n = state.num_generated
            true = self.truth[n : n + k]
            if not true:
                return Proposals.empty()
            rows = [list(true), list(true)]
            for _ in range(4):
                row = list(true[: rng.integers(1, len(true) + 1)])
                row[rng.integers(0, len(row))] = int(rng.integers(0, vocab))
                rows.append(row)
            rows.append([int(rng.integers(0, vocab))])
            rng.shuffle(rows)
            return Proposals.from_rows(rows)

    for _ in range(num_prompts):
        prompt = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(3, 20)))]
        params = SamplingParams(max_new_tokens=new_tokens)
        ref = plain_generate(engine, prompt, params, method="target").token_ids
        out = plain_generate(engine, prompt, params, proposer=Oracle(ref), k=5).token_ids
        if out != ref:
            return False
    return True


def run(quick: bool = False) -> dict:
    """The three summary keys."""
    ps = sampling_p_values(3000 if quick else 20000)
    return {
        "tree_greedy_identical": greedy_identical(2 if quick else 6),
        "tree_chi2_p": round(ps["ours"], 6),
        "biased_rule_chi2_p": float(f"{ps['biased']:.3g}"),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description="Exactness checks of the token-tree verifier (greedy equality on a "
        "tiny model; chi-square of the tree sampler and of the biased negative control)."
    )
    ap.add_argument("--quick", action="store_true", help="fewer samples (seconds)")
    ap.add_argument("--json", type=Path, help="write {'summary': ...} here")
    args = ap.parse_args(argv)
    summary = run(args.quick)
    print("| check | value |\n|---|---|")
    for key, value in summary.items():
        print(f"| {key} | {value} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary}, indent=2))
    return summary


if __name__ == "__main__":
    main()

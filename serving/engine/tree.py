"""Token trees: several drafts merged into one trie, verified by one target pass.

A proposer may return ``n`` candidate rows (``Proposals.tokens`` ``[n, k]`` with per-row
``lengths``). :func:`build` merges their shared prefixes into a :class:`TokenTree`:

- **node** ``i`` (``1 .. num_nodes``) is one drafted token at depth ``depth[i]`` (1 = the
  position right after the committed tokens) with parent ``parent[i]`` (0 = the **root**,
  the last committed token). Nodes are numbered in row order, so a parent always comes
  before its children.
- **samples** of a node: its children in row order, *with repetition*: one entry per row
  that passes through the node and drafts a token after it. For rows sampled i.i.d. from a
  draft model these are the i.i.d. draws the recursive rejection rule consumes; for
  deterministic rows the repetition is irrelevant (only the set of children matters).

The target sees the tree in one forward pass: each node at position ``base + depth - 1``
(``base`` = committed length), attending to the committed tokens, its ancestors and itself
(:func:`attention_mask`). The verifier's rules over a tree are in ``specops.serving.engine.verifier``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    """A trie of drafted tokens; index 0 is the root (the last committed token)."""

    tokens: list[int]
    """Token of each node (``tokens[0]`` is unused: the root is already committed)."""
    parent: list[int]
    """Parent of each node (``parent[0] == -1``)."""
    depth: list[int]
    """Depth of each node (root 0)."""
    samples: list[list[int]]
    """Children of each node in row order, repeated once per row that drafted them."""
    source: list[tuple[int, int]]
    """For each node, one ``(row, column)`` of ``Proposals`` it came from (root: ``(-1, -1)``)."""

    @property
    def num_nodes(self) -> int:
        """Drafted nodes (the root excluded)."""
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def children(self, node: int) -> dict[int, int]:
        """Token -> child node, first occurrence."""
        out: dict[int, int] = {}
        for c in self.samples[node]:
            out.setdefault(self.tokens[c], c)
        return out

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[i] for i in path]


def build(rows: list[list[int]]) -> TokenTree:
    """Merge candidate rows (token lists, any lengths) into a trie."""
    tokens, parent, depth, samples, source = [-1], [-1], [0], [[]], [(-1, -1)]
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for r, row in enumerate(rows):
        node = 0
        for j, tok in enumerate(row):
            tok = int(tok)
            child = index.get((node, tok))
            if child is None:
                child = len(tokens)
                index[(node, tok)] = child
                tokens.append(tok)
                parent.append(node)
                depth.append(depth[node] + 1)
                samples.append([])
                source.append((r, j))
            samples[node].append(child)
            node = child
    return TokenTree(tokens, parent, depth, samples, source)


def ancestors_mask(tree: TokenTree) -> torch.Tensor:
    """[num_nodes, num_nodes] bool: node ``i`` (row ``i-1``) may attend to node ``j`` (column
    ``j-1``) iff ``j`` is ``i`` or one of its ancestors."""
    n = tree.num_nodes
    allow = torch.zeros((n, n), dtype=torch.bool)
    for i in range(1, n + 1):
        j = i
        while j > 0:
            allow[i - 1, j - 1] = True
            j = tree.parent[j]
    return allow


def attention_mask(
    num_cached: int, num_fed_committed: int, tree: TokenTree, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The 4D additive mask ``[1, 1, q, num_cached + q]`` (0 = attend, dtype min = masked) for
    a pass that feeds ``num_fed_committed`` committed tokens (causal) then the tree's nodes."""
    c, n = num_fed_committed, tree.num_nodes
    q = c + n
    allow = torch.zeros((q, num_cached + q), dtype=torch.bool)
    allow[:, :num_cached] = True
    allow[:c, num_cached : num_cached + c] = torch.ones((c, c), dtype=torch.bool).tril()
    allow[c:, num_cached : num_cached + c] = True
    allow[c:, num_cached + c :] = ancestors_mask(tree)
    mask = torch.zeros(allow.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allow.to(device), torch.finfo(dtype).min)
    return mask[None, None]


def positions(base: int, num_fed_committed: int, tree: TokenTree) -> torch.Tensor:
    """[q] positions: the fed committed tokens end at ``base - 1``; node ``i`` sits at ``base + depth - 1``."""
    committed = torch.arange(base - num_fed_committed, base, dtype=torch.long)
    nodes = torch.tensor([base + d - 1 for d in tree.depth[1:]], dtype=torch.long)
    return torch.cat([committed, nodes])

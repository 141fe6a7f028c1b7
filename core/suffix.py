"""Exact suffix matching over a datastore's documents (REST's rule, our own code).

REST (He et al., 2023) keeps a suffix array over a token corpus; each step it finds the
longest suffix of the context (16 tokens down to 2) that occurs in the corpus, gathers the
continuations after its occurrences into a trie, and drafts the trie's most frequent paths.
A DReSD datastore (``specops.core.datastore``) already stores its documents' tokens once, so the same
rule runs over the same array with no second copy of the text: :class:`SuffixIndex` adds one
int32 per token, the positions sorted by the ``max_n`` tokens that start there (a suffix array
cut at ``max_n`` tokens, which is all a query of at most ``max_n`` tokens can compare).

- **No match crosses a document**: a position's string ends at its document's end (shorter
  strings sort first), so neither a match nor a continuation runs into the next document.
- **Frequency**: the occurrences of one string are contiguous in the sorted order and sorted
  by what follows them, so up to ``max_matches`` of them sampled evenly across the range keep
  each continuation's share; their continuations form a trie whose ``max_nodes`` most
  frequent nodes are kept (a node never counts more than its parent, so they form a subtree)
  and whose leaves are the rows, most frequent first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_N = 16
"""REST's longest suffix."""
MIN_N = 2
"""REST's shortest suffix (the paper: 16 tokens down to 2)."""


@dataclass(frozen=True)
class ExactMatch:
    """The result of one lookup: the matched suffix's length (0: none), how often it occurs,
    and the draft rows (most frequent first) with each row's share of the sampled occurrences."""

    length: int = 0
    occurrences: int = 0
    rows: list[list[int]] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)


class SuffixIndex:
    """Positions of a token array sorted by the (document-bounded) ``max_n`` tokens from each."""

    def __init__(self, tokens: np.ndarray, doc_ends: np.ndarray, max_n: int = MAX_N) -> None:
        if not 1 <= max_n <= 64:
            raise ValueError(f"max_n must be in 1..64, got {max_n}")
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.max_n = max_n
        n = len(self.tokens)
        pos = np.arange(n, dtype=np.int64)
        self.end = np.asarray(doc_ends, np.int64)[np.searchsorted(doc_ends, pos, side="right")].astype(np.int32)
        """[T] where each position's document ends (exclusive)."""
        keys = np.full((max_n, n), -1, dtype=np.int32)  # -1 past the document's end: sorts first
        for j in range(max_n):
            idx = pos + j
            ok = idx < self.end
            keys[j, ok] = self.tokens[idx[ok]]
        self.order = np.lexsort(keys[::-1]).astype(np.int32)  # primary key: the first token
        del keys
        self._toks = self.tokens.tolist()  # Python ints: comparisons in the binary search are list slices

    @property
    def num_bytes(self) -> int:
        """Memory beyond the datastore's own arrays (the order and the per-position document end)."""
        return int(self.order.nbytes + self.end.nbytes)

    def _window(self, p: int, n: int) -> list[int]:
        e = min(p + n, int(self.end[p]))
        return self._toks[p:e]

    def _range(self, query: list[int]) -> tuple[int, int]:
        """[lo, hi) of the sorted positions whose first ``len(query)`` tokens are ``query``."""
        n, order = len(query), self.order
        lo, hi = 0, len(order)
        while lo < hi:  # first window >= query
            mid = (lo + hi) // 2
            if self._window(int(order[mid]), n) < query:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, len(order)
        while lo < hi:  # first window > query (a window is at most n long: > means differs)
            mid = (lo + hi) // 2
            if self._window(int(order[mid]), n) == query:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def longest(self, context: list[int], min_n: int = MIN_N) -> tuple[int, int, int]:
        """(n, lo, hi): the longest suffix of ``context`` (``max_n`` down to ``min_n`` tokens) that
        occurs with at least one token after it, and its range; ``(0, 0, 0)`` if none."""
        top = min(self.max_n, len(context))
        # Occurrence is monotone in n (a suffix of a match matches), so binary-search the longest
        # length that occurs at all; then step down while its occurrences have nothing after them.
        lo_n, hi_n, best = min_n, top, None
        while lo_n <= hi_n:
            mid = (lo_n + hi_n) // 2
            r = self._range(list(context[len(context) - mid :]))
            if r[1] > r[0]:
                best, lo_n = (mid, *r), mid + 1
            else:
                hi_n = mid - 1
        while best is not None:
            n, lo, hi = best
            if any(int(self.order[i]) + n < int(self.end[int(self.order[i])]) for i in _spread(lo, hi, 64)):
                return n, lo, hi
            if n - 1 < min_n:
                break
            best = (n - 1, *self._range(list(context[len(context) - n + 1 :])))
        return 0, 0, 0

    def lookup(
        self,
        context: list[int],
        k: int,
        *,
        max_nodes: int = 32,
        n_rows: int = 0,
        max_matches: int = 128,
        min_share: float = 0.0,
        min_n: int = MIN_N,
    ) -> ExactMatch:
        """REST's drafts for ``context``: the continuations (up to ``k`` tokens) of its longest
        occurring suffix, as the leaves of their ``max_nodes`` most frequent trie nodes, most
        frequent first (at most ``n_rows`` of them; 0: all)."""
        if k <= 0 or not context:
            return ExactMatch()
        n, lo, hi = self.longest(context, min_n)
        if not n:
            return ExactMatch()
        counts: dict[tuple[int, ...], int] = {}
        total = 0
        for i in _spread(lo, hi, max_matches):
            p = int(self.order[i]) + n
            cont = self._toks[p : min(p + k, int(self.end[p - n]))]
            if not cont:
                continue
            total += 1
            for j in range(1, len(cont) + 1):
                key = tuple(cont[:j])
                counts[key] = counts.get(key, 0) + 1
        if not total:
            return ExactMatch()
        # The most frequent nodes; ties: shallower first, so a parent always precedes its child.
        floor = min_share * total
        kept = [p for p in sorted(counts, key=lambda path: (-counts[path], len(path), path)) if counts[p] >= floor]
        kept = kept[:max_nodes]
        parents = {p[:-1] for p in kept}
        leaves = [p for p in kept if p not in parents]
        leaves.sort(key=lambda p: (-counts[p], -len(p)))
        if n_rows:
            leaves = leaves[:n_rows]
        return ExactMatch(n, hi - lo, [list(p) for p in leaves], [counts[p] / total for p in leaves])


def _spread(lo: int, hi: int, m: int) -> list[int]:
    """Up to ``m`` indices evenly spread over [lo, hi)."""
    if hi - lo <= m:
        return list(range(lo, hi))
    return np.linspace(lo, hi - 1, m).round().astype(np.int64).tolist()

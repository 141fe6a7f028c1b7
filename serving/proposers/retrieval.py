"""``speculation.method = "retrieval"``: exact suffix matching first, dense neighbours where it is
short or absent, one token tree (a hybrid of REST and DReSD beyond either paper).

Both drafters read the same datastore (``specops.core.datastore``): REST's rule runs over its token
array (:class:`~specops.core.suffix.SuffixIndex`: the longest suffix of the context, 16 tokens down to
2, that occurs in the documents, and the most frequent continuations after it), DReSD's over its
keys (the target's hidden state after the last committed token, the first-token filter). Each
step:

1. the exact match: if its suffix is at least ``dense_below`` tokens long, its rows are the
   proposal (a long verbatim match is the best evidence a datastore has);
2. otherwise (a short match, or none) DReSD's rows are added after the exact rows, and the
   union is proposed: near-duplicates of the context that differ in a name or a word (the case
   exact matching misses, DReSD §2.2.1) still draft.

Rows that repeat or prefix another row are dropped; the rest merge into one trie verified in one
target pass by the exact tree verifier (``specops.serving.engine.verifier``), so the output is the
target's under greedy decoding and sampling alike (the rows are deterministic: the one-hot rule).
The first step has no hidden state yet, so it drafts from the exact match alone.
"""

from __future__ import annotations

import torch

from specops.core.suffix import MAX_N
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals, Verdict
from specops.serving.proposers.dresd import resolve_shape

DENSE_BELOW = 6
"""Dense rows join when the exact suffix match is shorter than this many tokens (0 never,
``MAX_N + 1`` always); chosen by ``benchmarks/dresd.py --curve``'s replay sweep."""
EXACT_NODES = 24
"""Trie nodes kept from the exact match's continuations (REST's ``choices``, which is 64 on a GPU;
on 2 CPU cores every verified node costs about 0.15 of a one-token pass)."""


def merge_rows(*groups: list[list[int]], max_rows: int = 0) -> list[list[int]]:
    """The rows of ``groups`` in order, without empty rows, repeats, or rows that are a prefix of
    an earlier one (the tree would merge them into nothing new); a later row that extends an
    earlier one replaces it in place. At most ``max_rows`` (0: all)."""
    out: list[list[int]] = []
    for rows in groups:
        for row in rows:
            if not row or any(r[: len(row)] == row for r in out):
                continue
            for i, r in enumerate(out):
                if row[: len(r)] == r:  # extends a kept row: keep the longer one where the shorter was
                    out[i] = list(row)
                    break
            else:
                if not max_rows or len(out) < max_rows:
                    out.append(list(row))
    return out


class RetrievalProposer(Proposer):
    """Exact suffix rows, plus dense rows where the exact match is short or absent."""

    name = "retrieval"
    needs_hidden = True

    def __init__(
        self,
        datastore,
        *,
        n_drafts: int = 0,
        search_k: int = 0,
        dense_below: int = DENSE_BELOW,
        exact_nodes: int = EXACT_NODES,
    ) -> None:
        if n_drafts < 0 or exact_nodes < 1 or not 0 <= dense_below <= MAX_N + 1:
            raise ValueError(
                f"n_drafts must be >= 0, exact_nodes >= 1, dense_below in 0..{MAX_N + 1}; "
                f"got {n_drafts}, {exact_nodes}, {dense_below}"
            )
        self.datastore = datastore
        self.n_dense, self.max_row = resolve_shape(datastore, n_drafts)
        """Dense rows per step and tokens per dense row at most (0: the step's k): the datastore's shape."""
        self.search_k, self.dense_below, self.exact_nodes = search_k, dense_below, exact_nodes
        self._hidden: torch.Tensor | None = None
        self.last_match = 0
        """The exact suffix length of the last proposal (0: none)."""
        self.num_exact = self.num_dense = self.num_empty = 0

    @property
    def suffix(self):
        """The datastore's exact-match index (built once per datastore, by its loader in serving)."""
        return self.datastore.suffix_index()

    def start(self, state: DecodeState) -> None:
        self._hidden = None
        self.num_exact = self.num_dense = self.num_empty = 0
        self.last_match = 0

    def propose(self, state: DecodeState, k: int) -> Proposals:
        if k <= 0:
            return Proposals.empty()
        ctx = state.token_ids
        exact = self.suffix.lookup(ctx[-MAX_N:], k, max_nodes=self.exact_nodes)
        self.last_match = exact.length
        rows = exact.rows
        dense: list[list[int]] = []
        if exact.length < self.dense_below and self._hidden is not None:
            length = min(k, self.max_row) if self.max_row else k
            dense = self.datastore.drafts(
                self._hidden, int(ctx[-1]), n_drafts=self.n_dense, length=length, search_k=self.search_k
            )
        merged = merge_rows(rows, dense)
        self.num_exact += bool(rows)
        self.num_dense += bool(dense)
        if not merged:
            self.num_empty += 1
            return Proposals.empty()
        return Proposals.from_rows(merged)

    def observe(self, state: DecodeState, verdict: Verdict) -> None:
        self._hidden = verdict.target_hidden  # None when the engine was not asked for it: exact rows only

    def rollback(self, state: DecodeState, position: int) -> None:
        self._hidden = None

    def counters(self) -> dict[str, int]:
        return {"exact_steps": self.num_exact, "dense_steps": self.num_dense, "empty_steps": self.num_empty}

"""``speculation.method = "retrieval"``: exact matching first (the datastore and the request's own
context), dense neighbours where both are short or absent, one token tree (a hybrid of REST and
DReSD beyond either paper).

Three sources, two of them the datastore (``specops.core.datastore``):

- **the datastore's tokens**, REST's rule (:class:`~specops.core.suffix.SuffixIndex`): the longest
  suffix of the context, 16 tokens down to 2, that occurs in the documents, and the most frequent
  continuations after it (at most ``exact_nodes`` trie nodes);
- **the request's own context** (prompt and output so far), LLMA's scored rule
  (:func:`~specops.serving.proposers.llma.scored_rows` at serving's
  :data:`~specops.serving.proposers.llma.SERVING_RULE`: every match length up to 64 tokens votes a
  path of ``match + 1`` tokens, cut below probability 0.05): what REST's own library does through
  its reader's query memory (``benchmarks/rest_baseline.py``), and what copies a repeated name, a
  quoted line or a list's pattern that no datastore holds (issue 60);
- **the datastore's keys**, DReSD's rule: the target's hidden state after the last committed
  token, the first-token filter, ``n_drafts`` rows.

Each step the two exact sources are looked up; if the longer of their matches is at least
``dense_below`` tokens, their rows are the proposal (a long verbatim match is the best evidence
there is); otherwise (a short match, or none) DReSD's rows are added after them: near-duplicates
of the context that differ in a name or a word (the case exact matching misses, DReSD §2.2.1)
still draft.

Rows that repeat or prefix another row are dropped; the rest merge into one trie verified in one
target pass by the exact tree verifier (``specops.serving.engine.verifier``), so the output is the
target's under greedy decoding and sampling alike (the rows are deterministic: the one-hot rule).
The first step has no hidden state yet, so it drafts from the exact sources alone.
"""

from __future__ import annotations

import torch

from specops.core.sessions.ngram import MAX_EXTEND, NgramIndex
from specops.core.suffix import MAX_N
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals, Verdict
from specops.serving.proposers.dresd import resolve_shape
from specops.serving.proposers.llma import SERVING_RULE, Scored, context_index, scored_rows

DENSE_BELOW = 0
"""Dense rows join when the longer exact match (datastore or context) is shorter than this many
tokens (0 never, ``MAX_N + 1`` always). 0 on 2 CPU cores: chosen with :data:`EXACT_NODES` on the
dev split of ``benchmarks/dresd.py --curve`` (its replay over 6 x 4 settings at 100k entries,
priced by the measured verify cost, 53.7 ms + 1.82 ms per token), reported on the test split
(``benchmarks/out/dresd.json``). Dense rows add accepted tokens wherever they join (id 1.11 ->
1.23 per step at 8 nodes, 6 instead of 0) but cost about as much as they bring there (priced
1.88x at 0, 1.86x at 2, 1.80x at 6); on a GPU, where a verified node costs little, 6 or 17
accept more. A request sets it with ``speculation.dense_below``."""
EXACT_NODES = 8
"""Trie nodes kept from the datastore's exact match (REST's ``choices``, which is 64 on a GPU):
the dev split's choice with :data:`DENSE_BELOW` (priced 1.88x at 8 nodes, 1.87x at 4, 1.78x at
16, 1.69x at 24). ``speculation.exact_nodes`` sets it per request."""
CONTEXT_MAX_N = 4
"""Longest n-gram the context index keys on (matches are then followed back up to 64 tokens)."""


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
    """Exact rows from the datastore and the request's context, plus dense rows where both
    matches are short or absent."""

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
        use_context: bool = True,
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
        self.use_context = use_context
        self._hidden: torch.Tensor | None = None
        self._context: NgramIndex | None = None
        self.last_match = 0
        """The longer exact match of the last proposal, datastore or context (0: none)."""
        self.num_exact = self.num_context = self.num_dense = self.num_empty = 0

    @property
    def suffix(self):
        """The datastore's exact-match index (built once per datastore, by its loader in serving)."""
        return self.datastore.suffix_index()

    def start(self, state: DecodeState) -> None:
        self._hidden = None
        self._context = None
        self.num_exact = self.num_context = self.num_dense = self.num_empty = 0
        self.last_match = 0

    def propose(self, state: DecodeState, k: int) -> Proposals:
        if k <= 0:
            return Proposals.empty()
        ctx = state.token_ids
        exact = self.suffix.lookup(ctx[-MAX_N:], k, max_nodes=self.exact_nodes)
        own = Scored()
        if self.use_context:
            self._context = context_index(self._context, ctx, CONTEXT_MAX_N)
            own = scored_rows([self._context], ctx[-MAX_EXTEND:], k, 1, **SERVING_RULE)
        own_rows = [row for _, row in own.rows]
        self.last_match = max(exact.length, own.length)
        dense: list[list[int]] = []
        if self.last_match < self.dense_below and self._hidden is not None:
            length = min(k, self.max_row) if self.max_row else k
            dense = self.datastore.drafts(
                self._hidden, int(ctx[-1]), n_drafts=self.n_dense, length=length, search_k=self.search_k
            )
        merged = merge_rows(own_rows, exact.rows, dense)
        self.num_exact += bool(exact.rows)
        self.num_context += bool(own_rows)
        self.num_dense += bool(dense)
        if not merged:
            self.num_empty += 1
            return Proposals.empty()
        return Proposals.from_rows(merged)

    def observe(self, state: DecodeState, verdict: Verdict) -> None:
        self._hidden = verdict.target_hidden  # None when the engine was not asked for it: exact rows only

    def rollback(self, state: DecodeState, position: int) -> None:
        self._hidden = None
        if self._context is not None and len(self._context.tokens) > position:
            self._context = None  # an index cannot drop tokens: rebuilt at the next step

    def counters(self) -> dict[str, int]:
        return {
            "exact_steps": self.num_exact,
            "context_steps": self.num_context,
            "dense_steps": self.num_dense,
            "empty_steps": self.num_empty,
        }

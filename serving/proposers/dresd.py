"""DReSD: draft from a dense-retrieval datastore keyed on the target's hidden state (DReSD Alg. 1).

Each step (after the first) queries the cluster's :class:`~specops.core.datastore.Datastore`
with the target's hidden state at the position that produced the last committed token (the
verifier returns it with each verdict), keeps the values that start with that token, and
proposes up to ``n_drafts`` rows of up to ``k`` tokens. The rows are verified as one token tree
(``specops.serving.engine.tree``) in one target pass, exactly under greedy decoding and sampling
(the trie rule for deterministic drafts; never the public code's "each row samples, the
longest match wins", which is biased).

**The first step.** Before the target has run, there is no hidden state to search with.
The first step therefore proposes nothing: it is the prefill, which runs the prompt through
the target anyway and emits one token with the hidden state that keys the second step. That
is the paper's step 2 (``v <- LLM(x)``) merged with the first verification: it costs no
extra target pass, only the drafts one step could have carried (measured in
``benchmarks/dresd.py`` as ``first_step_ms``).
"""

from __future__ import annotations

import torch

from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals, Verdict

DEFAULT_SHAPE = (3, 10)
"""Rows and tokens per row when neither the request nor the datastore says."""


def resolve_shape(datastore, n_drafts: int = 0) -> tuple[int, int]:
    """(rows, tokens per row at most; 0 = the step's k) for a request asking ``n_drafts`` rows
    (0: the datastore's measured ``meta["shape"]``, else :data:`DEFAULT_SHAPE`'s rows)."""
    if n_drafts:
        return n_drafts, 0
    shape = (getattr(datastore, "meta", None) or {}).get("shape") or {}
    return int(shape.get("n_drafts", DEFAULT_SHAPE[0])), int(shape.get("k", 0))


class DReSDProposer(Proposer):
    """Drafts ``n_drafts x k`` token rows from a datastore."""

    name = "dresd"
    needs_hidden = True

    def __init__(self, datastore, *, n_drafts: int = 0, search_k: int = 0) -> None:
        """``n_drafts`` 0: the datastore's own shape (rows, and tokens per row at most), which its
        rebuild measured as the fastest on held-out traffic; else :data:`DEFAULT_SHAPE`."""
        if n_drafts < 0:
            raise ValueError(f"n_drafts must be >= 0, got {n_drafts}")
        self.datastore = datastore
        self.n_drafts, self.max_row = resolve_shape(datastore, n_drafts)
        """Rows per step, and tokens per row at most (0: the step's k)."""
        self.search_k = search_k
        self._hidden: torch.Tensor | None = None
        self.num_searches = 0
        self.num_empty = 0
        """Searches that found no value starting with the target's token."""

    def start(self, state: DecodeState) -> None:
        self._hidden = None
        self.num_searches = self.num_empty = 0

    def propose(self, state: DecodeState, k: int) -> Proposals:
        if k <= 0 or self._hidden is None:
            return Proposals.empty()
        self.num_searches += 1
        length = min(k, self.max_row) if self.max_row else k
        rows = self.datastore.drafts(
            self._hidden, int(state.token_ids[-1]), n_drafts=self.n_drafts, length=length, search_k=self.search_k
        )
        if not rows:
            self.num_empty += 1
            return Proposals.empty()
        return Proposals.from_rows(rows)

    def observe(self, state: DecodeState, verdict: Verdict) -> None:
        assert verdict.target_hidden is not None, "dresd needs the verifier's target_hidden (catalogue: target_hidden)"
        self._hidden = verdict.target_hidden  # [hidden], after the last committed token's predecessor

    def rollback(self, state: DecodeState, position: int) -> None:
        self._hidden = None  # the key described a withdrawn position; the next step drafts nothing

"""DReSD: draft from a dense-retrieval datastore keyed on the target's hidden state (DReSD Alg. 1).

Each step (after the first) queries the cluster's :class:`~serving.retrieval.datastore.Datastore`
with the target's hidden state at the position that produced the last committed token (the
verifier returns it with each verdict), keeps the values that start with that token, and
proposes up to ``n_drafts`` rows of up to ``k`` tokens. The rows are verified as one token tree
(``serving.engine.tree``) in one target pass, exactly under greedy decoding and sampling
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

from serving.engine.types import DecodeState, Proposals, Verdict
from serving.proposers.base import Proposer


class DReSDProposer(Proposer):
    """Drafts ``n_drafts x k`` token rows from a datastore."""

    name = "dresd"

    def __init__(self, datastore, *, n_drafts: int = 3, search_k: int = 0) -> None:
        if n_drafts < 1:
            raise ValueError(f"n_drafts must be >= 1, got {n_drafts}")
        self.datastore = datastore
        self.n_drafts = n_drafts
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
        rows = self.datastore.drafts(self._hidden, int(state.token_ids[-1]), n_drafts=self.n_drafts, length=k,
                                     search_k=self.search_k)  # fmt: skip
        if not rows:
            self.num_empty += 1
            return Proposals.empty()
        return Proposals.from_rows(rows)

    def observe(self, state: DecodeState, verdict: Verdict) -> None:
        assert verdict.target_hidden is not None, "dresd needs the verifier's target_hidden (catalogue: target_hidden)"
        self._hidden = verdict.target_hidden  # [hidden], after the last committed token's predecessor

    def rollback(self, state: DecodeState, position: int) -> None:
        self._hidden = None  # the key described a withdrawn position; the next step drafts nothing

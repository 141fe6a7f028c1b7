"""REST (He et al., 2023) through its own library, ``draftretriever``, as a ``Proposer``.

REST keeps a suffix array over a token corpus. Each step it looks up the longest suffix of the
context (16 tokens down to 2) that occurs in the corpus and returns the continuations after
its occurrences, merged into a trie of at most ``choices`` nodes (``search(..., choices=64)``,
REST's default). Those rows go to our tree verifier, the same one DReSD's rows go to, so the
comparison is of the drafts alone. (REST's own code verifies with the biased "each row samples,
the longest match wins" rule under sampling; greedy, as measured here, the two agree.)

**A fresh reader per request.** ``draftretriever`` 0.1.1's ``Reader`` learns from the queries it
is asked: after a search for a 16-token string that is in no document, a search for the string's
first 3 tokens returns its continuation (``tests/benchmarks/test_rest_reader.py``). One reader
shared by every request is therefore a cache of all earlier requests' contexts and outputs (a
cross-request copy drafter, which serving would have to keep per tenant), not REST's datastore
retrieval. Each request here gets its own reader (:meth:`RestProposer.start`), so REST drafts from
its datastore and, through that quirk, from the request's own context, never from another
request's. Benchmarks before this fix shared one reader.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals


class RestIndex:
    """A REST datastore built from token documents with ``draftretriever.Writer``."""

    def __init__(self, docs: Sequence[Sequence[int]], vocab_size: int) -> None:
        import draftretriever

        self._dir = tempfile.TemporaryDirectory(prefix="specops-rest-")
        path = str(Path(self._dir.name) / "rest.idx")
        writer = draftretriever.Writer(path, vocab_size=vocab_size)
        for doc in docs:
            writer.add_entry([int(t) for t in doc])
        writer.finalize()
        self.path = Path(path)
        self.reader = draftretriever.Reader(path)
        self.num_tokens = sum(len(d) for d in docs)

    @property
    def num_bytes(self) -> int:
        return self.path.stat().st_size


class RestProposer(Proposer):
    """REST's drafts: every trie path (``n_drafts`` = 0) or the first ``n_drafts`` leaves."""

    name = "rest"

    def __init__(self, index: RestIndex, *, n_drafts: int = 0, choices: int = 64, max_suffix: int = 16) -> None:
        self.index, self.n_drafts, self.choices, self.max_suffix = index, n_drafts, choices, max_suffix
        self.reader = None

    def start(self, state: DecodeState | None = None) -> None:
        """A fresh reader for this request: nothing an earlier request asked is remembered."""
        import draftretriever

        self.reader = draftretriever.Reader(str(self.index.path))

    def propose(self, state: DecodeState, k: int) -> Proposals:
        ctx = state.token_ids
        rows: list[list[int]] = []
        for span in range(min(self.max_suffix, len(ctx)), 1, -1):  # REST: the longest suffix that matches
            if self.reader is None:
                self.start()
            found = self.reader.search([int(t) for t in ctx[-span:]], choices=self.choices)[0]
            if found:
                rows = [[t for t in r if t >= 0][:k] for r in found]
                break
        rows = [r for r in rows if r]
        # Leaves only (a row that prefixes another adds no node), in REST's order.
        leaves = [r for r in rows if not any(len(o) > len(r) and o[: len(r)] == r for o in rows)]
        unique = list(dict.fromkeys(tuple(r) for r in leaves))
        if self.n_drafts:
            unique = unique[: self.n_drafts]
        if k <= 0 or not unique:
            return Proposals.empty()
        return Proposals.from_rows([list(r) for r in unique])

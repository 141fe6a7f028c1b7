"""The n-gram index of token documents: the format LLMA copies from and the past-sessions
artifact is rebuilt as (``specops.core.sessions.cache.index_of``).

Every n-gram (n = 1..``max_n``) of the indexed documents maps to where it ends, so a lookup of
a request's trailing tokens costs at most ``max_n`` dictionary reads and never re-scans a
document. :meth:`NgramIndex.matches` ranks the hits of the longest n-gram by how far their
match extends further back (up to :data:`MAX_EXTEND` tokens), then by the continuation's
length, then by recency. LLMA's proposer (``specops.serving.proposers.llma``) drafts from these matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_EXTEND = 32
"""How far back a candidate's match is compared to rank equally long n-gram hits."""


@dataclass(frozen=True)
class Match:
    """A place in an index where the request's trailing tokens match: ``length`` tokens
    match, ending just before ``pos`` (the first token to copy) in the flat token list."""

    length: int
    pos: int
    available: int
    """Tokens that follow ``pos`` before the end of its document."""


class NgramIndex:
    """Where every n-gram (n = 1..``max_n``) of a collection of token documents ends.

    Documents are appended (never rewritten); each n-gram keeps at most ``max_positions``
    end positions, the most recent. Memory is bounded by ``max_tokens``: an append that
    would exceed it is refused (:meth:`room`), so an owner decides what to evict
    (:class:`~specops.serving.proposers.session_cache.SessionCache` rebuilds from its newest
    documents).
    """

    SEP = -1
    """Between documents in :attr:`tokens`: no n-gram or copy crosses it."""

    def __init__(self, max_n: int = 4, max_positions: int = 8, max_tokens: int = 1 << 20) -> None:
        if not (1 <= max_n <= 16):
            raise ValueError(f"max_n must be in 1..16, got {max_n}")
        if max_positions < 1 or max_tokens < 1:
            raise ValueError("max_positions and max_tokens must be >= 1")
        self.max_n = max_n
        self.max_positions = max_positions
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.num_docs = 0
        self._doc_start = 0
        """Where the last (open) document starts in :attr:`tokens`."""

    def __len__(self) -> int:
        return len(self.tokens) - max(0, self.num_docs - 1)  # separators are not tokens

    def room(self, n_tokens: int) -> bool:
        return len(self) + n_tokens <= self.max_tokens

    def add(self, doc: Sequence[int]) -> None:
        """Index one more document (a reference text's token ids)."""
        if not self.room(len(doc)):
            raise ValueError(f"index full: {len(self)} + {len(doc)} tokens > max_tokens {self.max_tokens}")
        if self.tokens:
            self.tokens.append(self.SEP)
        self._doc_start = len(self.tokens)
        self.num_docs += 1
        self.extend(doc)

    def extend(self, more: Iterable[int]) -> None:
        """Append tokens to the last document (a growing context), indexing the n-grams that
        end at each new token: ``max_n`` dictionary updates per token."""
        toks, table, cap = self.tokens, self.table, self.max_positions
        if not self.num_docs:
            self.num_docs = 1
            self._doc_start = 0
        for t in more:
            toks.append(int(t))
            end = len(toks)
            for n in range(1, min(self.max_n, end - self._doc_start) + 1):
                key = tuple(toks[end - n : end])
                hits = table.get(key)
                if hits is None:
                    table[key] = [end]
                else:
                    hits.append(end)
                    if len(hits) > cap:
                        del hits[0]

    def _extent(self, tail: Sequence[int], pos: int, limit: int) -> int:
        """How many trailing tokens of ``tail`` equal the tokens before ``pos`` (at most ``limit``)."""
        toks = self.tokens
        m = 0
        while m < limit and pos - 1 - m >= 0 and toks[pos - 1 - m] == tail[len(tail) - 1 - m]:
            m += 1
        return m

    def _available(self, pos: int, k: int) -> int:
        toks, end, n = self.tokens, min(len(self.tokens), pos + k), 0
        while pos + n < end and toks[pos + n] != self.SEP:
            n += 1
        return n

    def matches(self, tail: Sequence[int], k: int, min_n: int = 1) -> list[Match]:
        """Matches of the longest trailing n-gram of ``tail`` (``max_n`` down to ``min_n``)
        that have at least one token to copy, best first (in the request's own context, the
        match at the very end has nothing after it and is skipped)."""
        limit = min(len(tail), MAX_EXTEND)
        for n in range(min(self.max_n, len(tail)), min_n - 1, -1):
            hits = self.table.get(tuple(tail[len(tail) - n :]))
            if not hits:
                continue
            found = []
            for pos in hits:
                avail = self._available(pos, k)
                if avail:
                    found.append(Match(self._extent(tail, pos, limit), pos, avail))
            if found:
                found.sort(key=lambda m: (m.length, m.available, m.pos), reverse=True)
                return found
        return []

    def copy(self, m: Match, k: int) -> list[int]:
        return self.tokens[m.pos : m.pos + min(k, m.available)]

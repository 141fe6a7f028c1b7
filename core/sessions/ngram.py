"""The n-gram index of token documents: the format LLMA copies from and the past-sessions
artifact is rebuilt as (``specops.core.sessions.cache.index_of``).

Every n-gram (n = 1..``max_n``) of the indexed documents maps to where it ends, so a lookup of
a request's trailing tokens costs at most ``max_n`` dictionary reads and never re-scans a
document. :meth:`NgramIndex.matches` ranks the hits of the longest n-gram by how far their
match extends further back (up to :data:`MAX_EXTEND` tokens), then by the continuation's
length, then by recency; :meth:`NgramIndex.levels` gives every match by its length, as a
suffix tree counts them (LLMA's scored rule). LLMA's proposer (``specops.serving.proposers.llma``)
drafts from these matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

MAX_EXTEND = 64
"""How far back a candidate's match is compared: the longest match an index reports (SuffixDecoding's
tree depth, 64; it was 32 until the scored rule of issue 60 counted matches per length)."""


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
        end at each new token: ``max_n`` dictionary updates per token (one pass per n over
        tuples ``zip`` builds: a 1,000-token prompt is indexed in a few milliseconds)."""
        toks, table, cap = self.tokens, self.table, self.max_positions
        if not self.num_docs:
            self.num_docs = 1
            self._doc_start = 0
        old = len(toks)
        toks.extend(int(t) for t in more)
        new = len(toks)
        if new - old <= 16:  # a step's few tokens: token by token (the passes below cost more to set up)
            for end in range(old + 1, new + 1):
                for n in range(1, min(self.max_n, end - self._doc_start) + 1):
                    key = tuple(toks[end - n : end])
                    hits = table.get(key)
                    if hits is None:
                        table[key] = [end]
                    else:
                        hits.append(end)
                        if len(hits) > cap:
                            del hits[0]
            return
        for n in range(1, self.max_n + 1):
            first = max(old + 1, self._doc_start + n)  # the first end of an n-gram within the document
            if first > new:
                break
            grams = zip(*(toks[first - n + j : new - n + j + 1] for j in range(n)))
            for end, key in enumerate(grams, first):
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

    def levels(self, tail: Sequence[int], k: int, min_n: int = 1) -> Iterator[tuple[int, list[Match]]]:
        """Every place where a trailing piece of ``tail`` occurs with something to copy after it,
        by match length: one ``(n, matches)`` per n-gram length from the longest that occurs
        down to ``min_n``, each match given once, where it first appears.

        The first level holds the hits of the longest trailing n-gram, each with how far its
        match really extends (up to :data:`MAX_EXTEND`). Each later level ``n`` holds the
        hits of the n-token suffix not already given, whose match is exactly ``n`` long: a hit
        among the ``max_positions`` most recent of the n-gram that also matches ``n + 1`` tokens
        is among the most recent of the (n+1)-gram too. So the matches of length >= L, for any
        L, are the union of the levels down to L: what a suffix tree counts at depth L (within
        the cap). A generator, so a caller that has seen enough stops early."""
        limit = min(len(tail), MAX_EXTEND)
        seen: set[int] = set()
        first = True
        for n in range(min(self.max_n, len(tail)), min_n - 1, -1):
            level = []
            for pos in self.table.get(tuple(tail[len(tail) - n :]), ()):
                if pos in seen:
                    continue
                avail = self._available(pos, k)
                if avail:
                    seen.add(pos)
                    level.append(Match(self._extent(tail, pos, limit) if first else n, pos, avail))
            if first and not level:
                continue
            first = False
            level.sort(key=lambda m: (m.length, m.pos), reverse=True)
            yield n, level

    def copy(self, m: Match, k: int) -> list[int]:
        return self.tokens[m.pos : m.pos + min(k, m.available)]

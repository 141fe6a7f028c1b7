"""LLMA (Yang et al., "Inference with Reference", ``../shared/papers/llma.txt``): copy
drafting from reference texts.

At each step the trailing tokens of the request (prompt + output) are matched against the
references; the ``k`` tokens that followed the match in a reference are the draft
(Algorithm 1). Departures from the public code, as the issue asks:

- **incremental matching**: every reference set is indexed once (``specops.core.sessions.ngram.NgramIndex``: each
  n-gram, n = 1..``max_n``, maps to where it ends); a step looks up at most ``max_n`` keys
  and never re-scans a reference (the public code rebuilds every n-gram of the output at
  every step);
- **the longest match wins**, not the first occurrence: candidates of the longest n-gram
  are ranked by how far their match extends further back (up to :data:`MAX_EXTEND`
  tokens), then by the continuation's length, then by recency (the paper's rule,
  :func:`best_rows`);
- **serving scores every match length** (SuffixDecoding's rule, our code, :func:`scored_rows`,
  issue 60): the references, retrieved passages and past sessions are one pool, as
  SuffixDecoding's tree of past responses, and the request's context another; for every
  length L the request's last L tokens match (up to :data:`MAX_EXTEND` = 64), the places
  they occur vote a path token by token, its probability the product of each token's share,
  cut below ``min_prob`` and at ``copy_factor * L + copy_offset`` tokens; the path with the
  highest expected accepted length wins. Before issue 60 serving ranked the longest matches'
  continuations by frequency only (:func:`frequency_rows`, kept as the tuning's baseline);
- **several equally good matches become several drafts** (rows; serving's rule: the other
  distinct continuations, most probable first), merged into one token tree and verified in
  one target pass by the exact verifier;
- **exact under sampling**: copied drafts are deterministic, so the verifier uses the
  one-hot rule (draw from the target; accept while the draw equals the draft).

Sources (:class:`ReferenceSet`): the request's ``references``, the earlier turns of a chat,
retrieved passages, past sessions of the cluster (:mod:`specops.serving.proposers.session_cache`),
and the request's own context, which is indexed as it grows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specops.core.sessions.ngram import MAX_EXTEND, Match, NgramIndex
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals

COPY_FACTOR, COPY_OFFSET, MIN_PROB = 1.0, 1.0, 0.05
"""Serving's rule (:func:`scored_rows`): a match of L tokens drafts at most ``L + 1`` tokens (and
at most ``k``), cut where the path's probability falls below 0.05. Chosen on the dev split of
``benchmarks/llma.py``'s RAG and cache-assisted sets (25 cases each) by replaying 120 settings of
factor, offset, ``min_prob`` and n on the target's outputs, priced by the measured verify cost
and the proposer's own time (``benchmarks/llma_tune.py``, ``benchmarks/out/llma_tune.json``);
reported on the test split (``benchmarks/out/llma.json``). The best settings were within 1-2 %
of each other there (the proposer's measured time moves them about); every one of them beat the
frequency rule below and every setting of the paper's fixed-k rule. The paper copies ``k`` at
every match, which pays where a pass over k tokens costs what one over 1 token does (GPUs); a
1-token match is right far less often than a 16-token one."""
SERVING_RULE = dict(copy_factor=COPY_FACTOR, copy_offset=COPY_OFFSET, min_prob=MIN_PROB)
"""Serving's rule as :class:`LLMAProposer` keywords (the catalogue's ``llma`` and the benchmark's arm)."""
MIN_AGREEMENT = 0.5
"""The frequency rule (serving's before issue 60): the draft stops where the most frequent next
token has less than this share of the matches that agree with the draft so far."""
MIN_PATH = 0.1
"""... or where the draft's probability under the counts (the product of each token's share)
falls below this (SuffixDecoding's ``min_token_prob``)."""
FREQUENCY_RULE = dict(copy_factor=1.0, copy_offset=1.0, min_agreement=MIN_AGREEMENT, min_path=MIN_PATH)
"""The frequency rule as :class:`LLMAProposer` keywords: ``1 + match`` tokens of the continuation
most of the longest matches share (:func:`frequency_rows`); the tuning's baseline."""
WIDEN_MARGIN = 2
"""A longest match found once is counted with the matches up to this many tokens shorter, each
token shorter halving a match's weight (:func:`frequency_rows`)."""
MAX_POSITIONS = 32
"""Occurrences kept per n-gram in the indexes this module builds (references, retrieved passages,
the context): the most recent ones, so a frequent continuation is counted over 32 places, not 8.
Memory stays bounded by ``max_n`` entries per token whatever the cap; a lookup extends at most
this many hits per index (5,000 Zipf-distributed reference tokens, 3,000 of context: 74 µs per
paper-rule step at 8, 97 µs at 32; 145 µs per frequency-rule step)."""


def _ranked(found: list[tuple[NgramIndex, Match]]) -> list[tuple[NgramIndex, Match]]:
    """The matches best first: the longest, then the longest continuation, then (the order each
    index gives) the most recent."""
    return sorted(found, key=lambda im: (im[1].length, im[1].available), reverse=True)


def best_rows(found: list[tuple[NgramIndex, Match]], k: int, n_drafts: int) -> list[tuple[NgramIndex, list[int]]]:
    """The paper's rule (``min_agreement`` unset): up to ``n_drafts`` distinct continuations of
    the best matches (the longest; ties become several rows), best first, each with the index it
    was copied from. A row that is a prefix of another adds nothing to the tree."""
    if not found:
        return []
    best = max(m.length for _, m in found)
    rows: list[tuple[NgramIndex, list[int]]] = []
    for index, m in _ranked(found):
        if m.length < best or len(rows) >= n_drafts:
            break
        row = index.copy(m, k)
        if any(r[: len(row)] == row for _, r in rows):
            continue
        rows = [(i, r) for i, r in rows if row[: len(r)] != r]  # drop rows this one extends
        rows.append((index, row))
    return rows


def frequency_rows(
    found: list[tuple[NgramIndex, Match]], k: int, n_drafts: int, min_agreement: float, min_path: float = 0.0
) -> list[tuple[NgramIndex, list[int]]]:
    """Serving's rule: up to ``n_drafts`` rows ranked by how often their continuation follows
    the longest matches (SuffixDecoding's rule, on our n-gram index), best first, each with the
    index of the best-ranked match that continues with it.

    - **Who votes.** The matches of the longest length, each counted once: the occurrences of
      the longest matched suffix, which are what SuffixDecoding's suffix tree counts. Where only
      one match is that long it has nothing to be counted against, so the matches up to
      :data:`WIDEN_MARGIN` tokens shorter join it, each token shorter halving the weight: two
      matches one token shorter tie with it (a tie goes to the longer match), three outvote it,
      and matches further behind (9 tokens against a 32-token copy of this very passage) have no
      say.
    - **Row 0** follows the heaviest next token at every depth (a tie: the best-ranked match,
      :func:`_ranked`) and stops before the first token (never the first: the target pass is
      paid anyway) whose share of the matches that agree so far and have a next token is below
      ``min_agreement``, or where the product of the shares so far (the path's probability)
      falls below ``min_path``, where at least two have a say. A reference that ends has no say: it
      knows nothing of the next token.
    - **Further rows** are the other distinct continuations that no other extends, ranked by
      their probability under the counts (the product of each token's share), then by their
      best match; one that extends row 0 is left out (row 0 was cut there), so no row is a
      prefix of another and each adds nodes to the tree.
    """
    if not found:
        return []
    ranked = _ranked(found)
    best = ranked[0][1].length
    pool = [im for im in ranked if im[1].length == best]
    if len(pool) < 2:
        pool = [im for im in ranked if im[1].length >= best - WIDEN_MARGIN]
    conts = [index.copy(m, k) for index, m in pool]
    weight = [0.5 ** (best - m.length) for _, m in pool]
    row: list[int] = []
    group = list(range(len(pool)))  # the matches that agree with row 0 so far, best first
    path = 1.0
    for j in range(k):
        say = [c for c in group if len(conts[c]) > j]
        if not say:
            break
        votes: dict[int, float] = {}
        first: dict[int, int] = {}
        for c in say:
            t = conts[c][j]
            votes[t] = votes.get(t, 0.0) + weight[c]
            first.setdefault(t, c)
        top = max(votes, key=lambda t: (votes[t], -first[t]))
        share = votes[top] / sum(votes.values())
        path *= share
        if j and len(say) > 1 and (share < min_agreement or path < min_path):
            break
        row.append(top)
        group = [c for c in say if conts[c][j] == top]
    rows = [(pool[group[0]][0], row)]
    if n_drafts > 1:
        rows += _other_leaves(pool, conts, weight, row)[: n_drafts - 1]
    return rows


def _greedy_path(
    conts: list[list[int]], group: list[int], depth: int, min_prob: float
) -> tuple[list[int], float, list[int]]:
    """SuffixDecoding's path (``_speculate_path``) over the continuations ``conts[c]`` of the
    matches in ``group`` (best-ranked first): at each depth the next token most of the matches
    that agree so far continue with (a tie: the best-ranked), the path's probability multiplied
    by its share, until ``depth`` tokens or the probability falls below ``min_prob``. A match
    whose continuation ended has no say (a passage ends where it was cut, not where text
    ends). Returns the row, its score (the sum of the probabilities: the tokens the target is
    expected to accept) and the matches that agree with the whole row."""
    row: list[int] = []
    prob, score = 1.0, 0.0
    for j in range(depth):
        say = [c for c in group if len(conts[c]) > j]
        if not say:
            break
        votes: dict[int, int] = {}
        for c in say:
            votes[conts[c][j]] = votes.get(conts[c][j], 0) + 1
        top = max(votes, key=votes.__getitem__)  # dicts keep insertion order: a tie goes to the best-ranked
        p = prob * votes[top] / len(say)
        if p < min_prob:
            break
        prob, score = p, score + p
        row.append(top)
        group = [c for c in say if conts[c][j] == top]
    return row, score, group


@dataclass
class Scored:
    """The best draft of one pool of indexes under :func:`scored_rows`."""

    score: float = 0.0
    length: int = 0
    """The match length it was drawn at (0: none)."""
    rows: list[tuple[NgramIndex, list[int]]] = field(default_factory=list)


def scored_rows(
    pool: Sequence[NgramIndex],
    tail: Sequence[int],
    k: int,
    n_drafts: int,
    *,
    copy_factor: float,
    copy_offset: float,
    min_prob: float,
    min_n: int = 1,
) -> Scored:
    """SuffixDecoding's rule over a pool of n-gram indexes, as if their documents were one
    suffix tree of past responses (its global tree; the request's context is another pool, its
    local tree): for every match length L from the longest (up to :data:`MAX_EXTEND`) down to
    ``min_n``, the matches of at least L tokens vote a path of at most
    ``min(k, copy_factor * L + copy_offset)`` tokens (:func:`_greedy_path`); the path with the
    highest score wins (a tie: the longer match). A length L is scored only where some match is
    exactly L long (a shorter L with the same matches copies less), and the search stops where
    no shorter match could score more (a path's score is at most its length).

    Further rows (``n_drafts`` > 1) are the winning matches' other distinct continuations, most
    probable first (:func:`_other_leaves`)."""
    found: list[tuple[NgramIndex, Match]] = []  # every match seen so far, longest first
    pending = []  # per index: [its levels, the n of its next level]
    for index in pool:
        levels = index.levels(tail, k, min_n)
        first = next(levels, None)
        if first is not None:
            found += [(index, m) for m in first[1]]
            pending.append([levels, first[0] - 1, index])
    found.sort(key=lambda im: im[1].length, reverse=True)  # stable: each level is most recent first
    conts: list[list[int]] = []  # each match's continuation (up to k), as needed
    best = Scored()
    upto = 0  # found[:upto]: the matches at least ``length`` long
    length = found[0][1].length if found else 0
    while length >= max(min_n, 1):
        cap = max(1, min(k, int(copy_factor * length + copy_offset + 1e-9)))
        if cap <= best.score:  # no shorter match can do better
            break
        exactly: list[tuple[NgramIndex, Match]] = []  # the hits exactly ``length`` long of the later levels
        for p in pending:
            if p[1] >= length:
                lv = next(p[0], None)
                exactly += [(p[2], m) for m in lv[1]] if lv else []
                p[1] -= 1
        found[upto:upto] = exactly  # after the longer ones, before the uncounted (no longer) ones
        exact = False
        while upto < len(found) and found[upto][1].length >= length:
            exact |= found[upto][1].length == length
            upto += 1
        if exact:
            conts += [index.copy(m, k) for index, m in found[len(conts) : upto]]
            group = list(range(upto))
            row, score, agree = _greedy_path(conts, group, cap, min_prob)
            if row and score > best.score:
                rows = [(found[agree[0]][0], row)]
                if n_drafts > 1:
                    cut = [c[:cap] for c in conts[:upto]]
                    rows += _other_leaves(found[:upto], cut, [1.0] * upto, row)[: n_drafts - 1]
                best = Scored(score, length, rows)
        length -= 1
    return best


def _other_leaves(
    pool: list[tuple[NgramIndex, Match]], conts: list[list[int]], weight: list[float], row0: list[int]
) -> list[tuple[NgramIndex, list[int]]]:
    """The distinct continuations no other extends and that do not extend ``row0``, most
    probable first (then best-ranked), each with its best-ranked match's index."""
    through: dict[tuple[int, ...], float] = {}  # prefix -> weight of the matches that continue with it
    onward: dict[tuple[int, ...], float] = {}  # prefix -> weight of those that continue beyond it
    for c, w in zip(conts, weight):
        for d in range(len(c) + 1):
            through[tuple(c[:d])] = through.get(tuple(c[:d]), 0.0) + w
            if d < len(c):
                onward[tuple(c[:d])] = onward.get(tuple(c[:d]), 0.0) + w
    leaves: dict[tuple[int, ...], int] = {}  # leaf -> its best-ranked match
    for i, c in enumerate(conts):
        key = tuple(c)
        if c and key not in onward and c[: len(row0)] != row0:
            leaves.setdefault(key, i)

    def probability(leaf: tuple[int, ...]) -> float:
        p = 1.0
        for d in range(len(leaf)):
            p *= through[leaf[: d + 1]] / onward[leaf[:d]]
        return p

    order = sorted(leaves, key=lambda leaf: (-probability(leaf), leaves[leaf]))
    return [(pool[leaves[leaf]][0], list(leaf)) for leaf in order]


def context_index(index: NgramIndex | None, token_ids: Sequence[int], max_n: int) -> NgramIndex:
    """The request's own context (prompt and output so far) as an n-gram index, grown by the
    tokens committed since ``index`` was last brought up to date (a new index where it is None:
    the first step, or after a rollback dropped it)."""
    if index is None:
        index = NgramIndex(max_n=max_n, max_positions=MAX_POSITIONS, max_tokens=1 << 30)
        index.extend(token_ids)
    elif len(index.tokens) < len(token_ids):
        index.extend(token_ids[len(index.tokens) :])
    return index


SOURCES = ("request", "retrieved", "sessions", "context")
"""Where a copy came from: the request's references (and earlier chat turns), the passages a
one-shot retrieval put before the prompt, the cluster's past sessions, or the request's own
context (prompt, passages of a retrieval loop, and output)."""


class ReferenceSet:
    """The indexes a request copies from, each labelled with its source: built once per
    reference set and shared read-only (a past-sessions index is shared by every request of
    its cluster)."""

    def __init__(self, indexes: Sequence[NgramIndex] = (), sources: Sequence[str] | None = None) -> None:
        sources = list(sources) if sources is not None else ["request"] * len(indexes)
        assert len(sources) == len(indexes) and set(sources) <= set(SOURCES), sources
        kept = [(i, s) for i, s in zip(indexes, sources) if len(i)]
        self.indexes = tuple(i for i, _ in kept)
        self.sources = tuple(s for _, s in kept)

    @classmethod
    def from_docs(
        cls,
        docs: Iterable[Sequence[int]],
        max_n: int = 4,
        max_positions: int = MAX_POSITIONS,
        source: str = "request",
    ) -> ReferenceSet:
        index = NgramIndex(max_n=max_n, max_positions=max_positions)
        for d in docs:
            if len(d):
                index.add(d)
        return cls([index], [source])

    def plus(self, other: ReferenceSet) -> ReferenceSet:
        return ReferenceSet(self.indexes + other.indexes, self.sources + other.sources)

    def __len__(self) -> int:
        return sum(len(i) for i in self.indexes)


class LLMAProposer(Proposer):
    """Copy drafting from references (LLMA), greedy and sampling."""

    name = "llma"

    def __init__(
        self,
        references: ReferenceSet | None = None,
        *,
        min_n: int = 1,
        max_n: int = 4,
        n_drafts: int = 1,
        use_context: bool = True,
        copy_factor: float | None = None,
        copy_offset: float = 0.0,
        min_agreement: float | None = None,
        min_path: float = 0.0,
        min_prob: float | None = None,
    ) -> None:
        """``min_prob`` set: SuffixDecoding's scored rule (:func:`scored_rows`, copy length
        ``copy_factor * match + copy_offset``); else ``min_agreement`` set: the frequency rule
        (:func:`frequency_rows`); else the paper's (:func:`best_rows`)."""
        if not (1 <= min_n <= max_n):
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if n_drafts < 1:
            raise ValueError(f"n_drafts must be >= 1, got {n_drafts}")
        self.references = references or ReferenceSet()
        self.min_n, self.max_n, self.n_drafts = min_n, max_n, n_drafts
        self.use_context = use_context
        self.copy_factor, self.copy_offset = copy_factor, copy_offset
        self.min_agreement, self.min_path = min_agreement, min_path
        self.min_prob = min_prob
        if min_prob is not None and (copy_factor is None or not 0.0 <= min_prob <= 1.0):
            raise ValueError(f"the scored rule needs copy_factor and 0 <= min_prob <= 1, got {copy_factor}, {min_prob}")
        self._context: NgramIndex | None = None
        self.num_steps = 0
        self.num_hits = 0
        """Steps that found a match (the request's hit rate is num_hits / num_steps)."""
        self.hits_by_source = dict.fromkeys(SOURCES, 0)
        """Steps whose best row came from each source."""
        self.last_match = 0
        """Length of the best match of the latest ``propose`` (0: none); ``auto`` keys on it."""
        self.last_source = ""
        """Where the latest ``propose``'s best row came from (one of :data:`SOURCES`); ``auto`` keys on it."""

    def start(self, state: DecodeState) -> None:
        self._context = None
        self.num_steps = self.num_hits = 0
        self.hits_by_source = dict.fromkeys(SOURCES, 0)

    def counters(self) -> dict[str, int]:
        return {
            "steps": self.num_steps,
            "hits": self.num_hits,
            **{f"hits_{s}": n for s, n in self.hits_by_source.items()},
            "reference_tokens": len(self.references),
        }

    def _context_index(self, state: DecodeState) -> NgramIndex:
        self._context = context_index(self._context, state.token_ids, self.max_n)
        return self._context

    def propose(self, state: DecodeState, k: int) -> Proposals:
        if k <= 0:
            return Proposals.empty()
        self.num_steps += 1
        tail = state.token_ids[-MAX_EXTEND:]
        if self.min_prob is not None:
            return self._propose_scored(state, tail, k)
        found: list[tuple[NgramIndex, Match]] = []
        source_of: dict[int, str] = {}
        for index, source in zip(self.references.indexes, self.references.sources):
            found += [(index, m) for m in index.matches(tail, k, self.min_n)]
            source_of[id(index)] = source
        if self.use_context:
            ctx = self._context_index(state)
            found += [(ctx, m) for m in ctx.matches(tail, k, self.min_n)]
            source_of[id(ctx)] = "context"
        self.last_match = best = max((m.length for _, m in found), default=0)
        if found and self.copy_factor is not None:  # the copy length grows with the match
            k = max(1, min(k, int(self.copy_factor * best + self.copy_offset)))
        if self.min_agreement is None:  # the paper's rule: the longest match, then recency
            rows = best_rows(found, k, self.n_drafts)
        else:
            rows = frequency_rows(found, k, self.n_drafts, self.min_agreement, self.min_path)
        if not rows:
            return Proposals.empty()
        self.num_hits += 1
        self.last_source = source_of[id(rows[0][0])]
        self.hits_by_source[self.last_source] += 1
        return Proposals.from_rows([r for _, r in rows])

    def _propose_scored(self, state: DecodeState, tail: Sequence[int], k: int) -> Proposals:
        """The references (request, retrieved, sessions) are one pool, SuffixDecoding's global
        tree of responses; the context is the other, its per-request tree. The higher score
        wins (a tie: the longer match, then the references)."""
        rule = dict(
            copy_factor=self.copy_factor, copy_offset=self.copy_offset, min_prob=self.min_prob, min_n=self.min_n
        )
        best = scored_rows(self.references.indexes, tail, k, self.n_drafts, **rule)
        if self.use_context:
            own = scored_rows([self._context_index(state)], tail, k, self.n_drafts, **rule)
            if (own.score, own.length) > (best.score, best.length):
                best = own
        self.last_match = best.length
        if not best.rows:
            return Proposals.empty()
        self.num_hits += 1
        where = best.rows[0][0]
        sources = dict(zip(map(id, self.references.indexes), self.references.sources))
        self.last_source = sources.get(id(where), "context")
        self.hits_by_source[self.last_source] += 1
        return Proposals.from_rows([r for _, r in best.rows])

    def rollback(self, state: DecodeState, position: int) -> None:
        # The context index cannot drop tokens; a withdrawn speculation (rare) rebuilds it.
        if self._context is not None and len(self._context.tokens) > position:
            self._context = None

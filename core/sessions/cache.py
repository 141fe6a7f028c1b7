"""What a cluster's past-sessions index keeps, and how it is built: one definition for serving's
live cache (``specops.serving.proposers.session_cache.SessionCache``) and the trainer's ``sessions-<cluster>``
artifact (``trainer/sessions.py``), so both bound and match past outputs the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from specops.core.sessions.ngram import NgramIndex


@dataclass(frozen=True)
class SessionCacheConfig:
    max_tokens: int = 65536
    """Tokens kept per cluster (n-gram entries are ``max_n`` per token)."""
    max_n: int = 8
    min_output_tokens: int = 8
    """Shorter outputs are not worth copying from."""
    max_clusters: int = 256
    """(Scope, cluster) indexes kept; the least recently used one goes first."""

    def __post_init__(self) -> None:
        if self.max_tokens < 2 or self.max_n < 1 or self.min_output_tokens < 1 or self.max_clusters < 1:
            raise ValueError("need max_tokens >= 2 and max_n, min_output_tokens, max_clusters >= 1")

    def hash(self) -> str:
        """What changes the set of outputs kept and how they are matched (stamped on registered versions)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def keepable(self, output: Sequence[int]) -> tuple[int, ...] | None:
        """The part of one output that is kept (its last ``max_tokens / 2`` tokens), or None
        when it is shorter than ``min_output_tokens``."""
        doc = tuple(int(t) for t in output[-(self.max_tokens // 2) :])
        return doc if len(doc) >= self.min_output_tokens else None


def newest_within(docs: Sequence[tuple[int, ...]], budget: int) -> list[tuple[int, ...]]:
    """The newest of ``docs`` (oldest first) whose tokens fit ``budget``, oldest first: the
    first one that does not fit, going back from the newest, ends the set."""
    keep, total = [], 0
    for d in reversed(docs):
        if total + len(d) > budget:
            break
        keep.append(d)
        total += len(d)
    return keep[::-1]


def index_of(docs: Iterable[Sequence[int]], cfg: SessionCacheConfig) -> NgramIndex:
    """A cluster's index over ``docs`` (which fit ``cfg.max_tokens``), as serving builds it."""
    index = NgramIndex(max_n=cfg.max_n, max_tokens=cfg.max_tokens)
    for d in docs:
        index.add(d)
    return index

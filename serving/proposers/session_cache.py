"""Past sessions as a copy source (LLMA's cache-assisted generation, fed by live traffic).

Each cluster keeps the outputs of its recent finished requests in one bounded
:class:`~serving.proposers.llma.NgramIndex`. Serving appends an output when its request
finishes; an LLMA request of the cluster copies from the index as it stands (one shared
object, read without a lock: the index only grows, and a position is published after the
tokens it points at). When an append would pass the token budget, the index is rebuilt
from the newest outputs that fill half of it and swapped in by one assignment, so memory
stays within ``max_tokens`` per cluster and a rebuild costs at most once per
``max_tokens / 2`` appended tokens.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from serving.proposers.llma import NgramIndex


@dataclass(frozen=True)
class SessionCacheConfig:
    max_tokens: int = 65536
    """Tokens kept per cluster (n-gram entries are ``max_n`` per token)."""
    max_n: int = 8
    min_output_tokens: int = 8
    """Shorter outputs are not worth copying from."""
    max_clusters: int = 256
    """Clusters kept; the least recently used one goes first."""


class SessionCache:
    """Per-cluster indexes of past outputs, bounded in tokens and clusters."""

    def __init__(self, cfg: SessionCacheConfig | None = None) -> None:
        self.cfg = cfg or SessionCacheConfig()
        self._lock = threading.Lock()
        self._index: dict[str, NgramIndex] = {}
        self._docs: dict[str, deque[tuple[int, ...]]] = {}
        self.num_rebuilds = 0

    def index(self, cluster: str) -> NgramIndex | None:
        """The cluster's index as it stands (None before its first output)."""
        return self._index.get(cluster)

    def add(self, cluster: str, output: Sequence[int]) -> bool:
        """Remember one finished request's output; False when it is too short to keep."""
        cfg = self.cfg
        doc = tuple(int(t) for t in output[-cfg.max_tokens // 2 :])
        if len(doc) < cfg.min_output_tokens:
            return False
        with self._lock:
            index, docs = self._index.get(cluster), self._docs.get(cluster)
            if index is None:
                if len(self._index) >= cfg.max_clusters:
                    oldest = next(iter(self._index))
                    del self._index[oldest], self._docs[oldest]
                index, docs = NgramIndex(max_n=cfg.max_n, max_tokens=cfg.max_tokens), deque()
                self._docs[cluster] = docs
            else:  # most recently used last
                del self._index[cluster]
            docs.append(doc)
            if index.room(len(doc)):
                index.add(doc)
            else:  # rebuild from the newest outputs that fill half the budget
                keep, total = [], 0
                for d in reversed(docs):
                    if total + len(d) > cfg.max_tokens // 2:
                        break
                    keep.append(d)
                    total += len(d)
                docs.clear()
                docs.extend(reversed(keep))
                index = NgramIndex(max_n=cfg.max_n, max_tokens=cfg.max_tokens)
                for d in docs:
                    index.add(d)
                self.num_rebuilds += 1
            self._index[cluster] = index
        return True

    def stats(self) -> dict[str, dict[str, int]]:
        """Per cluster: outputs and tokens held (for ``/metrics``)."""
        with self._lock:
            return {c: {"outputs": len(self._docs[c]), "tokens": len(i)} for c, i in self._index.items()}

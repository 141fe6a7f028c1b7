"""Past sessions as a copy source (LLMA's cache-assisted generation, fed by live traffic).

Each *scope* of a cluster keeps the outputs of its recent finished requests in one bounded
:class:`~specops.core.sessions.ngram.NgramIndex`. A scope is whose outputs they are: a tenant's id
(serving's default, ``session_sharing = "tenant"``: a request copies only from its own
tenant's past outputs, so a key cannot probe another key's text through LLMA's hit counts or
speed) or ``""``, the cluster's shared scope (``session_sharing = "shared"``, and what the
registry seeds). Serving appends an output when its request finishes; an LLMA request copies
from its scope's index as it stands (one shared object, read without a lock: the index only
grows, and a position is published after the tokens it points at). When an append would pass
the token budget, the index is rebuilt from the newest outputs that fill half of it and
swapped in by one assignment, so memory stays within ``max_tokens`` per (scope, cluster), at
most ``max_clusters`` of them, and a rebuild costs at most once per ``max_tokens / 2``
appended tokens.

The trainer rebuilds the same bounded set from ``spec.generations`` and versions it as
``sessions-<cluster>`` (``trainer/sessions.py``; it mixes tenants, so only a shared server
uses it); serving replaces a cluster's shared outputs with its champion's
(:meth:`SessionCache.seed`, ``serving/fleet/sessions.py``) and keeps adding its own finished
outputs after them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

from specops.core.sessions.cache import SessionCacheConfig, index_of, newest_within
from specops.core.sessions.ngram import NgramIndex

SHARED = ""
"""The scope every tenant of a cluster shares (``session_sharing = "shared"``; registry seeds)."""


class SessionCache:
    """Per-(scope, cluster) indexes of past outputs, bounded in tokens and entries."""

    def __init__(self, cfg: SessionCacheConfig | None = None) -> None:
        self.cfg = cfg or SessionCacheConfig()
        self._lock = threading.Lock()
        self._index: dict[tuple[str, str], NgramIndex] = {}
        self._docs: dict[tuple[str, str], deque[tuple[int, ...]]] = {}
        self.num_rebuilds = 0

    def index(self, cluster: str, scope: str = SHARED) -> NgramIndex | None:
        """The index of ``scope``'s outputs in the cluster as it stands (None before the first)."""
        return self._index.get((scope, cluster))

    def add(self, cluster: str, output: Sequence[int], scope: str = SHARED) -> bool:
        """Remember one finished request's output in ``scope``; False when it is too short to keep."""
        cfg = self.cfg
        doc = cfg.keepable(output)
        if doc is None:
            return False
        key = (scope, cluster)
        with self._lock:
            index, docs = self._index.get(key), self._docs.get(key)
            if index is None:
                self._make_room()
                index, docs = NgramIndex(max_n=cfg.max_n, max_tokens=cfg.max_tokens), deque()
                self._docs[key] = docs
            else:  # most recently used last
                del self._index[key]
            docs.append(doc)
            if index.room(len(doc)):
                index.add(doc)
            else:  # rebuild from the newest outputs that fill half the budget
                keep = newest_within(docs, cfg.max_tokens // 2)
                docs.clear()
                docs.extend(keep)
                index = index_of(docs, cfg)
                self.num_rebuilds += 1
            self._index[key] = index
        return True

    def seed(self, cluster: str, outputs: Iterable[Sequence[int]]) -> int:
        """Replace the cluster's shared outputs with ``outputs`` (oldest first; a registered
        ``sessions-<cluster>`` version): the newest that fit ``max_tokens``, each cut and
        filtered as :meth:`add` does. The new index is built outside the lock and swapped in
        by one assignment. Returns the outputs kept."""
        cfg = self.cfg
        docs = deque(newest_within([d for o in outputs if (d := cfg.keepable(o)) is not None], cfg.max_tokens))
        index = index_of(docs, cfg)
        key = (SHARED, cluster)
        with self._lock:
            if key in self._index:
                del self._index[key]
            else:
                self._make_room()
            self._docs[key] = docs
            self._index[key] = index
        return len(docs)

    def export(self, cluster: str, scope: str = SHARED) -> list[tuple[int, ...]]:
        """``scope``'s outputs in the cluster, oldest first ([] when it has none)."""
        with self._lock:
            return list(self._docs.get((scope, cluster), ()))

    def _make_room(self) -> None:
        """Drop the least recently used entry when a new one would pass ``max_clusters`` (under the lock)."""
        if len(self._index) >= self.cfg.max_clusters:
            oldest = next(iter(self._index))
            del self._index[oldest], self._docs[oldest]

    def stats(self) -> dict[str, dict[str, int]]:
        """Per cluster, every scope together: outputs and tokens held (for ``/metrics``: no
        tenant's own count is shown, and the labels stay per cluster)."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for key, index in self._index.items():
                held = out.setdefault(key[1], {"outputs": 0, "tokens": 0})
                held["outputs"] += len(self._docs[key])
                held["tokens"] += len(index)
        return out

"""The retriever interface shared by knowledge-base search, RaLMSpec's local cache and kNN-LM.

A retriever searches one knowledge base (``specops.serving.retrieval.kb``). It works in two stages
so a loop can encode a query once and use it twice (speculatively against a local cache,
then in a batched verification against the whole KB):

- ``encode(texts) -> list[Query]``: one query object per text, each computed **on its
  own** (never padded with other texts), so a query's encoding is the same whatever batch
  or order it arrives in;
- ``search(queries, k) -> (ids [n, k] int64, scores [n, k] float32)``: best first, ties
  broken by the lower passage id, -1 / -inf where fewer than k passages exist. A query's
  row is **bit-identical** whether it is searched alone or in a batch of any size (an
  exact search computes scores in fixed-size query blocks for this): RaLMSpec's batched
  verification must see what RaLMSeq's one-at-a-time retrieval sees;
- ``score(queries, ids) -> [n, len(ids)] float32``: the score the KB search gives each of
  ``ids`` (the local cache ranks with it: cache scores equal KB scores).

Kinds: ``exact`` (dense, exact inner product), ``hnsw`` and ``scann`` (dense,
approximate), ``bm25`` (sparse, global corpus statistics).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

RETRIEVER_KINDS = ("exact", "hnsw", "scann", "bm25")


Query = np.ndarray
"""An encoded query: a float32 vector (dense) or token ids (sparse). Opaque to callers."""


@runtime_checkable
class Retriever(Protocol):
    kind: str
    """One of :data:`RETRIEVER_KINDS`."""

    def encode(self, texts: list[str]) -> list[Query]: ...

    def search(self, queries: list[Query], k: int) -> tuple[np.ndarray, np.ndarray]: ...

    def score(self, queries: list[Query], ids: np.ndarray) -> np.ndarray: ...

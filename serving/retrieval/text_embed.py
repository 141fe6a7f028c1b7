"""Text embedders for knowledge-base passages and queries: ``minilm`` and ``hash``.

Both map a text to a unit vector of 384 dimensions and name themselves by ``kind`` and
``config_sha256`` (a KB records both and refuses an embedder that differs: its stored
vectors only mean something in the space they were made in).

- ``minilm``: :class:`specops.core.embed.MiniLMEmbedder` (all-MiniLM-L6-v2, shipped as a
  wheel, no hub download). Its ``embed`` pads a batch to its longest text, and padding
  changes the floats a little, so a *query* is always embedded on its own
  (:func:`embed_each`); passages are embedded in length-sorted batches (:func:`embed_passages`),
  which is several times faster and changes nothing a search can see.
- ``hash`` (:class:`HashEmbedder`): a cheap but real embedder for the 10^6-passage scale
  setting. Words (lower case, ``\\w\\w+``, as BM25 splits them) are hashed into 2^20
  buckets (CRC-32); a text's vector is the tf-idf of its buckets (``1 + log tf`` times the
  smoothed idf ``log((1 + N) / (1 + df)) + 1`` fitted on the KB's passages and stored in
  the KB), feature-hashed with a sign into 384 dimensions (each bucket has a fixed
  dimension and sign), L2-normalised. It embeds each text on its own even in a batch, so a
  text's vector never depends on its neighbours.

An empty text (or one with no word) embeds as the zero vector.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Callable

import numpy as np

from specops.core.errors import KBError

MINILM, HASH = "minilm", "hash"
TEXT_EMBEDDER_KINDS = (MINILM, HASH)
WORD_RE = re.compile(r"(?u)\b\w\w+\b")
"""Word tokens: two or more word characters (scikit-learn's and bm25s's pattern)."""
HASH_BUCKETS = 1 << 20
HASH_DIM = 384
HASH_SCHEME = "crc32-splitmix64/1"
"""Names the bucket, dimension and sign functions; a change must change it (and the hash)."""


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 ``x``: a fixed, well-mixed function of the bucket id."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def word_buckets(text: str, buckets: int = HASH_BUCKETS) -> np.ndarray:
    """Bucket ids [words] int64 of ``text``'s words (lower case), in order."""
    words = WORD_RE.findall(text.lower())
    return np.fromiter((zlib.crc32(w.encode("utf-8")) for w in words), dtype=np.int64, count=len(words)) % buckets


class HashEmbedder:
    """tf-idf over hashed words, feature-hashed into ``dim`` signed dimensions, L2-normalised."""

    kind = HASH

    def __init__(self, idf: np.ndarray, *, dim: int = HASH_DIM) -> None:
        assert idf.ndim == 1 and idf.dtype == np.float32, (idf.shape, idf.dtype)
        self.idf, self.dim, self.buckets = idf, dim, int(idf.shape[0])
        mixed = _splitmix64(np.arange(self.buckets, dtype=np.uint64))
        self._dim_of = (mixed % np.uint64(dim)).astype(np.int64)  # [buckets]
        self._sign_of = np.where((mixed >> np.uint64(63)) == 1, -1.0, 1.0)  # [buckets] float64
        self._sha: str | None = None

    @classmethod
    def fit(
        cls,
        texts: list[str],
        *,
        buckets: int = HASH_BUCKETS,
        dim: int = HASH_DIM,
        progress: Callable[[int], None] | None = None,
    ) -> HashEmbedder:
        """Fit the idf on ``texts`` (the KB's passages); ``progress(n)`` after each 1,000 texts."""
        df = np.zeros(buckets, dtype=np.int64)
        for i, text in enumerate(texts):
            df[np.unique(word_buckets(text, buckets))] += 1
            if progress is not None and (i + 1) % 1000 == 0:
                progress(1000)
        if progress is not None:
            progress(len(texts) % 1000)
        idf = (np.log((1.0 + len(texts)) / (1.0 + df)) + 1.0).astype(np.float32)
        return cls(idf, dim=dim)

    @property
    def config_sha256(self) -> str:
        if self._sha is None:
            h = hashlib.sha256(
                json.dumps(
                    {"kind": self.kind, "scheme": HASH_SCHEME, "dim": self.dim, "buckets": self.buckets}, sort_keys=True
                ).encode()
            )
            h.update(self.idf.tobytes())
            self._sha = h.hexdigest()
        return self._sha

    def embed_one(self, text: str) -> np.ndarray:
        """[dim] float32 unit vector (zero for a text with no word)."""
        ids, counts = np.unique(word_buckets(text, self.buckets), return_counts=True)
        out = np.zeros(self.dim, dtype=np.float64)
        if len(ids):
            weights = (1.0 + np.log(counts)) * self.idf[ids].astype(np.float64) * self._sign_of[ids]
            np.add.at(out, self._dim_of[ids], weights)
            norm = np.linalg.norm(out)
            if norm > 0:
                out /= norm
        return out.astype(np.float32)

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32; every text on its own (a batch changes nothing)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            out[i] = self.embed_one(text)
        return out

    def tensors(self) -> dict[str, np.ndarray]:
        return {"idf": self.idf}

    @classmethod
    def from_tensors(cls, tensors: dict[str, np.ndarray], dim: int) -> HashEmbedder:
        idf = tensors.get("idf")
        if idf is None or idf.ndim != 1 or idf.dtype != np.float32 or not np.isfinite(idf).all():
            raise KBError("the hash embedder's idf must be a finite float32 vector")
        return cls(idf, dim=dim)


def make_text_embedder(kind: str, *, fit_texts: list[str] | None = None, progress: Callable[[int], None] | None = None):
    """The embedder named ``kind``: ``minilm``, or ``hash`` fitted on ``fit_texts``."""
    if kind == MINILM:
        from specops.core.embed import MiniLMEmbedder

        return MiniLMEmbedder()
    if kind == HASH:
        if fit_texts is None:
            raise KBError("the hash embedder is fitted on the KB's passages: give fit_texts")
        return HashEmbedder.fit(fit_texts, progress=progress)
    raise KBError(f"unknown text embedder {kind!r}; use one of {', '.join(TEXT_EMBEDDER_KINDS)}")


def embed_each(embedder, texts: list[str]) -> np.ndarray:
    """[len(texts), dim] float32, one ``embed`` call per text: a query's vector is the same
    whatever batch it arrives in (no padding against other texts)."""
    out = np.zeros((len(texts), embedder.dim), dtype=np.float32)
    for i, text in enumerate(texts):
        out[i] = embedder.embed([text])[0]
    return out


def embed_passages(
    embedder, texts: list[str], *, batch_size: int = 64, progress: Callable[[int], None] | None = None
) -> np.ndarray:
    """[len(texts), dim] float32 passage vectors, in length-sorted batches (little padding);
    ``progress(n)`` after each batch."""
    out = np.zeros((len(texts), embedder.dim), dtype=np.float32)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        out[rows] = embedder.embed([texts[i] for i in rows])
        if progress is not None:
            progress(len(rows))
    return out

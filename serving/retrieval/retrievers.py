"""The four retrievers of a knowledge base (``specops.serving.retrieval.retriever.Retriever``):
``exact`` (EDR), ``hnsw`` and ``scann`` (ADR), ``bm25`` (SR).

**Dense scores are exact, so they cannot depend on the batch.** A passage vector is stored
in float16 and a query is rounded to float16 when it is encoded. The product of two
float16 numbers is a multiple of 2^-48 of at most 22 significant bits, and every partial
sum of a 384-term dot product of (near) unit vectors stays below 2, so float64 adds them
with no rounding at all, in any order: the score (rounded once to float32) is the same
bits whatever the batch, block, row position, thread count or BLAS kernel. Search does
the heavy pass in float32 (one matrix product per block of up to :data:`QUERY_BLOCK`
queries: memory-bound, so 4 queries cost about what 1 does) and then rescores exactly
every passage within :func:`fp32_margin` of the k-th float32 score, a rigorous bound on a
float32 dot product's error (Higham's ``γ_n Σ|a_i b_i|``), so the exact top k is always
among them. :meth:`DenseRetriever.score` (the local cache's scorer) computes the same
exact scores, so cache scores equal KB scores bit for bit. HNSW and ScaNN propose
``k + ANN_OVERFETCH`` candidates per query (each query searched on its own: FAISS's HNSW
per query, ScaNN's ``search_batched``) that are rescored the same way.

**BM25** (bm25s, Lucene's variant, ``k1 = 1.5``, ``b = 0.75``; lower case, English stop
words, no stemmer) precomputes every (passage, word) score over the whole KB into a CSC
matrix (a column per word, its passages sorted). A query's score for a passage is the sum,
over the query's words in order, of that column's entry, accumulated in float32; search and
:meth:`BM25Retriever.score` add the same numbers in the same order, so the cache scores
with the global corpus statistics and equals the KB bit for bit. A passage sharing no word
with the query is not a result (search returns -1 / -inf there); its ``score`` is 0.

Ranks: score descending, ties to the lower passage id.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

import numpy as np
import torch

from specops.core.errors import KBError
from specops.core.index import KeyIndex
from specops.serving.retrieval.retriever import Query

QUERY_BLOCK = 8
"""Queries per float32 matrix product in an exact search."""
ANN_OVERFETCH = 8
"""Extra candidates an approximate index proposes per query before exact rescoring."""
RESCORE_CHUNK = 65536
"""Passages rescored in float64 at once (bounds memory when many passages tie)."""
BM25_TOKEN_PATTERN = r"(?u)\b\w\w+\b"


def fp32_margin(dims: int, norm_product: float) -> float:
    """Twice the worst-case error of a float32 dot product of ``dims`` terms whose absolute
    products sum to at most ``norm_product`` (γ_n = n·u / (1 - n·u), u = 2^-24), plus slack
    for the final float32 rounding: every passage the exact top k can hold lies within this
    of the k-th float32 score."""
    u = 2.0**-24
    gamma = dims * u / (1 - dims * u)
    return 2.0 * gamma * max(1.0, norm_product) + 1e-6


def to_query(vector: np.ndarray) -> np.ndarray:
    """A dense query: the vector rounded to float16 values, held as float32 [dims]."""
    return np.asarray(vector, dtype=np.float32).astype(np.float16).astype(np.float32)


def exact_scores(query: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Exact scores [len(rows)] float32 of ``query`` [dims] (float16 values) against passage
    vectors ``rows`` [c, dims] (float16): products and sums in float64, which hold them with no
    rounding (module docstring), rounded once to float32. Every dense backend scores with this,
    so a score is the same bits wherever the vectors live (memory, Milvus, a request's cache)."""
    return (rows.astype(np.float64) @ np.asarray(query, dtype=np.float64)).astype(np.float32)


def dense_queries(queries: list[Query], dims: int) -> np.ndarray:
    """Dense queries stacked as [n, dims] float32 holding float16 values; a wrong shape is a KBError."""
    q = np.stack([to_query(x) for x in queries]) if queries else np.zeros((0, dims), np.float32)
    if q.ndim != 2 or q.shape[1] != dims:
        raise KBError(f"dense queries must be vectors of {dims} dims; got shape {q.shape}")
    return q


def _rank(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of (ids, scores): score descending, ties to the lower id; padded with -1 / -inf."""
    order = np.lexsort((ids, -scores))[:k]
    out_ids = np.full(k, -1, dtype=np.int64)
    out_scores = np.full(k, -np.inf, dtype=np.float32)
    out_ids[: len(order)], out_scores[: len(order)] = ids[order], scores[order]
    return out_ids, out_scores


class ExactScorer:
    """Exact scores against the KB's float16 passage vectors, and the float32 copy of them the
    exact retriever's first pass multiplies (made on first use: HNSW and ScaNN never need it)."""

    def __init__(self, embeddings: np.ndarray) -> None:
        assert embeddings.ndim == 2 and embeddings.dtype == np.float16, (embeddings.shape, embeddings.dtype)
        self.embeddings = embeddings  # [N, dims] float16
        self.num_passages, self.dims = embeddings.shape
        self.max_norm = 0.0
        for s in range(0, self.num_passages, RESCORE_CHUNK):
            chunk = embeddings[s : s + RESCORE_CHUNK].astype(np.float32)
            self.max_norm = max(self.max_norm, 1.001 * float(np.sqrt((chunk * chunk).sum(axis=1)).max()))
        self._matrix: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def matrix(self) -> torch.Tensor:
        """[N, dims] float32 (exactly the float16 values), resident once made."""
        with self._lock:
            if self._matrix is None:
                self._matrix = torch.from_numpy(self.embeddings.astype(np.float32))
            return self._matrix

    def exact(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Exact scores [len(ids)] float32 of ``query`` [dims] (float16 values) against passages ``ids``."""
        out = np.empty(len(ids), dtype=np.float32)
        for s in range(0, len(ids), RESCORE_CHUNK):
            out[s : s + RESCORE_CHUNK] = exact_scores(query, self.embeddings[ids[s : s + RESCORE_CHUNK]])
        return out

    def check_ids(self, ids: np.ndarray) -> None:
        if len(ids) and (ids.max() >= self.num_passages or ids.min() < -1):
            raise KBError(f"passage ids must be in [0, {self.num_passages}) (or -1 for none)")


class DenseRetriever:
    """``exact`` (no index: the float32 pass plus exact rescoring) or ``hnsw`` / ``scann``
    (the index proposes, exact scores rank)."""

    def __init__(self, kind: str, scorer: ExactScorer, embedder, index: KeyIndex | None = None) -> None:
        assert (kind == "exact") == (index is None), kind
        self.kind, self.scorer, self.embedder, self.index = kind, scorer, embedder, index

    def encode(self, texts: list[str]) -> list[Query]:
        from specops.serving.retrieval.text_embed import embed_each

        return [to_query(v) for v in embed_each(self.embedder, texts)]

    def _matrix(self, queries: list[Query]) -> np.ndarray:
        return dense_queries(queries, self.scorer.dims)  # [n, dims] float32 holding float16 values

    def search(self, queries: list[Query], k: int) -> tuple[np.ndarray, np.ndarray]:
        if k < 1:
            raise KBError(f"k must be >= 1, got {k}")
        q = self._matrix(queries)
        ids = np.full((len(q), k), -1, dtype=np.int64)
        scores = np.full((len(q), k), -np.inf, dtype=np.float32)
        if self.scorer.num_passages == 0:
            return ids, scores
        candidates = self._exact_candidates(q, k) if self.index is None else self._ann_candidates(q, k)
        for row, cand in enumerate(candidates):
            ids[row], scores[row] = _rank(cand, self.scorer.exact(q[row], cand), k)
        return ids, scores

    def _exact_candidates(self, q: np.ndarray, k: int) -> list[np.ndarray]:
        """Per query, every passage whose float32 score is within the error margin of the k-th."""
        kk = min(k, self.scorer.num_passages)
        out = []
        matrix = self.scorer.matrix
        with torch.inference_mode():
            for s in range(0, len(q), QUERY_BLOCK):
                block = torch.from_numpy(q[s : s + QUERY_BLOCK])  # [b, dims]
                # E @ Q^T with at least two query columns: MKL's one-column (matrix-vector) path
                # is 2.5x slower on 1M passages than a product with 2 to 5 columns.
                padded = torch.cat([block, torch.zeros_like(block)]) if len(block) == 1 else block
                approx = (matrix @ padded.T).T[: len(block)]  # [b, N] float32
                kth = torch.topk(approx, kk, dim=1).values[:, -1]  # [b]
                for r in range(len(block)):
                    norm = float(block[r].double().norm())
                    if norm == 0.0:  # an empty text: every score is exactly 0, so the lowest ids win
                        out.append(np.arange(kk, dtype=np.int64))
                        continue
                    margin = fp32_margin(self.scorer.dims, norm * self.scorer.max_norm)
                    out.append(torch.nonzero(approx[r] >= kth[r] - margin).squeeze(1).numpy().astype(np.int64))
        return out

    def _ann_candidates(self, q: np.ndarray, k: int) -> list[np.ndarray]:
        kk = min(k + ANN_OVERFETCH, self.scorer.num_passages)
        found, _ = self.index.search(q, kk)  # [n, kk]; HNSW's breadth is a function of kk alone (index.py)
        return [np.unique(row[row >= 0]) for row in found]

    def score(self, queries: list[Query], ids: np.ndarray) -> np.ndarray:
        """[n, len(ids)] float32 exact scores (-inf for id -1), the numbers search ranks by."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.scorer.check_ids(ids)
        q = self._matrix(queries)
        out = np.full((len(q), len(ids)), -np.inf, dtype=np.float32)
        valid = ids >= 0
        for row in range(len(q)):
            out[row, valid] = self.scorer.exact(q[row], ids[valid])
        return out


# ---------------------------------------------------------------- BM25
class BM25Index:
    """BM25 scores of every (passage, word) over the KB, as a CSC matrix (a column per word)."""

    def __init__(
        self,
        data: np.ndarray,
        indices: np.ndarray,
        indptr: np.ndarray,
        vocab: list[str],
        num_passages: int,
        params: dict,
    ) -> None:
        self.data, self.indices, self.indptr = data, indices, indptr
        self.vocab, self.num_passages, self.params = vocab, num_passages, dict(params)
        self.column = {word: i for i, word in enumerate(vocab)}
        self.validate()

    def validate(self) -> None:
        d, ix, p = self.data, self.indices, self.indptr
        if d.dtype != np.float32 or ix.dtype != np.int32 or p.dtype != np.int64 or d.ndim != 1 or ix.shape != d.shape:
            raise KBError("BM25 arrays must be data float32, indices int32 (same length), indptr int64")
        if len(p) != len(self.vocab) + 1 or p[0] != 0 or p[-1] != len(d) or (np.diff(p) < 0).any():
            raise KBError(f"BM25 indptr does not partition {len(d)} entries into {len(self.vocab)} words")
        if len(ix) and (ix.min() < 0 or ix.max() >= self.num_passages):
            raise KBError("a BM25 entry points outside the passages")
        if not np.isfinite(d).all() or (d <= 0).any():
            raise KBError("BM25 scores must be finite and positive")
        if len(self.column) != len(self.vocab):
            raise KBError("the BM25 vocabulary repeats a word")
        # Passages ascend within each column (score() looks them up by binary search).
        rising = np.diff(ix.astype(np.int64)) > 0
        starts = np.zeros(len(ix), dtype=bool)
        starts[p[:-1][np.diff(p) > 0]] = True
        if len(ix) > 1 and not (rising | starts[1:]).all():
            raise KBError("BM25 passages are not sorted within each word's column")

    @property
    def num_bytes(self) -> int:
        return int(
            self.data.nbytes + self.indices.nbytes + self.indptr.nbytes + sum(len(w.encode()) + 1 for w in self.vocab)
        )

    def tensors(self) -> dict[str, np.ndarray]:
        return {"data": self.data, "indices": self.indices, "indptr": self.indptr}


def _bm25s():
    """bm25s, imported where used (serving without BM25 stays light). Its import sets its
    logger to DEBUG; that is undone so the application's logging level applies."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.NOTSET)
    return bm25s


@functools.lru_cache(maxsize=1)
def _bm25_rules() -> tuple[re.Pattern, frozenset[str]]:
    return re.compile(BM25_TOKEN_PATTERN), frozenset(_bm25s().stopwords.STOPWORDS_EN)


def bm25_tokens(text: str) -> list[str]:
    """bm25s's tokenizer: lower case, ``\\w\\w+`` words, English stop words dropped, no stemmer."""
    pattern, stop = _bm25_rules()
    return [w for w in pattern.findall(text.lower()) if w not in stop]


def build_bm25(
    texts: list[str], *, k1: float = 1.5, b: float = 0.75, method: str = "lucene", progress: bool = False
) -> BM25Index:
    """Index ``texts`` (the KB's passages) with bm25s; its arrays are copied out (its own
    save/load is not used: the KB stores them in safetensors)."""
    bm25s = _bm25s()
    vocab: dict[str, int] = {}
    corpus_ids = [[vocab.setdefault(w, len(vocab)) for w in bm25_tokens(t)] for t in texts]
    if not vocab:
        raise KBError("no passage has a word BM25 can index")
    model = bm25s.BM25(k1=k1, b=b, method=method, backend="numpy", csc_backend="numpy")
    model.index((corpus_ids, vocab), create_empty_token=False, show_progress=progress)
    s = model.scores
    data = np.asarray(s["data"], dtype=np.float32)
    indices = np.asarray(s["indices"], dtype=np.int32)
    indptr = np.asarray(s["indptr"], dtype=np.int64)
    cols = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    order = np.lexsort((indices, cols))  # passages ascending within each column
    words = [""] * len(vocab)
    for w, i in vocab.items():
        words[i] = w
    params = {
        "k1": k1,
        "b": b,
        "method": method,
        "token_pattern": BM25_TOKEN_PATTERN,
        "stopwords": "en",
        "stemmer": None,
        "library": f"bm25s=={bm25s.__version__}",
    }
    return BM25Index(data[order], indices[order], indptr, words, len(texts), params)


class BM25Retriever:
    """Sparse retrieval over a :class:`BM25Index`; a query is its words' column ids (int64, in order)."""

    kind = "bm25"

    def __init__(self, index: BM25Index) -> None:
        self.index = index

    def encode(self, texts: list[str]) -> list[Query]:
        col = self.index.column
        return [np.array([col[w] for w in bm25_tokens(t) if w in col], dtype=np.int64) for t in texts]

    def _columns(self, q: Query) -> np.ndarray:
        q = np.asarray(q)
        if q.ndim != 1 or (len(q) and (q.dtype.kind not in "iu" or q.min() < 0 or q.max() >= len(self.index.vocab))):
            raise KBError(f"a BM25 query is a vector of word ids in [0, {len(self.index.vocab)})")
        return q.astype(np.int64)

    def search(self, queries: list[Query], k: int) -> tuple[np.ndarray, np.ndarray]:
        if k < 1:
            raise KBError(f"k must be >= 1, got {k}")
        ix, ptr, data = self.index.indices, self.index.indptr, self.index.data
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        for row, q in enumerate(queries):
            total = np.zeros(self.index.num_passages, dtype=np.float32)
            for t in self._columns(q):
                a, b = ptr[t], ptr[t + 1]
                total[ix[a:b]] += data[a:b]  # passages are distinct within a column
            hit = np.nonzero(total > 0)[0]
            if len(hit) > k:
                hit = hit[total[hit] >= np.partition(total[hit], len(hit) - k)[len(hit) - k]]
            ids[row], scores[row] = _rank(hit.astype(np.int64), total[hit], k)
        return ids, scores

    def score(self, queries: list[Query], ids: np.ndarray) -> np.ndarray:
        """[n, len(ids)] float32: the KB's BM25 score of each passage (-inf for id -1)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.max() >= self.index.num_passages or ids.min() < -1):
            raise KBError(f"passage ids must be in [0, {self.index.num_passages}) (or -1 for none)")
        ix, ptr, data = self.index.indices, self.index.indptr, self.index.data
        out = np.zeros((len(queries), len(ids)), dtype=np.float32)
        for row, q in enumerate(queries):
            acc = out[row]
            for t in self._columns(q):
                a, b = ptr[t], ptr[t + 1]
                col = ix[a:b]
                pos = np.minimum(np.searchsorted(col, ids), max(len(col) - 1, 0))
                hit = (col[pos] == ids) if len(col) else np.zeros(len(ids), dtype=bool)
                acc[hit] += data[a + pos[hit]]  # the same float32 adds, in the same order, as search
        out[:, ids < 0] = -np.inf
        return out

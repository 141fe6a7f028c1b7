"""Knowledge bases served by Milvus: one collection shared by every replica, in place of a copy
of the passages and vectors in each replica's memory (``specops.serving.retrieval.kb``).

**What lives where.** The Milvus collection (``kb_<name>_<first 12 hex of its content
sha256>``, so a rebuild never touches the collection a champion serves) holds every passage:
``id`` INT64 (primary, 0..N-1), ``vector`` FLOAT_VECTOR holding exactly the float16 values of
the in-memory KB's vectors, ``text``, ``title`` and ``source`` VARCHAR, and one dense index:
``FLAT`` (retriever ``exact``) or ``HNSW`` (``hnsw``), metric ``IP``. The registry artifact
``kb-<name>`` is then a *manifest*: ``kb.json`` (``"backend": "milvus"`` and a ``milvus`` block
naming the URI, collection, index and content sha256) and, for the hash embedder, its idf:
queries are embedded locally, as for an in-memory KB. Builds: ``specops.serving.retrieval.milvus.build``;
the connection: ``specops.serving.retrieval.milvus.service``.

**Connection.** The URI recorded at build is a Milvus Lite path (``/path/kb.db``: embedded, one
process at a time) or a server (``http://host:19530``, or ``milvus-lite server``). A deployment
reaches its service at its own address, so ``SPECOPS_MILVUS_URI`` (and ``SPECOPS_MILVUS_TOKEN``)
override it when a KB is loaded; a token is never recorded. One client per (URI, token) per
process, shared by threads (gRPC channels are thread-safe).

**Scores.** ``search`` makes one Milvus call for a batch of queries (RaLMSpec's batched
verification), asking for ``k + ANN_OVERFETCH`` candidates with their vectors, then rescores
them exactly (``retrievers.exact_scores``: float64, the same bits as the in-memory KB) and ranks
them (score descending, ties to the lower id). For ``exact`` the float32 distances Milvus ranked
by are checked against :func:`~specops.serving.retrieval.retrievers.fp32_margin`: when a passage outside
the candidates could still reach the k-th exact score, that query is searched again with a wider
limit, so ``exact`` is the true top k, the in-memory exact retriever's, and a query's row depends
on nothing but the query (never on its batch).

**The local cache, per request.** RaLMSpec's cache scores cached passages at every speculation
step, which must be local, cheap and equal to the KB's scores. :meth:`MilvusRetriever.for_request`
gives a view that remembers the vectors its own searches returned (at most ``VIEW_CAPACITY``)
and fetches any other id's vector in one ``get``. Nothing is shared between requests: a shared
cache would let one API key time which passages another retrieved.

**No BM25.** Milvus has a BM25 function, but its scores use corpus statistics held by the
server, which a request's local cache cannot reproduce bit for bit; a request for ``bm25`` (or
``scann``) is a KBError naming what was built: build an in-memory KB for those.

**Validation on load** (:meth:`MilvusKB.from_manifest`, each a KBError): the service
unreachable (naming the URI and ``SPECOPS_MILVUS_URI``), the collection missing (with the
rebuild command), its ``specops.content_sha256`` property not the manifest's (another or an
unfinished build), its vector dims, row count or index not the manifest's. Non-finite vectors are
refused at build. A Milvus failure while serving is an UnavailableError (503, retry).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from specops.core.errors import KBError
from specops.core.passage import Passage
from specops.registry.artifacts import KB_FORMAT, sha256_file
from specops.serving.retrieval.kb_files import (
    BACKEND_MILVUS,
    HASH_FILE,
    META_FILE,
    canonical_sha,
    embedder_for,
    read_meta,
    save_tensors,
)
from specops.serving.retrieval.milvus.service import TOKEN_ENV, URI_ENV, Service, as_f16, is_lite
from specops.serving.retrieval.retriever import Query
from specops.serving.retrieval.retrievers import ANN_OVERFETCH, dense_queries, exact_scores, fp32_margin, to_query
from specops.serving.retrieval.text_embed import HashEmbedder

log = logging.getLogger(__name__)

CONTENT_PROPERTY = "specops.content_sha256"
"""Collection property: set last at build, so a collection without it is an unfinished build."""
INDEXES = {"exact": "FLAT", "hnsw": "HNSW"}
"""Retriever kind -> the Milvus index of the collection's one dense field."""
METRIC = "IP"
HNSW_BUILD = {"M": 16, "efConstruction": 200}
HNSW_EF_MIN = 64
"""HNSW search breadth: max(this, limit), a function of the limit alone (batch-independent)."""
FIELDS = ("text", "title", "source")
VIEW_CAPACITY = 4096
"""Passage vectors a request's view remembers (RaLM's local cache holds 4096 by default)."""
MAX_LIMIT = 16384
"""Milvus's largest ``limit`` (topk): the widest an exact search is ever widened to."""


# ---------------------------------------------------------------- retrievers
class MilvusRetriever:
    """``exact`` or ``hnsw`` over the collection (``specops.serving.retrieval.retriever.Retriever``)."""

    def __init__(self, kb: MilvusKB) -> None:
        self.kind, self.service, self.embedder = kb.kind, kb.service, kb.embedder
        self.num_passages, self.dims = kb.num_passages, kb.dims
        self.max_norm = float(kb.meta["milvus"]["max_norm"])
        self.search_holds_gil = is_lite(self.service.uri)
        """Embedded Milvus Lite serves its searches from pure-Python threads in this process
        (``milvus_lite.server_manager``), so RaLMSpec's default verifies synchronously over it
        (``specops.serving.ralm.loop.RalmGenerator._asynchronous``); a server's searches do not."""

    def encode(self, texts: list[str]) -> list[Query]:
        from specops.serving.retrieval.text_embed import embed_each

        return [to_query(v) for v in embed_each(self.embedder, texts)]

    def for_request(self) -> RequestView:
        """A view for one request: its own memory of passage vectors, shared with no one."""
        return RequestView(self)

    def search(self, queries: list[Query], k: int) -> tuple[np.ndarray, np.ndarray]:
        ids, scores, _ = self.search_with_vectors(queries, k)
        return ids, scores

    def search_with_vectors(self, queries: list[Query], k: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """(ids [n, k], scores [n, k], per row the float16 vectors of its ids that are not -1)."""
        if k < 1:
            raise KBError(f"k must be >= 1, got {k}")
        q = dense_queries(queries, self.dims)
        n, kk = len(q), min(k, self.num_passages)
        ids = np.full((n, k), -1, dtype=np.int64)
        scores = np.full((n, k), -np.inf, dtype=np.float32)
        vectors = [np.zeros((0, self.dims), np.float16)] * n
        norms = np.sqrt((q.astype(np.float64) ** 2).sum(axis=1))

        def keep(row: int, cand: np.ndarray, rows: np.ndarray, exact: np.ndarray) -> None:
            order = np.lexsort((cand, -exact))[:k]  # as retrievers._rank: score descending, ties to the lower id
            ids[row, : len(order)], scores[row, : len(order)] = cand[order], exact[order]
            vectors[row] = rows[order]

        zero = [r for r in range(n) if norms[r] == 0.0]
        if zero:  # an empty text: every score is exactly 0, so the lowest ids win
            cand = np.arange(kk, dtype=np.int64)
            got = self.service.vectors(cand.tolist(), self.dims)
            rows = np.stack([got[i] for i in cand.tolist()])
            for r in zero:
                keep(r, cand, rows, exact_scores(q[r], rows))
        pending = [r for r in range(n) if norms[r] > 0.0]
        limit = min(k + ANN_OVERFETCH, self.num_passages)
        while pending:
            widen = []
            for r, hits in zip(pending, self._milvus_search(q[pending], limit)):
                cand, dist, rows = self._parse(hits)
                exact = exact_scores(q[r], rows)
                if self.kind == "exact" and not self._proven(cand, dist, exact, kk, limit, norms[r]):
                    if limit < min(self.num_passages, MAX_LIMIT):
                        widen.append(r)
                        continue
                    log.warning(
                        "exact search of %s: near-ties past %d candidates; ranked those", self.service.collection, limit
                    )
                keep(r, cand, rows, exact)
            pending, limit = widen, min(limit * 4, self.num_passages, MAX_LIMIT)
        return ids, scores, vectors

    def _milvus_search(self, q: np.ndarray, limit: int) -> list:
        params = {"metric_type": METRIC}
        if self.kind == "hnsw":
            params["params"] = {"ef": max(HNSW_EF_MIN, limit)}
        return self.service.call(
            "search",
            self.service.collection,
            data=q.tolist(),
            limit=limit,
            anns_field="vector",
            output_fields=["vector"],
            search_params=params,
        )

    def _parse(self, hits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One query's hits as (ids int64, Milvus distances float64, vectors float16)."""
        cand = np.fromiter((int(h["id"]) for h in hits), dtype=np.int64, count=len(hits))
        if len(cand) and (cand.min() < 0 or cand.max() >= self.num_passages or len(np.unique(cand)) != len(cand)):
            raise KBError(f"collection {self.service.collection!r} returned ids outside 0..{self.num_passages - 1}")
        dist = np.fromiter((float(h["distance"]) for h in hits), dtype=np.float64, count=len(hits))
        raw = np.asarray([h["entity"]["vector"] for h in hits], dtype=np.float32).reshape(len(hits), -1)
        rows = as_f16(raw, self.dims, self.service.collection) if len(hits) else np.zeros((0, self.dims), np.float16)
        return cand, dist, rows

    def _proven(self, cand, dist, exact, kk: int, limit: int, norm: float) -> bool:
        """Whether no passage outside ``cand`` can reach the k-th exact score: every such passage's
        float32 distance is at most the last one returned, and within the margin of its exact score."""
        if len(cand) >= self.num_passages:
            return True  # every passage was scored
        if len(cand) < limit or len(cand) < kk:
            return False
        kth = np.sort(exact)[::-1][kk - 1]
        return float(dist.min()) + fp32_margin(self.dims, norm * self.max_norm) < float(kth)

    def score(self, queries: list[Query], ids: np.ndarray) -> np.ndarray:
        """[n, len(ids)] float32 exact scores (-inf for id -1), fetching the vectors in one ``get``."""
        return _score(self, queries, ids, {})

    def check_ids(self, ids: np.ndarray) -> None:
        if len(ids) and (ids.max() >= self.num_passages or ids.min() < -1):
            raise KBError(f"passage ids must be in [0, {self.num_passages}) (or -1 for none)")


def _score(base: MilvusRetriever, queries: list[Query], ids, known: dict[int, np.ndarray]) -> np.ndarray:
    """The exact scores of ``ids``: vectors from ``known``, the rest fetched (and added to it)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    base.check_ids(ids)
    q = dense_queries(queries, base.dims)
    out = np.full((len(q), len(ids)), -np.inf, dtype=np.float32)
    valid = ids >= 0
    wanted = [int(i) for i in dict.fromkeys(ids[valid].tolist())]
    known.update(base.service.vectors([i for i in wanted if i not in known], base.dims))
    if wanted:
        rows = np.stack([known[int(i)] for i in ids[valid]])
        for r in range(len(q)):
            out[r, valid] = exact_scores(q[r], rows)
    return out


class RequestView:
    """One request's retriever over a :class:`MilvusRetriever`: the same interface, with a
    memory of the passage vectors its own searches returned (most recent ``capacity``), so the
    local cache scores locally; unseen ids are fetched in one ``get``. Thread-safe (RaLMSpec
    verifies in a worker thread while the main thread speculates)."""

    def __init__(self, base: MilvusRetriever, capacity: int = VIEW_CAPACITY) -> None:
        self.base, self.capacity, self.kind = base, capacity, base.kind
        self.search_holds_gil = base.search_holds_gil
        self._vectors: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def encode(self, texts: list[str]) -> list[Query]:
        return self.base.encode(texts)

    def _remember(self, found: dict[int, np.ndarray]) -> None:
        with self._lock:
            for pid, vec in found.items():
                self._vectors.pop(pid, None)
                self._vectors[pid] = vec
            while len(self._vectors) > self.capacity:
                self._vectors.popitem(last=False)

    def search(self, queries: list[Query], k: int) -> tuple[np.ndarray, np.ndarray]:
        ids, scores, vectors = self.base.search_with_vectors(queries, k)
        found = {}
        for row, rows in zip(ids, vectors):
            found.update(zip(row[: len(rows)].tolist(), rows))
        self._remember(found)
        return ids, scores

    def score(self, queries: list[Query], ids: np.ndarray) -> np.ndarray:
        wanted = np.asarray(ids, dtype=np.int64).reshape(-1)
        with self._lock:
            known = {int(i): self._vectors[int(i)] for i in wanted if int(i) in self._vectors}
        seen = set(known)
        out = _score(self.base, queries, wanted, known)
        self._remember({i: v for i, v in known.items() if i not in seen})
        return out


# ---------------------------------------------------------------- the KB
class MilvusKB:
    """A knowledge base whose passages and vectors live in a Milvus collection: the read
    interface of :class:`~specops.serving.retrieval.kb.KnowledgeBase` that serving and the RaLM loop use."""

    backend = BACKEND_MILVUS

    def __init__(self, name: str, meta: dict, embedder, service: Service) -> None:
        self.name, self.meta, self.embedder, self.service = name, dict(meta), embedder, service
        self.version = ""
        """The registry version it was loaded from ("" for a local manifest or a fresh build)."""
        self.kind = self.meta["retrievers"][0]
        self._retriever: MilvusRetriever | None = None
        self._lock = threading.Lock()

    @property
    def num_passages(self) -> int:
        return int(self.meta["num_passages"])

    @property
    def dims(self) -> int:
        return int(self.meta["dims"])

    @property
    def retrievers(self) -> tuple[str, ...]:
        return (self.kind,)

    @property
    def uri(self) -> str:
        """The service URI in use (``SPECOPS_MILVUS_URI`` when set, else the build's)."""
        return self.service.uri

    @property
    def num_bytes(self) -> int:
        """The collection's field bytes (ids, float32 vectors, UTF-8 strings; the index not
        counted) plus the local embedder's."""
        n = int(self.meta["milvus"]["field_bytes"])
        return n + (self.embedder.idf.nbytes if isinstance(self.embedder, HashEmbedder) else 0)

    @property
    def bytes_per_passage(self) -> float:
        return self.num_bytes / max(1, self.num_passages)

    def passages(self, ids: Iterable[int]) -> list[Passage]:
        """The passages of ``ids`` (each in [0, num_passages)), in one ``get``."""
        ids = [int(x) for x in ids]
        for i in ids:
            if not 0 <= i < self.num_passages:
                raise KBError(f"passage id {i} is outside {self.name!r} (0..{self.num_passages - 1})")
        if not ids:
            return []
        rows = self.service.call("get", self.service.collection, ids=sorted(set(ids)), output_fields=list(FIELDS))
        got = {int(r["id"]): r for r in rows}
        missing = sorted(set(ids) - set(got))
        if missing:
            raise KBError(f"collection {self.service.collection!r} lacks passages {missing[:8]}: modified")
        return [Passage(id=i, **{f: str(got[i][f]) for f in FIELDS}) for i in ids]

    def retriever(self, kind: str) -> MilvusRetriever:
        """The collection's retriever (one per KB object, thread-safe). Its ``for_request()``
        is what a request's loop should use."""
        if kind != self.kind:
            why = " (BM25 scores need the server's corpus statistics, which RaLM's local cache cannot reproduce)"
            raise KBError(
                f"knowledge base {self.name!r} has no {kind!r} retriever; it is served by Milvus with "
                f"{self.kind} ({INDEXES[self.kind]} index){why if kind == 'bm25' else ''}: rebuild with "
                "--retrievers exact or hnsw, or build an in-memory KB (--backend memory) for bm25 and scann"
            )
        with self._lock:
            if self._retriever is None:
                self._retriever = MilvusRetriever(self)
            return self._retriever

    def describe(self) -> dict:
        keep = ("embedder", "retrievers", "build_s", "sources", "heldout_excluded", "chunking")
        m = self.meta["milvus"]
        return {
            "name": self.name,
            "version": self.version,
            "backend": BACKEND_MILVUS,
            "num_passages": self.num_passages,
            "dims": self.dims,
            "bytes_per_passage": round(self.bytes_per_passage, 1),
            "milvus": {"uri": self.uri, "collection": m["collection"], "index": m["index"], "metric": m["metric"]},
            **{k: self.meta[k] for k in keep if k in self.meta},
        }

    # ------------------------------------------------------------ the manifest
    def save(self, out_dir: Path) -> Path:
        """Write the manifest (kb.json, and the hash embedder's idf) into ``out_dir``; return it."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        if isinstance(self.embedder, HashEmbedder):
            save_tensors(self.embedder.tensors(), out_dir / HASH_FILE)
            written.append(HASH_FILE)
        meta = {
            **{k: v for k, v in self.meta.items() if k != "meta_sha256"},
            "format": KB_FORMAT,
            "backend": BACKEND_MILVUS,
            "name": self.name,
            "num_passages": self.num_passages,
            "dims": self.dims,
            "files": {name: sha256_file(out_dir / name) for name in written},
            "bytes_per_passage": round(self.bytes_per_passage, 1),
        }
        meta["meta_sha256"] = canonical_sha(meta)
        (out_dir / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        return out_dir

    @classmethod
    def load(cls, path: Path) -> MilvusKB:
        """Read and verify a manifest and connect (``KnowledgeBase.load`` does the same for any backend)."""
        path = Path(path)
        try:
            meta = read_meta(path)
            if meta.get("backend") != BACKEND_MILVUS:
                raise KBError(f"backend {meta.get('backend', 'memory')!r}, not {BACKEND_MILVUS}")
            return cls.from_manifest(path, meta)
        except (KBError, OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise KBError(f"{path} is not a usable knowledge base: {exc}") from exc

    @classmethod
    def from_manifest(cls, path: Path, meta: dict) -> MilvusKB:
        """Connect to the manifest's collection (``SPECOPS_MILVUS_URI`` overriding its URI) and
        check that it is the collection the manifest describes."""
        m, name, n, dims = meta["milvus"], meta["name"], int(meta["num_passages"]), int(meta["dims"])
        kinds = list(meta["retrievers"])
        if len(kinds) != 1 or kinds[0] not in INDEXES or INDEXES[kinds[0]] != m["index"] or m["metric"] != METRIC:
            raise KBError(f"retrievers {kinds} with index {m['index']}/{m['metric']}: not a Milvus KB this code serves")
        embedder = embedder_for(meta, path, dims)
        env_uri = os.environ.get(URI_ENV, "").strip()
        uri = env_uri or m["uri"]
        where = f"{uri} ({URI_ENV})" if env_uri else f"{uri} (recorded at build; {URI_ENV} overrides it)"
        service = Service(uri, os.environ.get(TOKEN_ENV, ""), m["collection"])
        coll = m["collection"]
        if not service.call("has_collection", coll, error=KBError):
            raise KBError(
                f"collection {coll!r} is not in the Milvus service at {where}: dropped, or another service. "
                f"Rebuild it: specops kb build --name {name} --backend milvus --milvus-uri {uri} "
                f"--retrievers {kinds[0]} (with the same sources), then register the new manifest"
            )
        desc = service.call("describe_collection", coll, error=KBError)
        found = (desc.get("properties") or {}).get(CONTENT_PROPERTY)
        if found != m["content_sha256"]:
            raise KBError(
                f"collection {coll!r} at {uri} holds content {str(found)[:12] if found else 'of an unfinished build'}, "
                f"not the manifest's {m['content_sha256'][:12]}: another build; rebuild or register its manifest"
            )
        field = next((f for f in desc.get("fields", ()) if f.get("name") == "vector"), None)
        got_dims = int((field or {}).get("params", {}).get("dim", -1))
        if got_dims != dims:
            raise KBError(f"collection {coll!r} at {uri} has vectors of {got_dims} dims; the manifest says {dims}")
        index = service.call("describe_index", coll, "vector", error=KBError) or {}
        if index.get("index_type") != m["index"] or index.get("metric_type") != METRIC:
            raise KBError(
                f"collection {coll!r} at {uri} is indexed {index.get('index_type')}/{index.get('metric_type')}, "
                f"not the manifest's {m['index']}/{METRIC}"
            )
        from pymilvus.client.types import LoadState

        if service.call("get_load_state", coll, error=KBError).get("state") != LoadState.Loaded:
            service.call("load_collection", coll, error=KBError)  # released (a server restart): loading is idempotent
        rows = service.call("query", coll, filter="", output_fields=["count(*)"], error=KBError)
        count = int(rows[0]["count(*)"]) if rows else 0
        if count != n:
            raise KBError(f"collection {coll!r} at {uri} holds {count} passages; the manifest says {n}")
        return cls(name, meta, embedder, service)

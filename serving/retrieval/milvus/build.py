"""Building a Milvus-backed knowledge base (``specops.serving.retrieval.milvus.kb``): the in-memory build's
passage steps (``kb.prepare_passages``: duplicates dropped, title + text embedded to float16),
then one new collection filled in batches, indexed and loaded.

The collection is ``kb_<name>_<first 12 hex of the content sha256>``; the content sha256 covers
the passages, their float16 vectors, the embedder and the index, so the same build twice names
the same collection (it is reused when complete) and any other build names a new one: a rebuild
never overwrites the collection a champion serves. The sha256 is written to the collection's
``specops.content_sha256`` property last, after every row is in and the index is loaded, so a
collection without it is an unfinished build (dropped and rebuilt by the next build of that
content). Old collections are never dropped here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from urllib.parse import urlparse

import numpy as np

from specops.core.errors import KBError
from specops.core.passage import Passage
from specops.serving.retrieval.kb import BACKEND_MILVUS, _pack, check_name, prepare_passages
from specops.serving.retrieval.milvus.kb import (
    CONTENT_PROPERTY,
    FIELDS,
    HNSW_BUILD,
    HNSW_EF_MIN,
    INDEXES,
    METRIC,
    MilvusKB,
)
from specops.serving.retrieval.milvus.service import Service, is_lite, normalize_uri
from specops.serving.retrieval.retrievers import ANN_OVERFETCH

log = logging.getLogger(__name__)

INSERT_BATCH = 1000
"""Passages per insert call (about 2.5 MB of gRPC message with 384-dim vectors)."""
MAX_VARCHAR = 65535
"""Milvus's longest VARCHAR, in UTF-8 bytes."""


def collection_name(name: str, content_sha256: str) -> str:
    """``kb_<name>_<sha12>``, the name's symbols made ``_`` (Milvus allows letters, digits and ``_``)."""
    return f"kb_{re.sub(r'[^A-Za-z0-9_]', '_', name)}_{content_sha256[:12]}"


def content_sha256(texts: dict[str, list[str]], embeddings: np.ndarray, embedder: dict, kind: str) -> str:
    """The sha256 of what a collection holds and how it is indexed."""
    h = hashlib.sha256()
    head = {
        "format": "specops-milvus-content/1",
        "embedder": embedder,
        "shape": list(embeddings.shape),
        "index": INDEXES[kind],
        "metric": METRIC,
        "index_params": HNSW_BUILD if kind == "hnsw" else {},
    }
    h.update(json.dumps(head, sort_keys=True).encode())
    for f in FIELDS:
        blob, offsets = _pack(texts[f])
        h.update(offsets.tobytes())
        h.update(blob.tobytes())
    h.update(np.ascontiguousarray(embeddings, dtype="<f2").tobytes())
    return h.hexdigest()


def _check_uri(uri: str) -> str:
    uri = normalize_uri(uri)
    if not is_lite(uri) and (urlparse(uri).username or urlparse(uri).password):
        raise KBError(
            f"the Milvus URI {urlparse(uri).hostname}:... carries credentials, and kb.json records the URI: "
            "pass the token separately (token=..., or SPECOPS_MILVUS_TOKEN)"
        )
    return uri


def _schema(dims: int):
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dims)
    for f in FIELDS:
        schema.add_field(f, DataType.VARCHAR, max_length=MAX_VARCHAR)
    return schema


def _complete(service: Service, n: int, sha: str) -> bool:
    """Whether the collection exists as a finished build of this content (else it is dropped)."""
    coll = service.collection
    if not service.call("has_collection", coll, error=KBError):
        return False
    found = (service.call("describe_collection", coll, error=KBError).get("properties") or {}).get(CONTENT_PROPERTY)
    if found == sha:
        from pymilvus.client.types import LoadState

        if service.call("get_load_state", coll, error=KBError).get("state") != LoadState.Loaded:
            service.call("load_collection", coll, error=KBError)
        rows = service.call("query", coll, filter="", output_fields=["count(*)"], error=KBError)
        if rows and int(rows[0]["count(*)"]) == n:
            return True
    elif found is not None:
        raise KBError(f"collection {coll!r} at {service.uri} holds content {found[:12]}: a sha256 prefix clash")
    log.warning("collection %s at %s is an unfinished build: dropping it and building again", coll, service.uri)
    service.call("drop_collection", coll, error=KBError)
    return False


def build_milvus_kb(
    name: str,
    passages: Sequence[Passage],
    *,
    uri: str,
    embedder="minilm",
    retriever: str = "exact",
    progress: bool = True,
    meta: dict | None = None,
    batch: int = INSERT_BATCH,
    token: str = "",
) -> MilvusKB:
    """Build KB ``name`` into a new collection at ``uri`` (a Milvus Lite ``.db`` path or a
    server's ``http://host:port``; ``token`` is used, never recorded) with retriever ``exact``
    (FLAT index) or ``hnsw``; passages as for ``kb.build_kb``. Returns the KB, connected; its
    ``save`` writes the manifest, ``kb.register_kb`` registers it."""
    from tqdm import tqdm

    check_name(name)
    if retriever not in INDEXES:
        raise KBError(
            f"retriever {retriever!r}: a Milvus KB is built with one of {', '.join(INDEXES)} (bm25 needs "
            "corpus statistics a request's local cache cannot reproduce; scann is not a Milvus index)"
        )
    if batch < 1:
        raise KBError(f"batch must be >= 1, got {batch}")
    uri = _check_uri(uri)
    t_start = time.perf_counter()
    prepared = prepare_passages(name, passages, embedder=embedder, progress=progress)
    emb, kept = prepared.embeddings, prepared.kept
    bad = np.nonzero(~np.isfinite(emb).all(axis=1))[0]
    if len(bad):
        raise KBError(f"passages {bad[:8].tolist()} have non-finite vectors; nothing was inserted")
    texts = {f: [getattr(p, f) for p in kept] for f in FIELDS}
    for f, values in texts.items():
        long = next((i for i, v in enumerate(values) if len(v.encode("utf-8")) > MAX_VARCHAR), None)
        if long is not None:
            raise KBError(f"passage {long}'s {f} is over {MAX_VARCHAR} UTF-8 bytes, Milvus's longest VARCHAR")
    info = prepared.info()
    n, dims = emb.shape
    sha = content_sha256(texts, emb, info["embedder"], retriever)
    service = Service(uri, token, collection_name(name, sha), create=True)
    coll, build_s = service.collection, {"embed": prepared.embed_s}

    reused = _complete(service, n, sha)
    t0 = time.perf_counter()
    if not reused:
        service.call("create_collection", coll, schema=_schema(int(dims)), consistency_level="Strong", error=KBError)
        vectors = emb.astype(np.float32)  # exactly the float16 values
        with tqdm(total=n, unit="passage", desc="milvus insert", disable=not progress) as bar:
            for s in range(0, n, batch):
                e = min(s + batch, n)
                rows = [
                    {"id": i, "vector": vectors[i].tolist(), **{f: texts[f][i] for f in FIELDS}} for i in range(s, e)
                ]
                service.call("insert", coll, data=rows, error=KBError)
                bar.update(e - s)
        service.call("flush", coll, error=KBError)
    build_s["insert"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if not reused:
        from pymilvus import MilvusClient

        index = MilvusClient.prepare_index_params()
        index.add_index(
            field_name="vector",
            index_type=INDEXES[retriever],
            metric_type=METRIC,
            params=dict(HNSW_BUILD) if retriever == "hnsw" else {},
        )
        service.call("create_index", coll, index, error=KBError)
        service.call("load_collection", coll, error=KBError)
        service.call("alter_collection_properties", coll, properties={CONTENT_PROPERTY: sha}, error=KBError)
    build_s["index"] = time.perf_counter() - t0
    build_s["total"] = time.perf_counter() - t_start

    norms = np.sqrt((emb.astype(np.float64) ** 2).sum(axis=1))
    field_bytes = n * (8 + 4 * dims) + sum(len(v.encode("utf-8")) for f in FIELDS for v in texts[f])
    full = {
        **(meta or {}),
        "backend": BACKEND_MILVUS,
        "name": name,
        "num_passages": int(n),
        "dims": int(dims),
        "retrievers": [retriever],
        "build_s": {k: round(v, 3) for k, v in build_s.items()},
        **info,
        "insert_passages_per_s": round(n / max(build_s["insert"], 1e-9), 1),
        "milvus": {
            "uri": uri,
            "collection": coll,
            "index": INDEXES[retriever],
            "metric": METRIC,
            "index_params": dict(HNSW_BUILD) if retriever == "hnsw" else {},
            "search": {"overfetch": ANN_OVERFETCH, "hnsw_ef_min": HNSW_EF_MIN},
            "content_sha256": sha,
            "max_norm": 1.001 * float(norms.max()),
            "field_bytes": int(field_bytes),
            "reused": reused,
        },
    }
    log.info("kb %s: %d passages in %s at %s (%s)", name, n, coll, uri, "reused" if reused else "built")
    return MilvusKB(name, full, prepared.embedder, service)

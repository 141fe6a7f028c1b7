"""Knowledge bases for retrieval-augmented generation (RaLMSpec, kNN-LM): passages, their
vectors and the indexes of four retrievers (``specops.serving.retrieval.retrievers``).

A passage (``specops.core.passage``) is about 100 words (the paper's DPR-style chunks,
``specops.core.passage.chunk_text``) and at most ``MAX_PASSAGE_TOKENS`` target tokens (RaLMSeq prepends a
chunk of at most 256). Exact duplicates (same words) are dropped at build: two passages with the same text would
tie for every query, and the winner would be decided by nothing but their ids. What is
embedded and indexed is the passage's title, a newline, and its text.

On disk (a registry ``kb`` artifact, ``kb-<name>``; safetensors and JSON only, nothing is
ever unpickled):

- ``passages.safetensors``: ``text``, ``title``, ``source``: each one UTF-8 byte blob
  (uint8) with ``*_offsets`` int64 [N + 1];
- ``embeddings.safetensors``: ``embeddings`` float16 [N, dims] (unit vectors);
- ``hash_embedder.safetensors``: the ``hash`` embedder's idf, when it is the embedder;
- ``hnsw.safetensors``, ``scann.safetensors``: each index's files as raw bytes (uint8),
  from ``specops.core.index``;
- ``bm25.safetensors`` (``data`` float32, ``indices`` int32, ``indptr`` int64: the CSC
  score matrix) and ``bm25.json`` (its vocabulary and parameters);
- ``kb.json``: format ``specops-kb/1``, name, embedder kind and config hash, sizes,
  retrievers, build times, bytes per passage, the sha256 of every other file, and a sha256
  of its own content. :meth:`KnowledgeBase.load` checks all of it and refuses any file it
  does not list.

A KB served by Milvus (``specops.serving.retrieval.milvus.kb``) is registered the same way, but its
artifact is a manifest: ``kb.json`` with ``"backend": "milvus"`` (and the hash embedder's
file); :meth:`KnowledgeBase.load` verifies it the same way and returns a ``MilvusKB``
connected to its collection, so the registry, the catalog and the RaLM loop treat both alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specops.core.errors import KBError
from specops.core.index import IndexConfig, KeyIndex, build_index, config_from_json, load_index
from specops.core.passage import Passage, indexed_text
from specops.registry.artifacts import KB_FORMAT, sha256_file
from specops.serving.retrieval.kb_files import (
    BACKEND_MEMORY,
    BACKEND_MILVUS,
    HASH_FILE,
    META_FILE,
    read_meta,
)
from specops.serving.retrieval.kb_files import canonical_sha as _canonical_sha
from specops.serving.retrieval.kb_files import embedder_for as _embedder_for
from specops.serving.retrieval.kb_files import load_tensors as _load
from specops.serving.retrieval.kb_files import save_tensors as _save
from specops.serving.retrieval.retriever import RETRIEVER_KINDS, Retriever
from specops.serving.retrieval.retrievers import BM25Index, BM25Retriever, DenseRetriever, ExactScorer, build_bm25
from specops.serving.retrieval.text_embed import HASH, HashEmbedder, embed_passages, make_text_embedder

log = logging.getLogger(__name__)

PASSAGES_FILE, EMBEDDINGS_FILE = "passages.safetensors", "embeddings.safetensors"
BM25_FILE, BM25_VOCAB_FILE = "bm25.safetensors", "bm25.json"
ANN_KINDS = ("hnsw", "scann")
ANN_CONFIGS = {"hnsw": IndexConfig(kind="hnsw", quantizer="sq8"), "scann": IndexConfig(kind="scann")}
"""HNSW keeps 8-bit keys: it only proposes candidates, which are rescored exactly from the embeddings."""
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_STRING_FIELDS = ("text", "title", "source")


# ---------------------------------------------------------------- strings as blobs
def _pack(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), offsets


class KnowledgeBase:
    """Passages, their vectors and built retrievers; immutable once built (a rebuild makes a new one)."""

    def __init__(
        self,
        name: str,
        strings: dict[str, tuple[np.ndarray, np.ndarray]],
        embeddings: np.ndarray,
        embedder,
        *,
        ann: dict[str, KeyIndex],
        bm25: BM25Index | None,
        meta: dict,
    ) -> None:
        assert embeddings.dtype == np.float16 and embeddings.ndim == 2, (embeddings.dtype, embeddings.shape)
        self.name, self.embeddings, self.embedder = name, embeddings, embedder
        self._strings, self._ann, self._bm25 = strings, ann, bm25
        self.meta = dict(meta)
        self.version = ""
        """The registry version it was loaded from ("" for a local directory or a fresh build)."""
        self._built = tuple(k for k in RETRIEVER_KINDS if k in self.meta.get("retrievers", ()))
        self._scorer: ExactScorer | None = None
        self._retrievers: dict[str, Retriever] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ reads
    @property
    def num_passages(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def dims(self) -> int:
        return int(self.embeddings.shape[1])

    @property
    def retrievers(self) -> tuple[str, ...]:
        """The retriever kinds built, in :data:`RETRIEVER_KINDS` order."""
        return self._built

    @property
    def num_bytes(self) -> int:
        """Bytes of the stored arrays and indexes (the files, less their headers)."""
        n = sum(blob.nbytes + off.nbytes for blob, off in self._strings.values()) + self.embeddings.nbytes
        n += sum(ix.num_bytes for ix in self._ann.values())
        n += self._bm25.num_bytes if self._bm25 is not None else 0
        n += self.embedder.idf.nbytes if isinstance(self.embedder, HashEmbedder) else 0
        return int(n)

    @property
    def bytes_per_passage(self) -> float:
        return self.num_bytes / max(1, self.num_passages)

    def passages(self, ids: Iterable[int]) -> list[Passage]:
        """The passages of ``ids`` (each in [0, num_passages))."""
        out = []
        for i in (int(x) for x in ids):
            if not 0 <= i < self.num_passages:
                raise KBError(f"passage id {i} is outside {self.name!r} (0..{self.num_passages - 1})")
            fields = {f: bytes(blob[off[i] : off[i + 1]]).decode("utf-8") for f, (blob, off) in self._strings.items()}
            out.append(Passage(id=i, **fields))
        return out

    def retriever(self, kind: str) -> Retriever:
        """The retriever ``kind`` (built once per KB object and shared: it is thread-safe)."""
        if kind not in self._built:
            raise KBError(
                f"knowledge base {self.name!r} has no {kind!r} retriever; it was built with "
                f"{', '.join(self._built) or 'none'} (rebuild with --retrievers to add one)"
            )
        with self._lock:
            if kind not in self._retrievers:
                if kind == "bm25":
                    self._retrievers[kind] = BM25Retriever(self._bm25)
                else:
                    if self._scorer is None:
                        self._scorer = ExactScorer(self.embeddings)
                    self._retrievers[kind] = DenseRetriever(kind, self._scorer, self.embedder, self._ann.get(kind))
            return self._retrievers[kind]

    def describe(self) -> dict:
        keep = ("embedder", "retrievers", "build_s", "sources", "heldout_excluded", "chunking", "index_configs")
        return {
            "name": self.name,
            "version": self.version,
            "num_passages": self.num_passages,
            "dims": self.dims,
            "bytes_per_passage": round(self.bytes_per_passage, 1),
            **{k: self.meta[k] for k in keep if k in self.meta},
        }

    # ------------------------------------------------------------ files
    def save(self, out_dir: Path) -> Path:
        """Write the KB into ``out_dir`` (created); return it."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        strings = {}
        for f, (blob, off) in self._strings.items():
            strings[f], strings[f"{f}_offsets"] = blob, off
        _save(strings, out_dir / PASSAGES_FILE)
        _save({"embeddings": self.embeddings}, out_dir / EMBEDDINGS_FILE)
        written = [PASSAGES_FILE, EMBEDDINGS_FILE]
        if isinstance(self.embedder, HashEmbedder):
            _save(self.embedder.tensors(), out_dir / HASH_FILE)
            written.append(HASH_FILE)
        for kind, index in self._ann.items():
            _save(
                {n: np.frombuffer(bytearray(b), dtype=np.uint8) for n, b in index.files.items()},
                out_dir / f"{kind}.safetensors",
            )
            written.append(f"{kind}.safetensors")
        if self._bm25 is not None:
            _save(self._bm25.tensors(), out_dir / BM25_FILE)
            (out_dir / BM25_VOCAB_FILE).write_text(json.dumps({"vocab": self._bm25.vocab, "params": self._bm25.params}))
            written += [BM25_FILE, BM25_VOCAB_FILE]
        files = {name: sha256_file(out_dir / name) for name in written}
        total = sum((out_dir / name).stat().st_size for name in written)
        meta = {
            **self.meta,
            "format": KB_FORMAT,
            "name": self.name,
            "num_passages": self.num_passages,
            "dims": self.dims,
            "files": files,
            "bytes_per_passage": round(total / max(1, self.num_passages), 1),
        }
        meta["meta_sha256"] = _canonical_sha(meta)
        (out_dir / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        return out_dir

    @classmethod
    def load(cls, path: Path) -> KnowledgeBase:
        """Read a saved KB, verifying every file; a missing, unlisted, corrupt or foreign file raises KBError.
        A Milvus KB's manifest gives a connected ``MilvusKB`` (its collection checked as well)."""
        path = Path(path)
        try:
            return cls._load(path)
        except KBError as exc:
            raise KBError(f"{path} is not a usable knowledge base: {exc}") from exc
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, UnicodeDecodeError) as exc:
            raise KBError(f"{path} is not a usable knowledge base: {exc}") from exc

    @classmethod
    def _load(cls, path: Path) -> KnowledgeBase:
        meta = read_meta(path)
        backend = meta.get("backend", BACKEND_MEMORY)
        if backend == BACKEND_MILVUS:  # the manifest of a KB served by Milvus (specops.serving.retrieval.milvus.kb)
            from specops.serving.retrieval.milvus.kb import MilvusKB

            return MilvusKB.from_manifest(path, meta)
        if backend != BACKEND_MEMORY:
            raise KBError(f"backend {backend!r}: this version knows {BACKEND_MEMORY} and {BACKEND_MILVUS}")
        raw = _load(path / PASSAGES_FILE)
        n = int(meta["num_passages"])
        strings = {}
        for f in _STRING_FIELDS:
            blob, off = raw[f], raw[f"{f}_offsets"]
            if (
                blob.dtype != np.uint8
                or off.dtype != np.int64
                or off.shape != (n + 1,)
                or off[0] != 0
                or off[-1] != len(blob)
                or (np.diff(off) < 0).any()
            ):
                raise KBError(f"passage {f}s are not {n} UTF-8 strings with rising offsets")
            strings[f] = (blob, off)
        emb = _load(path / EMBEDDINGS_FILE)["embeddings"]
        if emb.dtype != np.float16 or emb.shape != (n, int(meta["dims"])) or not np.isfinite(emb).all():
            raise KBError(f"embeddings must be finite float16 [{n}, {meta['dims']}]; got {emb.dtype} {emb.shape}")
        embedder = _embedder_for(meta, path, int(meta["dims"]))
        ann = {}
        for kind in ANN_KINDS:
            if kind in meta["retrievers"]:
                blobs = {k: v.tobytes() for k, v in _load(path / f"{kind}.safetensors").items()}
                cfg = config_from_json(meta["index_configs"][kind])
                if cfg.kind != kind:
                    raise KBError(f"the {kind} index is described as {cfg.kind}")
                ann[kind] = load_index(cfg, blobs, int(meta["dims"]), n)
        bm25 = None
        if "bm25" in meta["retrievers"]:
            arrays = _load(path / BM25_FILE)
            vocab = json.loads((path / BM25_VOCAB_FILE).read_text())
            bm25 = BM25Index(
                arrays["data"], arrays["indices"], arrays["indptr"], list(vocab["vocab"]), n, vocab["params"]
            )
        return cls(meta["name"], strings, emb, embedder, ann=ann, bm25=bm25, meta=meta)


# ---------------------------------------------------------------- build
def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise KBError(
            f"knowledge base name {name!r}: letters, digits, '_', '.', '-' (up to 64, not starting with a symbol)"
        )


@dataclass(frozen=True)
class Prepared:
    """The passages a KB keeps (exact duplicates dropped, renumbered 0..N-1 in order), the text
    embedded for each, the embedder and their float16 vectors: what every backend stores."""

    kept: list[Passage]
    docs: list[str]
    embedder: object
    embeddings: np.ndarray
    """[N, dims] float16."""
    duplicates_dropped: int
    embed_s: float

    def info(self) -> dict:
        """The build facts kb.json records about these steps."""
        e = self.embedder
        return {
            "embedder": {"kind": e.kind, "config_sha256": e.config_sha256, "dim": int(e.dim)},
            "duplicates_dropped": self.duplicates_dropped,
            "embed_passages_per_s": round(len(self.docs) / max(self.embed_s, 1e-9), 1),
        }


def prepare_passages(name: str, passages: Sequence[Passage], *, embedder="minilm", progress: bool = True) -> Prepared:
    """The steps every KB backend shares: check the name, drop exact duplicates (same words),
    then embed title + text (fitting the hash embedder's idf first) to float16."""
    check_name(name)
    from tqdm import tqdm

    kept, seen = [], set()
    for p in passages:
        key = " ".join(p.text.split())
        if key and key not in seen:
            seen.add(key)
            kept.append(p)
    if not kept:
        raise KBError("no passage with text to build a knowledge base from")
    log.info("kb %s: %d passages (%d exact duplicates dropped)", name, len(kept), len(passages) - len(kept))
    docs = [indexed_text(p) for p in kept]
    t0 = time.perf_counter()
    with tqdm(
        total=len(docs) * (2 if embedder == HASH else 1), unit="passage", desc="embedding", disable=not progress
    ) as bar:
        if isinstance(embedder, str):
            embedder = make_text_embedder(embedder, fit_texts=docs, progress=bar.update)
        vectors = embed_passages(embedder, docs, progress=bar.update)  # [N, dims] float32
    return Prepared(
        kept, docs, embedder, vectors.astype(np.float16), len(passages) - len(kept), time.perf_counter() - t0
    )


def build_kb(
    name: str,
    passages: Sequence[Passage],
    *,
    embedder="minilm",
    retrievers: Sequence[str] = RETRIEVER_KINDS,
    progress: bool = True,
    meta: dict | None = None,
    index_configs: dict[str, IndexConfig] | None = None,
) -> KnowledgeBase:
    """Build KB ``name`` from ``passages`` (their ids are ignored: passages are renumbered
    0..N-1 in order after exact duplicates are dropped). ``embedder`` is ``minilm``,
    ``hash`` (fitted here on the passages) or an embedder object; ``meta`` is stored in kb.json."""
    check_name(name)
    unknown = [k for k in retrievers if k not in RETRIEVER_KINDS]
    if unknown or not retrievers:
        raise KBError(f"retrievers {list(retrievers)}: choose from {', '.join(RETRIEVER_KINDS)}")
    from tqdm import tqdm

    t_start = time.perf_counter()
    prepared = prepare_passages(name, passages, embedder=embedder, progress=progress)
    kept, docs, embedder, embeddings = prepared.kept, prepared.docs, prepared.embedder, prepared.embeddings
    build_s: dict[str, float] = {"embed": prepared.embed_s}

    # The indexes (exact needs none: it searches the embeddings).
    kinds = [k for k in RETRIEVER_KINDS if k in retrievers]
    configs = {**ANN_CONFIGS, **(index_configs or {})}
    ann, bm25 = {}, None
    keys = None
    with tqdm(kinds, unit="index", desc="indexes", disable=not progress) as bar:
        for kind in bar:
            bar.set_postfix_str(kind)
            t0 = time.perf_counter()
            if kind in ANN_KINDS:
                keys = embeddings.astype(np.float32) if keys is None else keys
                ann[kind] = build_index(keys, configs[kind])
            elif kind == "bm25":
                bm25 = build_bm25(docs, progress=False)
            build_s[kind] = time.perf_counter() - t0
    build_s["total"] = time.perf_counter() - t_start
    info = {
        **(meta or {}),
        "retrievers": kinds,
        "build_s": {k: round(v, 3) for k, v in build_s.items()},
        "index_configs": {k: asdict(configs[k]) for k in ann},
        **prepared.info(),
    }
    strings = {f: _pack([getattr(p, f) for p in kept]) for f in _STRING_FIELDS}
    return KnowledgeBase(name, strings, embeddings, embedder, ann=ann, bm25=bm25, meta=info)


# ---------------------------------------------------------------- registry
def register_kb(registry, kb: KnowledgeBase, *, promote: bool = True, tags: dict[str, str] | None = None):
    """Register ``kb`` as a new version of ``kb-<name>`` (alias ``challenger``; ``champion``
    too when ``promote``) with its sizes and embedder as tags and metrics; returns the
    version and sets ``kb.version``. The same content registered again returns the existing
    version (its source id is the hash of the passages, embeddings and retrievers)."""
    kind = registry.artifact("kb")
    with tempfile.TemporaryDirectory(prefix="specops-kb-") as tmp:
        path = kb.save(Path(tmp) / "kb")
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("backend") == BACKEND_MILVUS:
            # The manifest of a Milvus collection: the same collection at the same service is the same KB.
            service = meta["milvus"]
            held = {k: service[k] for k in ("content_sha256", "uri", "collection")}
            extra_tags = {"backend": BACKEND_MILVUS, "milvus_collection": service["collection"]}
        else:
            held = {"passages": meta["files"][PASSAGES_FILE], "embeddings": meta["files"][EMBEDDINGS_FILE]}
            extra_tags = {}
        content = hashlib.sha256(
            json.dumps({**held, "retrievers": list(kb.retrievers)}, sort_keys=True).encode()
        ).hexdigest()
        v = kind.register(
            kb.name,
            path,
            meta={"name": kb.name, "num_passages": kb.num_passages},
            tags={
                "embedder": kb.embedder.kind,
                "embedder_sha256": kb.embedder.config_sha256,
                "retrievers": ",".join(kb.retrievers),
                "content_sha256": content,
                **extra_tags,
                **(tags or {}),
            },
            metrics={
                "num_passages": float(kb.num_passages),
                "bytes_per_passage": float(meta["bytes_per_passage"]),
                "build_s": float(kb.meta.get("build_s", {}).get("total", 0.0)),
            },
            source_id=f"kb:{content}",
        )
    if promote:
        kind.promote(kb.name, v.version, reason="specops kb build")
        v = kind.get(kb.name, v.version)
    kb.version = v.version
    return v


def load_kb_from_registry(
    registry, name: str, alias: str = "champion", *, version: str | None = None, cache_dir: Path | None = None
) -> KnowledgeBase:
    """The KB ``kb-<name>`` at ``alias`` (or ``version``), fetched, verified and loaded, with
    ``.version`` set. With ``cache_dir`` the files stay there (``<cache_dir>/kb-<name>/<version>``)
    and a later call loads them without downloading (still verifying every sha256)."""
    kind = registry.artifact("kb")
    v = kind.get(name, version) if version else kind.by_alias(name, alias)
    if v is None:
        raise KBError(f"kb-{name} has no version at alias {alias!r}: build one with `specops kb build --name {name}`")
    if cache_dir is not None:
        dest = Path(cache_dir) / f"kb-{name}" / str(v.version)
        try:
            kb = KnowledgeBase.load(dest) if (dest / META_FILE).is_file() else None
        except KBError as exc:
            log.warning("cached %s is unusable (%s); fetching it again", dest, exc)
            kb = None
        if kb is None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            kind.fetch(v, dest)
            kb = KnowledgeBase.load(dest)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="specops-kb-"))
        try:
            kind.fetch(v, tmp / "kb")
            kb = KnowledgeBase.load(tmp / "kb")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    kb.version = str(v.version)
    return kb

"""Nearest-neighbour indexes over unit-length keys, searched by cosine similarity (= inner
product): exact (FAISS flat), HNSW (FAISS) and ScaNN (tree + asymmetric hashing + reorder,
the DReSD paper's). Each serialises to raw bytes plus a small JSON description, so a
datastore artifact carries it inside safetensors; nothing is unpickled on load.

Sizes per key of ``d`` dims (``d = 64``): flat and HNSW store the key as float16 (``2d`` =
128 bytes) or 8-bit (``d`` = 64 bytes); HNSW adds ``2 * M`` 4-byte links on its bottom
layer (``M = 12``: 96 bytes); ScaNN stores 4-bit codes per 2 dims (``d/4`` = 16 bytes) and
int8 reorder data (``d`` bytes).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

INDEX_KINDS = ("flat", "hnsw", "scann")
QUANTIZERS = ("fp16", "sq8")


@dataclass(frozen=True)
class IndexConfig:
    """How to index the keys."""

    kind: str = "hnsw"
    """``flat`` (exact), ``hnsw`` (FAISS) or ``scann`` (the paper's)."""
    quantizer: str = "fp16"
    """How flat and HNSW store a key: ``fp16`` (2 bytes a dim) or ``sq8`` (1 byte a dim)."""
    hnsw_m: int = 12
    """HNSW links per node (twice that on the bottom layer)."""
    hnsw_ef_construction: int = 40
    hnsw_ef_search: int = 64
    """HNSW search breadth: higher finds nearer neighbours, slower."""
    scann_leaves: int = 0
    """ScaNN tree leaves; 0 = about sqrt(number of keys)."""
    scann_leaves_to_search: int = 0
    """ScaNN leaves searched per query; 0 = a tenth of the leaves, at least 8."""
    scann_reorder: int = 64
    """ScaNN candidates rescored with the int8 keys."""
    threads: int = 0
    """Build threads (0 = every core)."""

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ValueError(f"index kind {self.kind!r}: choose one of {', '.join(INDEX_KINDS)}")
        if self.quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer {self.quantizer!r}: choose one of {', '.join(QUANTIZERS)}")
        if min(self.hnsw_m, self.hnsw_ef_construction, self.hnsw_ef_search, self.scann_reorder) < 1:
            raise ValueError("hnsw_m, hnsw_ef_construction, hnsw_ef_search and scann_reorder must be >= 1")


class KeyIndex:
    """A built index: ``search(queries, k) -> ids [n, k]`` (-1 where fewer were found)."""

    def __init__(self, cfg: IndexConfig, impl, files: dict[str, bytes], dims: int, size: int) -> None:
        self.cfg, self._impl, self.files, self.dims, self.size = cfg, impl, files, dims, size

    @property
    def num_bytes(self) -> int:
        return sum(len(b) for b in self.files.values())

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``queries`` [n, dims] float32 unit vectors; ids [n, k] int64 of the nearest keys (-1:
        none) and their similarities [n, k] float32 (inner product, nearest first)."""
        assert queries.ndim == 2 and queries.shape[1] == self.dims, (queries.shape, self.dims)
        q = np.ascontiguousarray(queries, dtype=np.float32)
        k = max(1, min(k, self.size))
        if self.cfg.kind == "scann":
            ids, sims = self._impl.search_batched(q, final_num_neighbors=k)
            ids, sims = np.asarray(ids, dtype=np.int64), np.asarray(sims, dtype=np.float32)
            if ids.shape[1] < k:
                ids = np.pad(ids, ((0, 0), (0, k - ids.shape[1])), constant_values=-1)
                sims = np.pad(sims, ((0, 0), (0, k - sims.shape[1])), constant_values=-np.inf)
            return ids, sims
        if self.cfg.kind == "hnsw":
            # HNSW returns at most efSearch neighbours. The breadth goes with the call, not the shared
            # index: a function of k alone (an earlier wide search must not change later results),
            # and concurrent searches do not race on it.
            params = _faiss().SearchParametersHNSW(efSearch=max(self.cfg.hnsw_ef_search, k))
            sims, ids = self._impl.search(q, k, params=params)
        else:
            sims, ids = self._impl.search(q, k)
        return ids.astype(np.int64), sims.astype(np.float32)

    def describe(self) -> dict:
        return {"config": asdict(self.cfg), "dims": self.dims, "size": self.size, "files": sorted(self.files)}


def _faiss():
    import faiss  # imported where used: the CLI and serving without DReSD stay light

    return faiss


def build_index(keys: np.ndarray, cfg: IndexConfig) -> KeyIndex:
    """Index ``keys`` [n, dims] float32 (unit length)."""
    assert keys.ndim == 2 and keys.shape[0] >= 1, keys.shape
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    n, d = keys.shape
    if cfg.kind == "scann":
        return _build_scann(keys, cfg)
    faiss = _faiss()
    if cfg.threads:
        faiss.omp_set_num_threads(cfg.threads)
    qtype = faiss.ScalarQuantizer.QT_fp16 if cfg.quantizer == "fp16" else faiss.ScalarQuantizer.QT_8bit
    if cfg.kind == "flat":
        index = faiss.IndexScalarQuantizer(d, qtype, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexHNSWSQ(d, qtype, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = cfg.hnsw_ef_construction
    index.train(keys)
    index.add(keys)
    return _faiss_index(index, cfg, d, n)


def _faiss_index(index, cfg: IndexConfig, d: int, n: int) -> KeyIndex:
    faiss = _faiss()
    if cfg.kind == "hnsw":
        index.hnsw.efSearch = cfg.hnsw_ef_search
    blob = faiss.serialize_index(index).tobytes()
    return KeyIndex(cfg, index, {"faiss.index": blob}, d, n)


def _scann_params(cfg: IndexConfig, n: int) -> tuple[int, int]:
    leaves = cfg.scann_leaves or max(1, min(n, int(round(np.sqrt(n)))))
    search = cfg.scann_leaves_to_search or max(min(8, leaves), leaves // 10)
    return leaves, min(search, leaves)


def _build_scann(keys: np.ndarray, cfg: IndexConfig) -> KeyIndex:
    import scann

    n, d = keys.shape
    leaves, search = _scann_params(cfg, n)
    builder = scann.scann_ops_pybind.builder(keys, 10, "dot_product")
    if cfg.threads:
        builder = builder.set_n_training_threads(cfg.threads)
    if n >= 2 * leaves and leaves > 1:
        builder = builder.tree(num_leaves=leaves, num_leaves_to_search=search, training_sample_size=min(n, 250_000))
    if n >= 256:  # asymmetric hashing needs enough keys to train its codebooks
        builder = builder.score_ah(2, anisotropic_quantization_threshold=0.2).reorder(
            cfg.scann_reorder, quantize=scann.ReorderType.INT8
        )
    else:
        builder = builder.score_brute_force()
    searcher = builder.build()
    with tempfile.TemporaryDirectory(prefix="specops-scann-") as tmp:
        searcher.serialize(tmp, relative_path=True)  # the assets name their files relative to the folder
        files = {name: (Path(tmp) / name).read_bytes() for name in sorted(os.listdir(tmp))}
    return KeyIndex(cfg, searcher, files, d, n)


SCANN_SUFFIXES = (".npy", ".pb", ".pbtxt")


def load_index(cfg: IndexConfig, files: dict[str, bytes], dims: int, size: int) -> KeyIndex:
    """Rebuild an index from the bytes :func:`build_index` produced. Only FAISS's own binary
    format and ScaNN's numpy arrays and text protobuf are read; a pickle is refused."""
    if cfg.kind == "scann":
        import scann
        from scann.scann_ops.py import scann_ops_pybind as ops

        bad = [name for name in files if not name.endswith(SCANN_SUFFIXES) or "/" in name or name.startswith(".")]
        if bad or "scann_assets.pbtxt" not in files:
            raise ValueError(
                f"ScaNN index files {sorted(files)}: expected .npy arrays, protobufs and scann_assets.pbtxt only"
            )
        with tempfile.TemporaryDirectory(prefix="specops-scann-") as tmp:
            for name, blob in files.items():
                (Path(tmp) / name).write_bytes(blob)
            for name in files:  # refuse object arrays before ScaNN opens them (np.load without pickles)
                if name.endswith(".npy"):
                    np.load(Path(tmp) / name, allow_pickle=False, mmap_mode="r")
            pbtxt = (Path(tmp) / "scann_assets.pbtxt").read_text()
            # ScaNN's load_searcher would unpickle a docids file; build the searcher from the assets directly.
            searcher = ops.ScannSearcher(scann.scann_ops_pybind.scann_pybind.ScannNumpy(tmp, pbtxt))
        return KeyIndex(cfg, searcher, dict(files), dims, size)
    if set(files) != {"faiss.index"}:
        raise ValueError(f"FAISS index files {sorted(files)}: expected faiss.index only")
    faiss = _faiss()
    index = faiss.deserialize_index(np.frombuffer(files["faiss.index"], dtype=np.uint8))
    if index.d != dims or index.ntotal != size:
        raise ValueError(f"index has {index.ntotal} keys of {index.d} dims; the datastore says {size} of {dims}")
    return _faiss_index(index, cfg, dims, size)


def config_from_json(blob: str | dict) -> IndexConfig:
    data = json.loads(blob) if isinstance(blob, str) else dict(blob)
    return IndexConfig(**{k: v for k, v in data.items() if k in IndexConfig.__dataclass_fields__})

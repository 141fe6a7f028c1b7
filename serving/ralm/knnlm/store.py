"""The kNN-LM datastore (Khandelwal et al., 2020; served speculatively as in RaLMSpec §5.3).

**Entries.** For every position ``t`` of every document of a corpus, the key is the target's
hidden state at ``t`` before the LM head (the final norm's output: what ``lm_head``
multiplies), the value is token ``t+1``, and the entry records its document, so that "the
next n entries after a neighbour" (the speculative cache's spatial locality) never crosses
into another document. Entries of one document are consecutive. Documents longer than
``max_doc_len`` are split into windows of that many tokens, each its own document.

**Keys are stored float16** (2 bytes a dimension, half of float32) and searched in float32
(the float16 values, widened): the searcher never depends on how a key was rounded, only on
the stored value. ``tests/serving/ralm/knnlm/test_decode.py`` checks that float16 and float32 keys give
the same greedy outputs on the tiny model. On the bootstrapped SmolLM2-135M target (6,172
keys of prose, 300 other positions as queries) float16 keys found the float32 nearest
neighbour for every query and 99.94 % of the top 16, the nearest squared distance moving by
1e-4 (median, relative; at most 2e-3): hidden-state entries stay under 60, well inside float16.

**Search** is by squared L2 distance (Khandelwal et al.), ``exact`` or ``ivfpq``
(:mod:`specops.serving.ralm.knnlm.search`: a query's neighbours never depend on its batch); an
``ivfpq`` datastore keeps product-quantised codes (``pq_m`` bytes a key) instead of the
float16 keys. :mod:`specops.serving.ralm.knnlm.decode` builds the distribution and decodes.

**On disk** (the registry kind ``knnlm``, format ``specops-knnlm/1``; safetensors and JSON,
nothing is unpickled): ``knnlm.safetensors`` (``values`` [N] int32, ``entry_doc`` [N] int32,
``keys`` [N, hidden] float16 for ``exact``), ``index.safetensors`` (FAISS's own bytes, for
``ivfpq``) and ``knnlm.json`` (config, sizes, the sha256 of every file, the target's and the
tokenizer's fingerprints, and a sha256 of the JSON itself). A corrupt file, or a datastore
built for another target, raises :class:`KnnDatastoreError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specops.core.errors import DatastoreError
from specops.registry.artifacts import KNNLM_FORMAT as FORMAT
from specops.registry.artifacts import sha256_file, sha256_json
from specops.serving.ralm.knnlm.search import ExactSearcher, IvfpqSearcher, Neighbours, build_ivfpq

log = logging.getLogger(__name__)

DATA_FILE, INDEX_FILE, META_FILE = "knnlm.safetensors", "index.safetensors", "knnlm.json"
SEARCHERS = ("exact", "ivfpq")
KEY_DTYPES = {"float16": torch.float16, "float32": torch.float32}
MAX_K = 1024


class KnnDatastoreError(DatastoreError):
    """A kNN-LM datastore is malformed, corrupt, or was built for another target or tokenizer."""

    code = "knnlm_datastore"


@dataclass(frozen=True)
class KnnBuildConfig:
    """How a kNN-LM datastore is built (and, for ``ivfpq``, searched)."""

    index: str = "exact"
    """``exact`` (blocked matmul over every key) or ``ivfpq`` (FAISS IndexIVFPQ)."""
    key_dtype: str = "float16"
    """How ``exact`` stores keys: ``float16`` (default) or ``float32``."""
    max_doc_len: int = 1024
    """Longer documents are split into windows of this many tokens."""
    batch_tokens: int = 4096
    """Tokens per target forward while making keys."""
    nlist: int = 0
    """ivfpq: inverted lists; 0 = about sqrt(entries)."""
    pq_m: int = 0
    """ivfpq: bytes per key code; 0 = hidden / 8 (rounded to a divisor of the hidden size)."""
    pq_bits: int = 8
    nprobe: int = 16
    """ivfpq: lists searched per query (changeable at load time)."""
    train_sample: int = 65_536
    """ivfpq: keys sampled (seeded) to train the coarse quantizer and the PQ codebooks."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.index not in SEARCHERS:
            raise ValueError(f"kNN-LM index {self.index!r}: choose one of {', '.join(SEARCHERS)}")
        if self.key_dtype not in KEY_DTYPES:
            raise ValueError(f"key_dtype {self.key_dtype!r}: choose one of {', '.join(KEY_DTYPES)}")
        if self.max_doc_len < 2 or self.batch_tokens < 2 or self.nprobe < 1 or not 1 <= self.pq_bits <= 16:
            raise ValueError("max_doc_len and batch_tokens must be >= 2, nprobe >= 1, pq_bits in 1..16")


def target_fingerprint(target) -> str:
    """sha256 of what makes a target's hidden states: its config (without volatile fields) and a
    strided sample of its final norm and LM head, rounded to bfloat16 so that a float32 and a
    bfloat16 load of one checkpoint agree (hashing every weight would take seconds)."""
    cfg = target.config.to_dict()
    for volatile in (
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
    ):
        cfg.pop(volatile, None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    tensors = [target.get_output_embeddings().weight]
    norm = getattr(getattr(target, "model", None), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        tensors.append(norm.weight)
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 65_536)].to("cpu", torch.bfloat16).float()
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- the datastore
@dataclass
class KnnBuildStats:
    num_docs: int = 0
    num_tokens: int = 0
    num_entries: int = 0
    embed_s: float = 0.0
    index_s: float = 0.0
    total_s: float = 0.0

    @property
    def embed_tokens_per_s(self) -> float:
        return self.num_tokens / self.embed_s if self.embed_s else 0.0


@dataclass
class KnnDatastore:
    """Values, per-entry documents and a searcher; immutable once built."""

    cfg: KnnBuildConfig
    values: torch.Tensor
    """[N] int64: entry ``i``'s next token."""
    entry_doc: torch.Tensor
    """[N] int32: entry ``i``'s document (entries of a document are consecutive)."""
    hidden_size: int
    searcher: ExactSearcher | IvfpqSearcher
    target_sha256: str = ""
    tokenizer_sha256: str = ""
    index_bytes: bytes = b""
    """FAISS's serialised index (ivfpq only), as saved."""
    meta: dict = field(default_factory=dict)
    build_stats: KnnBuildStats | None = None

    @property
    def num_entries(self) -> int:
        return int(self.values.shape[0])

    @property
    def stored_keys(self) -> torch.Tensor | None:
        """[N, hidden] the keys as saved (exact only): the searcher's float32 copy cast back to
        ``key_dtype`` (lossless: they were widened from it), so memory holds one copy."""
        if not isinstance(self.searcher, ExactSearcher):
            return None
        return self.searcher.keys[: self.num_entries].to("cpu", KEY_DTYPES[self.cfg.key_dtype])

    @property
    def num_bytes(self) -> int:
        """Bytes the artifact stores (keys or index codes, values, documents)."""
        width = KEY_DTYPES[self.cfg.key_dtype].itemsize
        keys = self.num_entries * self.hidden_size * width if isinstance(self.searcher, ExactSearcher) else 0
        return keys + len(self.index_bytes) + 4 * self.num_entries * 2

    @property
    def bytes_per_entry(self) -> float:
        return self.num_bytes / max(1, self.num_entries)

    def search(self, hidden: torch.Tensor, k: int) -> Neighbours:
        """The ``k`` nearest entries to target hidden states ``hidden`` [n, hidden]."""
        assert hidden.ndim == 2 and hidden.shape[1] == self.hidden_size, (hidden.shape, self.hidden_size)
        return self.searcher.search(hidden, k)

    def next_entries(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """``ids`` and the up-to-``n`` entries after each, in the same document (RaLMSpec §5.3's
        spatial locality); -1s dropped, duplicates kept (the cache merges them)."""
        ids = ids.reshape(-1).cpu()
        ids = ids[ids >= 0]
        if n <= 0 or not len(ids):
            return ids
        nxt = ids[:, None] + torch.arange(n + 1)[None]  # [m, n+1]
        ok = nxt < self.num_entries
        nxt = nxt.clamp(max=self.num_entries - 1)
        ok &= self.entry_doc[nxt] == self.entry_doc[ids][:, None]
        return nxt[ok]

    def check_fits(self, target, tokenizer_sha256: str | None = None) -> None:
        """Refuse a datastore built for another target or tokenizer."""
        hidden = int(target.config.hidden_size)
        if hidden != self.hidden_size:
            raise KnnDatastoreError(
                f"kNN-LM keys are hidden states of size {self.hidden_size}; this target's are "
                f"{hidden}: the datastore was built for another model"
            )
        got = target_fingerprint(target)
        if self.target_sha256 and got != self.target_sha256:
            raise KnnDatastoreError(
                f"kNN-LM datastore was built with target {self.target_sha256[:12]}, this target is "
                f"{got[:12]}: rebuild it with `specops knnlm build` for this model"
            )
        if tokenizer_sha256 and self.tokenizer_sha256 and tokenizer_sha256 != self.tokenizer_sha256:
            raise KnnDatastoreError(
                f"kNN-LM datastore was built with tokenizer {self.tokenizer_sha256[:12]}, this "
                f"target's is {tokenizer_sha256[:12]}"
            )
        vocab = int(target.config.vocab_size)
        if self.num_entries and int(self.values.max()) >= vocab:
            raise KnnDatastoreError(
                f"kNN-LM datastore holds token {int(self.values.max())}, past the vocabulary of {vocab}"
            )

    def describe(self) -> dict:
        out = {
            "searcher": self.searcher.kind,
            "num_entries": self.num_entries,
            "hidden_size": self.hidden_size,
            "num_docs": int(self.entry_doc.max()) + 1 if self.num_entries else 0,
            "bytes_per_entry": round(self.bytes_per_entry, 1),
            "config": asdict(self.cfg),
            "target_sha256": self.target_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "meta": self.meta,
        }
        if self.searcher.kind == "ivfpq":
            out["nprobe"] = self.searcher.nprobe
        return out

    # ------------------------------------------------------------ files
    def save(self, out_dir: Path) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {"values": self.values.to(torch.int32), "entry_doc": self.entry_doc.to(torch.int32)}
        if isinstance(self.searcher, ExactSearcher):
            tensors["keys"] = self.stored_keys.contiguous()
        save_file(tensors, str(out_dir / DATA_FILE))
        files = [DATA_FILE]
        if self.index_bytes:
            save_file(
                {"faiss.index": torch.frombuffer(bytearray(self.index_bytes), dtype=torch.uint8)},
                str(out_dir / INDEX_FILE),
            )
            files.append(INDEX_FILE)
        meta = {
            "format": FORMAT,
            "config": asdict(self.cfg),
            "hidden_size": self.hidden_size,
            "num_entries": self.num_entries,
            "bytes_per_entry": round(self.bytes_per_entry, 2),
            "target_sha256": self.target_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "files": {name: sha256_file(out_dir / name) for name in files},
            "meta": self.meta,
        }
        meta["json_sha256"] = _json_sha(meta)
        (out_dir / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        return out_dir

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        target=None,
        tokenizer_sha256: str | None = None,
        nprobe: int | None = None,
        device: str | torch.device = "cpu",
    ) -> KnnDatastore:
        """Read a saved datastore, checking every sha256; with ``target``, refuse one built for
        another target (or tokenizer). Raises KnnDatastoreError."""
        path = Path(path)
        try:
            meta = json.loads((path / META_FILE).read_text())
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise ValueError(
                    f"format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT}"
                )
            if meta.get("json_sha256") != _json_sha({k: v for k, v in meta.items() if k != "json_sha256"}):
                raise ValueError(f"{META_FILE} does not match its own sha256: corrupt or edited")
            for name, want in meta["files"].items():
                if name not in (DATA_FILE, INDEX_FILE):
                    raise ValueError(f"unexpected file {name!r}")
                if sha256_file(path / name) != want:
                    raise ValueError(f"{name} does not match its sha256: corrupt or tampered")
            cfg = KnnBuildConfig(**meta["config"])
            data = load_file(str(path / DATA_FILE))
            values, entry_doc = data["values"].long(), data["entry_doc"]
            n, hidden = int(meta["num_entries"]), int(meta["hidden_size"])
            if values.shape != (n,) or entry_doc.shape != (n,) or entry_doc.dtype != torch.int32:
                raise ValueError(f"values {tuple(values.shape)} / entry_doc {tuple(entry_doc.shape)}, expected ({n},)")
            if n and (int(values.min()) < 0 or int(entry_doc.min()) < 0 or bool((entry_doc.diff() < 0).any())):
                raise ValueError("negative tokens or documents, or entries of a document not consecutive")
            blob = b""
            if cfg.index == "exact":
                stored_keys = data.pop("keys")
                if stored_keys.shape != (n, hidden) or stored_keys.dtype != KEY_DTYPES[cfg.key_dtype]:
                    raise ValueError(
                        f"keys {tuple(stored_keys.shape)} {stored_keys.dtype}, expected ({n}, {hidden}) {cfg.key_dtype}"
                    )
                searcher = ExactSearcher(stored_keys, device)
            else:
                import faiss

                blob = load_file(str(path / INDEX_FILE))["faiss.index"].numpy().tobytes()
                index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
                if index.d != hidden or index.ntotal != n:
                    raise ValueError(f"index holds {index.ntotal} keys of {index.d} dims; expected {n} of {hidden}")
                searcher = IvfpqSearcher(index, nprobe or cfg.nprobe)
        except KnnDatastoreError:
            raise
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise KnnDatastoreError(f"{path} is not a usable kNN-LM datastore: {exc}") from exc
        store = cls(
            cfg,
            values,
            entry_doc,
            hidden,
            searcher,
            meta.get("target_sha256", ""),
            meta.get("tokenizer_sha256", ""),
            blob,
            meta.get("meta", {}),
        )
        if target is not None:
            store.check_fits(target, tokenizer_sha256)
        return store


def _json_sha(meta: dict) -> str:
    return sha256_json(meta)


# ---------------------------------------------------------------- build
def split_documents(docs: Sequence[Sequence[int]], max_len: int) -> list[list[int]]:
    """Documents as windows of at most ``max_len`` tokens; windows under 2 tokens dropped."""
    out = []
    for d in docs:
        d = [int(t) for t in d]
        out.extend(d[i : i + max_len] for i in range(0, len(d), max_len) if len(d[i : i + max_len]) >= 2)
    return out


def build_knnlm(
    target,
    docs: Sequence[Sequence[int]],
    *,
    index: str = "exact",
    cfg: KnnBuildConfig | None = None,
    tokenizer_sha256: str = "",
    meta: dict | None = None,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> KnnDatastore:
    """A datastore over ``docs`` (token-id lists): the target's hidden state at each position
    but a document's last (batched forwards, a tqdm bar counting tokens), the next token, the
    document; then the searcher. ``cfg.index`` wins over ``index`` when ``cfg`` is given."""
    from tqdm import tqdm

    from specops.core.keys import target_hidden_states

    cfg = cfg or KnnBuildConfig(index=index)
    t_start = time.perf_counter()
    docs = split_documents(docs, cfg.max_doc_len)
    if not docs:
        raise KnnDatastoreError("no document of at least 2 tokens to build a kNN-LM datastore from")
    vocab = int(target.config.vocab_size)
    if max(max(d) for d in docs) >= vocab or min(min(d) for d in docs) < 0:
        raise KnnDatastoreError(f"documents hold token ids outside the target's vocabulary of {vocab}")
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths - 1)])
    n, hidden_size = int(starts[-1]), int(target.config.hidden_size)
    stats = KnnBuildStats(num_docs=len(docs), num_tokens=int(lengths.sum()), num_entries=n)
    store_dtype = KEY_DTYPES[cfg.key_dtype] if cfg.index == "exact" else torch.float32
    keys = torch.empty((n, hidden_size), dtype=store_dtype)
    values = torch.from_numpy(np.concatenate([np.asarray(d[1:], dtype=np.int64) for d in docs]))
    entry_doc = torch.from_numpy(np.repeat(np.arange(len(docs), dtype=np.int32), lengths - 1))

    # 1. keys: hidden states at every position with a next token
    t0 = time.perf_counter()
    with tqdm(total=stats.num_tokens, unit="tok", desc="kNN-LM keys", disable=not progress) as bar:
        for i, h in target_hidden_states(target, docs, max_len=cfg.max_doc_len, batch_tokens=cfg.batch_tokens):
            keys[starts[i] : starts[i + 1]] = torch.from_numpy(h[:-1]).to(store_dtype)
            bar.update(len(docs[i]))
    if not bool(torch.isfinite(keys).all()):
        raise KnnDatastoreError(
            f"a hidden state does not fit {store_dtype} (overflow or NaN); build with key_dtype=float32"
        )
    stats.embed_s = time.perf_counter() - t0

    # 2. the searcher
    t0 = time.perf_counter()
    blob = b""
    if cfg.index == "exact":
        searcher = ExactSearcher(keys, device)
    else:
        import faiss

        ivf = build_ivfpq(
            keys.numpy(),
            nlist=cfg.nlist,
            pq_m=cfg.pq_m,
            pq_bits=cfg.pq_bits,
            nprobe=cfg.nprobe,
            train_sample=cfg.train_sample,
            seed=cfg.seed,
        )
        blob = faiss.serialize_index(ivf).tobytes()
        searcher = IvfpqSearcher(ivf, cfg.nprobe)
    del keys
    stats.index_s = time.perf_counter() - t0
    stats.total_s = time.perf_counter() - t_start
    info = {
        "num_docs": stats.num_docs,
        "num_tokens": stats.num_tokens,
        "embed_s": round(stats.embed_s, 3),
        "index_s": round(stats.index_s, 3),
        **(meta or {}),
    }
    store = KnnDatastore(
        cfg, values, entry_doc, hidden_size, searcher, target_fingerprint(target), tokenizer_sha256, blob, info, stats
    )
    log.info(
        "kNN-LM datastore: %d entries from %d documents, %s, %.0f bytes/entry; keys %.1fs, index %.1fs",
        n,
        stats.num_docs,
        cfg.index,
        store.bytes_per_entry,
        stats.embed_s,
        stats.index_s,
    )
    return store


# ---------------------------------------------------------------- registry
def register_knnlm(
    registry,
    name: str,
    store: KnnDatastore,
    *,
    tags: dict | None = None,
    metrics: dict | None = None,
    lineage: dict | None = None,
):
    """Register ``store`` as a new version of ``knnlm-<name>`` (alias ``challenger``), stamped
    with its searcher, sizes and the target's and tokenizer's fingerprints; returns the version."""
    with tempfile.TemporaryDirectory(prefix="specops-knnlm-") as tmp:
        store.save(Path(tmp) / "knnlm")
        return registry.artifact("knnlm").register(
            name,
            Path(tmp) / "knnlm",
            meta={"searcher": store.cfg.index, "target_sha256": store.target_sha256},
            tags={
                "searcher": store.cfg.index,
                "target_sha256": store.target_sha256,
                "tokenizer_sha256": store.tokenizer_sha256,
                **(tags or {}),
            },
            metrics={
                "num_entries": float(store.num_entries),
                "bytes_per_entry": store.bytes_per_entry,
                **({"embed_tokens_per_s": store.build_stats.embed_tokens_per_s} if store.build_stats else {}),
                **(metrics or {}),
            },
            lineage=lineage,
        )


def load_knnlm(
    registry,
    name: str,
    *,
    alias: str = "champion",
    version: str | None = None,
    target=None,
    tokenizer_sha256: str | None = None,
    nprobe: int | None = None,
    device: str | torch.device = "cpu",
):
    """``(store, version)``: ``knnlm-<name>`` at ``version`` (or ``alias``), fetched, verified
    (the registry's manifest, then every sha256 of the datastore) and checked against
    ``target``. Raises KnnDatastoreError when there is no such version."""
    kind = registry.artifact("knnlm")
    v = kind.get(name, version) if version else kind.by_alias(name, alias)
    if v is None:
        raise KnnDatastoreError(
            f"knnlm-{name} has no version with alias {alias!r}; build one with `specops knnlm build --name {name}`"
        )
    with tempfile.TemporaryDirectory(prefix="specops-knnlm-") as tmp:
        kind.fetch(v, Path(tmp) / "knnlm")
        store = KnnDatastore.load(
            Path(tmp) / "knnlm", target=target, tokenizer_sha256=tokenizer_sha256, nprobe=nprobe, device=device
        )
    return store, v

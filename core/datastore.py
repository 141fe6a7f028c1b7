"""The DReSD datastore: keys from the target's hidden states, values the next tokens (DReSD §3.5).

Entries: every position ``t`` of every document (a prompt and the target's output, or
corpus text) that has a next token. Its key is the target's hidden state at ``t`` through
the :class:`~specops.core.keys.Projection`; its value is ``x_{t+1} .. x_{t+N}``, cut at
the document's end (``N = value_len``, 20). Values are not stored per entry: the documents'
tokens are stored once (4 bytes a token) and an entry is its position (4 bytes).

Drafting (:meth:`Datastore.drafts`): search the ``search_k`` nearest keys to the query (the
target's hidden state after the last committed token), keep values whose first token is the
target's next token (the bonus it just emitted), drop that token, and return the first
``n_drafts`` distinct rows, nearest first.

On disk (a registry ``datastore`` artifact, safetensors and JSON only):

- ``datastore.safetensors``: ``tokens`` [T] int32, ``doc_ends`` [D] int64, ``entry_pos`` [M]
  int32, ``znorm_mean``, ``znorm_scale``, ``pca_components``, ``pca_explained``;
- ``index.safetensors``: one uint8 tensor per index file (FAISS's binary index or ScaNN's
  assets), the raw bytes;
- ``datastore.json``: config, sizes, lineage, the sha256 of both files above and of every
  index file, and a sha256 of its own content.

:meth:`Datastore.load` checks all of it before anything is used (a flipped byte anywhere is
refused, naming the file), then the values: token ids >= 0 (and below the target's vocabulary
in :meth:`Datastore.check_fits`), documents and entries inside the tokens, sizes as described,
the projection finite. A datastore of the first format (``specops-dresd/1``, written before
the files were checksummed) is refused with a message to rebuild it: it cannot be verified, and
a rebuild is one command (``specops datastore build``) or the trainer's next rebuild.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specops.core.errors import DatastoreError
from specops.core.index import IndexConfig, KeyIndex, build_index, config_from_json, load_index
from specops.core.keys import Projection, target_hidden_states
from specops.registry.artifacts import sha256_file, sha256_json

log = logging.getLogger(__name__)

FORMAT = "specops-dresd/2"
UNVERIFIABLE_FORMATS = ("specops-dresd/1",)
"""Formats of datastores whose files carry no checksum: refused, to be rebuilt."""
DATA_FILE, INDEX_FILE, META_FILE = "datastore.safetensors", "index.safetensors", "datastore.json"


@dataclass(frozen=True)
class DatastoreConfig:
    """How a datastore is built and searched."""

    dims: int = 64
    """PCA dimensions ``l`` of a key (DReSD Table 2: 64; 32 and 128 measured in benchmarks/dresd.py)."""
    value_len: int = 20
    """Tokens stored after each key (``N``); a draft is at most ``value_len - 1`` long."""
    fit_sample: int = 200_000
    """Hidden states sampled (uniformly, seeded) to fit z-norm and PCA."""
    max_doc_len: int = 1024
    """Documents are cut to this many tokens (the paper's 1,024)."""
    batch_tokens: int = 4096
    """Tokens per target forward while making keys."""
    index: IndexConfig = field(default_factory=IndexConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dims < 2 or self.value_len < 2 or self.fit_sample < 2 or self.max_doc_len < 2:
            raise ValueError("dims, value_len, fit_sample and max_doc_len must each be >= 2")
        if isinstance(self.index, dict):
            object.__setattr__(self, "index", config_from_json(self.index))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DatastoreConfig:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class BuildStats:
    """What a build did and how long each stage took."""

    num_docs: int = 0
    num_tokens: int = 0
    num_entries: int = 0
    embed_s: float = 0.0
    fit_s: float = 0.0
    index_s: float = 0.0

    @property
    def embed_tokens_per_s(self) -> float:
        return self.num_tokens / self.embed_s if self.embed_s else 0.0


class Datastore:
    """Keys, values and an index; immutable once built (a rebuild makes a new one)."""

    def __init__(
        self,
        cfg: DatastoreConfig,
        tokens: np.ndarray,
        doc_ends: np.ndarray,
        entry_pos: np.ndarray,
        projection: Projection,
        index: KeyIndex,
        meta: dict | None = None,
    ) -> None:
        assert tokens.ndim == doc_ends.ndim == entry_pos.ndim == 1
        assert index.size == len(entry_pos) and index.dims == projection.dims, (index.size, len(entry_pos))
        self.cfg, self.tokens, self.doc_ends, self.entry_pos = cfg, tokens, doc_ends, entry_pos
        self.projection, self.index = projection, index
        self.meta = dict(meta or {})
        # Each entry's value ends at its document's end.
        self._entry_end = doc_ends[np.searchsorted(doc_ends, entry_pos, side="right")].astype(np.int64)
        self._suffix = None
        self._suffix_lock = threading.Lock()

    def suffix_index(self):
        """REST's exact-match index over this datastore's tokens (``specops.core.suffix``), built on first
        use (about a second per million tokens; loaders call it off the request path) and kept."""
        if self._suffix is None:
            with self._suffix_lock:
                if self._suffix is None:
                    from specops.core.suffix import SuffixIndex

                    self._suffix = SuffixIndex(self.tokens, self.doc_ends)
        return self._suffix

    # ------------------------------------------------------------ sizes
    @property
    def num_entries(self) -> int:
        return int(len(self.entry_pos))

    @property
    def hidden_size(self) -> int:
        return self.projection.hidden_size

    @property
    def num_bytes(self) -> int:
        """Bytes of everything the artifact stores (tokens, positions, projection, index)."""
        arrays = (
            self.tokens,
            self.doc_ends,
            self.entry_pos,
            self.projection.mean,
            self.projection.scale,
            self.projection.components,
            self.projection.explained,
        )
        return int(sum(a.nbytes for a in arrays)) + self.index.num_bytes

    @property
    def bytes_per_entry(self) -> float:
        return self.num_bytes / max(1, self.num_entries)

    # ------------------------------------------------------------ search
    def values(self, ids: np.ndarray, length: int) -> list[np.ndarray]:
        """The first ``length`` value tokens of entries ``ids`` (ids < 0 give empty values)."""
        out = []
        for i in ids.tolist():
            if i < 0:
                out.append(self.tokens[:0])
                continue
            start = int(self.entry_pos[i]) + 1
            out.append(self.tokens[start : min(start + length, int(self._entry_end[i]))])
        return out

    def search(self, hidden: np.ndarray | torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Ids [n, k] of the entries nearest to the target hidden states ``hidden`` [n, hidden],
        and their cosine similarities [n, k]."""
        return self.index.search(self.projection.apply(hidden), k)

    def drafts(
        self,
        hidden: np.ndarray | torch.Tensor,
        next_token: int,
        *,
        n_drafts: int,
        length: int,
        search_k: int = 0,
        min_similarity: float = -1.0,
    ) -> list[list[int]]:
        """Up to ``n_drafts`` distinct draft rows of up to ``length`` tokens to follow
        ``next_token``, the target's token after the state ``hidden`` [hidden] (DReSD's
        first-token filter), from neighbours at least ``min_similarity`` close. Nearest first;
        rows that are a prefix of a nearer row are dropped (the token tree would merge them)."""
        search_k = search_k or max(32, 8 * n_drafts)
        query = (
            hidden.reshape(1, -1) if isinstance(hidden, torch.Tensor) else np.asarray(hidden, np.float32).reshape(1, -1)
        )
        ids, sims = self.search(query, search_k)
        ids = ids[0][sims[0] >= min_similarity]
        rows: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for value in self.values(ids, length + 1):
            if len(value) < 2 or int(value[0]) != next_token:
                continue
            row = tuple(int(t) for t in value[1:])
            if any(r[: len(row)] == row for r in seen) or row in seen:
                continue
            seen.add(row)
            rows.append(list(row))
            if len(rows) == n_drafts:
                break
        return rows

    # ------------------------------------------------------------ build
    @classmethod
    def build(
        cls,
        target,
        docs: Sequence[Sequence[int]],
        cfg: DatastoreConfig | None = None,
        *,
        meta: dict | None = None,
        progress: Callable[[int], None] | None = None,
        hidden: Callable[[int], np.ndarray] | None = None,
    ) -> tuple[Datastore, BuildStats]:
        """Embed ``docs`` (token-id lists) with ``target``, fit the projection, index the keys.
        ``progress(n_tokens)`` is called after each embedded batch. ``hidden(i)`` ([len, hidden]
        float32 for document ``i`` as given, cut to ``max_doc_len``) skips the target pass when the
        caller has the states already (benchmarks building nested datastores; other key layers)."""
        cfg = cfg or DatastoreConfig()
        keep = [i for i, d in enumerate(docs) if len(d) >= 2]
        docs = [list(map(int, docs[i][: cfg.max_doc_len])) for i in keep]
        if not docs:
            raise DatastoreError("no document of at least 2 tokens to build a datastore from")
        stats = BuildStats(num_docs=len(docs))
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        doc_ends = np.cumsum(lengths)
        starts = doc_ends - lengths
        tokens = np.fromiter((t for d in docs for t in d), dtype=np.int32, count=int(doc_ends[-1]))
        stats.num_tokens = int(len(tokens))

        # 1. Hidden states of every position but each document's last (it has no next token).
        t0 = time.perf_counter()
        given = hidden
        states = (
            ((j, given(i)[: len(docs[j])]) for j, i in enumerate(keep))
            if given is not None
            else target_hidden_states(target, docs, max_len=cfg.max_doc_len, batch_tokens=cfg.batch_tokens)
        )
        hidden_size = int(given(keep[0]).shape[1]) if given is not None else int(target.config.hidden_size)
        n_entries = int((lengths - 1).sum())
        hidden = np.empty((n_entries, hidden_size), dtype=np.float32)
        entry_start = np.concatenate([[0], np.cumsum(lengths - 1)])
        for i, h in states:
            hidden[entry_start[i] : entry_start[i + 1]] = h[:-1]
            if progress is not None:
                progress(len(docs[i]))
        entry_pos = np.concatenate([np.arange(s, e - 1) for s, e in zip(starts, doc_ends)]).astype(np.int32)
        stats.embed_s = time.perf_counter() - t0

        # 2. z-norm and PCA on a bounded sample; 3. keys; 4. the index.
        t0 = time.perf_counter()
        rng = np.random.default_rng(cfg.seed)
        sample = (
            hidden
            if n_entries <= cfg.fit_sample
            else hidden[np.sort(rng.choice(n_entries, cfg.fit_sample, replace=False))]
        )
        projection = Projection.fit(sample, cfg.dims)
        keys = projection.apply(hidden)
        del hidden
        if not np.isfinite(keys).all():
            raise DatastoreError("the target's hidden states give non-finite keys (NaN or inf): no datastore built")
        stats.fit_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        index = build_index(keys, cfg.index)
        stats.index_s = time.perf_counter() - t0
        stats.num_entries = n_entries
        info = {
            "num_docs": stats.num_docs,
            "num_tokens": stats.num_tokens,
            "num_entries": n_entries,
            "explained_variance": float(projection.explained.sum()),
            "embed_s": round(stats.embed_s, 3),
            "fit_s": round(stats.fit_s, 3),
            "index_s": round(stats.index_s, 3),
            **(meta or {}),
        }
        return cls(cfg, tokens, doc_ends, entry_pos, projection, index, info), stats

    # ------------------------------------------------------------ files
    def save(self, out_dir: Path) -> Path:
        """Write the three files into ``out_dir`` (created); return it."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(
            {
                "tokens": torch.from_numpy(self.tokens),
                "doc_ends": torch.from_numpy(self.doc_ends),
                "entry_pos": torch.from_numpy(self.entry_pos),
                **self.projection.tensors(),
            },
            str(out_dir / DATA_FILE),
        )
        save_file(
            {name: torch.frombuffer(bytearray(blob), dtype=torch.uint8) for name, blob in self.index.files.items()},
            str(out_dir / INDEX_FILE),
        )
        meta = {
            "format": FORMAT,
            "config": self.cfg.to_dict(),
            "config_hash": self.cfg.hash(),
            "hidden_size": self.hidden_size,
            "dims": self.projection.dims,
            "num_entries": self.num_entries,
            "num_tokens": int(len(self.tokens)),
            "num_docs": int(len(self.doc_ends)),
            "bytes_per_entry": round(self.bytes_per_entry, 2),
            "index_files": {name: hashlib.sha256(blob).hexdigest() for name, blob in self.index.files.items()},
            "files": {name: sha256_file(out_dir / name) for name in (DATA_FILE, INDEX_FILE)},
            "meta": self.meta,
        }
        meta["json_sha256"] = _json_sha(meta)
        (out_dir / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        return out_dir

    @classmethod
    def load(cls, path: Path) -> Datastore:
        """Read a saved datastore, verifying every sha256 first; a missing, corrupt, unverifiable
        or inconsistent file raises DatastoreError naming it."""
        path = Path(path)
        try:
            meta = _verified_meta(path)
            cfg = DatastoreConfig.from_dict(meta["config"])
            data = load_file(str(path / DATA_FILE))
            blobs = {name: t.numpy().tobytes() for name, t in load_file(str(path / INDEX_FILE)).items()}
            want = meta["index_files"]
            if set(blobs) != set(want):
                raise ValueError(f"{INDEX_FILE} holds {sorted(blobs)}, {META_FILE} lists {sorted(want)}")
            for name, blob in blobs.items():
                if hashlib.sha256(blob).hexdigest() != want[name]:
                    raise ValueError(f"index file {name} does not match its sha256: corrupt or tampered")
            projection = Projection.from_tensors(data)
            tokens, doc_ends, entry_pos = (data[n].numpy() for n in ("tokens", "doc_ends", "entry_pos"))
            _check_values(meta, projection, tokens, doc_ends, entry_pos)
            index = load_index(cfg.index, blobs, projection.dims, len(entry_pos))
        except DatastoreError:
            raise
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError) as exc:
            raise DatastoreError(f"{path} is not a usable datastore: {exc}") from exc
        return cls(cfg, tokens, doc_ends, entry_pos, projection, index, meta.get("meta", {}))

    def check_fits(self, target, vocab_size: int | None = None) -> None:
        """Refuse a datastore built for another target (hidden size, vocabulary)."""
        hidden = int(target.config.hidden_size)
        if hidden != self.hidden_size:
            raise DatastoreError(
                f"datastore keys come from hidden states of size {self.hidden_size}; this target's "
                f"are {hidden}: it was built for another model"
            )
        vocab = vocab_size or int(target.config.vocab_size)
        if len(self.tokens) and (int(self.tokens.max()) >= vocab or int(self.tokens.min()) < 0):
            bad = int(self.tokens.max()) if int(self.tokens.max()) >= vocab else int(self.tokens.min())
            raise DatastoreError(f"datastore holds token id {bad}, outside this target's vocabulary [0, {vocab})")

    def describe(self) -> dict:
        return {
            "num_entries": self.num_entries,
            "num_tokens": int(len(self.tokens)),
            "num_docs": int(len(self.doc_ends)),
            "dims": self.projection.dims,
            "hidden_size": self.hidden_size,
            "explained_variance": round(float(self.projection.explained.sum()), 4),
            "bytes_per_entry": round(self.bytes_per_entry, 1),
            "index": self.index.describe(),
            "config_hash": self.cfg.hash(),
            "meta": self.meta,
        }


# ---------------------------------------------------------------- verification
def _json_sha(meta: dict) -> str:
    return sha256_json(meta, without="json_sha256")


def _verified_meta(path: Path) -> dict:
    """``datastore.json``, after checking its own sha256 and every file's; raises DatastoreError naming the file."""
    from specops.registry.artifacts import MANIFEST

    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise DatastoreError(f"{meta_path} is not readable JSON: {exc}") from exc
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt in UNVERIFIABLE_FORMATS:
        raise DatastoreError(
            f"{meta_path} is format {fmt}, which has no checksums of its files, so it cannot be "
            f"verified: rebuild it (`specops datastore build`, or the trainer's next rebuild)"
        )
    if fmt != FORMAT:
        raise DatastoreError(f"{meta_path}: format {fmt!r}, expected {FORMAT}")
    if meta.get("json_sha256") != _json_sha(meta):
        raise DatastoreError(f"{meta_path} does not match its own sha256: corrupt or edited")
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != {DATA_FILE, INDEX_FILE}:
        raise DatastoreError(f"{meta_path} must list the sha256 of exactly {DATA_FILE} and {INDEX_FILE}")
    present = {p.name for p in path.iterdir()} - {META_FILE, MANIFEST}
    if present != set(files):
        raise DatastoreError(
            f"{path}: files not listed in {META_FILE}: {sorted(present - set(files))}; "
            f"missing: {sorted(set(files) - present)}"
        )
    for name, want in files.items():
        if sha256_file(path / name) != want:
            raise DatastoreError(f"{path / name} does not match its sha256 in {META_FILE}: corrupt or tampered")
    return meta


def _check_values(
    meta: dict, projection: Projection, tokens: np.ndarray, doc_ends: np.ndarray, entry_pos: np.ndarray
) -> None:
    """Dtypes, sizes as described, ranges, finite numbers: raises ValueError naming what is wrong."""
    where = f"{DATA_FILE}:"
    if tokens.dtype != np.int32 or entry_pos.dtype != np.int32 or doc_ends.dtype != np.int64:
        raise ValueError(f"{where} tokens and entry_pos must be int32, doc_ends int64")
    sizes = {
        "num_tokens": len(tokens),
        "num_docs": len(doc_ends),
        "num_entries": len(entry_pos),
        "hidden_size": projection.hidden_size,
        "dims": projection.dims,
    }
    wrong = {k: (v, meta.get(k)) for k, v in sizes.items() if meta.get(k) != v}
    if wrong:
        raise ValueError(
            f"{where} sizes differ from {META_FILE}: " + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in wrong.items())
        )
    if len(tokens) and int(tokens.min()) < 0:
        raise ValueError(f"{where} token id {int(tokens.min())} is negative")
    if len(doc_ends) and (doc_ends[-1] != len(tokens) or doc_ends[0] < 1 or (np.diff(doc_ends) < 1).any()):
        raise ValueError(f"{where} doc_ends do not partition the tokens")
    if len(entry_pos) and (entry_pos.min() < 0 or entry_pos.max() >= len(tokens)):
        raise ValueError(f"{where} an entry points outside the tokens")
    arrays = {
        "znorm_mean": projection.mean,
        "znorm_scale": projection.scale,
        "pca_components": projection.components,
        "pca_explained": projection.explained,
    }
    bad = sorted(n for n, a in arrays.items() if not np.isfinite(a).all())
    if bad:
        raise ValueError(f"{where} {', '.join(bad)} hold NaN or infinite numbers")

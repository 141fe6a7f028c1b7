"""A cluster's past sessions on disk: the files of a registry ``sessions`` artifact.

One directory, safetensors and JSON only (nothing is unpickled)::

    sessions.safetensors   tokens [num_tokens] int32: the outputs, concatenated, oldest first
                           offsets [num_outputs + 1] int64: output i is tokens[offsets[i]:offsets[i + 1]]
    sessions.json          format, cluster, num_outputs, num_tokens, tokenizer_sha256, built_at,
                           the sha256 of sessions.safetensors, and the builder's extra fields
                           (the SessionCacheConfig hash, the spec.generations offsets read, the gate)

:func:`load_sessions` checks the checksum before parsing, then dtypes, shapes, offsets and
counts against the description; anything else raises :class:`SessionStoreError`. (The
registry's own manifest checks the files again when a version is fetched.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specops.core.errors import DatastoreError
from specops.registry.artifacts import sha256_file

FORMAT = "specops-llma-sessions/1"
DATA_FILE, META_FILE = "sessions.safetensors", "sessions.json"


class SessionStoreError(DatastoreError):
    """A saved past-sessions index is missing, corrupt, malformed or made for another tokenizer."""


@dataclass(frozen=True)
class SavedSessions:
    """A loaded ``sessions`` directory: the outputs, oldest first, and their description."""

    cluster: str
    docs: list[tuple[int, ...]]
    tokenizer_sha256: str
    manifest: dict = field(default_factory=dict)
    """All of ``sessions.json`` (``built_at``, ``extra``...)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(d) for d in self.docs)


def save_sessions(
    out_dir: Path, cluster: str, docs: Sequence[Sequence[int]], tokenizer_sha256: str = "", extra: dict | None = None
) -> Path:
    """Write ``docs`` (token ids, oldest first) into ``out_dir`` (created); return it."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = np.asarray([len(d) for d in docs], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths, dtype=np.int64)])
    tokens = np.fromiter((int(t) for d in docs for t in d), dtype=np.int64, count=int(offsets[-1]))
    if len(tokens) and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise SessionStoreError(f"sessions of {cluster}: token ids must be non-negative int32 values")
    save_file({"tokens": tokens.astype(np.int32), "offsets": offsets}, str(out_dir / DATA_FILE))
    meta = {
        "format": FORMAT,
        "cluster": cluster,
        "num_outputs": len(docs),
        "num_tokens": int(offsets[-1]),
        "tokenizer_sha256": tokenizer_sha256,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": {DATA_FILE: sha256_file(out_dir / DATA_FILE)},
        "extra": dict(extra or {}),
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return out_dir


def load_sessions(path: Path, *, vocab_size: int | None = None) -> SavedSessions:
    """Read a saved past-sessions index; refuse (``SessionStoreError``) a missing, corrupt or
    inconsistent file, or a token id outside ``vocab_size``."""
    from safetensors.numpy import load_file

    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT}")
        want = meta["files"][DATA_FILE]
        got = sha256_file(path / DATA_FILE)
        if got != want:
            raise ValueError(
                f"{DATA_FILE} has sha256 {got[:12]}, the description says {str(want)[:12]}: corrupt or tampered"
            )
        data = load_file(str(path / DATA_FILE))
        if set(data) != {"tokens", "offsets"}:
            raise ValueError(f"tensors {sorted(data)}, expected offsets and tokens")
        tokens, offsets = data["tokens"], data["offsets"]
        if tokens.dtype != np.int32 or offsets.dtype != np.int64 or tokens.ndim != 1 or offsets.ndim != 1:
            raise ValueError("tokens must be a 1-d int32 tensor and offsets a 1-d int64 tensor")
        if len(offsets) != int(meta["num_outputs"]) + 1 or len(tokens) != int(meta["num_tokens"]):
            raise ValueError(
                f"{len(offsets) - 1} outputs of {len(tokens)} tokens, the description says "
                f"{meta['num_outputs']} of {meta['num_tokens']}"
            )
        if offsets[0] != 0 or offsets[-1] != len(tokens) or (np.diff(offsets) < 0).any():
            raise ValueError("offsets do not partition the tokens")
        if len(tokens) and (tokens.min() < 0 or (vocab_size is not None and tokens.max() >= vocab_size)):
            raise ValueError(f"token ids outside the vocabulary (0..{vocab_size})")
    except SessionStoreError:
        raise
    except Exception as exc:  # OSError, JSON, KeyError, TypeError, safetensors' own error: all mean unusable
        raise SessionStoreError(f"{path} is not a usable past-sessions index: {exc}") from exc
    flat = tokens.tolist()
    docs = [tuple(flat[a:b]) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    return SavedSessions(str(meta.get("cluster", "")), docs, str(meta.get("tokenizer_sha256", "")), meta)

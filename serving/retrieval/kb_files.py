"""What every knowledge-base artifact shares, whatever its backend (``specops.serving.retrieval.kb``
in memory, ``specops.serving.retrieval.milvus.kb`` in a Milvus collection): ``kb.json`` and its
verification, the safetensors helpers, and the embedder a KB names (queries are always
embedded locally, by the embedder the KB was built with)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specops.core.errors import KBError
from specops.registry.artifacts import KB_FORMAT, MANIFEST, sha256_file, sha256_json
from specops.serving.retrieval.text_embed import HASH, MINILM, HashEmbedder, make_text_embedder

META_FILE, HASH_FILE = "kb.json", "hash_embedder.safetensors"
BACKEND_MEMORY, BACKEND_MILVUS = "memory", "milvus"
"""Where a KB's passages and vectors live: the artifact's own files, or a Milvus collection
that the artifact (then a manifest) names (``specops.serving.retrieval.milvus.kb``)."""


def canonical_sha(meta: dict) -> str:
    return sha256_json(meta, without="meta_sha256")


def save_tensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, str(path))


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    return {k: t.numpy() for k, t in load_file(str(path)).items()}


def read_meta(path: Path) -> dict:
    """``path/kb.json``, verified: its format, its own sha256, and the sha256 of every file it
    lists; a file it does not list (the registry's manifest aside) is refused."""
    meta = json.loads((path / META_FILE).read_bytes().decode("utf-8"))
    if not isinstance(meta, dict) or meta.get("format") != KB_FORMAT:
        raise KBError(f"format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {KB_FORMAT}")
    if meta.get("meta_sha256") != canonical_sha(meta):
        raise KBError(f"{META_FILE} does not match its own sha256: corrupt or edited")
    files = meta["files"]
    bad = sorted(
        n for n in files if "/" in n or "\\" in n or n.startswith(".") or not n.endswith((".safetensors", ".json"))
    )
    if bad:
        raise KBError(f"{META_FILE} lists files a KB never holds: {bad} (only safetensors and JSON)")
    present = {p.name for p in path.iterdir()} - {META_FILE, MANIFEST}
    if present != set(files):
        raise KBError(
            f"files not listed in {META_FILE}: {sorted(present - set(files))}; missing: {sorted(set(files) - present)}"
        )
    for name, want in files.items():
        if sha256_file(path / name) != want:
            raise KBError(f"{name} does not match its sha256: corrupt or tampered")
    return meta


def embedder_for(meta: dict, path: Path, dims: int):
    """The embedder the KB was built with; refused when this machine's differs (other MiniLM weights)."""
    spec = meta["embedder"]
    if spec["kind"] == HASH:
        embedder = HashEmbedder.from_tensors(load_tensors(path / HASH_FILE), dims)
    elif spec["kind"] == MINILM:
        embedder = make_text_embedder(MINILM)
    else:
        raise KBError(f"unknown embedder {spec['kind']!r}")
    if embedder.config_sha256 != spec["config_sha256"] or embedder.dim != dims:
        raise KBError(
            f"built with a {spec['kind']} embedder of config {spec['config_sha256'][:12]}; this one is "
            f"{embedder.config_sha256[:12]} ({embedder.dim} dims): its vectors would not match the KB's"
        )
    return embedder

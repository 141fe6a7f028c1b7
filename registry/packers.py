"""How each artifact kind's directory is packed for registration, and the tags it earns.

A packer copies what it is given into a staging directory with a checksummed manifest
(``specops.registry.artifacts``) and returns ``(manifest_sha256, version_tags, model_tags)``. Drafts
and routers check what their directories must hold and tag what serving filters on; every
other kind packs safetensors and JSON as they are (:func:`pack_any`). A new kind needs a
packer here only when its directory has rules of its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from specops.registry import artifacts
from specops.registry.errors import ArtifactFormatError
from specops.registry.kinds import ArtifactKind

Packed = tuple[str, dict[str, str], dict[str, str]]


def pack_any(kind: ArtifactKind, key: str, src_dir: Path, staging: Path, meta: dict | None) -> Packed:
    """Any kind: safetensors and JSON files, tagged with the kind and key."""
    sha = artifacts.pack_files(src_dir, staging, kind.format, meta={"key": key, **(meta or {})})
    return sha, {"kind": kind.name, "key": key}, {"kind": kind.name, "key": key}


def pack_draft(
    kind: ArtifactKind,
    cluster: str,
    model_dir: Path,
    staging: Path,
    meta: dict | None,
    *,
    tokenizer_sha256: str,
    tokenizer_dir: Path | None = None,
    config_sha256: str | None = None,
) -> Packed:
    """A draft model (``save_pretrained`` directory or trainer checkpoint) and its tokenizer."""
    sha = artifacts.pack(
        model_dir,
        staging,
        tokenizer_dir=tokenizer_dir,
        meta={"cluster": cluster, "tokenizer_sha256": tokenizer_sha256, **(meta or {})},
    )
    tags = {
        "cluster": cluster,
        "tokenizer_sha256": tokenizer_sha256,
        "config_sha256": config_sha256 or artifacts.config_hash(staging),
    }
    return sha, tags, {"cluster": cluster, "kind": "draft"}


def pack_router(kind: ArtifactKind, key: str, router_dir: Path, staging: Path, meta: dict | None) -> Packed:
    """A saved router (``router.safetensors`` + ``router.json``, ``specops.core.router.Router.save``),
    tagged with its cluster names and the embedder's kind and config hash."""
    info = router_info(Path(router_dir))
    sha = artifacts.pack_router(router_dir, staging, meta={**info, **(meta or {})})
    tags = {
        "kind": "router",
        "clusters": ",".join(info["clusters"]),
        "num_clusters": str(len(info["clusters"])),
        "embedder_kind": info["embedder_kind"],
        "embedder_sha256": info["embedder_sha256"],
        "config_sha256": info["embedder_sha256"],
    }
    return sha, tags, {"kind": "router"}


PACKERS: dict[str, Callable[..., Packed]] = {"draft": pack_draft, "router": pack_router}
"""Kinds with a packer of their own; any other kind uses :func:`pack_any`."""


def router_info(router_dir: Path) -> dict:
    """Cluster names and embedder of a saved router, read from its ``router.json``."""
    path = router_dir / "router.json"
    try:
        meta = json.loads(path.read_text())
        clusters = [str(c) for c in meta["clusters"]]
        embedder = meta["embedder"]
        info = {
            "clusters": clusters,
            "embedder_kind": str(embedder["kind"]),
            "embedder_sha256": str(embedder["config_sha256"]),
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactFormatError(
            f"{path} is not a saved router's description ({type(exc).__name__}: {exc}); "
            "save routers with core.router.Router.save"
        ) from exc
    if not clusters or any(not c or "," in c for c in clusters):
        raise ArtifactFormatError(f"{path}: cluster names must be non-empty and contain no comma, got {clusters}")
    return info

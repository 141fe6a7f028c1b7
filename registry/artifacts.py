"""Draft artifacts: safetensors, JSON and a chat template only, every file checksummed in a manifest.

A registered draft is one directory::

    manifest.json            {"format", "files": {name: {"sha256", "bytes"}}, "meta": {...}}
    config.json              the HF model config
    generation_config.json   (when the model has one)
    model.safetensors        the weights (or shards plus model.safetensors.index.json)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja, ...
    draft_vocab.json         (when the draft scores a subset of its vocabulary)

The sha256 of ``manifest.json`` itself is stamped on the registry version as a tag, so a
changed manifest is caught as surely as a changed weight file. :func:`verify_dir` checks
all of it before anything is loaded; nothing is ever unpickled.

A registered router (format ``specops-router/1``, :func:`pack_router`) is the same kind of
directory with ``router.safetensors`` (the centroids) and ``router.json`` (cluster names,
embedder kind and config hash) in place of the model files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from specops.registry.errors import ArtifactFormatError, ArtifactIntegrityError

FORMAT = "specops-draft/1"
ROUTER_FORMAT = "specops-router/1"
DATASTORE_FORMAT = "specops-datastore/1"
KB_FORMAT = "specops-kb/1"
KNNLM_FORMAT = "specops-knnlm/1"
SESSIONS_FORMAT = "specops-sessions/1"
POLICY_FORMAT = "specops-policy/1"
ROUTER_FILES = ("router.safetensors", "router.json")
"""Exactly the files of a router artifact."""
MANIFEST = "manifest.json"
ALLOWED_SUFFIXES = (".safetensors", ".json", ".jinja")
"""Weights, JSON, and a tokenizer's chat template (Jinja text, rendered in transformers' sandbox)."""
SKIP = {"optimizer.safetensors", "trained.safetensors", "state.json", MANIFEST}
"""Files of a trainer checkpoint that are not part of the served draft (optimiser state; the trained
weights of a draft that publishes their moving average, ``specops.trainer.checkpoint.TRAINED_FILE``)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj, *, without: str | None = None) -> str:
    """sha256 of a JSON value written canonically (keys sorted); ``without`` leaves one key of a
    dict out (the key that will hold this very hash)."""
    if without is not None:
        obj = {k: v for k, v in obj.items() if k != without}
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def config_hash(model_dir: Path) -> str:
    """sha256 of the model config, canonicalised (keys sorted), without volatile fields."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    for volatile in ("_name_or_path", "transformers_version"):
        cfg.pop(volatile, None)
    return sha256_json(cfg)


def pack(model_dir: Path, out_dir: Path, *, tokenizer_dir: Path | None = None, meta: dict | None = None) -> str:
    """Copy a draft (and its tokenizer) into ``out_dir`` with a manifest; return the manifest's sha256.

    ``model_dir`` is a ``save_pretrained`` directory or a trainer checkpoint (its optimiser
    and state files are left out). Tokenizer files come from ``tokenizer_dir`` when the
    model directory has none. Any other file type is refused: the registry carries
    safetensors, JSON and a Jinja chat template only.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise ArtifactFormatError(f"{model_dir} is not a model directory (no config.json)")
    if not any(p.name not in SKIP for p in model_dir.glob("*.safetensors")):
        raise ArtifactFormatError(f"{model_dir} has no .safetensors weights; only safetensors are registered")
    out_dir.mkdir(parents=True, exist_ok=True)
    sources: dict[str, Path] = {}
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and p.name not in SKIP and not p.name.startswith("."):
            sources[p.name] = p
    if tokenizer_dir is not None and not any(n in sources for n in TOKENIZER_FILES):
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                sources[name] = Path(tokenizer_dir) / name
    refused = [n for n in sources if not n.endswith(ALLOWED_SUFFIXES)]
    if refused:
        raise ArtifactFormatError(
            f"refusing to register {refused} from {model_dir}: the registry carries "
            f"only {', '.join(ALLOWED_SUFFIXES)} files"
        )
    if "tokenizer.json" not in sources:
        raise ArtifactFormatError(
            f"no tokenizer.json with {model_dir}: pass tokenizer_dir (the target's "
            "directory); serving checks the draft's tokenizer against the target's"
        )
    return _write(sources, out_dir, FORMAT, lambda: {"config_sha256": config_hash(out_dir), **(meta or {})})


def pack_router(router_dir: Path, out_dir: Path, *, meta: dict | None = None) -> str:
    """Copy a saved router (``router.safetensors`` + ``router.json``) into ``out_dir`` with a
    manifest; return the manifest's sha256. Any other file in ``router_dir`` is refused."""
    router_dir, out_dir = Path(router_dir), Path(out_dir)
    present = (
        {p.name for p in router_dir.iterdir() if p.is_file() and not p.name.startswith(".")}
        if router_dir.is_dir()
        else set()
    )
    missing, extra = set(ROUTER_FILES) - present, present - set(ROUTER_FILES) - {MANIFEST}
    if missing or extra:
        raise ArtifactFormatError(
            f"{router_dir} is not a saved router: missing {sorted(missing)}, unexpected "
            f"{sorted(extra)} (a router is exactly {' and '.join(ROUTER_FILES)})"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    return _write({n: router_dir / n for n in ROUTER_FILES}, out_dir, ROUTER_FORMAT, lambda: dict(meta or {}))


def pack_files(src_dir: Path, out_dir: Path, fmt: str, *, meta: dict | None = None) -> str:
    """Copy every file of ``src_dir`` (safetensors, JSON) into ``out_dir`` with a manifest of
    format ``fmt``; return the manifest's sha256. The generic packing of a kind with no
    packer of its own (datastores, knowledge bases); anything else in ``src_dir`` is refused."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if not src_dir.is_dir():
        raise ArtifactFormatError(f"{src_dir} is not a directory")
    files = {
        p.name: p
        for p in sorted(src_dir.iterdir())
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    }
    bad = sorted(n for n in files if not n.endswith((".safetensors", ".json")))
    if bad or not files:
        raise ArtifactFormatError(
            f"{src_dir}: a {fmt} artifact is safetensors and JSON files only; "
            f"{'refused ' + str(bad) if bad else 'found none'}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    return _write(files, out_dir, fmt, lambda: dict(meta or {}))


def _write(sources: dict[str, Path], out_dir: Path, fmt: str, meta) -> str:
    """Copy ``sources`` into ``out_dir``, write the manifest (``meta()`` is called after the
    copy) and return its sha256."""
    files = {}
    for name, src in sources.items():
        shutil.copyfile(src, out_dir / name)
        files[name] = {"sha256": sha256_file(out_dir / name), "bytes": (out_dir / name).stat().st_size}
    manifest = {"format": fmt, "files": files, "meta": meta()}
    blob = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (out_dir / MANIFEST).write_bytes(blob)
    return hashlib.sha256(blob).hexdigest()


def verify_dir(path: Path, manifest_sha256: str | None, fmt: str = FORMAT) -> dict:
    """Check a downloaded artifact of format ``fmt`` (a draft by default) against its manifest
    (and the manifest against the registry's tag); return the manifest. Raises
    ArtifactIntegrityError on any mismatch."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ArtifactIntegrityError(f"{path} has no {MANIFEST}; refusing an unverifiable artifact")
    blob = mpath.read_bytes()
    got = hashlib.sha256(blob).hexdigest()
    if manifest_sha256 is not None and got != manifest_sha256:
        raise ArtifactIntegrityError(f"{mpath} has sha256 {got[:12]}, the registry recorded {manifest_sha256[:12]}")
    try:
        manifest = json.loads(blob)
        files = manifest["files"]
        if manifest.get("format") != fmt or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactIntegrityError(f"{mpath} is not a {fmt} manifest ({exc})") from exc
    present = {p.name for p in path.iterdir() if p.is_file()} - {MANIFEST}
    extra, missing = present - set(files), set(files) - present
    if extra or missing:
        raise ArtifactIntegrityError(f"{path}: files not in the manifest {sorted(extra)}, missing {sorted(missing)}")
    for name, want in files.items():
        if "/" in name or "\\" in name or name.startswith(".") or not name.endswith(ALLOWED_SUFFIXES):
            raise ArtifactIntegrityError(f"{path}: manifest names a file the registry never carries: {name!r}")
        size = (path / name).stat().st_size
        if size != want["bytes"]:
            raise ArtifactIntegrityError(f"{path / name} has {size} bytes, the manifest says {want['bytes']}")
        digest = sha256_file(path / name)
        if digest != want["sha256"]:
            raise ArtifactIntegrityError(
                f"{path / name} has sha256 {digest[:12]}, the manifest says {want['sha256'][:12]}: corrupt or tampered"
            )
    return manifest

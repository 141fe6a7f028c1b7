"""The draft's own vocabulary in vLLM: a *view* of a draft folder that vLLM loads as our model class.

A draft folder with ``draft_vocab.json`` (``core/draft_vocab.py``) scores only those tokens in
our engine. vLLM reads the model class from ``config.json``'s ``architectures``; the view is
the same folder's files, linked (nothing is copied), with that one entry replaced by
``SpecopsDraftVocabLlamaForCausalLM`` (``plugin/specops_vllm_vocab.py``, registered in every
vLLM process by our general plugin), which multiplies by the subset's head rows only.

Views live under the front door's own folder (a draft folder may be read-only: the registry's
cache, a mounted volume), one per draft folder and content (its config, its vocabulary, its
weights' sizes and times), written to a temporary name and renamed, so two front doors never
see half a view. A draft without ``draft_vocab.json``, or not a Llama, is served as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ARCH = "SpecopsDraftVocabLlamaForCausalLM"
"""Must equal ``plugin/specops_vllm_vocab.py``'s ``ARCH`` (a test checks)."""
VOCAB_FILE = "draft_vocab.json"
MARK = ".specops-view.json"
KEEP = 8
"""Views kept under one folder (the newest; a front door serves a handful of drafts at once)."""


def _fingerprint(draft: Path) -> str:
    h = hashlib.sha256(str(draft).encode())
    for path in sorted(p for p in draft.iterdir() if p.is_file() and not p.name.startswith(".")):
        st = path.stat()
        h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if path.name in ("config.json", VOCAB_FILE):
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def draft_view(draft: Path, root: Path) -> Path:
    """The folder vLLM should load for ``draft``: a view under ``root`` when the draft has its own
    vocabulary (module docstring), else ``draft`` itself."""
    draft = Path(draft).resolve()
    if not (draft / VOCAB_FILE).is_file():
        return draft
    config = json.loads((draft / "config.json").read_text())
    if config.get("model_type") != "llama":
        log.info("draft %s is a %s, not a Llama: vLLM runs its full LM head", draft, config.get("model_type"))
        return draft
    root = Path(root)
    view = root / f"{draft.name}-{_fingerprint(draft)}"
    if (view / MARK).is_file():
        return view
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{draft.name}-", dir=root))
    try:
        for path in draft.iterdir():
            if path.is_file() and path.name != "config.json" and not path.name.startswith("."):
                os.symlink(path, tmp / path.name)
        (tmp / "config.json").write_text(json.dumps({**config, "architectures": [ARCH]}, indent=2) + "\n")
        (tmp / MARK).write_text(json.dumps({"draft": str(draft), "architecture": ARCH}) + "\n")
        try:
            os.rename(tmp, view)
        except OSError:  # another front door made it meanwhile
            if not (view / MARK).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("vLLM loads draft %s through %s: an LM head over its %s", draft, view, VOCAB_FILE)
    _prune(root, keep=view)
    return view


def _prune(root: Path, *, keep: Path) -> None:
    views = sorted(
        (p for p in root.iterdir() if (p / MARK).is_file() and p != keep), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for old in views[KEEP - 1 :]:
        shutil.rmtree(old, ignore_errors=True)  # a server started from it keeps its loaded weights

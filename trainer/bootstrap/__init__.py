"""``specops bootstrap``: a target and a draft model trained from local text only.

Layout written to ``out_dir`` (a contract other code relies on)::

    out_dir/target/       HF model dir (safetensors) + tokenizer files
    out_dir/draft/        HF model dir (safetensors) + tokenizer files
    out_dir/manifest.json

The run reads top to bottom: (1) corpus, (2) tokenizer, (3) target, (4) draft,
(5) eval, (6) save atomically. Everything is seeded and uses fixed step counts.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .corpus import DOMAINS, build_corpus, read_document
from .evaluate import evaluate
from .tokenizer import EOT, encode_documents, file_sha256, train_bpe, wrap
from .train import (DRAFT_SHAPE, TARGET_SHAPE, TINY_DRAFT_SHAPE, TINY_TARGET_SHAPE, MixedBatches,
                    TokenStream, TrainConfig, build_model, num_params, train_draft,
                    train_target)

__all__ = ["run", "is_bootstrapped", "load_manifest", "heldout_texts", "MANIFEST_FORMAT"]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
NUM_THREADS = 2
"""Fixed thread count: float reductions, hence weights, depend on it."""
VOCAB_SIZE, TINY_VOCAB_SIZE = 4096, 512
TOKENIZER_CHARS, TINY_TOKENIZER_CHARS = 3_000_000, 100_000
"""Characters of train text per domain the tokenizer learns from."""
TRAIN_CHARS = 4_000_000
"""Characters of train text per domain tokenized for training (enough for the step counts)."""
HELDOUT_CHARS = 300_000
"""Characters of held-out text per domain tokenized for the metrics."""
TINY_MAX_FILES = 40
"""Files scanned per domain by ``--tiny``."""


def is_bootstrapped(out_dir: Path) -> bool:
    """A complete, non-tiny bootstrap exists at ``out_dir``."""
    out_dir = Path(out_dir)
    try:
        manifest = load_manifest(out_dir)
    except (OSError, ValueError):
        return False
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("tiny", True):
        return False
    return all((out_dir / m / f).is_file() for m in ("target", "draft")
               for f in ("config.json", "model.safetensors", "tokenizer.json"))


def load_manifest(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "manifest.json").read_text())


def heldout_texts(manifest: dict, domain: str) -> list[str]:
    """Held-out documents of ``domain`` as plain text, rendered as in training."""
    if domain not in manifest["domains"]:
        raise ValueError(f"unknown domain {domain!r}; have {sorted(manifest['domains'])}")
    texts = (read_document(p, domain) for p in manifest["domains"][domain]["heldout"])
    return [t for t in texts if t is not None]


def run(out_dir: Path, *, tiny: bool = False, seed: int = 0, force: bool = False) -> dict:
    """Build the bootstrap at ``out_dir`` and return its manifest.

    An existing complete non-tiny bootstrap is kept (and its manifest returned)
    unless ``force``. Output is written to a sibling temp dir and renamed into
    place, so an interrupted run never leaves a half-written ``out_dir``.
    """
    out_dir = Path(out_dir).absolute()
    if not force and is_bootstrapped(out_dir):
        log.info("bootstrap exists at %s; skipping (force=True rebuilds)", out_dir)
        return load_manifest(out_dir)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    try:
        return _build(out_dir, tiny=tiny, seed=seed)
    finally:
        torch.set_num_threads(prev_threads)


def _take(paths: list[str], texts: dict[str, str], max_chars: int, seed: int, tag: str) -> list[str]:
    """Seeded shuffle of ``paths``, documents taken until ``max_chars``."""
    order = list(paths)
    random.Random(f"{tag}:{seed}").shuffle(order)
    out, n = [], 0
    for p in order:
        if n >= max_chars:
            break
        out.append(texts[p])
        n += len(texts[p])
    return out


def _build(out_dir: Path, *, tiny: bool, seed: int) -> dict:
    timing: dict[str, float] = {}
    t0 = last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        timing[name] = round(now - last, 2)
        last = now

    # 1. corpus: scan both domains, split at file level
    splits, texts = build_corpus(seed, max_files_per_domain=TINY_MAX_FILES if tiny else None)
    lap("corpus")

    # 2. tokenizer on a seeded sample of train files (never held-out)
    tok_chars = TINY_TOKENIZER_CHARS if tiny else TOKENIZER_CHARS
    sample = [t for d in DOMAINS for t in _take(splits[d].train, texts, tok_chars, seed, "train")]
    tok = train_bpe(sample, TINY_VOCAB_SIZE if tiny else VOCAB_SIZE)
    eot_id = tok.token_to_id(EOT)
    vocab_size = tok.get_vocab_size()
    lap("tokenizer")

    # 3. target, hard labels, code and prose 50/50
    cfg = TrainConfig()
    target_shape, draft_shape = (TINY_TARGET_SHAPE, TINY_DRAFT_SHAPE) if tiny else (TARGET_SHAPE, DRAFT_SHAPE)
    target = build_model(target_shape, vocab_size, eot_id, seed)
    draft = build_model(draft_shape, vocab_size, eot_id, seed + 1)
    metrics = None
    if not tiny:
        train_streams = {d: TokenStream.from_documents(
            encode_documents(tok, _take(splits[d].train, texts, TRAIN_CHARS, seed, "train")), eot_id)
            for d in DOMAINS}
        log.info("train tokens: %s", {d: s.ids.numel() for d, s in train_streams.items()})
        train_target(target, MixedBatches(train_streams, cfg.batch_size, cfg.seq_len, seed),
                     MixedBatches(train_streams, cfg.long_batch_size, cfg.long_seq_len, seed + 100), cfg)
    lap("target")

    # 4. draft: warm start on hard labels, then forward KL to the target
    if not tiny:
        train_draft(draft, target, MixedBatches(train_streams, cfg.batch_size, cfg.seq_len, seed + 1),
                    MixedBatches(train_streams, cfg.long_batch_size, cfg.long_seq_len, seed + 101), cfg)
    lap("draft")

    # 5. eval on held-out files
    if not tiny:
        heldout_streams = {d: TokenStream.from_documents(encode_documents(
            tok, _take(sorted(splits[d].heldout), texts, HELDOUT_CHARS, seed, "heldout")), eot_id)
            for d in DOMAINS}
        metrics = evaluate(target, draft, heldout_streams, num_windows=cfg.eval_windows,
                           seq_len=cfg.eval_seq_len)
        log.info("metrics: %s", json.dumps(metrics))
    lap("eval")

    # 6. save to a temp dir, then rename into place
    hf_tok = wrap(tok, target_shape.max_position_embeddings)
    manifest = {
        "format": MANIFEST_FORMAT,
        "tiny": tiny,
        "seed": seed,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tokenizer_sha256": None,
        "domains": {d: {"train": splits[d].train, "heldout": splits[d].heldout} for d in DOMAINS},
        "models": {name: {"params": num_params(m), "config": json.loads(m.config.to_json_string())}
                   for name, m in (("target", target), ("draft", draft))},
        "metrics": metrics,
        "timing_s": timing,
    }
    _save_atomically(out_dir, target, draft, hf_tok, manifest, t0)
    log.info("bootstrap written to %s in %.1fs: %s", out_dir, timing["total"], timing)
    return manifest


def _save_atomically(out_dir: Path, target, draft, hf_tok, manifest: dict, t0: float) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    try:
        for name, model in (("target", target), ("draft", draft)):
            model.save_pretrained(tmp / name, safe_serialization=True)
            hf_tok.save_pretrained(tmp / name)
        manifest["tokenizer_sha256"] = file_sha256(tmp / "target" / "tokenizer.json")
        assert manifest["tokenizer_sha256"] == file_sha256(tmp / "draft" / "tokenizer.json")
        manifest["timing_s"]["total"] = round(time.perf_counter() - t0, 2)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        _swap_into_place(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``; an existing ``out_dir`` is moved aside first, then removed."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{time.time_ns()}"
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if old is not None:
            os.rename(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

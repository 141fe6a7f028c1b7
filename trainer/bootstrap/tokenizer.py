"""Byte-level BPE tokenizer shared by the bootstrapped target and draft models.

One special token, ``<|endoftext|>``, serves as bos, eos and pad; training
documents are joined with it, so a prompt that starts with it looks like the
start of a training document. No template adds it automatically.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (in the given order; deterministic)."""
    assert vocab_size > 256 + 1, vocab_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    log.info(
        "tokenizer: trained vocab %d on %d docs (%.1f MB)",
        tok.get_vocab_size(),
        len(texts),
        sum(len(t) for t in texts) / 1e6,
    )
    return tok


def wrap(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """Hugging Face wrapper with bos/eos/pad = ``<|endoftext|>``."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids per document, no special tokens."""
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (the GGUF is 270 MB)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()

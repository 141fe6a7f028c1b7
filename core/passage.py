"""A passage of a knowledge base, and how text is cut into passages: the format the trainer's
KB sources (``trainer/kb_sources.py``) and serving's knowledge bases (``specops.serving.retrieval.kb``)
share.

A passage is about 100 words (the paper's DPR-style chunks, :func:`chunk_text`) and at most
:data:`MAX_PASSAGE_TOKENS` target tokens (RaLMSeq prepends a chunk of at most 256). What is
embedded and indexed is the passage's title, a newline, and its text (:func:`indexed_text`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

CHUNK_WORDS = 100
MAX_PASSAGE_TOKENS = 256


@dataclass(frozen=True)
class Passage:
    """One passage of a knowledge base."""

    id: int
    """Row in the KB (0..num_passages-1); stable within a KB version."""
    title: str
    """What a client cites: the source's name (a man page ``ls(1)``, a file's path)."""
    text: str
    source: str = ""
    """Where the text came from (a path)."""


def chunk_text(
    text: str,
    words: int = CHUNK_WORDS,
    *,
    max_tokens: int = MAX_PASSAGE_TOKENS,
    count_tokens: Callable[[str], int] | None = None,
) -> list[str]:
    """``text`` cut into chunks of at most ``words`` words, as even as possible (130 words
    make two of 65, never 100 and 30), each a slice of the original (line breaks kept).
    With ``count_tokens`` (a tokenizer's length), a chunk over ``max_tokens`` is halved by
    words until it fits, and a single over-long word by characters."""
    spans = [m.span() for m in re.finditer(r"\S+", text)]
    if not spans:
        return []
    n_chunks = math.ceil(len(spans) / words)
    size = math.ceil(len(spans) / n_chunks)
    out: list[str] = []

    def emit(lo: int, hi: int) -> None:  # words [lo, hi)
        chunk = text[spans[lo][0] : spans[hi - 1][1]]
        if count_tokens is None or count_tokens(chunk) <= max_tokens:
            out.append(chunk)
        elif hi - lo > 1:
            emit(lo, (lo + hi) // 2)
            emit((lo + hi) // 2, hi)
        else:
            _split_word(chunk, max_tokens, count_tokens, out)

    for lo in range(0, len(spans), size):
        emit(lo, min(lo + size, len(spans)))
    return out


def _split_word(word: str, max_tokens: int, count_tokens: Callable[[str], int], out: list[str]) -> None:
    if count_tokens(word) <= max_tokens or len(word) == 1:
        out.append(word)
        return
    _split_word(word[: len(word) // 2], max_tokens, count_tokens, out)
    _split_word(word[len(word) // 2 :], max_tokens, count_tokens, out)


def token_counter(tokenizer) -> Callable[[str], int]:
    """A Hugging Face tokenizer's length of a text (no special tokens), for :func:`chunk_text`."""
    return lambda text: len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def indexed_text(p: Passage) -> str:
    """What is embedded and indexed: the title (a man page's ``ls(1)``) then the text."""
    return f"{p.title}\n{p.text}" if p.title else p.text

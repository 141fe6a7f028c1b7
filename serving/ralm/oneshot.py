"""One-shot retrieval (``retrieval.mode = "oneshot"``): the top passages for the prompt, retrieved
once and put before it, then a plain decode (the LLMA paper's RAG setting)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specops.serving.engine.types import ContextSpan
from specops.serving.ralm.types import RalmConfig
from specops.serving.retrieval.retriever import Retriever


@dataclass(frozen=True)
class OneShot:
    """The context of a one-shot retrieval: the top passages for the prompt, put before it."""

    context_ids: list[int]
    spans: tuple[ContextSpan, ...]
    passage_ids: list[int]
    passage_tokens: tuple[tuple[int, ...], ...]
    search_s: float


def oneshot_context(
    retriever: Retriever, passages: Callable[[list[int]], list[str]], tokenizer, prompt_ids: list[int], cfg: RalmConfig
) -> OneShot:
    """Retrieve the top ``cfg.passages`` passages once, for the last ``cfg.query_tokens`` tokens
    of the prompt, and put them before it (best first, each cut to ``max_passage_tokens``, separated
    as the retrieval loop separates its passage from the prompt). The LLMA paper's RAG setting."""
    t0 = time.perf_counter()
    query = retriever.encode([tokenizer.decode(prompt_ids[-cfg.query_tokens :])])
    ids, _ = retriever.search(query, cfg.passages)
    search_s = time.perf_counter() - t0
    pids = [int(i) for i in ids[0] if i >= 0]
    sep = list(tokenizer.encode("\n\n", add_special_tokens=False))
    toks = tuple(tuple(tokenizer.encode(t, add_special_tokens=False)[: cfg.max_passage_tokens]) for t in passages(pids))
    context: list[int] = []
    spans = []
    for t in toks:
        if t:
            spans.append(ContextSpan("retrieved", len(context), len(context) + len(t)))
            context += [*t, *sep]
    if prompt_ids:
        spans.append(ContextSpan("prompt", len(context), len(context) + len(prompt_ids)))
    return OneShot(context + list(prompt_ids), tuple(spans), pids, toks, search_s)

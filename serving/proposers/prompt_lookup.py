"""Prompt-lookup decoding: copy what followed the last earlier occurrence of the
trailing n-gram in the request's own context. The model-free baseline."""

from __future__ import annotations

import numpy as np
import torch

from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals


def lookup(tokens: np.ndarray, k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Continuation of the longest trailing n-gram (max_ngram down to min_ngram) that
    occurred earlier in ``tokens``.

    Among the earlier occurrences, the most recent one that still has ``k`` tokens after
    it wins; if none has, the one with the longest continuation. (In a repetition loop
    the most recent occurrence is one period back and leaves fewer than ``k`` tokens.)"""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        tail = tokens[n_tok - n :]
        # Candidate start positions i of earlier windows tokens[i:i+n] (i + n < n_tok).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)  # [n_tok-n, n]
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            avail = np.minimum(n_tok - (hits + n), k)  # continuation length after each hit
            best = int(hits[np.flatnonzero(avail == avail.max())[-1]]) + n
            cont = tokens[best : best + k]
            if cont.size:
                return cont.tolist()
    return []


class PromptLookupProposer(Proposer):
    """N-gram match in the request's own context (prompt and output so far)."""

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, state: DecodeState, k: int) -> Proposals:
        if k <= 0:
            return Proposals.empty()
        cont = lookup(np.asarray(state.token_ids, dtype=np.int64), k, self.max_ngram, self.min_ngram)
        return Proposals(tokens=torch.tensor([cont], dtype=torch.long).reshape(1, len(cont)))

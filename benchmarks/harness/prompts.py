"""Prompt sets: a bootstrap's held-out prompts, topped up with seeded random token prompts where a
bare model directory has too few."""

from __future__ import annotations

import logging
import random
from pathlib import Path

log = logging.getLogger(__name__)


def random_token_prompts(n: int, num_tokens: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``num_tokens`` ids drawn from ``[1, vocab_size)`` (seeded)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(num_tokens)] for _ in range(n)]


def heldout_or_random(
    model_dir: Path, tokenizer, domain: str, n: int, num_tokens: int, vocab_size: int
) -> tuple[list[list[int]], str]:
    """``n`` held-out ``domain`` prompts of the bootstrap at ``model_dir`` as token ids, topped up
    with random token prompts (seed 0) when it has fewer; and a label saying which they are."""
    try:
        from specops.workloads.prompts import heldout_prompts

        prompts = [p.token_ids for p in heldout_prompts(model_dir, tokenizer, domain, n, num_tokens=num_tokens)]
    except (OSError, ValueError, KeyError) as exc:
        log.warning("no held-out prompts in %s (%s); using random token prompts", model_dir, exc)
        prompts = []
    if len(prompts) >= n:
        return prompts[:n], f"held-out {domain}"
    heldout = len(prompts)
    if heldout:
        log.warning("only %d held-out prompts; topping up with random token prompts", heldout)
    rng = random.Random(0)
    while len(prompts) < n:
        prompts.append([rng.randrange(1, vocab_size) for _ in range(num_tokens)])
    return prompts, f"held-out {domain} + random token" if heldout else "random token"

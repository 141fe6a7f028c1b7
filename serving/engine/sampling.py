"""Logits to probabilities (temperature, top-p) and seeded draws.

Target and draft apply the same warping, so speculative sampling preserves the
target's *warped* distribution, which is what target-only sampling draws from.
"""

from __future__ import annotations

import torch

from serving.engine.types import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature and top-p.

    Greedy requests get the one-hot distribution of the argmax.
    """
    assert logits.ndim == 2, logits.shape
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop_sorted = (cum - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [vocab] distribution."""
    assert probs.ndim == 1, probs.shape
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator).item())

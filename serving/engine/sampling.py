"""Logits to probabilities (temperature, top-p) and seeded draws.

Target and draft apply the same warping, so speculative sampling preserves the
target's *warped* distribution, which is what target-only sampling draws from.

Extreme settings stay well defined: a temperature so small that ``logits / T`` overflows
float32 (any ``0 < T`` is allowed) gives the limit, all the mass on the argmax (split over
exact ties), and a ``top_p`` so small that it rounds to 0 in float32 (``1e-300``) keeps the
most probable token. Nucleus sampling always keeps at least that token.
"""

from __future__ import annotations

import torch

from specops.serving.engine.types import SamplingParams


def tempered_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the last dim, float32, finite for any ``temperature > 0``.

    The usual float32 path, unchanged, whenever it is finite; otherwise (``logits / T``
    overflowed, or ``T`` rounded to 0 in float32) the max-shifted float64 form, whose limit
    for tiny ``T`` is the argmax.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if bool(torch.isfinite(probs).all()):
        return probs
    z = logits.double()
    z = (z - z.amax(dim=-1, keepdim=True)) / temperature  # the max is 0, the rest <= 0 (or -inf)
    return torch.softmax(z.nan_to_num(nan=0.0), dim=-1).float()  # nan: a +inf logit (inf - inf)


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
    probs = tempered_softmax(logits, params.temperature)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p. The top token always stays, also
        # when top_p rounds to 0 in float32 (the comparison is in the tensor's dtype).
        drop_sorted = (cum - sorted_p) >= params.top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [vocab] distribution (non-negative weights, not necessarily normalized).

    Weights that are not a distribution (NaN, infinite, negative, or all zero) never reach
    ``torch.multinomial``, which raises on them (:func:`drawable`).
    """
    assert probs.ndim == 1, probs.shape
    total = probs.sum()
    if not bool((probs.min() >= 0) & (total > 0) & torch.isfinite(total)):  # NaN fails every comparison
        fixed = drawable(probs)
        if fixed is None:
            return int(probs.nan_to_num(nan=float("-inf")).argmax())
        probs = fixed
    return int(torch.multinomial(probs, 1, generator=generator).item())


def drawable(probs: torch.Tensor) -> torch.Tensor | None:
    """[vocab] weights ``torch.multinomial`` accepts: an infinite weight takes all the mass (split
    over the infinite ones), NaN and negative weights count as 0; None when nothing is left."""
    p = probs.double()
    inf = torch.isposinf(p)
    if bool(inf.any()):
        return inf.double()
    p = p.nan_to_num(nan=0.0).clamp_min(0.0)
    return p if float(p.sum()) > 0.0 else None


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator).item())

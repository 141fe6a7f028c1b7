"""Logits to probabilities (temperature, min-p, top-k, top-p) and seeded draws.

Target and draft apply the same warping, so speculative sampling preserves the
target's *warped* distribution, which is what target-only sampling draws from.

The order is vLLM's (``vllm/v1/sample/sampler.py``): temperature, then min-p, then top-k,
then top-p over what is left (renormalized). Min-p and top-k commute (each keeps a prefix
of the tokens sorted by probability, and min-p's threshold is relative to the top token,
which top-k keeps), so HF's order (top-k, top-p, min-p) differs from this one only where
top-p and min-p are both on. Ties with the ``top_k``-th token are kept, as vLLM keeps them.

Extreme settings stay well defined: a temperature so small that ``logits / T`` overflows
float32 (any ``0 < T`` is allowed) gives the limit, all the mass on the argmax (split over
exact ties), and a ``top_p`` so small that it rounds to 0 in float32 (``1e-300``) keeps the
most probable token. Nucleus sampling always keeps at least that token.
"""

from __future__ import annotations

import torch

from specops.serving.engine.types import SamplingParams, TokenLogprob


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
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature, min-p, top-k and
    top-p (the module docstring's order).

    Greedy requests get the one-hot distribution of the argmax (no filter ever drops it).
    """
    assert logits.ndim == 2, logits.shape
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    probs = tempered_softmax(logits, params.temperature)
    probs = filter_min_p_top_k(probs, params.min_p, params.top_k)
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


def filter_min_p_top_k(probs: torch.Tensor, min_p: float, top_k: int) -> torch.Tensor:
    """[n, vocab] probabilities -> the same after min-p and top-k, renormalized; unchanged when both are off.

    Min-p drops a token whose probability is below ``min_p`` times the row's largest; top-k
    drops a token below the ``top_k``-th largest. The most probable token always stays.
    """
    top_k = top_k if 0 < top_k < probs.shape[-1] else 0
    if min_p <= 0.0 and not top_k:
        return probs
    keep = torch.ones_like(probs, dtype=torch.bool)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.amax(dim=-1, keepdim=True)
    if top_k:
        kth = probs.masked_fill(~keep, 0.0).topk(top_k, dim=-1).values[:, -1:]  # [n, 1]
        keep &= probs >= kth
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


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


LOGPROB_FLOOR = -9999.0
"""What a ``-inf`` log-probability (a token the filters dropped) is reported as: JSON has no
infinity, and vLLM reports the same floor."""


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], params: SamplingParams, probs: torch.Tensor | None = None
) -> list[TokenLogprob]:
    """Each of ``tokens``' log-probability in the matching row of ``logits`` [len(tokens), vocab],
    with the ``params.logprobs`` most probable alternatives: log-softmax of the raw logits, or with
    ``logprobs_mode="processed"`` (sampling) the log of the warped distribution ``probs`` (computed
    when not given) the token was drawn from. The verifier calls this on the rows of the pass that
    emitted the tokens, so no forward is added and target-only decoding gets the same numbers."""
    assert logits.ndim == 2 and logits.shape[0] == len(tokens), (logits.shape, len(tokens))
    if params.logprobs_mode == "processed" and not params.greedy:
        lp = torch.log(probs if probs is not None else warp(logits, params))
    else:
        lp = torch.log_softmax(logits.float(), dim=-1)
    lp = lp.clamp_min(LOGPROB_FLOOR)
    n = int(params.logprobs or 0)
    top_v, top_i = lp.topk(n, dim=-1) if n else (None, None)
    picked = lp.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    out = []
    for r, (tok, v) in enumerate(zip(tokens, picked, strict=True)):
        top = tuple(zip(top_i[r].tolist(), top_v[r].tolist(), strict=True)) if n else ()
        out.append(TokenLogprob(int(tok), float(v), top))
    return out

"""Distillation losses for online speculative decoding (OSD, Liu et al. 2023, §4.1 Eq. 3–5).

The draft q = softmax(draft_logits / τ) learns from the target's distribution p at the
logged positions; each loss is the mean over positions of a divergence D (OSD Eq. 3/5):
forward KL D(p‖q), reverse KL D(q‖p) and the generalised Jensen–Shannon divergence
JSD[β] = β·KL(p‖m) + (1−β)·KL(q‖m) with m = βp + (1−β)q (OSD Eq. 4, after Agarwal et
al. 2023, GKD). Everything is computed in log space (log_softmax / logsumexp), in
float32 (float64 when the draft logits are float64); terms with a = 0 contribute 0 to
KL(a‖·), with where-masks so that their gradients are 0 rather than NaN.

Top-k targets (design decision). A top-k record holds the k most likely target tokens
and ``residual``, the mass of every other token. The divergence is then computed over
the k+1 outcomes {top-k tokens, "everything else"}, a coarse-graining of the vocabulary:

- target: p_i = exp(topk_logprobs_i), p_rest = max(residual, RESIDUAL_FLOOR), then the
  k+1 probabilities are renormalised (this also absorbs rounding in stored log-probs).
  The floor keeps RKL/JSD finite when rounding made the residual exactly 0;
- draft: q_i = q(topk_ids_i), q_rest = logsumexp of the draft log-probs with the top-k
  columns masked to -inf (stable; 1 − Σq_i would cancel catastrophically).

By the data-processing inequality each coarse-grained divergence is a lower bound of the
full-vocabulary one; it is equal when the residual is 0 and the draft puts no mass
outside the top k. When k = V the rest bucket is empty for both sides (no floor).

Temperature with top-k targets: the top-k log-probs are tempered exactly (÷τ); the
residual bucket is tempered assuming its mass r is spread uniformly over the V − k tail
tokens (each has log-prob log(r/(V−k))), so its unnormalised tempered log-mass is
log(V−k) + log(r/(V−k))/τ; then the k+1 outcomes are renormalised. This is exact at
τ = 1 and an approximation otherwise (V = draft_logits.shape[-1]).

Not checked (too costly per step): a top-k row must not repeat a token id.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from prometheus_client import Counter

log = logging.getLogger(__name__)

LOSSES = ("fkl", "rkl", "jsd")
RESIDUAL_FLOOR = 1e-6
"""Smallest target residual mass used for a top-k row with k < V (before renormalising)."""

SKIPPED_STEPS = Counter(
    "specops_trainer_skipped_steps_total", "Training steps skipped for non-finite inputs or loss", ["reason"]
)

_NEG_INF = -math.inf
_RESTRICT_FLOOR = 1e-12
"""Smallest per-token probability of a restricted target (``TargetDist.restrict``)."""


@dataclass(frozen=True)
class TargetDist:
    """The target's distribution at N positions: full, or top-k plus residual mass."""

    logprobs: torch.Tensor
    """[N, V] (full) or [N, k] (top-k, most likely first) float log-probabilities."""
    topk_ids: torch.Tensor | None = None
    """[N, k] integer token ids (top-k only)."""
    residual: torch.Tensor | None = None
    """[N] float mass of every token outside the top k (top-k only)."""

    def __post_init__(self) -> None:
        lp = self.logprobs
        if not isinstance(lp, torch.Tensor) or lp.ndim != 2 or not lp.is_floating_point():
            raise ValueError(f"target logprobs must be a 2-D float tensor, got {_describe(lp)}")
        if (self.topk_ids is None) != (self.residual is None):
            raise ValueError("a top-k target needs both topk_ids and residual (a full target neither)")
        if self.topk_ids is not None:
            ids, res = self.topk_ids, self.residual
            if ids.ndim != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"topk_ids must be a 2-D integer tensor, got {_describe(ids)}")
            if ids.shape != lp.shape:
                raise ValueError(f"topk_ids shape {tuple(ids.shape)} does not match topk_logprobs {tuple(lp.shape)}")
            if res.ndim != 1 or res.shape[0] != lp.shape[0] or not res.is_floating_point():
                raise ValueError(f"residual must be a float tensor of shape ({lp.shape[0]},), got {_describe(res)}")

    @classmethod
    def full(cls, logprobs: torch.Tensor) -> TargetDist:  # [N, V]
        return cls(logprobs)

    @classmethod
    def topk(cls, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, residual: torch.Tensor) -> TargetDist:
        return cls(topk_logprobs, topk_ids, residual)  # [N, k], [N, k], [N]

    @property
    def is_topk(self) -> bool:
        return self.topk_ids is not None

    def to(self, device: torch.device | str) -> TargetDist:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, logprobs=move(self.logprobs), topk_ids=move(self.topk_ids), residual=move(self.residual))

    def restrict(self, token_ids: torch.Tensor) -> TargetDist:
        """This distribution conditioned on the tokens ``token_ids`` ([S], sorted, unique):
        a full ``[N, S]`` one, columns in the order of ``token_ids``.

        A draft with a draft vocabulary can only propose those tokens, so it learns the
        target's distribution over them. A top-k target's residual mass is spread evenly
        over the subset's tokens outside its top k (the log does not say where it lies).
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.logprobs.device)
        if not self.is_topk:
            return TargetDist.full(torch.log_softmax(self.logprobs.float()[:, ids], dim=-1))
        n, s = self.logprobs.shape[0], ids.numel()
        col = torch.searchsorted(ids, self.topk_ids.long()).clamp_max(s - 1)  # [N, k]
        inside = ids[col] == self.topk_ids.long()  # top-k tokens that are in the subset
        p_top = self.logprobs.float().exp() * inside
        hit = torch.zeros(n, s, device=ids.device).scatter_add_(1, col, inside.float()) > 0
        top = torch.zeros(n, s, device=ids.device).scatter_add_(1, col, p_top)
        tail = self.residual.float().clamp_min(0) / (s - inside.sum(-1)).clamp_min(1)  # [N] per outside token
        probs = torch.where(hit, top, tail[:, None]).clamp_min(_RESTRICT_FLOOR)
        return TargetDist.full((probs / probs.sum(-1, keepdim=True)).log())

    def _rows(self, mask: torch.Tensor | None) -> TargetDist:
        if mask is None:
            return self
        pick = lambda t: None if t is None else t[mask]  # noqa: E731
        return TargetDist(self.logprobs[mask], pick(self.topk_ids), pick(self.residual))


def _describe(t: object) -> str:
    return f"shape {tuple(t.shape)} dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_args(kind: str, beta: float, tau: float) -> None:
    if kind not in LOSSES:
        raise ValueError(f"unknown loss kind {kind!r}; valid kinds: {', '.join(LOSSES)}")
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"temperature tau must be a finite number > 0, got {tau!r}")
    if kind == "jsd" and not (isinstance(beta, (int, float)) and 0.0 < beta < 1.0):
        raise ValueError(f"JSD beta must be in (0, 1) exclusive (use fkl/rkl for the limits), got {beta!r}")


def _validate(draft_logits: torch.Tensor, target: TargetDist, mask: torch.Tensor | None) -> None:
    if not isinstance(draft_logits, torch.Tensor) or draft_logits.ndim != 2 or not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a 2-D float tensor [N, V], got {_describe(draft_logits)}")
    n, v = draft_logits.shape
    lp = target.logprobs
    if not target.is_topk and lp.shape != draft_logits.shape:
        raise ValueError(f"full target logprobs shape {tuple(lp.shape)} does not match draft_logits {(n, v)}")
    if target.is_topk:
        if lp.shape[0] != n:
            raise ValueError(f"top-k target has {lp.shape[0]} positions, draft_logits has {n}")
        if lp.shape[1] > v:
            raise ValueError(f"top-k target k={lp.shape[1]} exceeds the vocabulary size V={v}")
        ids = target.topk_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
            raise ValueError(f"topk_ids out of range [0, {v})")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (n,)):
        raise ValueError(f"mask must be a bool tensor of shape ({n},), got {_describe(mask)}")


def _outcome_logprobs(draft_logits: torch.Tensor, target: TargetDist, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log q), each [n, C]: C = V for a full target, k+1 (top-k, rest) for top-k."""
    dtype = torch.float64 if draft_logits.dtype == torch.float64 else torch.float32
    log_q = F.log_softmax(draft_logits.to(dtype) / tau, dim=-1)  # [n, V]
    target_lp = target.logprobs.to(dtype)
    if not target.is_topk:
        return F.log_softmax(target_lp / tau, dim=-1), log_q  # logprobs treated as logits
    n, v = log_q.shape
    ids = target.topk_ids.long()  # [n, k]
    k = ids.shape[-1]
    q_top = log_q.gather(-1, ids)  # [n, k]
    if k == v:  # no tail tokens: the rest bucket is empty on both sides
        p_rest = q_rest = log_q.new_full((n, 1), _NEG_INF)
    else:
        in_top = torch.zeros_like(log_q, dtype=torch.bool).scatter_(-1, ids, True)
        q_rest = torch.logsumexp(log_q.masked_fill(in_top, _NEG_INF), dim=-1, keepdim=True)  # [n, 1]
        log_r = target.residual.to(dtype).clamp_min(RESIDUAL_FLOOR).log()
        log_tail = math.log(v - k)
        p_rest = (log_tail + (log_r - log_tail) / tau).unsqueeze(-1)  # uniform-tail tempering, [n, 1]
    log_p = F.log_softmax(torch.cat([target_lp / tau, p_rest], dim=-1), dim=-1)  # renormalised k+1
    return log_p, torch.cat([q_top, q_rest], dim=-1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b) = Σ a·(log a − log b) over the last dim, with 0·log(0/b) = 0; [n, C] → [n]."""
    pos = log_a != _NEG_INF  # NaN counts as present, so it propagates
    la, lb = torch.where(pos, log_a, 0.0), torch.where(pos, log_b, 0.0)
    return torch.where(pos, la.exp() * (la - lb), 0.0).sum(-1)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """log m = log(βp + (1−β)q), the two-term logsumexp (logaddexp); m = 0 stays -inf, no NaN grads."""
    some = (log_p != _NEG_INF) | (log_q != _NEG_INF)
    lp, lq = torch.where(some, log_p, 0.0), torch.where(some, log_q, 0.0)
    return torch.where(some, torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta)), _NEG_INF)


def _divergence(draft_logits: torch.Tensor, target: TargetDist, kind: str, beta: float, tau: float) -> torch.Tensor:
    """Per-position divergence [n] for already selected rows."""
    log_p, log_q = _outcome_logprobs(draft_logits, target, tau)
    if kind == "fkl":
        return _kl(log_p, log_q)
    if kind == "rkl":
        return _kl(log_q, log_p)
    log_m = _log_mixture(log_p, log_q, beta)
    return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)


def _select(draft_logits: torch.Tensor, target: TargetDist, mask: torch.Tensor | None):  # -> [n, V], n rows
    return (draft_logits if mask is None else draft_logits[mask]), target._rows(mask)


def _mean(per_position: torch.Tensor) -> torch.Tensor:
    # sum/max(n, 1): an empty selection gives a 0 still connected to draft_logits (zero grads)
    return per_position.sum() / max(per_position.shape[0], 1)


def distill_loss(draft_logits: torch.Tensor, target: TargetDist, kind: str, *, beta=0.5, tau=1.0, mask=None):
    """ℓ = (1/n) Σ_i D_kind(p_i, q_i) over the n masked positions (OSD Eq. 3/5), kind in LOSSES.

    draft_logits [N, V] float; target full [N, V] or top-k [N, k] + [N]; mask [N] bool or
    None (all). Returns a 0-d tensor; with no position selected, a 0 still connected to
    draft_logits (zero gradients).
    """
    _check_args(kind, beta, tau)
    _validate(draft_logits, target, mask)
    z, tgt = _select(draft_logits, target, mask)  # [n, V], n rows
    return _mean(_divergence(z, tgt, kind, beta, tau))


def forward_kl(draft_logits: torch.Tensor, target: TargetDist, *, tau=1.0, mask=None) -> torch.Tensor:
    """Forward KL D(p‖q) = Σ_x p(x)·log(p(x)/q(x)), mean over positions (OSD Eq. 4, ℓ_KL)."""
    return distill_loss(draft_logits, target, "fkl", tau=tau, mask=mask)


def reverse_kl(draft_logits: torch.Tensor, target: TargetDist, *, tau=1.0, mask=None) -> torch.Tensor:
    """Reverse KL D(q‖p) = Σ_x q(x)·log(q(x)/p(x)), mean over positions (OSD Eq. 4, ℓ_RKL)."""
    return distill_loss(draft_logits, target, "rkl", tau=tau, mask=mask)


def jsd(draft_logits: torch.Tensor, target: TargetDist, *, beta=0.5, tau=1.0, mask=None) -> torch.Tensor:
    """JSD[β] = β·KL(p‖m) + (1−β)·KL(q‖m), m = βp + (1−β)q, β in (0, 1) (OSD Eq. 4; GKD).

    Not a weighted sum of forward and reverse KL: JSD[β]/β → KL(p‖q) as β → 0 and
    JSD[β]/(1−β) → KL(q‖p) as β → 1. Mean over positions.
    """
    return distill_loss(draft_logits, target, "jsd", beta=beta, tau=tau, mask=mask)


def _skip(reason: str, detail: str) -> tuple[None, str]:
    SKIPPED_STEPS.labels(reason=reason).inc()
    message = f"{reason}: {detail}"
    log.warning("skipping distillation step: %s", message)
    return None, message


def checked_loss(
    draft_logits: torch.Tensor, target: TargetDist, kind: str, *, beta=0.5, tau=1.0, mask=None
) -> tuple[torch.Tensor | None, str | None]:
    """``distill_loss`` that refuses non-finite inputs or results: (loss, None) or (None, reason).

    Only the masked positions are checked (padding rows may hold anything). A refused step
    logs a WARNING and increments ``specops_trainer_skipped_steps_total{reason=...}``.
    Shape or argument errors still raise ValueError: they are bugs, not bad data.
    """
    _check_args(kind, beta, tau)
    _validate(draft_logits, target, mask)
    z, tgt = _select(draft_logits, target, mask)  # [n, V]
    n = z.shape[0]
    with torch.no_grad():
        bad = (~torch.isfinite(z)).any(-1)  # [n]
        if bad.any():
            return _skip("nonfinite_draft_logits", f"{int(bad.sum())} of {n} positions have NaN/inf draft logits")
        lp = tgt.logprobs
        if tgt.is_topk:  # top-k log-probs and residual must be finite
            bad = (~torch.isfinite(lp)).any(-1) | ~torch.isfinite(tgt.residual)
        else:  # -inf means probability 0; a row needs some mass
            bad = (torch.isnan(lp) | (lp == math.inf)).any(-1) | (lp == _NEG_INF).all(-1)
        if bad.any():
            return _skip("nonfinite_target", f"{int(bad.sum())} of {n} positions have a NaN/inf target distribution")
    per_position = _divergence(z, tgt, kind, beta, tau)  # [n]
    bad = ~torch.isfinite(per_position.detach())
    if bad.any():
        return _skip("nonfinite_loss", f"{int(bad.sum())} of {n} positions have a non-finite {kind} divergence")
    return _mean(per_position), None

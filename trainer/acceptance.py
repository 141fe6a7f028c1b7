"""Offline expected acceptance of a draft on logged target distributions.

For one position with target distribution p and draft distribution q:

- sampling (speculative rejection sampling, OSD Eq. 1): a drafted token is accepted
  with probability ``Σ_x min(p(x), q(x))`` (Leviathan et al. 2023, α = 1 − TV(p, q));
- greedy: the draft's argmax is accepted iff it equals the target's argmax.

With a top-k target the tail is known only as one residual mass r. The estimate sums
``min(p, q)`` over the top-k tokens (a lower bound, ``sampling``) and also reports the
upper bound that adds ``min(r, q_rest)`` (``sampling_upper``); for k = 64 the two differ
by little. The registry's promotion gate compares candidates on the same records with
the same estimate, so the bound's slack cancels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from streams.records import MissRecord
from trainer.losses import TargetDist


@dataclass(frozen=True)
class Acceptance:
    """Mean expected acceptance over positions."""

    sampling: float
    sampling_upper: float
    greedy: float
    num_positions: int

    def to_dict(self) -> dict:
        return {"sampling": self.sampling, "sampling_upper": self.sampling_upper, "greedy": self.greedy,
                "num_positions": self.num_positions}  # fmt: skip


def position_acceptance(draft_logits: torch.Tensor, target: TargetDist) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: (sampling lower bound, sampling upper bound, greedy agreement), each [N]."""
    assert draft_logits.ndim == 2, draft_logits.shape
    logq = torch.log_softmax(draft_logits.float(), dim=-1)  # [N, V]
    q = logq.exp()
    if target.is_topk:
        assert target.topk_ids is not None and target.residual is not None
        ids = target.topk_ids.to(q.device)
        p_top = target.logprobs.float().exp().to(q.device)  # [N, k]
        q_top = q.gather(1, ids)  # [N, k]
        low = torch.minimum(p_top, q_top).sum(dim=1)
        q_rest = (1.0 - q_top.sum(dim=1)).clamp(min=0.0)
        high = low + torch.minimum(target.residual.float().to(q.device), q_rest)
        target_argmax = ids[:, 0]
    else:
        p = target.logprobs.float().exp().to(q.device)  # [N, V]
        low = high = torch.minimum(p, q).sum(dim=1)
        target_argmax = target.logprobs.argmax(dim=1).to(q.device)
    greedy = (logq.argmax(dim=1) == target_argmax).float()
    return low, high, greedy


@torch.no_grad()
def evaluate_records(model: torch.nn.Module, records: Iterable[MissRecord]) -> Acceptance:
    """Expected acceptance of ``model`` at every rejected position of ``records``."""
    from trainer.data import draft_logits_at, target_dist

    was_training = model.training
    model.eval()
    lows, highs, greedys = [], [], []
    try:
        for rec in records:
            if rec.num_rejected == 0:
                continue
            low, high, greedy = position_acceptance(draft_logits_at(model, rec), target_dist(rec))
            lows.append(low)
            highs.append(high)
            greedys.append(greedy)
    finally:
        model.train(was_training)
    if not lows:
        return Acceptance(0.0, 0.0, 0.0, 0)
    low, high, greedy = torch.cat(lows), torch.cat(highs), torch.cat(greedys)
    return Acceptance(float(low.mean()), float(high.mean()), float(greedy.mean()), int(low.numel()))

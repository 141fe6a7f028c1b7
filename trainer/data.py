"""From logged records to tensors: the target's distribution and the draft's logits at
each rejected position of a MissRecord."""

from __future__ import annotations

import torch

from streams.records import DIST_TOPK, MissRecord
from trainer.losses import TargetDist


def target_dist(rec: MissRecord) -> TargetDist:
    """The logged target distribution of ``rec`` as tensors (float32)."""
    logprobs = torch.from_numpy(rec.logprobs.astype("float32"))  # [m, k] or [m, V]
    if rec.dist_kind == DIST_TOPK:
        assert rec.topk_ids is not None and rec.residual is not None
        return TargetDist.topk(torch.from_numpy(rec.topk_ids).long(), logprobs, torch.from_numpy(rec.residual.copy()))
    return TargetDist.full(logprobs)


def draft_logits_at(model: torch.nn.Module, rec: MissRecord) -> torch.Tensor:
    """[m, V] the draft's logits predicting each rejected position of ``rec``.

    One causal forward over ``token_ids[:last position]``: the logits at index ``i - 1``
    are the draft's prediction for the token at index ``i``.
    """
    if rec.num_rejected == 0:
        vocab = int(getattr(model.config, "vocab_size", rec.vocab_size))
        return torch.zeros((0, vocab), device=next(model.parameters()).device)
    positions = torch.from_numpy(rec.positions).long()
    last = int(positions.max())
    device = next(model.parameters()).device
    ids = torch.from_numpy(rec.token_ids[:last]).long().unsqueeze(0).to(device)  # [1, last]
    logits = model(input_ids=ids).logits[0]  # [last, V]
    return logits[(positions - 1).to(device)]

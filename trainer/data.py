"""From logged records to tensors: training examples, the target's distribution and the
draft's logits at each rejected position of a MissRecord."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Example:
    """One training sequence: the draft predicts ``context[positions[i]]`` from ``context[:positions[i]]``."""

    context: torch.Tensor
    """[L] token ids the draft reads (long)."""
    positions: torch.Tensor
    """[m] indices into the sequence of the predicted tokens, each in [1, L]."""
    target: TargetDist
    """The target's distribution at each of the m positions."""
    request_id: str

    @property
    def num_positions(self) -> int:
        return int(self.positions.numel())


def teacher_example(rec: MissRecord) -> Example:
    """The logged rejected positions of ``rec`` and the logged target distributions there."""
    positions = torch.from_numpy(rec.positions).long()
    last = int(positions.max()) if positions.numel() else 0
    return Example(torch.from_numpy(rec.token_ids[:last]).long(), positions, target_dist(rec), rec.request_id)


def draft_logits(model: torch.nn.Module, ex: Example) -> torch.Tensor:
    """[m, V] the draft's logits predicting each position of ``ex`` (one causal forward)."""
    device = next(model.parameters()).device
    if ex.num_positions == 0:
        vocab = int(model.config.vocab_size)
        return torch.zeros((0, vocab), device=device)
    logits = model(input_ids=ex.context.unsqueeze(0).to(device)).logits[0]  # [L, V]
    return logits[(ex.positions - 1).to(device)]


def draft_logits_at(model: torch.nn.Module, rec: MissRecord) -> torch.Tensor:
    """[m, V] the draft's logits predicting each rejected position of ``rec``.

    One causal forward over ``token_ids[:last position]``: the logits at index ``i - 1``
    are the draft's prediction for the token at index ``i``.
    """
    return draft_logits(model, teacher_example(rec))

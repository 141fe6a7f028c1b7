"""From logged records to tensors: training examples, the target's distribution and the
draft's logits at each rejected position of a MissRecord."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.engine.draft_vocab import DraftVocab
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


def draft_logits(model: torch.nn.Module, ex: Example, vocab: DraftVocab | None = None) -> torch.Tensor:
    """[m, V] the draft's logits predicting each position of ``ex`` (one causal forward).

    With a draft vocabulary ``vocab`` ([S] token ids), only those head rows run: [m, S],
    columns in the order of ``vocab.token_ids`` (pair with ``TargetDist.restrict``).
    """
    device = next(model.parameters()).device
    if ex.num_positions == 0:
        width = vocab.size if vocab is not None else int(model.config.vocab_size)
        return torch.zeros((0, width), device=device)
    # the LM head runs only at the m predicting positions, not at every one of the L
    keep = (ex.positions - 1).to(device)  # [m]
    ids = ex.context.unsqueeze(0).to(device)
    if vocab is None:
        return model(input_ids=ids, logits_to_keep=keep).logits[0]  # [m, V]
    hidden = model.base_model(input_ids=ids).last_hidden_state[0, keep]  # [m, H]
    head = model.get_output_embeddings()
    rows = head.weight[vocab.token_ids.to(device)] if head.weight.requires_grad else vocab.rows(head)
    logits = F.linear(hidden, rows)  # [m, S]
    if head.bias is not None:
        logits = logits + head.bias[vocab.token_ids.to(device)]
    return logits


def draft_logits_at(model: torch.nn.Module, rec: MissRecord) -> torch.Tensor:
    """[m, V] the draft's logits predicting each rejected position of ``rec``.

    One causal forward over ``token_ids[:last position]``: the logits at index ``i - 1``
    are the draft's prediction for the token at index ``i``.
    """
    return draft_logits(model, teacher_example(rec))

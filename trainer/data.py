"""From logged records to tensors: training examples, the target's distribution and the
draft's logits at each rejected position of a MissRecord."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specops.core.draft_vocab import DraftVocab
from specops.streams.records import DIST_TOPK, MissRecord
from specops.trainer.losses import TargetDist


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


TEACHER_TOPK = 64
"""Target log-probs kept per position when the trainer recomputes them (as serving logs them)."""


def every_position_example(rec: MissRecord, target: TargetDist) -> Example:
    """Every output position of ``rec`` (not only the rejected ones) against ``target``, the
    target's distribution at each of them ([n_out] rows, in order)."""
    first, n = rec.num_prompt_tokens, len(rec.token_ids)
    positions = torch.arange(first, n, dtype=torch.long)
    if target.logprobs.shape[0] != positions.numel():
        raise ValueError(
            f"request {rec.request_id}: {target.logprobs.shape[0]} target rows for {positions.numel()} output positions"
        )
    return Example(torch.from_numpy(rec.token_ids[: n - 1]).long(), positions, target, rec.request_id)


def logs_every_position(rec: MissRecord) -> bool:
    """The record carries the target's distribution at every output position (serving logged them all)."""
    n_out = len(rec.token_ids) - rec.num_prompt_tokens
    return n_out > 0 and len(rec.positions) == n_out and int(rec.positions[0]) == rec.num_prompt_tokens


class TargetTeacher:
    """The target's distribution at every output position of a logged request, by one teacher
    forward over its tokens (top-k + residual, as serving logs them), cached per request.

    Serving logs the target's distribution only where a draft token was rejected; training
    at every position (``OnlineConfig.positions = "all"``) needs it at the accepted positions
    too. One forward of the target over the request's tokens gives it. A request trained in
    several updates (a ``recent`` replay buffer) is forwarded once: results are kept for the
    ``cache_size`` most recent requests."""

    def __init__(self, target: torch.nn.Module, *, topk: int = TEACHER_TOPK, cache_size: int = 512) -> None:
        self.target = target
        self.topk = topk
        self.cache_size = cache_size
        self._cache: dict[str, TargetDist] = {}
        self.forwards = 0
        self.seconds = 0.0

    @torch.no_grad()
    def __call__(self, rec: MissRecord) -> TargetDist:
        import time

        key = f"{rec.request_id}:{len(rec.token_ids)}"
        hit = self._cache.pop(key, None)
        if hit is None:
            t0 = time.perf_counter()
            device = next(self.target.parameters()).device
            first, n = rec.num_prompt_tokens, len(rec.token_ids)
            ids = torch.from_numpy(rec.token_ids[: n - 1]).long().unsqueeze(0).to(device)
            keep = torch.arange(first - 1, n - 1, device=device)
            logits = self.target(input_ids=ids, logits_to_keep=keep).logits[0].float()  # [n_out, V]
            logp = torch.log_softmax(logits, -1)
            vals, tids = logp.topk(min(self.topk, logp.shape[-1]), dim=-1)
            residual = (1.0 - vals.double().exp().sum(-1)).clamp(0.0, 1.0).float()
            hit = TargetDist.topk(tids.cpu(), vals.cpu(), residual.cpu())
            self.forwards += 1
            self.seconds += time.perf_counter() - t0
        self._cache[key] = hit  # most recent last
        while len(self._cache) > self.cache_size:
            self._cache.pop(next(iter(self._cache)))
        return hit

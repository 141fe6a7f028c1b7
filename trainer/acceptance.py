"""Offline expected acceptance of a draft on logged target distributions.

For one position with target distribution p and draft distribution q:

- sampling (speculative rejection sampling, OSD Eq. 1): a drafted token is accepted
  with probability ``Σ_x min(p(x), q(x))`` (Leviathan et al. 2023, α = 1 − TV(p, q));
- greedy: the draft's argmax is accepted iff it equals the target's argmax.

With a top-k target the tail is known only as one residual mass r. The estimate sums
``min(p, q)`` over the top-k tokens (a lower bound, ``sampling``) and also reports the
upper bound that adds ``min(r, q_rest)`` (``sampling_upper``); for k = 64 the two differ
by little.

Those positions are the *rejected* ones: where the draft that served the request was
wrong. They are selected by that draft's errors, so they cannot compare two drafts: the
draft that served scores 0 on them in greedy agreement by construction, and any other
draft looks better there while its errors elsewhere go unseen. ``served`` is the
unbiased measure: on held-out *greedy* requests every output token is the target's
argmax, so the draft's argmax agreement with the output at *every* output position is
known without any logged distribution. Greedy speculative decoding accepts exactly the
runs of such agreements (the draft proposes from the committed prefix, which is the
target's own output), so ``served`` is the per-token acceptance α serving will see. The
promotion gate compares drafts on it, pairing them request by request
(:func:`paired_gain`).

Every estimate is taken as serving runs the draft: restricted to its draft vocabulary
when it has one (``specops.core.draft_vocab``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specops.core.draft_vocab import DraftVocab, supports_subset_head
from specops.streams.records import MissRecord
from specops.trainer.losses import TargetDist


@dataclass(frozen=True)
class Acceptance:
    """Mean expected acceptance at rejected positions, and greedy agreement at every output position."""

    sampling: float
    sampling_upper: float
    greedy: float
    num_positions: int
    """Rejected positions the first three are averaged over."""
    served: float = 0.0
    """Greedy agreement over every output position of the greedy held-out requests."""
    served_positions: int = 0
    per_request: tuple[tuple[int, int], ...] = ()
    """(agreeing positions, output positions) of each greedy held-out request, in order."""

    def to_dict(self) -> dict:
        return {
            "sampling": self.sampling,
            "sampling_upper": self.sampling_upper,
            "greedy": self.greedy,
            "num_positions": self.num_positions,
            "served": self.served,
            "served_positions": self.served_positions,
            "served_requests": len(self.per_request),
        }


def paired_gain(candidate: Acceptance, reference: Acceptance) -> tuple[float, float]:
    """``served`` of the candidate minus the reference's on the same requests, and its standard error.

    Requests are the independent units (positions of one request are correlated): the
    difference is a ratio of sums over requests, and its standard error the ratio
    estimator's, ``sqrt(R/(R-1) · Σ (d_i - Δ·n_i)²) / Σ n_i``.
    """
    pairs = list(zip(candidate.per_request, reference.per_request))
    if not pairs or any(c[1] != r[1] for c, r in pairs) or len(candidate.per_request) != len(reference.per_request):
        raise ValueError("paired_gain needs both drafts evaluated on the same requests")
    n = sum(c[1] for c, _ in pairs)
    if n == 0:
        return 0.0, float("inf")
    d = [c[0] - r[0] for c, r in pairs]
    delta = sum(d) / n
    if len(pairs) < 2:
        return delta, float("inf")
    resid = sum((di - delta * c[1]) ** 2 for di, (c, _) in zip(d, pairs))
    return delta, math.sqrt(resid * len(pairs) / (len(pairs) - 1)) / n


def position_acceptance(
    draft_logits: torch.Tensor, target: TargetDist
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
def evaluate_records(
    model: torch.nn.Module, records: Iterable[MissRecord], *, vocab: DraftVocab | None = None
) -> Acceptance:
    """Expected acceptance of ``model`` at every rejected position of ``records``, and its
    greedy agreement at every output position of the greedy ones (``served``); with
    ``vocab``, the draft scores only those tokens, as serving runs it."""
    from specops.trainer.data import target_dist

    was_training = model.training
    model.eval()
    lows, highs, greedys = [], [], []
    per_request: list[tuple[int, int]] = []
    device = next(model.parameters()).device
    mask = None
    subset = vocab is not None and supports_subset_head(model)
    if vocab is not None and not subset:
        mask = torch.full((vocab.vocab_size,), float("-inf"), device=device)
        mask[vocab.token_ids.to(device)] = 0.0
    try:
        for rec in records:
            greedy_request = rec.sampling.temperature == 0.0
            first = rec.num_prompt_tokens  # output positions: first .. len - 1
            n_out = len(rec.token_ids) - first
            if (rec.num_rejected == 0 and not greedy_request) or n_out <= 0 or first == 0:
                continue
            ids = torch.from_numpy(rec.token_ids).long()
            keep = torch.arange(first - 1, len(ids) - 1)  # predicting positions first .. len - 1
            if subset:  # only the draft vocabulary's head rows run: -inf elsewhere, as serving scores it
                hidden = model.base_model(input_ids=ids[:-1].unsqueeze(0).to(device)).last_hidden_state[
                    0, keep.to(device)
                ]
                logits = vocab.logits(model.get_output_embeddings(), hidden)  # [n_out, V]
            else:
                logits = model(input_ids=ids[:-1].unsqueeze(0).to(device), logits_to_keep=keep.to(device)).logits[0]
            if mask is not None:
                logits = logits + mask
            if rec.num_rejected:
                rows = torch.from_numpy(rec.positions).long().to(device) - first
                low, high, greedy = position_acceptance(logits[rows], target_dist(rec))
                lows.append(low)
                highs.append(high)
                greedys.append(greedy)
            if greedy_request:
                agree = logits.argmax(dim=-1).cpu() == ids[first:]
                per_request.append((int(agree.sum()), n_out))
    finally:
        model.train(was_training)
    matched, served_n = sum(m for m, _ in per_request), sum(n for _, n in per_request)
    served = dict(
        served=matched / served_n if served_n else 0.0, served_positions=served_n, per_request=tuple(per_request)
    )
    if not lows:
        return Acceptance(0.0, 0.0, 0.0, 0, **served)
    low, high, greedy = torch.cat(lows), torch.cat(highs), torch.cat(greedys)
    return Acceptance(float(low.mean()), float(high.mean()), float(greedy.mean()), int(low.numel()), **served)

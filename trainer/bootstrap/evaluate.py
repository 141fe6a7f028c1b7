"""Held-out metrics of the bootstrapped pair, per domain.

- ``heldout_loss``: mean next-token cross-entropy (nats/token) on held-out files.
- ``greedy_agreement``: fraction of positions where argmax q == argmax p.
- ``expected_acceptance``: mean over positions of sum_x min(p(x), q(x)), the
  probability that speculative sampling accepts one draft token
  (Leviathan et al. 2023, Sec. 3.5: alpha = E[sum_x min(p, q)]).

p is the target's next-token distribution, q the draft's.
"""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from .train import TokenStream, next_token_loss


def agreement(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> tuple[float, float]:
    """(greedy agreement, expected acceptance) averaged over [batch, seq] positions."""
    assert draft_logits.shape == target_logits.shape and draft_logits.ndim == 3
    greedy = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
    p = torch.softmax(target_logits.float(), -1)
    q = torch.softmax(draft_logits.float(), -1)
    accept = torch.minimum(p, q).sum(-1).mean().item()
    return greedy, accept


@torch.inference_mode()
def evaluate(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    streams: dict[str, TokenStream],
    *,
    num_windows: int,
    seq_len: int,
    chunk: int = 4,
) -> dict:
    """Manifest ``metrics`` block computed on each domain's held-out stream."""
    target.eval()
    draft.eval()
    out: dict = {
        "target": {"heldout_loss": {}},
        "draft": {"heldout_loss": {}, "greedy_agreement": {}, "expected_acceptance": {}},
    }
    for domain, stream in sorted(streams.items()):
        windows = stream.contiguous_windows(num_windows, seq_len + 1)  # [n, seq + 1]
        sums = {"t_loss": 0.0, "d_loss": 0.0, "greedy": 0.0, "accept": 0.0}
        n = 0
        for i in range(0, windows.shape[0], chunk):
            ids = windows[i : i + chunk]
            inputs, labels = ids[:, :-1], ids[:, 1:]
            t_logits = target(input_ids=inputs).logits  # [chunk, seq, vocab]
            d_logits = draft(input_ids=inputs).logits  # [chunk, seq, vocab]
            greedy, accept = agreement(d_logits, t_logits)
            w = ids.shape[0]
            sums["t_loss"] += next_token_loss(t_logits, labels).item() * w
            sums["d_loss"] += next_token_loss(d_logits, labels).item() * w
            sums["greedy"] += greedy * w
            sums["accept"] += accept * w
            n += w
        out["target"]["heldout_loss"][domain] = round(sums["t_loss"] / n, 4)
        out["draft"]["heldout_loss"][domain] = round(sums["d_loss"] / n, 4)
        out["draft"]["greedy_agreement"][domain] = round(sums["greedy"] / n, 4)
        out["draft"]["expected_acceptance"][domain] = round(sums["accept"] / n, 4)
    return out

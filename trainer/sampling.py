"""Where the distillation loss is applied: teacher, student or mixed sampling (OSD §4.1).

GKD's loss (OSD Eq. 5) compares the target and the draft along a sequence ``y``. Which
``y`` is the choice of *sampling*:

- ``teacher`` (the default): the sequence the target actually produced in serving, with
  the loss at the logged rejected positions, against the logged target distributions.
  Needs nothing but the stream.
- ``student``: ``y`` is sampled from the current draft ``q`` after the logged prompt, and
  the loss applies at every sampled position against the target's full distribution
  there, so the draft learns where its own mistakes lead it.
- ``mixed``: token-level mixed sampling, ``y_j ~ λ·p + (1-λ)·q`` (Gu et al. 2023; OSD
  §4.1), ``λ = mix``. ``mix=0`` is student sampling, ``mix=1`` samples from the target.

Student and mixed sampling need the target model at hand (``specops train --target``):
one target forward per sampled token, plus one scoring pass per sequence. Samples are
drawn once per update with the draft as it is at the start of that update; nothing is
differentiated through the sampling (OSD Eq. 5).
"""

from __future__ import annotations

import torch

from specops.streams.records import MissRecord
from specops.trainer.data import Example
from specops.trainer.losses import TargetDist

SAMPLING = ("teacher", "student", "mixed")


def mixture_sample(
    target_logits: torch.Tensor, draft_logits_: torch.Tensor, mix: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row from ``mix·softmax(target) + (1-mix)·softmax(draft)``: [N, V], [N, V] -> [N]."""
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be in [0, 1], got {mix}")
    p = torch.softmax(target_logits.float(), -1)
    q = torch.softmax(draft_logits_.float(), -1)
    probs = mix * p + (1.0 - mix) * q
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def sampled_example(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    rec: MissRecord,
    *,
    mix: float,
    max_new_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> Example:
    """Sample a continuation of ``rec``'s prompt from ``mix·p + (1-mix)·q``; score it with the target.

    ``max_new_tokens`` defaults to the length of the logged output (at least 1). Both
    models decode with their KV caches; the target's distribution at every sampled
    position is then taken from one forward over the whole sequence (full vocabulary).
    """
    device = next(draft.parameters()).device
    prompt = torch.from_numpy(rec.token_ids[: rec.num_prompt_tokens]).long().to(device).unsqueeze(0)  # [1, P]
    n_new = max_new_tokens or max(1, len(rec.token_ids) - rec.num_prompt_tokens)
    limit = min(getattr(m.config, "max_position_embeddings", 1 << 30) for m in (target, draft))
    n_new = max(1, min(n_new, limit - prompt.shape[1]))
    was_training = draft.training
    draft.eval()
    try:
        ids = prompt
        t_out = target(input_ids=ids, use_cache=True)
        d_out = draft(input_ids=ids, use_cache=True)
        new = []
        for _ in range(n_new):
            tok = mixture_sample(t_out.logits[:, -1], d_out.logits[:, -1], mix, generator)  # [1]
            new.append(tok)
            step = tok.unsqueeze(0)  # [1, 1]
            t_out = target(input_ids=step, past_key_values=t_out.past_key_values, use_cache=True)
            d_out = draft(input_ids=step, past_key_values=d_out.past_key_values, use_cache=True)
        seq = torch.cat([prompt[0], torch.cat(new)])  # [P + n]
        logp = torch.log_softmax(target(input_ids=seq[:-1].unsqueeze(0)).logits[0].float(), -1)  # [P + n - 1, V]
    finally:
        draft.train(was_training)
    start = prompt.shape[1]
    positions = torch.arange(start, seq.shape[0], device=device)
    return Example(seq[:-1].cpu(), positions.cpu(), TargetDist.full(logp[start - 1 :].cpu()), rec.request_id)

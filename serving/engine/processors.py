"""What a request changes in the target's logits before sampling: ``logit_bias``, ``min_tokens``,
``repetition_penalty`` and OpenAI's ``presence_penalty`` / ``frequency_penalty``.

Each depends on the tokens before the position it scores, so the verifier applies it **row by
row**: row ``i`` of a chain's pass scores the position after the committed output and the
drafts ``d_1 .. d_i``, so its counts include those drafts (accepted earlier in the same step if
the row is reached at all); a tree node's row counts the path from the root to it. Target-only
decoding applies the same function to its one row, so the adjusted distribution, and with it
every acceptance rule, is the one target-only decoding samples from: greedy outputs are
identical and sampled ones are distributed alike (``tests/serving/engine/test_penalties.py``,
with a negative control that counts only the tokens committed before the step).

Order and definitions are vLLM's (``vllm/v1/sample``): ``logit_bias`` added; the EOS tokens
masked while fewer than ``min_tokens`` are out; then ``repetition_penalty`` (HF/vLLM: a logit
of a token in the context or the output divided by it when positive, multiplied when not),
``frequency_penalty`` × the token's count in the output and ``presence_penalty`` × whether it
occurs there subtracted (OpenAI: output tokens only). Temperature and the filters come after
(``specops.serving.engine.sampling.warp``).
"""

from __future__ import annotations

import torch

from specops.serving.engine.types import SamplingParams


def adjusts(params: SamplingParams) -> bool:
    """Whether ``params`` change the logits at all (the verifier skips this module otherwise)."""
    return any(getattr(params, name) != off for name, off in OFF.items())


OFF = {"logit_bias": (), "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
"""The request fields this module applies, with their "off" values (``SamplingParams``' names)."""


def adjusting_field(params: SamplingParams) -> str:
    """The first field of ``params`` that changes the logits (what a 400 that refuses them names)."""
    return next((name for name, off in OFF.items() if getattr(params, name) != off), "logit_bias")


def adjust(
    logits: torch.Tensor,
    params: SamplingParams,
    context: list[int],
    num_prompt: int,
    extras: list[list[int]],
    eos: frozenset[int] | tuple[int, ...] = (),
) -> torch.Tensor:
    """``logits`` [rows, vocab] adjusted row by row (module docstring): ``context`` is the request's
    committed tokens (``num_prompt`` of them the prompt), ``extras[r]`` the drafted tokens between
    them and row ``r``'s position. Returns a new float32 tensor (``logits`` itself when nothing
    changes)."""
    if not adjusts(params):
        return logits
    rows, vocab = logits.shape
    assert len(extras) == rows, (len(extras), rows)
    x = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if 0 <= t < vocab], dtype=torch.long)
        vals = torch.tensor([b for t, b in params.logit_bias if 0 <= t < vocab], dtype=x.dtype)
        x[:, ids] += vals
    out = context[num_prompt:]
    if params.min_tokens and eos:
        eos_ids = torch.tensor(sorted(t for t in eos if 0 <= t < vocab), dtype=torch.long)
        for r, extra in enumerate(extras):
            if len(out) + len(extra) < params.min_tokens:
                x[r, eos_ids] = float("-inf")
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        counts = torch.zeros((rows, vocab), dtype=x.dtype)
        if out:
            counts += torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[:vocab].to(x.dtype)
        for r, extra in enumerate(extras):
            if extra:
                counts[r].index_add_(0, torch.tensor(extra, dtype=torch.long), torch.ones(len(extra), dtype=x.dtype))
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            if num_prompt:
                prompt = torch.zeros(vocab, dtype=torch.bool)
                prompt[torch.tensor(context[:num_prompt], dtype=torch.long)] = True
                seen |= prompt
            rp = params.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        if params.frequency_penalty:
            x -= params.frequency_penalty * counts
        if params.presence_penalty:
            x -= params.presence_penalty * (counts > 0).to(x.dtype)
    return x

"""The target's greedy continuations of many prompts, batched with left padding (one function for
every benchmark that needs reference outputs: ``benchmarks/dresd.py``, ``benchmarks/dresd_curve.py``,
``benchmarks/dresd_perturb.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from tqdm import tqdm


def generation_eos(target) -> set[int]:
    """The EOS ids of ``target.generation_config`` (none, one or a list) as a set."""
    eos = getattr(target.generation_config, "eos_token_id", None)
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def greedy_batches(
    target,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    pad: int,
    *,
    batch: int | None = 64,
    by_length: bool = True,
    eos: Iterable[int | None] = (),
    desc: str | None = None,
) -> list[list[int]]:
    """``new_tokens`` greedy tokens of ``target`` after each prompt, in the order of ``prompts``.

    Prompts go through ``target.generate`` ``batch`` at a time (None: all in one batch), left
    padded with ``pad`` under an attention mask (as HF ``generate`` wants for decoder-only
    models); ``by_length`` sorts them by length first (stable), so a batch holds prompts of similar
    length. Each output is cut after its first token in ``eos`` (None entries are ignored; empty:
    no cut). ``desc``: a progress bar per batch under that name (None: no bar). The batches (and
    so the padding each row sees) depend only on these arguments, so a caller gets the same token
    ids as the inline loop it replaced."""
    stop = {t for t in eos if t is not None}
    device = next(target.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if by_length else list(range(len(prompts)))
    size = batch or max(1, len(order))
    starts = range(0, len(order), size)
    out: list[list[int]] = [[] for _ in prompts]
    for b in tqdm(starts, desc=desc, unit="batch") if desc is not None else starts:
        idx = order[b : b + size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)  # [b, width]
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(list(prompts[i]))
            mask[r, width - len(prompts[i]) :] = 1
        with torch.no_grad():
            gen = target.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        for r, i in enumerate(idx):
            g = gen[r, width:].tolist()
            cut = next((j for j, t in enumerate(g) if t in stop), None)
            out[i] = g[: cut + 1] if cut is not None else g
    return out

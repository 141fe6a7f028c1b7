"""A GKD update step on a GPU (``pytest -m cuda``): the loss and gradients the trainer computes
(``specops.trainer.losses``, OSD Eq. 4's JSD[β]) agree with the CPU's, and optimiser steps on the device
lower the loss and raise the draft's greedy agreement with the target.

The step is ``specops.trainer.online.update``'s: draft logits at the logged positions, ``checked_loss``,
backward, ``clip_grad_norm_``, AdamW. (The update loop itself reads records from ``streams``,
whose pins the GPU machine lacks; the CPU tests run it end to end.)
"""

from __future__ import annotations

import copy

import pytest
import torch

from specops.trainer.losses import TargetDist, checked_loss
from tests import cuda_support as cs
from tests.conftest import perturbed, random_prompts

pytestmark = cs.MARKS


def _batch(target: torch.nn.Module) -> tuple[torch.Tensor, TargetDist]:
    """Four 24-token sequences and the target's full distribution at every position."""
    ids = torch.tensor([p[:24] for p in random_prompts(4, seed=21, lo=24, hi=25)])  # [4, 24]
    with torch.no_grad():
        logits = target(input_ids=ids.to(target.device)).logits.float()  # [4, 24, vocab]
    return ids, TargetDist(torch.log_softmax(logits.reshape(-1, logits.shape[-1]), -1))


def _loss(draft: torch.nn.Module, ids: torch.Tensor, target: TargetDist) -> torch.Tensor:
    z = draft(input_ids=ids.to(draft.device)).logits  # [4, 24, vocab]
    loss, reason = checked_loss(z.reshape(-1, z.shape[-1]), target, "jsd", beta=0.5)
    assert reason is None, reason
    return loss


def _agreement(draft: torch.nn.Module, ids: torch.Tensor, target: TargetDist) -> float:
    with torch.no_grad():
        z = draft(input_ids=ids.to(draft.device)).logits.reshape(-1, target.logprobs.shape[-1])
    return float((z.argmax(-1) == target.logprobs.argmax(-1)).float().mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gkd_step_on_the_device_matches_the_cpu_and_learns(dtype):
    cpu_target = cs.cpu_target()
    cpu_draft = perturbed(cpu_target, 0.3, seed=4).train()
    draft = copy.deepcopy(cpu_draft).to(cs.DEVICE, dtype)
    target = cs.on_device(cpu_target)
    ids, tgt = _batch(target)
    _, cpu_tgt = _batch(cpu_target)
    assert tgt.logprobs.device.type == torch.device(cs.DEVICE).type

    # 1. the same loss and gradients as on the CPU (float32: to rounding; bfloat16: its precision)
    loss, cpu_loss = _loss(draft, ids, tgt), _loss(cpu_draft.to(dtype), ids, cpu_tgt)
    loss.backward()
    cpu_loss.backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert loss.dtype == torch.float32  # the losses compute in float32 whatever the draft's precision
    assert abs(loss.item() - cpu_loss.item()) <= tol * max(1.0, cpu_loss.item())
    g, g_cpu = draft.lm_head.weight.grad.float().cpu(), cpu_draft.lm_head.weight.grad.float()
    assert torch.isfinite(g).all()
    assert float((g - g_cpu).norm() / g_cpu.norm()) < (1e-3 if dtype == torch.float32 else 0.1)

    # 2. steps as the trainer takes them: the loss falls and the draft agrees with the target more
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3 if dtype == torch.float32 else 1e-2)
    draft.zero_grad()
    first, before = loss.item(), _agreement(draft, ids, tgt)
    for _ in range(15):
        step_loss = _loss(draft, ids, tgt)
        opt.zero_grad()
        step_loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
    after_loss = _loss(draft, ids, tgt).item()
    assert after_loss < 0.7 * first, (first, after_loss)
    assert _agreement(draft, ids, tgt) >= before
    assert next(draft.parameters()).device.type == torch.device(cs.DEVICE).type

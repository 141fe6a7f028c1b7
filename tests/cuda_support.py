"""What the CUDA tests share (``pytest -m cuda``; ``benchmarks/gpu_check.py`` runs them on a GPU).

The tests reuse the CPU tests' machinery (``tests.conftest``'s tiny random models and prompts,
``benchmarks.tree_check``, the CPU tests' reference loops) with the models placed on the GPU.
Without a GPU they skip ("no CUDA GPU"). ``SPECOPS_CUDA_TESTS_DEVICE=cpu`` runs them on the CPU
instead (to check the tests themselves where no GPU is lent).

They must import on the GPU machine, which lacks most of this project's pins: only torch,
transformers, safetensors, numpy and pytest, with ``benchmarks.gpu_compat``'s stand-ins for
``prometheus_client`` and ``tenacity`` (``gpu_check.py`` runs pytest with ``-p
benchmarks.gpu_compat --noconftest``, since ``tests/conftest.py`` loads the MLflow fixtures).
Fixtures therefore live in the test modules, built from these helpers.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from specops.core.models import ModelPair
from tests.conftest import perturbed, tiny_llama

DEVICE = os.environ.get("SPECOPS_CUDA_TESTS_DEVICE", "cuda")
"""Where the CUDA tests run: ``cuda`` unless the variable says otherwise."""

MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="no CUDA GPU"),
]
"""``pytestmark`` of every CUDA test module."""


def on_device(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` on :data:`DEVICE` (the CPU fixtures stay where they are)."""
    return copy.deepcopy(model).to(DEVICE).eval()


def cpu_target() -> torch.nn.Module:
    """``tests.conftest``'s ``tiny_target`` (same seed and shape), on the CPU."""
    return tiny_llama(64, 2, seed=1)


def tiny_target() -> torch.nn.Module:
    """``tiny_target`` on the device."""
    return on_device(cpu_target())


def close_pair(target: torch.nn.Module) -> ModelPair:
    """``close_pair`` on the device: the target and a perturbed copy of it (partial acceptance)."""
    return ModelPair(target=target, draft=on_device(perturbed(cpu_target(), 0.05, seed=3)), tokenizer=None)


def tiny_pair(target: torch.nn.Module) -> ModelPair:
    """``tiny_pair`` on the device: the target and an unrelated random draft (mostly rejected)."""
    return ModelPair(target=target, draft=on_device(tiny_llama(32, 1, seed=2)), tokenizer=None)


def twin_pair(target: torch.nn.Module) -> ModelPair:
    """``twin_pair`` on the device: an exact copy as the draft (always accepted when greedy)."""
    return ModelPair(target=target, draft=copy.deepcopy(target), tokenizer=None)


def bfloat16_pair() -> ModelPair:
    """``close_pair`` in bfloat16 on the device (serving's precision on a GPU)."""
    pair = close_pair(tiny_target())
    return ModelPair(target=pair.target.to(torch.bfloat16), draft=pair.draft.to(torch.bfloat16), tokenizer=None)


def first_divergence_is_a_rounding_tie(
    target, prompt: list[int], ref: list[int], out: list[int], ulps: int = 4
) -> bool:
    """Where ``out`` first leaves ``ref``, were the two tokens' target logits within ``ulps`` rounding
    units? (``tests/core/test_device.py``'s check, which the GPU machine cannot import: a verify pass
    over k+1 positions sums in another order than a one-token step, so an exact tie may fall either way.)"""
    i = next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + ref[:i]], device=target.device)).logits[0, -1].float()
    tolerance = ulps * torch.finfo(target.dtype).eps * logits.abs().max().item()
    gap = abs(logits[ref[i]].item() - logits[out[i]].item())
    assert gap <= tolerance, f"diverged at {i}: {ref[i]} vs {out[i]}, logit gap {gap:.4f} > {tolerance:.4f}"
    return True

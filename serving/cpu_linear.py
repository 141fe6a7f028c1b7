"""Linear layers for decoding on a CPU: a few rows at a time, computed as ``W @ xᵀ``.

Decoding multiplies every weight matrix by very few rows: one token for target-only
decoding, ``k + 1`` for a verification step. On the CPUs we serve on (AMD EPYC, AVX2),
MKL's ``x @ Wᵀ`` (what ``nn.Linear`` calls) handles 2 to 8 rows badly: it repacks ``W`` on
every call, so a 5-token verification of SmolLM2-135M cost 1.6x a 1-token forward and the
49k-row LM head 2-3x. The same product written as ``W @ xᵀ`` streams ``W`` once: measured
on 30 layers' worth of distinct matrices, 576→1536 with 3 rows went from 14.1 ms to 6.0 ms
and the 49152×576 head with 3 rows from 60 ms to 13 ms, and 1 row is unchanged.

:func:`use_small_batch_linear` switches a model's ``nn.Linear`` modules to
:class:`SmallBatchLinear`, which takes that route only where it helps: CPU, float32, no
autograd, 2..``MAX_ROWS`` rows. Training and prefill go through ``nn.Linear`` unchanged.
The result is the same product with another summation order, so values differ from
``nn.Linear``'s in the last bits, as they already do between MKL's 1-row and 5-row
kernels; every method of a served model, HF's baselines in the benchmarks included, runs
through the same modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16
"""Most rows routed to ``W @ xᵀ``; longer inputs (a prompt's prefill) use ``nn.Linear``."""


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` that computes few-row inference products as ``(W @ xᵀ)ᵀ``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        rows = x.numel() // self.in_features if self.in_features else 0
        if (2 <= rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
                and self.weight.dtype == torch.float32 and not torch.is_grad_enabled()):
            y = torch.mm(self.weight, x.reshape(rows, self.in_features).t()).t()  # [rows, out]
            if self.bias is not None:
                y = y + self.bias
            return y.contiguous().reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def use_small_batch_linear(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`SmallBatchLinear` in place; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
            n += 1
    return n

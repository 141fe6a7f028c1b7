"""Linear layers for decoding on a CPU: a few rows at a time, computed as ``W @ xᵀ``.

Decoding multiplies every weight matrix by very few rows: one token for target-only
decoding and each draft token, ``k + 1`` for a verification step. These products are
bound by reading ``W`` from memory, and MKL (what ``nn.Linear``'s ``x @ Wᵀ`` calls on our
CPUs, AMD EPYC with AVX2) handles them badly:

- **1 row** goes to a matrix-vector kernel that runs on **one thread**: on 2 cores a
  1-token forward of SmolLM2-135M read its 538 MB of weights at about 5-6 GB/s (the same
  with 1 or 2 threads). Written as a 2-column ``W @ [x; x]ᵀ``, the product goes to the
  matrix-matrix kernel, which splits ``W``'s rows over both threads: on 30 layers' worth
  of distinct 576×1536 matrices 54 ms became 40 ms, and the 49,152×576 head 21 ms became
  14 ms (one row computed twice costs nothing here: the time is the reads of ``W``).
- **2 to 8 rows** through ``x @ Wᵀ`` repack ``W`` on every call: a 5-token verification
  cost 1.6x a 1-token forward and the head 2-3x. ``W @ xᵀ`` streams ``W`` once (576→1536
  with 3 rows: 14.1 ms to 6.0 ms over 30 matrices; the head with 3 rows: 60 ms to 13 ms).

:func:`use_small_batch_linear` switches a model's ``nn.Linear`` modules to
:class:`SmallBatchLinear`, which takes that route only where it helps: CPU, float32, no
autograd, 1..``MAX_ROWS`` rows (:func:`few_rows_linear`, also used for a draft
vocabulary's head rows). Training and prefill go through ``nn.Linear`` unchanged. The
result is the same product with another summation order, so values differ from
``nn.Linear``'s in the last bits, as they already differ between MKL's 1-row and 5-row
kernels. Every method runs through the same modules, so greedy speculative decoding
still equals target-only decoding token for token (tests/serving/test_greedy_equality.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16
"""Most rows routed to ``W @ xᵀ``; longer inputs (a prompt's prefill) use ``nn.Linear``."""


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``W @ xᵀ`` when ``x`` has 1..MAX_ROWS rows of
    float32 on a CPU outside autograd (the module docstring says why). x ``[..., in]``."""
    in_features, out_features = weight.shape[1], weight.shape[0]
    rows = x.numel() // in_features if in_features else 0
    if not (1 <= rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and not torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, in_features)
    if rows == 1:
        x2 = x2.repeat(2, 1)  # [2, in]: the multi-threaded matrix-matrix kernel
    y = torch.mm(weight, x2.t()).t()[:rows]  # [rows, out]
    if bias is not None:
        y = y + bias
    return y.contiguous().reshape(*x.shape[:-1], out_features)


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` that computes few-row inference products with :func:`few_rows_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        return few_rows_linear(x, self.weight, self.bias)


def use_small_batch_linear(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`SmallBatchLinear` in place; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
            n += 1
    return n


@contextlib.contextmanager
def stock_linear(*models: nn.Module | None) -> Iterator[None]:
    """Within the block, ``models`` compute with plain ``nn.Linear`` as Hugging Face ships
    them (benchmarks time HF's own decoding loops this way); switched back afterwards."""
    switched = [m for model in models if model is not None for m in model.modules() if type(m) is SmallBatchLinear]
    for m in switched:
        m.__class__ = nn.Linear
    try:
        yield
    finally:
        for m in switched:
            m.__class__ = SmallBatchLinear

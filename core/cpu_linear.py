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

**Which route is faster depends on the CPU**, so a loaded model measures it
(:func:`calibrate`). The numbers above are from AMD EPYC; on an Intel Xeon with the same
torch, ``nn.Linear``'s 1-row kernel read the head in 3.2 ms where ``W @ [x; x]ᵀ`` took
10.8 ms, and 1-4 rows were 1.5-3x faster through ``nn.Linear`` on every SmolLM2 shape, while
8-16 rows were faster as ``W @ xᵀ``: always taking ``W @ xᵀ`` made target-only decoding of the
default pair 1.7x slower than Hugging Face's loop there. ``SPECOPS_CPU_LINEAR`` overrides
the measurement: ``auto`` (default), ``wx`` (always ``W @ xᵀ``, the route before calibration)
or ``stock`` (never).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16
"""Most rows routed to ``W @ xᵀ``; longer inputs (a prompt's prefill) use ``nn.Linear``."""

ROUTE_ENV = "SPECOPS_CPU_LINEAR"
"""``auto`` (measure at load, the default), ``wx`` (always ``W @ xᵀ``) or ``stock`` (never)."""
CALIBRATION_ROWS = (1, 2, 4, 8, 16)
"""Row counts timed at load; a count between two of them takes the route of the next one up."""
MIN_CALIBRATION_BYTES = 32 << 20
"""Models with fewer float32 linear weights than this are not timed (their products are
µs-scale and the timing would be noise): they keep ``W @ xᵀ`` for 1..MAX_ROWS rows."""
CALIBRATION_MARGIN = 0.9
"""``W @ xᵀ`` is taken where it cost less than this share of ``nn.Linear``'s time, so a near
tie stays on ``nn.Linear`` (the stock kernel) rather than flipping from one load to the next."""
ALL_ROWS = frozenset(range(1, MAX_ROWS + 1))

log = logging.getLogger(__name__)


def few_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, wx_rows: frozenset[int] = ALL_ROWS
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``W @ xᵀ`` when ``x`` has a number of rows in
    ``wx_rows`` (1..MAX_ROWS) of float32 on a CPU outside autograd (the module docstring says
    why). x ``[..., in]``."""
    in_features, out_features = weight.shape[1], weight.shape[0]
    rows = x.numel() // in_features if in_features else 0
    if not (
        rows in wx_rows
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
    ):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, in_features)
    if rows == 1:
        x2 = x2.repeat(2, 1)  # [2, in]: the multi-threaded matrix-matrix kernel
    y = torch.mm(weight, x2.t()).t()[:rows]  # [rows, out]
    if bias is not None:
        y = y + bias
    return y.contiguous().reshape(*x.shape[:-1], out_features)


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` that computes few-row inference products with :func:`few_rows_linear`
    for the row counts in ``wx_rows`` (set per module by :func:`calibrate`)."""

    wx_rows: frozenset[int] = ALL_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        return few_rows_linear(x, self.weight, self.bias, self.wx_rows)


def use_small_batch_linear(model: nn.Module, mode: str | None = None) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`SmallBatchLinear` in place and
    choose their routes (``mode``: ``auto``, ``wx`` or ``stock``; default ``$SPECOPS_CPU_LINEAR``
    or ``auto``, see :func:`calibrate`); returns how many were switched."""
    mode = mode or os.environ.get(ROUTE_ENV, "auto")
    if mode not in ("auto", "wx", "stock"):
        raise ValueError(f"{ROUTE_ENV} must be auto, wx or stock, got {mode!r}")
    switched = []
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
            switched.append(module)
    if mode == "stock":
        for m in switched:
            m.wx_rows = frozenset()
    elif mode == "auto" and switched:
        calibrate(switched)
    return len(switched)


def _measure(route: str, modules: list[nn.Linear], x: torch.Tensor, reps: int = 3) -> float:
    """Best of ``reps`` seconds to run ``x`` through every module by ``route`` (``stock``:
    ``nn.Linear``'s kernel; ``wx``: ``W @ xᵀ``), after one warm-up run."""
    if route == "stock":

        def run() -> None:
            for m in modules:
                F.linear(x, m.weight, m.bias)
    else:

        def run() -> None:
            for m in modules:
                few_rows_linear(x, m.weight, m.bias)

    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(modules: list[nn.Linear]) -> dict[tuple[int, int], frozenset[int]]:
    """Time ``nn.Linear`` against ``W @ xᵀ`` on ``modules`` (grouped by weight shape; every
    module of a shape is run, so the weights stream from memory as in a forward) at each of
    :data:`CALIBRATION_ROWS`, and set each module's ``wx_rows`` to the counts where ``W @ xᵀ``
    won by :data:`CALIBRATION_MARGIN`. Skipped (``W @ xᵀ`` kept for every count) below
    :data:`MIN_CALIBRATION_BYTES` of float32 CPU weights. Returns the choice per shape."""
    groups: dict[tuple[int, int], list[nn.Linear]] = defaultdict(list)
    for m in modules:
        w = m.weight
        if w.device.type == "cpu" and w.dtype == torch.float32:
            groups[tuple(w.shape)].append(m)
    total = sum(m.weight.numel() * 4 for ms in groups.values() for m in ms)
    if total < MIN_CALIBRATION_BYTES:
        return {}
    t0 = time.perf_counter()
    chosen: dict[tuple[int, int], frozenset[int]] = {}
    report = []
    with torch.inference_mode():
        for shape, ms in groups.items():
            won = set()
            for rows in CALIBRATION_ROWS:
                x = torch.randn(rows, shape[1])
                stock, wx = _measure("stock", ms, x), _measure("wx", ms, x)
                if wx < CALIBRATION_MARGIN * stock:
                    won.add(rows)
                report.append(f"{shape[0]}x{shape[1]}@{rows}: {1e3 * stock:.1f}/{1e3 * wx:.1f}")
            bucket = {r: next(c for c in CALIBRATION_ROWS if c >= r) for r in ALL_ROWS}
            chosen[shape] = frozenset(r for r in ALL_ROWS if bucket[r] in won)
            for m in ms:
                m.wx_rows = chosen[shape]
    log.info(
        "cpu linear: W @ xT for rows %s per weight shape, nn.Linear otherwise (timed in %.1fs)",
        {f"{o}x{i}": sorted(r) for (o, i), r in chosen.items()},
        time.perf_counter() - t0,
    )
    log.debug("cpu linear: nn.Linear / W @ xT ms: %s", ", ".join(report))
    return chosen


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

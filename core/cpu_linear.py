"""Linear layers for decoding on a CPU: three routes, chosen per weight shape and row count.

Decoding multiplies every weight matrix by very few rows: one token for target-only
decoding and each draft token, ``k + 1`` for a verification step, a few per request in a
batched pass. These products are bound by reading ``W`` from memory, and the stock route
(``nn.Linear``'s ``x @ Wᵀ``, MKL on our CPUs) handles them badly:

- **1 row** goes to a matrix-vector kernel that runs on **one thread**: on 2 cores a
  1-token forward of SmolLM2-135M read its 538 MB of weights at about 5-6 GB/s.
- **2 to 16 rows** through ``x @ Wᵀ`` repack ``W`` on every call: a 5-token verification
  cost 1.6x a 1-token forward and the head 2-3x.

The routes:

- ``stock``: ``F.linear``, as Hugging Face ships it.
- ``wx``: ``W @ xᵀ`` (one row written as two), which streams ``W`` once through the
  multi-threaded matrix-matrix kernel (1..``MAX_ROWS`` rows).
- ``onednn``: **prepacked weights**. ``W`` is reordered once, at load, into oneDNN's
  blocked layout for its CPU (``torch.ops.mkldnn._reorder_linear_weight``), and every product
  runs oneDNN's matmul on it (``torch.ops.mkldnn._linear_pointwise``), as vLLM's CPU
  backend does with its own oneDNN handles. Nothing is repacked per call, and it takes any
  number of rows, a prompt's prefill included. Measured on a 2-core AMD EPYC, 30 layers of
  SmolLM2-135M's shapes plus its head, at 8 rows: 32 ms by the better of ``stock`` and
  ``wx`` against 14 ms prepacked; at 1 row 31 ms against 10 ms. It costs a second copy of
  the weights (the packed one; the original stays for training, the draft vocabulary's head
  rows and ``state_dict``), and it is float32 only.

:func:`use_small_batch_linear` switches a model's ``nn.Linear`` modules to
:class:`SmallBatchLinear`, which takes the measured route only where it applies: CPU,
float32, no autograd. Training goes through ``nn.Linear`` unchanged. Each route is the
same product with another summation order, so values differ in the last bits between
routes (as they already differ between MKL's 1-row and 5-row kernels). Every method runs
through the same modules, so greedy speculative decoding still equals target-only decoding
token for token (tests/serving/test_greedy_equality.py). A packed weight follows its module:
one whose weight was changed in place (a hot-swapped copy, ``load_state_dict``) is repacked
at its next product.

**Which route is faster depends on the CPU**, so a loaded model measures it
(:func:`calibrate`): ``stock``, ``wx`` and ``onednn`` at 1, 2, 4, 8 and 16 rows and, for
longer inputs, ``stock`` against ``onednn`` at :data:`PREFILL_ROWS`. (On an Intel Xeon with
the same torch, ``nn.Linear``'s 1-row kernel read the head in 3.2 ms where ``W @ xᵀ`` took
10.8 ms: always taking ``W @ xᵀ`` had made target-only decoding 1.7x slower than Hugging
Face's loop there.) ``SPECOPS_CPU_LINEAR`` overrides the measurement: ``auto`` (default),
``onednn`` (always prepacked, where oneDNN is built in), ``wx`` (always ``W @ xᵀ`` for
1..``MAX_ROWS`` rows, the route before calibration) or ``stock`` (never).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16
"""Most rows routed to ``W @ xᵀ``; longer inputs (a prompt's prefill) use ``nn.Linear`` or oneDNN."""
PREFILL_ROWS = 64
"""Rows timed for inputs longer than ``MAX_ROWS`` (``stock`` against ``onednn``)."""

ROUTE_ENV = "SPECOPS_CPU_LINEAR"
"""``auto`` (measure at load, the default), ``onednn``, ``wx`` or ``stock``."""
MODES = ("auto", "onednn", "wx", "stock")
CALIBRATION_ROWS = (1, 2, 4, 8, 16)
"""Row counts timed at load; a count between two of them takes the route of the next one up."""
MIN_CALIBRATION_BYTES = 32 << 20
"""Models with fewer float32 linear weights than this are not timed (their products are
µs-scale and the timing would be noise): they keep ``W @ xᵀ`` for 1..MAX_ROWS rows."""
CALIBRATION_MARGIN = 0.9
"""A route other than ``stock`` is taken where it cost less than this share of the best
route so far (``stock``, then ``wx``, then ``onednn``), so a near tie keeps the simpler
route rather than flipping from one load to the next."""
ALL_ROWS = frozenset(range(1, MAX_ROWS + 1))

_PACKED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int], torch.Tensor]] = weakref.WeakKeyDictionary()
"""Each module's packed weight and the weight it was packed from, beside the module rather than
in it: an opaque oneDNN tensor cannot be deep-copied, and a copy of a module packs its own."""

log = logging.getLogger(__name__)


def onednn_available() -> bool:
    """oneDNN's prepacked linear is built into this torch (the CPU wheels have it)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` over a weight from :func:`pack_weight`; x ``[..., in]``, any number of rows."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """What identifies the weight's contents for its packed copy: storage and in-place version."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor has no version counter (it cannot change in place either)
        version = -1
    return weight.data_ptr(), version


class SmallBatchLinear(nn.Linear):
    """``nn.Linear`` that computes inference products by the route :func:`calibrate` chose for
    their row count: oneDNN on prepacked weights for the counts in ``onednn_rows`` (and for
    more than ``MAX_ROWS`` rows when ``onednn_long``), ``W @ xᵀ`` for those in ``wx_rows``,
    ``nn.Linear`` otherwise."""

    wx_rows: frozenset[int] = ALL_ROWS
    onednn_rows: frozenset[int] = frozenset()
    onednn_long: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        if (self.onednn_rows or self.onednn_long) and not torch.is_grad_enabled():
            rows = x.numel() // self.in_features if self.in_features else 0
            if (rows in self.onednn_rows if rows <= MAX_ROWS else self.onednn_long) and self._packable(x):
                return packed_linear(x, self.packed(), self.bias)
        return few_rows_linear(x, self.weight, self.bias, self.wx_rows)

    def _packable(self, x: torch.Tensor) -> bool:
        w = self.weight
        return x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == w.dtype == torch.float32

    def packed(self) -> torch.Tensor:
        """The weight in oneDNN's layout, packed again if the weight changed since."""
        key = _weight_key(self.weight)
        got = _PACKED.get(self)
        if got is None or got[0] != key:
            got = _PACKED[self] = (key, pack_weight(self.weight))
        return got[1]

    def set_routes(self, wx_rows: frozenset[int], onednn_rows: frozenset[int], onednn_long: bool) -> None:
        self.wx_rows, self.onednn_rows, self.onednn_long = wx_rows, onednn_rows, onednn_long
        if not (onednn_rows or onednn_long):
            _PACKED.pop(self, None)
        elif self.weight.device.type == "cpu" and self.weight.dtype == torch.float32:
            self.packed()  # at load, not in the first request's pass


def use_small_batch_linear(model: nn.Module, mode: str | None = None) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`SmallBatchLinear` in place and
    choose their routes (``mode``: see :data:`MODES`; default ``$SPECOPS_CPU_LINEAR`` or
    ``auto``, see :func:`calibrate`); returns how many were switched."""
    mode = mode or os.environ.get(ROUTE_ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"{ROUTE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    switched = []
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallBatchLinear
            switched.append(module)
    if mode == "stock":
        for m in switched:
            m.set_routes(frozenset(), frozenset(), False)
    elif mode == "onednn":
        if not onednn_available():
            log.warning("%s=onednn: this torch has no oneDNN; W @ xT for 1..%d rows instead", ROUTE_ENV, MAX_ROWS)
        else:
            for m in switched:
                m.set_routes(frozenset(), ALL_ROWS, True)
    elif mode == "auto" and switched:
        calibrate(switched)
    return len(switched)


def _measure(route: str, modules: list[nn.Linear], x: torch.Tensor, reps: int = 3) -> float:
    """Best of ``reps`` seconds to run ``x`` through every module by ``route`` (``stock``:
    ``nn.Linear``'s kernel; ``wx``: ``W @ xᵀ``; ``onednn``: the prepacked weights), after one
    warm-up run."""
    if route == "stock":

        def run() -> None:
            for m in modules:
                F.linear(x, m.weight, m.bias)
    elif route == "wx":

        def run() -> None:
            for m in modules:
                few_rows_linear(x, m.weight, m.bias)
    else:
        packed = [pack_weight(m.weight) for m in modules]

        def run() -> None:
            for m, p in zip(modules, packed):
                packed_linear(x, p, m.bias)

    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def _fastest(times: dict[str, float]) -> str:
    """The route to take: ``stock`` unless another beat the best so far by :data:`CALIBRATION_MARGIN`."""
    best = "stock"
    for route in ("wx", "onednn"):
        if route in times and times[route] < CALIBRATION_MARGIN * times[best]:
            best = route
    return best


def calibrate(modules: list[nn.Linear]) -> dict[tuple[int, int], dict[int, str]]:
    """Time the routes on ``modules`` (grouped by weight shape; every module of a shape is run,
    so the weights stream from memory as in a forward) at each of :data:`CALIBRATION_ROWS` and
    at :data:`PREFILL_ROWS`, and set each module's routes to the fastest (by
    :data:`CALIBRATION_MARGIN`). Skipped (``W @ xᵀ`` kept for 1..MAX_ROWS rows) below
    :data:`MIN_CALIBRATION_BYTES` of float32 CPU weights. Returns the route per shape and
    timed row count."""
    groups: dict[tuple[int, int], list[nn.Linear]] = defaultdict(list)
    for m in modules:
        w = m.weight
        if w.device.type == "cpu" and w.dtype == torch.float32:
            groups[tuple(w.shape)].append(m)
    total = sum(m.weight.numel() * 4 for ms in groups.values() for m in ms)
    if total < MIN_CALIBRATION_BYTES:
        return {}
    routes = ("stock", "wx", "onednn") if onednn_available() else ("stock", "wx")
    t0 = time.perf_counter()
    chosen: dict[tuple[int, int], dict[int, str]] = {}
    report = []
    with torch.inference_mode():
        for shape, ms in groups.items():
            won: dict[int, str] = {}
            for rows in (*CALIBRATION_ROWS, PREFILL_ROWS):
                x = torch.randn(rows, shape[1])
                times = {r: _measure(r, ms, x) for r in routes if not (r == "wx" and rows > MAX_ROWS)}
                won[rows] = _fastest(times)
                report.append(f"{shape[0]}x{shape[1]}@{rows}: " + "/".join(f"{1e3 * t:.1f}" for t in times.values()))
            bucket = {r: next(c for c in CALIBRATION_ROWS if c >= r) for r in ALL_ROWS}
            wx = frozenset(r for r in ALL_ROWS if won[bucket[r]] == "wx")
            onednn = frozenset(r for r in ALL_ROWS if won[bucket[r]] == "onednn")
            for m in ms:
                m.set_routes(wx, onednn, won[PREFILL_ROWS] == "onednn")
            chosen[shape] = won
    log.info(
        "cpu linear: route per weight shape at %s rows (then longer inputs): %s (timed in %.1fs)",
        "/".join(map(str, CALIBRATION_ROWS)),
        {f"{o}x{i}": "/".join(w.values()) for (o, i), w in chosen.items()},
        time.perf_counter() - t0,
    )
    log.debug("cpu linear: %s ms: %s", "/".join(routes), ", ".join(report))
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

"""The draft's precision, chosen by measurement on the machine that serves it (``auto``).

A draft token costs reading the draft's weights, so half the bytes should make it faster,
and on AMD EPYC (``avx512_bf16``) they do: the default draft's cached 1-token forward went
6.3 -> 3.8 ms in bfloat16, and the bfloat16 draft gave 1.32x target-only on code. On an Intel
Xeon the same bfloat16 draft ran at 0.71-0.76x target-only: its bfloat16 products are slower
than float32's there (float32 also gets ``specops.core.cpu_linear``'s measured routes; bfloat16 always
takes ``nn.Linear``). Which precision is faster is a property of the CPU, as the few-row
linear route is, so ``auto`` measures it when the draft loads (:func:`settle`):

1. ``$SPECOPS_DRAFT_DTYPE`` set to a precision forces it (as ``$SPECOPS_CPU_LINEAR`` forces a route).
2. A GPU: bfloat16 (float16 on a GPU older than Ampere, which lacks bfloat16 kernels).
3. An architecture already measured in this process (config sizes, draft vocabulary, device,
   threads): the same choice, not measured again.
4. Fewer float32 linear weights than ``cpu_linear.MIN_CALIBRATION_BYTES``: float32 (the
   timing would be noise; deterministic for tests).
5. Otherwise the float32 model (with its calibrated routes) and a bfloat16 copy are timed on
   what drafting runs (:class:`StepTimes`), arms interleaved, best of :data:`REPS`; bfloat16 is
   kept only when it costs less than :data:`MARGIN` of float32's time per drafted token, and
   the other copy is dropped.

**Why the margin favours float32**: float32 is the precision the draft was trained, evaluated
and registered in, and bfloat16 moves acceptance slightly (its greedy token agreed with
float32's at 98 % of held-out positions), so a bfloat16 draft must be clearly faster to pay;
and a near tie should not flip between loads on timing noise. Precision never changes the
output: verification runs on the target's logits whatever the draft's dtype.

A hot-swapped draft version is loaded in the serving draft's dtype (``specops.serving.fleet.hotswap``),
so precision never changes mid-traffic; the per-process cache also gives a reload of the same
architecture the same answer without timing it again.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn
from transformers import PreTrainedModel

from specops.core import draft_vocab
from specops.core.cost import CachedForward
from specops.core.cpu_linear import MIN_CALIBRATION_BYTES, ROUTE_ENV
from specops.core.device import DTYPES
from specops.core.errors import ModelConfigError

log = logging.getLogger(__name__)

AUTO = "auto"
"""The precision name that asks for :func:`settle`'s choice."""
ENV = "SPECOPS_DRAFT_DTYPE"
"""Forces the precision ``auto`` resolves to (``float32``, ``bfloat16``, ``float16`` on a GPU)."""
TIMED = ("float32", "bfloat16")
"""The precisions timed on a CPU (float16 is refused on a CPU, ``specops.core.device``)."""
MARGIN = 0.9
"""bfloat16 is kept where it costs less than this share of float32's time (module docstring)."""
MIN_TIMED_BYTES = MIN_CALIBRATION_BYTES
"""Below this many bytes of float32 linear weights the draft is not timed: float32."""
PROMPT_TOKENS = 64
"""Tokens of the timed prefill (the draft's first step of a request feeds the whole prompt)."""
ROUND_K = 3
"""Drafted tokens per round of the nominal request :class:`StepTimes` prices."""
ROUNDS = 21
"""Rounds of the nominal request (63 drafted tokens after the 64-token prompt)."""
REPS = 10
"""Timed repetitions of the steps per arm (after one warm-up); the best is kept."""
PREFILL_REPS = 3
"""Timed repetitions of the prefill per arm (after the warm-up)."""

_LOCK = threading.Lock()
CHOICES: dict[tuple, DtypeChoice] = {}
"""The choice per :func:`arch_key`, for this process."""


@dataclass(frozen=True)
class StepTimes:
    """Best milliseconds of the forwards a draft runs while drafting (``specops.serving.proposers.draft_model``):
    the prompt's prefill once per request, a 1-token step per drafted token, and a 2-token step
    (the last draft and the bonus token) after a fully accepted round."""

    prefill_ms: float
    one_ms: float
    two_ms: float

    @property
    def ms_per_token(self) -> float:
        """Draft time per drafted token of a nominal request: the prefill, then :data:`ROUNDS`
        rounds of :data:`ROUND_K` tokens, each a 2-token step and ``ROUND_K - 1`` 1-token steps."""
        round_ms = self.two_ms + (ROUND_K - 1) * self.one_ms
        return (self.prefill_ms + ROUNDS * round_ms) / (ROUNDS * ROUND_K)


@dataclass(frozen=True)
class DtypeChoice:
    """What ``auto`` chose for a draft, and why."""

    dtype: str
    """``float32``, ``bfloat16`` or ``float16``."""
    reason: str
    """``timed``, ``small`` (too small to time), ``device`` (a GPU) or ``env`` (``$SPECOPS_DRAFT_DTYPE``)."""
    ms_per_token: dict[str, float] = field(default_factory=dict)
    """Per timed precision: :attr:`StepTimes.ms_per_token` (``timed`` only)."""
    steps_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per timed precision: the :class:`StepTimes` fields."""
    timing_s: float = 0.0
    """Seconds the timing took."""
    cached: bool = False
    """Taken from an earlier measurement of the same architecture in this process."""

    def as_dict(self) -> dict:
        return asdict(self)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def choose(ms_per_token: Mapping[str, float], margin: float = MARGIN) -> str:
    """``bfloat16`` where it costs less than ``margin`` × float32's milliseconds per drafted
    token, else ``float32`` (a near tie keeps float32: the module docstring says why)."""
    return "bfloat16" if ms_per_token["bfloat16"] < margin * ms_per_token["float32"] else "float32"


def arch_key(model: PreTrainedModel) -> tuple:
    """What the measurement depends on: the config's sizes, the draft vocabulary, where and how
    (threads, ``$SPECOPS_CPU_LINEAR``) it runs. Two versions of one draft share it."""
    cfg = model.config
    fields = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    heads = ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
    vocab = draft_vocab.of(model)
    return (
        *(getattr(cfg, f, None) for f in fields + heads),
        vocab.size if vocab is not None else None,
        str(next(model.parameters()).device),
        torch.get_num_threads(),
        os.environ.get(ROUTE_ENV, "auto"),
    )


def linear_bytes(model: nn.Module) -> int:
    """Bytes of the model's linear weights in float32 (what ``cpu_linear`` compares with its threshold)."""
    return 4 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def cast_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the parameters in place; buffers (rotary frequencies) stay as they are, as
    ``from_pretrained(dtype=...)`` leaves them (``model.to(dtype)`` would round them)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
    return model


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy with its parameters in ``dtype`` (buffers, routes and draft vocabulary copied as
    they are), made without a transient full-precision copy; tied weights stay tied."""
    memo: dict[int, object] = {
        id(p): nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad) for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def _ids(model: PreTrainedModel) -> list[int]:
    vocab = int(model.config.vocab_size)
    return [(7 * i + 3) % vocab for i in range(PROMPT_TOKENS)]


def measure(arms: Mapping[str, PreTrainedModel], reps: int | None = None) -> dict[str, StepTimes]:
    """:class:`StepTimes` of each arm through the engine's forward (``specops.core.cost.CachedForward``),
    the arms interleaved (order alternating) so a concurrent job slows both alike; best of
    ``reps`` after one warm-up repetition (the prefill, a larger and steadier forward, best of
    :data:`PREFILL_REPS`); ``reps`` defaults to :data:`REPS`."""
    reps = REPS if reps is None else reps
    context = _ids(next(iter(arms.values())))
    best = {name: [float("inf")] * 3 for name in arms}
    lms: dict[str, CachedForward] = {}
    for rep in range(reps + 1):
        for name in list(arms) if rep % 2 else list(reversed(arms)):
            elapsed = [float("inf")]
            if rep <= PREFILL_REPS or name not in lms:
                lms[name] = lm = CachedForward(arms[name])
                t0 = time.perf_counter()
                lm.forward(context, logits_to_keep=1)
                elapsed = [time.perf_counter() - t0]
            lm = lms[name]
            base = lm.num_cached
            for n in (1, 2):
                t0 = time.perf_counter()
                lm.forward(context[-n:], logits_to_keep=1)  # the draft keeps one row per step
                elapsed.append(time.perf_counter() - t0)
                lm.rollback(base)
            if rep:
                best[name] = [min(b, 1e3 * e) for b, e in zip(best[name], elapsed)]
    return {name: StepTimes(*b) for name, b in best.items()}


def _forced(device: torch.device) -> str | None:
    name = os.environ.get(ENV, "").strip()
    if not name or name == AUTO:
        return None
    if name not in DTYPES:
        raise ModelConfigError(f"{ENV}={name!r} is not a precision: choose {AUTO}, {', '.join(DTYPES)}")
    if name == "float16" and device.type == "cpu":
        raise ModelConfigError(f"{ENV}=float16 needs a GPU: on a CPU use bfloat16, float32 or {AUTO}")
    return name


def _gpu_dtype(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        return "float16"  # before Ampere: no bfloat16 tensor cores
    return "bfloat16"


def decide(
    model: PreTrainedModel,
    *,
    timer: Callable[[Mapping[str, PreTrainedModel]], Mapping[str, StepTimes]] = measure,
    min_bytes: int = MIN_TIMED_BYTES,
) -> tuple[DtypeChoice, dict[str, PreTrainedModel]]:
    """The precision ``auto`` means for ``model`` (steps 1-5 of the module docstring), and the
    copies made to time it by precision name (``model`` itself under its own dtype's name)."""
    device = next(model.parameters()).device
    forced = _forced(device)
    if forced is not None:
        return DtypeChoice(forced, "env"), {}
    if device.type != "cpu":
        return DtypeChoice(_gpu_dtype(device), "device"), {}
    key = arch_key(model)
    arms: dict[str, PreTrainedModel] = {}
    with _LOCK:  # one measurement at a time: two at once would time each other
        if key in CHOICES:
            return replace(CHOICES[key], cached=True), {}
        if linear_bytes(model) < min_bytes:
            choice = DtypeChoice("float32", "small")
        else:
            t0 = time.perf_counter()
            for name in TIMED:
                dtype = torch_dtype(name)
                arms[name] = model if model.dtype == dtype else cast_copy(model, dtype)
            times = timer(arms)
            per_token = {name: round(times[name].ms_per_token, 4) for name in TIMED}
            choice = DtypeChoice(
                choose(per_token),
                "timed",
                per_token,
                {name: {k: round(v, 4) for k, v in asdict(times[name]).items()} for name in TIMED},
                round(time.perf_counter() - t0, 3),
            )
            other = next(n for n in TIMED if n != choice.dtype)
            log.info(
                "draft dtype: %s %.2f ms/token vs %s %.2f ms/token: %s (timed in %.1fs; bfloat16 is kept below "
                "%.0f%% of float32's time)",
                choice.dtype,
                per_token[choice.dtype],
                other,
                per_token[other],
                choice.dtype,
                choice.timing_s,
                100 * MARGIN,
            )
        CHOICES[key] = choice
    return choice, arms


def settle(model: PreTrainedModel, **kwargs) -> PreTrainedModel:
    """``model`` (float32, prepared for decoding) in the precision :func:`decide` chose: the
    model itself cast in place, or the copy that was timed (then drop ``model``). The choice is
    kept on the returned model as ``draft_dtype_measurement`` (:meth:`DtypeChoice.as_dict`)."""
    choice, arms = decide(model, **kwargs)
    kept = arms.pop(choice.dtype, None)
    arms.clear()  # the losing copy goes now
    if kept is None:
        kept = cast_weights(model, torch_dtype(choice.dtype))
    if choice.reason != "timed" or choice.cached:
        log.info(
            "draft dtype: %s (%s%s)", choice.dtype, choice.reason, ", earlier in this process" if choice.cached else ""
        )
    kept.draft_dtype_measurement = choice.as_dict()
    return kept

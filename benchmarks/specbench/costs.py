"""Step costs (c), the engine's loop overhead, and OSD Eq. 2.

Split out of ``benchmarks/spec_decode.py``, which is the command.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.specbench.config import BenchConfig
from specops.core.cost import step_ms
from specops.core.models import ModelPair
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate


# ---------------------------------------------------------------- step costs (c)
def measure_step_costs(pair: ModelPair, prompt_ids: list[int], cfg: BenchConfig, draft32=None) -> dict:
    """Median wall time of one cached forward of n new tokens on top of the prompt, for
    the draft (n=1) and the target (n=1 and n=k+1, a verification step), through the
    engine's ``CachedLM`` (``specops.core.cost.step_ms``). c = draft(1) / target(1)."""
    ks = sorted({cfg.k, *cfg.sweep})
    out: dict = {"reps": cfg.cost_reps, "context_tokens": len(prompt_ids)}
    out["target_1_ms"] = step_ms(pair.target, prompt_ids, 1, reps=cfg.cost_reps)
    out["draft_1_ms"] = step_ms(pair.draft, prompt_ids, 1, reps=cfg.cost_reps) if pair.draft is not None else None
    out["target_verify_ms"] = {str(k): step_ms(pair.target, prompt_ids, k + 1, reps=cfg.cost_reps) for k in ks}
    out["c"] = out["draft_1_ms"] / out["target_1_ms"] if out["draft_1_ms"] else None
    out["draft_dtype"] = str(pair.draft.dtype).removeprefix("torch.") if pair.draft is not None else None
    out["draft_dtype_measurement"] = getattr(pair.draft, "draft_dtype_measurement", None)  # auto's timing
    if draft32 is not None:  # the same draft in float32, for the side-by-side arm
        out["draft_float32_1_ms"] = step_ms(draft32, prompt_ids, 1, reps=cfg.cost_reps)
        out["c_float32"] = out["draft_float32_1_ms"] / out["target_1_ms"]
    # target(k+1 tokens) / target(1 token): Eq. 2 assumes 1.
    out["verify_ratio"] = {k: v / out["target_1_ms"] for k, v in out["target_verify_ms"].items()}
    return out


def measure_loop_overhead(pair: ModelPair, prompt_ids: list[int], tokens: int = 32, reps: int = 3) -> dict:
    """Time per generated token spent outside the target's forward, target-only and greedy, for
    our engine and HF ``generate`` on the same (served) modules: what each loop adds to the
    model's own time. Wall time minus time inside ``target.forward`` is robust to the machine
    noise that dominates whole-request timings, since the model's time is taken out."""
    inside = [0.0]
    t_in: list[float] = []

    def pre(module, args, kwargs):
        t_in.append(time.perf_counter())

    def post(module, args, kwargs, output):
        inside[0] += time.perf_counter() - t_in.pop()

    handles = [
        pair.target.register_forward_pre_hook(pre, with_kwargs=True),
        pair.target.register_forward_hook(post, with_kwargs=True),
    ]
    engine = SpecEngine(pair)
    ids = torch.tensor([prompt_ids], dtype=torch.long)

    def ours() -> float:
        res = plain_generate(
            engine, prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=tokens), method="target"
        )
        return max(1, res.stats.num_generated)

    def hf() -> float:
        with torch.inference_mode():
            out = pair.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return out.shape[1] - ids.shape[1]

    per: dict[str, list[float]] = {"ours": [], "hf": []}
    try:
        for _ in range(reps):
            for name, run in (("ours", ours), ("hf", hf)):
                inside[0] = 0.0
                t0 = time.perf_counter()
                n = run()
                per[name].append((time.perf_counter() - t0 - inside[0]) * 1000 / n)
    finally:
        for h in handles:
            h.remove()
    return {
        "ours_ms_per_step": statistics.median(per["ours"]),
        "hf_ms_per_step": statistics.median(per["hf"]),
        "tokens": tokens,
        "reps": reps,
        "runs_ms_per_step": per,
    }


# ---------------------------------------------------------------- Eq. 2
def expected_tokens(alpha: float, k: int) -> float:
    """E|y| = (1 - α^(k+1)) / (1 - α), tokens emitted per verification (OSD Eq. 2)."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def eq2_speedup(alpha: float, k: int, c: float, verify_ratio: float = 1.0) -> float:
    """OSD Eq. 2: E[speedup] = (1 - α^(k+1)) / ((1 - α)(k c + 1)); ``verify_ratio`` replaces
    the 1 (a (k+1)-token target forward costs as much as a 1-token one) when measured."""
    return expected_tokens(alpha, k) / (k * c + verify_ratio)


def alpha_from_tokens_per_step(m: float, k: int) -> float:
    """The per-token acceptance α for which E|y| (Eq. 2) equals the measured tokens per step."""
    if m >= k + 1:
        return 1.0
    if m <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < m else (lo, mid)
    return (lo + hi) / 2

"""The projection half of ``benchmarks/gpu_check.py``: each method's acceptance measured on the
CPU (the committed ``benchmarks/out/spec_decode.json`` and ``llma.json``) priced with a GPU's
measured pass costs, by Eq. 2 generalised as ``auto`` prices a step (``E / (P + V(n))`` against
``1 / V(1)``). Pure arithmetic over JSONs: ``gpu_check.py --reproject`` runs it without a GPU."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from specops.core.auto_policy import expected_tokens


def interp(points: dict[float, float], n: float) -> float:
    """Piecewise-linear cost at ``n`` tokens through measured (tokens, ms) points, extrapolated past the ends."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    for a, b in zip(xs, xs[1:], strict=False):  # the segment holding n; the first or last one outside
        if n <= b:
            break
    return points[a] + (points[b] - points[a]) * (n - a) / (b - a)


def projected(
    method: str, e: float, drafted: float, propose_ms: float, v: dict[float, float], draft_1_ms: float | None
) -> float:
    """Speed-up over target-only of a method that emits ``e`` tokens per step from ``drafted`` drafts:
    ``auto``'s speed ``E / (P + V(1 + drafted))`` over target-only's ``1 / V(1)``. ``P``: a draft model's
    ``drafted`` one-token steps; a copy method's measured propose time (CPU work, the same on a GPU host)."""
    p = drafted * draft_1_ms if method == "draft" else propose_ms
    return (e / (p + interp(v, 1.0 + drafted))) * interp(v, 1.0)


def cpu_rows(out_dir: Path) -> tuple[list[dict], dict]:
    """Per (method, domain): tokens per step, drafts per step, propose cost and the CPU's speed-up, from the
    committed benchmark JSONs; and the CPU's step costs (spec_decode.json's ``step_costs``)."""
    rows: list[dict] = []
    costs: dict = {}
    sd_path = out_dir / "spec_decode.json"
    if sd_path.exists():
        sd = json.loads(sd_path.read_text())
        sc = sd.get("step_costs", {})
        v = {1.0: sc["target_1_ms"], **{int(k) + 1.0: ms for k, ms in sc.get("target_verify_ms", {}).items()}}
        costs = {"source": "benchmarks/out/spec_decode.json step_costs", "verify_ms": v, "draft_1_ms": sc["draft_1_ms"]}
        for domain, modes in sd.get("results", {}).items():
            arms = modes.get("greedy", {})
            base = arms.get("target", {}).get("speedup")
            for method in ("draft", "pld"):
                arm = arms.get(method)
                if not arm or not arm.get("acceptance_rate") or not base:
                    continue
                e = arm["tokens_per_verify_step"]
                rows.append(
                    {
                        "method": method,
                        "domain": domain,
                        "source": "spec_decode.json",
                        "k": arm.get("k"),
                        "tokens_per_step": e,
                        "drafted_per_step": (e - 1.0) / arm["acceptance_rate"],
                        "propose_ms": 0.0,
                        "cpu_measured": arm["speedup"] / base,
                        "alpha": arm.get("alpha"),
                    }
                )
    ll_path = out_dir / "llma.json"
    if ll_path.exists():
        ll = json.loads(ll_path.read_text())
        for domain, block in ll.get("sets", {}).items():
            arms = block.get("arms", {})
            base = arms.get("target", {}).get("speedup")
            for method in ("llma", "pld", "suffix"):  # suffix: SuffixDecoding (its own time not recorded: 0)
                arm = arms.get(method)
                if not arm or not arm.get("acceptance") or not base:
                    continue
                e = arm["tokens_per_forward"]
                rows.append(
                    {
                        "method": method,
                        "domain": domain,
                        "source": "llma.json",
                        "k": {"llma": ll.get("args", {}).get("k"), "pld": ll.get("args", {}).get("pld_k")}.get(
                            method, "–"
                        ),
                        "tokens_per_step": e,
                        "drafted_per_step": (e - 1.0) / arm["acceptance"],
                        "propose_ms": (arm.get("propose_us_per_step") or 0.0) / 1000.0,
                        "cpu_measured": arm["speedup"] / base,
                    }
                )
    return rows, costs


def best_k(alpha: float, v: dict[float, float], draft_1_ms: float, max_k: int = 16) -> tuple[float, int]:
    """The draft's best (speed-up, k) at per-token acceptance ``alpha``: Eq. 2 with measured costs,
    ``E(alpha, k) / (k x draft step + V(k + 1)) x V(1)``, over k = 1 .. ``max_k`` (``auto``'s choice of k)."""
    return max(
        (expected_tokens(alpha, k) / (k * draft_1_ms + interp(v, k + 1.0)) * interp(v, 1.0), k)
        for k in range(1, max_k + 1)
    )


def copy_ratios(rows: list[dict], timings: dict) -> dict:
    """LLMA over SuffixDecoding per domain: the CPU's measured ratio, and each timed shape's
    projection (``E / (P + V(1 + d))`` of each, at that shape's pass costs). SuffixDecoding's
    proposer time is not recorded (0 ms): the projection favours it."""
    out: dict = {}
    for domain in dict.fromkeys(r["domain"] for r in rows):
        arms = {r["method"]: r for r in rows if r["domain"] == domain and r["source"] == "llma.json"}
        if "llma" not in arms or "suffix" not in arms:
            continue
        ll, sx = arms["llma"], arms["suffix"]
        entry = {"cpu_measured": ll["cpu_measured"] / sx["cpu_measured"]}
        for shape, tm in timings.items():
            if "verify" in tm:
                v = {float(n): ms for n, ms in tm["verify"]["ms"].items()}
                a, b = ((r["method"], r["tokens_per_step"], r["drafted_per_step"], r["propose_ms"]) for r in (ll, sx))
                entry[shape] = projected(*a, v, None) / projected(*b, v, None)
        out[domain] = entry
    return out


def projections(timing: dict | None, out_dir: Path, timings: dict | None = None) -> dict:
    """Each CPU row priced with the GPU's costs, and with the CPU's (same formula), beside the CPU's measurement."""
    rows, cpu_costs = cpu_rows(out_dir)
    if not rows:
        return {"rows": [], "by_method": {}, "reason": f"no per-method acceptance in {out_dir}"}
    gpu_v = gpu_draft = None
    if timing and "verify" in timing and "draft_1_ms" in timing:
        gpu_v = {float(n): ms for n, ms in timing["verify"]["ms"].items()}
        gpu_draft = timing["draft_1_ms"]
    for r in rows:
        args = (r["method"], r["tokens_per_step"], r["drafted_per_step"], r["propose_ms"])
        r["cpu_eq2"] = projected(*args, cpu_costs["verify_ms"], cpu_costs["draft_1_ms"]) if cpu_costs else None
        r["gpu_projected"] = projected(*args, gpu_v, gpu_draft) if gpu_v else None
        r["gpu_best_k"] = r["gpu_projected_best_k"] = None
        if gpu_v and r["method"] == "draft" and r.get("alpha"):  # the k auto would pick at these costs
            r["gpu_projected_best_k"], r["gpu_best_k"] = best_k(r["alpha"], gpu_v, gpu_draft)
    by_method: dict[str, float] = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        vals = [r["gpu_projected"] for r in rows if r["method"] == method and r["gpu_projected"] is not None]
        if vals:
            by_method[method] = statistics.median(vals)
    return {
        "rows": rows,
        "by_method": by_method,
        "llma_vs_suffix": copy_ratios(rows, timings or ({"smollm2-135m": timing} if timing else {})),
        "cpu_costs": cpu_costs,
        "formula": "speedup = E / (P + V(1 + d)) * V(1): E tokens per step and d drafts per step measured on the CPU "
        "(greedy), V the GPU's target pass over n tokens (interpolated), P = d x the GPU draft step (draft) or the "
        "measured propose time (copy methods; 0 where not recorded); best k: the draft's k that maximises "
        "E(alpha, k) / (k x draft step + V(k + 1)) x V(1) at its CPU alpha (core.auto_policy.expected_tokens); "
        "CPU measured: the arm's speed-up over hf_target / our target-only arm's (medians of per-prompt ratios)",
        "sources": sorted({r["source"] for r in rows}),
    }

"""Running the arms interleaved per prompt, aggregating, and the summary.

Split out of ``benchmarks/spec_decode.py``, which is the command.
"""

from __future__ import annotations

import json
import logging
import shlex
import statistics
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import environment as common_environment
from benchmarks.common import target_name
from benchmarks.specbench.config import (
    BAR_DEFAULT_VS_TARGET,
    BAR_TARGET_VS_HF_TARGET,
    BAR_VS_HF_ASSISTED,
    BAR_VS_TARGET_CODE,
    DOMAINS,
    HEADLINE_K,
    HF_PLD_NUM_TOKENS,
    MODES,
    REFERENCE,
    BenchConfig,
    default_arm,
    serving_setting,
    worst,
)
from benchmarks.specbench.costs import (
    alpha_from_tokens_per_step,
    eq2_speedup,
    measure_loop_overhead,
    measure_step_costs,
)
from benchmarks.specbench.methods import ForwardCounter, Method, Outcome, build_methods, hf_assisted_settings
from specops.core.models import load_model, load_model_dir
from specops.serving.proposers.catalogue import DEFAULT_K, PromptLookupOptions
from specops.workloads.prompts import heldout_prompts

log = logging.getLogger("benchmarks.spec_decode")


# ---------------------------------------------------------------- running
def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def identical_prefix(a: list[int], b: list[int]) -> bool:
    """Equal over their common length (HF and our engine both stop at EOS)."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def timed(m: Method, prompt_ids: list[int], temperature: float, max_new_tokens: int, seed: int) -> Outcome:
    cpu0 = time.process_time()
    o = m.run(prompt_ids, temperature, max_new_tokens, seed)
    o.cpu_share = (time.process_time() - cpu0) / o.wall_s if o.wall_s > 0 else None
    return o


def warm_up(methods: list[Method], prompt_ids: list[int]) -> None:
    for m in methods:
        for temp in MODES.values():
            m.run(prompt_ids, temp, 8, 0)


def run_benchmark(cfg: BenchConfig, command: list[str]) -> dict:
    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    pair = load_model_dir(Path(cfg.model_dir), draft_dtype=cfg.draft_dtype)
    if pair.draft is None or pair.tokenizer is None:
        raise SystemExit(f"{cfg.model_dir} needs target/, draft/ and a tokenizer; run `specops bootstrap` first")
    manifest = json.loads((Path(cfg.model_dir) / "manifest.json").read_text())
    prompts = {
        d: heldout_prompts(Path(cfg.model_dir), pair.tokenizer, d, cfg.prompts, cfg.prompt_tokens, cfg.seed)
        for d in DOMAINS
    }
    for d, ps in prompts.items():
        if not ps:
            raise SystemExit(f"no held-out {d} prompt of {cfg.prompt_tokens} tokens in {cfg.model_dir}")
        if len(ps) < cfg.prompts:
            log.warning("only %d held-out %s prompts (asked for %d)", len(ps), d, cfg.prompts)

    draft32 = None
    if cfg.float32_arm and pair.draft.dtype != torch.float32:
        draft32 = load_model(Path(cfg.model_dir) / "draft", dtype=torch.float32)
    counter = ForwardCounter(pair.target)
    methods = build_methods(pair, cfg, counter, draft32)
    log.info("methods: %s", ", ".join(m.name for m in methods))
    first = prompts[DOMAINS[0]][0].token_ids
    log.info("warming up")
    warm_up(methods, first)
    log.info("measuring step costs (c)")
    costs = measure_step_costs(pair, first, cfg, draft32)
    log.info(
        "c = %.3f (draft %.3f ms, target %.3f ms per cached 1-token forward)",
        costs["c"],
        costs["draft_1_ms"],
        costs["target_1_ms"],
    )
    loop_overhead = measure_loop_overhead(pair, first)
    log.info(
        "time outside the target's forward per token: ours %.2f ms, HF generate %.2f ms",
        loop_overhead["ours_ms_per_step"],
        loop_overhead["hf_ms_per_step"],
    )

    # records[domain][mode][method] -> list of per-prompt dicts
    records: dict = {d: {mode: {m.name: [] for m in methods} for mode in MODES} for d in DOMAINS}
    retries = 0
    units = [(d, i, p) for d in DOMAINS for i, p in enumerate(prompts[d])]
    for d, i, p in tqdm(units, desc="prompts", unit="prompt", disable=None):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]  # rotate: no method always first
        for mode, temp in MODES.items():
            seed = cfg.seed + i
            for attempt in range(1, cfg.max_attempts + 1):
                outs = {m.name: timed(m, p.token_ids, temp, cfg.max_new_tokens, seed) for m in order}
                worst = min(o.cpu_share or 0.0 for o in outs.values())
                if worst >= cfg.min_cpu_share or attempt == cfg.max_attempts:
                    break
                log.warning(
                    "%s %s prompt %d: a run got %.0f%% of a core (paused or starved); measuring again",
                    d,
                    mode,
                    i,
                    100 * worst,
                )
                retries += 1
                time.sleep(cfg.retry_wait_s)
            # Losslessness is checked within a family, on the same kernels: our methods against our
            # target-only loop, HF's against hf_target (stock nn.Linear, whose last bits can differ).
            refs = {"ours": outs["target"].token_ids, "hf": outs[REFERENCE].token_ids}
            for m in methods:
                o = outs[m.name]
                n = len(o.token_ids)
                rec = {
                    "prompt": i,
                    "source": p.source,
                    "num_generated": n,
                    "wall_s": round(o.wall_s, 6),
                    "tokens_per_s": n / o.wall_s if o.wall_s > 0 else 0.0,
                    "num_target_forwards": o.num_target_forwards,
                    "num_drafted": o.num_drafted,
                    "num_accepted": o.num_accepted,
                    "num_verify_steps": o.num_verify_steps,
                    "num_rejected_steps": o.num_rejected_steps,
                    "finish_reason": o.finish_reason,
                    "cpu_share": round(o.cpu_share, 3) if o.cpu_share is not None else None,
                }
                if temp == 0.0:
                    ref = refs[m.family]
                    rec["identical"] = identical_prefix(o.token_ids, ref)
                    rec["identical_to_hf_target"] = identical_prefix(o.token_ids, refs["hf"])
                    rec["same_length"] = n == len(ref)
                    if not rec["identical"]:
                        j = next(j for j, (a, b) in enumerate(zip(o.token_ids, ref)) if a != b)
                        rec["first_divergence"] = j
                        log.warning("%s %s prompt %d: %s differs from %s at token %d", d, mode, i, m.name, REFERENCE, j)
                records[d][mode][m.name].append(rec)
            log.debug(
                "%s prompt %d %s: %s",
                d,
                i,
                mode,
                ", ".join(f"{n} {len(o.token_ids) / o.wall_s:.0f} tok/s" for n, o in outs.items()),
            )
    counter.close()

    results = aggregate(records, methods)
    eq2 = explain(results, costs, cfg)
    summary = {"model": target_name(Path(cfg.model_dir)), **summarize(records, results, eq2, costs, cfg, methods)}
    env = environment(cfg)
    summary["cpu_model"] = env["cpu_model"]
    return {
        "benchmark": "spec_decode",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(command),
        "config": {**asdict(cfg), "sweep": list(cfg.sweep)},
        "headline_k_rule": f"k = the engine's default draft k (serving.engine.spec.DEFAULT_K['draft'] = {HEADLINE_K}), fixed before measuring; pld uses its default k ({DEFAULT_K['pld']})",
        "environment": env,
        "models": {name: manifest.get("models", {}).get(name, {}).get("params") for name in ("target", "draft")},
        "bootstrap_tiny": manifest.get("tiny"),
        "hf_settings": {
            "hf_assisted": {"assistant_model": "draft", **hf_assisted_settings(pair)},
            "hf_pld": {"prompt_lookup_num_tokens": HF_PLD_NUM_TOKENS, "max_matching_ngram_size": 2},
            "sampling": {"top_k": 0, "top_p": 1.0, "note": "HF's default top_k=50 turned off to match our engine"},
        },
        "our_settings": {
            "pld_max_ngram": PromptLookupOptions().pld_max_ngram,
            "pld_min_ngram": PromptLookupOptions().pld_min_ngram,
            "pld_k": DEFAULT_K["pld"],
            "serving_default_method": summary["default_method"],
            "serving_default_arm": summary["default_arm"],
            **{m.name: m.settings for m in methods if m.settings},
        },
        "definitions": {
            "tokens_per_s": "median over prompts of generated tokens / wall time of the whole request (prefill included)",
            "speedup": "median over prompts of the per-prompt ratio tokens/s(method) / tokens/s(hf_target) "
            "(paired: both ran on the same prompt, interleaved)",
            "speedup_ratio_of_medians": "median tokens/s(method) / median tokens/s(hf_target)",
            "acceptance_rate": "sum accepted / sum drafted over prompts",
            "tokens_per_target_forward": "sum generated / sum target forward calls (hook on target.forward)",
            "accepted_per_target_forward": "sum accepted / sum target forward calls",
            "alpha": "per-token acceptance of Eq. 2 (ours): accepted / (accepted + steps that rejected a draft)",
            "alpha_from_tokens_per_step": "cross-check: the α for which Eq. 2's E|y| equals the measured tokens per step",
            "identical": "greedy output equals the target-only output of its own family (ours: our target "
            "loop; HF: hf_target) token for token over their common length",
            "identical_to_hf_target": "greedy output equals hf_target's (stock nn.Linear) token for token",
        },
        "step_costs": costs,
        "loop_overhead": loop_overhead,
        "results": results,
        "per_prompt": records,
        "eq2": eq2,
        "summary": summary,
        "remeasured_prompt_modes": retries,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def aggregate(records: dict, methods: list[Method]) -> dict:
    out: dict = {}
    for d, modes in records.items():
        out[d] = {}
        for mode, by_method in modes.items():
            ref = by_method[REFERENCE]
            ref_tps = median([r["tokens_per_s"] for r in ref])
            out[d][mode] = {}
            for m in methods:
                rs = by_method[m.name]
                if not rs:
                    continue
                tps = median([r["tokens_per_s"] for r in rs])
                ratios = [r["tokens_per_s"] / q["tokens_per_s"] for r, q in zip(rs, ref) if q["tokens_per_s"] > 0]
                gen = sum(r["num_generated"] for r in rs)
                fwd = sum(r["num_target_forwards"] for r in rs)
                drafted = sum(r["num_drafted"] or 0 for r in rs)
                accepted = sum(r["num_accepted"] or 0 for r in rs)
                steps = sum(r["num_verify_steps"] or 0 for r in rs)
                rejected = sum(r["num_rejected_steps"] or 0 for r in rs)
                has_alpha = rs[0]["num_rejected_steps"] is not None
                spec = rs[0]["num_drafted"] is not None
                row = {
                    "family": m.family,
                    "k": m.k,
                    "num_prompts": len(rs),
                    "tokens_per_s": tps,
                    "speedup": median(ratios),
                    "speedup_ratio_of_medians": tps / ref_tps if tps and ref_tps else None,
                    "acceptance_rate": accepted / drafted if spec and drafted else None,
                    "tokens_per_target_forward": gen / fwd if fwd else None,
                    "accepted_per_target_forward": accepted / fwd if spec and fwd else None,
                    "tokens_per_verify_step": (accepted + steps) / steps if spec and steps else None,
                    # Per-token acceptance (the α of Eq. 2), maximum likelihood under its i.i.d. model:
                    # every accepted draft is a success, every step that rejected one is one failure.
                    "alpha": accepted / (accepted + rejected) if has_alpha and accepted + rejected else None,
                    "num_generated": gen,
                }
                if mode == "greedy":
                    row["identical"] = sum(r["identical"] for r in rs) / len(rs)
                    row["same_length"] = sum(r["same_length"] for r in rs) / len(rs)
                out[d][mode][m.name] = row
    return out


def explain(results: dict, costs: dict, cfg: BenchConfig) -> dict:
    """Eq. 2 per domain for our greedy draft at the headline k, with the measured c and α."""
    out = {}
    c = costs["c"]
    k = cfg.k
    vr = costs["verify_ratio"][str(k)]
    for d in DOMAINS:
        row = results[d]["greedy"]["draft"]
        alpha = row["alpha"] if row["alpha"] is not None else 0.0  # None: nothing was drafted
        ours_target = results[d]["greedy"]["target"]["tokens_per_s"]
        out[d] = {
            "k": k,
            "c": c,
            "alpha": alpha,
            "acceptance_rate": row["acceptance_rate"],
            "tokens_per_verify_step": row["tokens_per_verify_step"],
            "alpha_from_tokens_per_step": alpha_from_tokens_per_step(row["tokens_per_verify_step"], k),
            "eq2_speedup": eq2_speedup(alpha, k, c),
            "eq2_speedup_measured_verify": eq2_speedup(alpha, k, c, vr),
            "verify_ratio": vr,
            "measured_vs_our_target": row["tokens_per_s"] / ours_target if ours_target else None,
            "measured_vs_hf_target": row["speedup"],
            "our_target_vs_hf_target": results[d]["greedy"]["target"]["speedup"],
        }
    return out


def pooled_ratio(greedy: dict, a: str, b: str) -> float | None:
    """Median over the greedy prompts of both domains of ``a``'s tokens/s over ``b``'s (None without ``b``)."""
    if any(b not in greedy[d] for d in DOMAINS):
        return None
    return median(
        [
            x["tokens_per_s"] / y["tokens_per_s"]
            for d in DOMAINS
            for x, y in zip(greedy[d][a], greedy[d][b])
            if y["tokens_per_s"] > 0
        ]
    )


def domain_ratio(greedy: dict, a: str, b: str, d: str) -> float | None:
    """Median over domain ``d``'s greedy prompts of ``a``'s tokens/s over ``b``'s on the same prompt."""
    return median(
        [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(greedy[d][a], greedy[d][b]) if y["tokens_per_s"] > 0]
    )


def by_domain(greedy: dict, a: str, b: str) -> dict[str, float | None]:
    return {d: domain_ratio(greedy, a, b, d) for d in DOMAINS}


def summarize(records: dict, results: dict, eq2: dict, costs: dict, cfg: BenchConfig, methods: list[Method]) -> dict:
    greedy = {d: records[d]["greedy"] for d in DOMAINS}
    # Pooled over both domains: median of the per-prompt ratios of all greedy prompts.
    pooled = [
        a["tokens_per_s"] / b["tokens_per_s"]
        for d in DOMAINS
        for a, b in zip(greedy[d]["draft"], greedy[d]["hf_assisted"])
        if b["tokens_per_s"] > 0
    ]
    checked = [
        r["identical"]
        for d in DOMAINS
        for name, rs in greedy[d].items()
        if name not in (REFERENCE, "target")
        for r in rs
    ]
    draft_names = [
        m.name
        for m in methods
        if m.family == "ours" and m.name.startswith("draft") and "adaptive" not in m.name and m.name != "draft_float32"
    ]

    def pooled_speedup(name: str) -> float | None:
        ratios = [
            a["tokens_per_s"] / b["tokens_per_s"]
            for d in DOMAINS
            for a, b in zip(greedy[d][name], greedy[d][REFERENCE])
            if b["tokens_per_s"] > 0
        ]
        return median(ratios)

    sweep = {({m.name: m.k for m in methods}[n]): pooled_speedup(n) for n in draft_names}
    best_k = max(sweep, key=lambda k: sweep[k] or 0.0) if len(sweep) > 1 else None  # None: no sweep (--quick)
    s = {
        "draft_vs_hf_assisted": median(pooled),
        "draft_vs_target_code": results["code"]["greedy"]["draft"]["speedup"],
        "greedy_identical": sum(checked) / len(checked) if checked else None,
        "target_identical_to_hf_target": (
            sum(r["identical_to_hf_target"] for d in DOMAINS for r in greedy[d]["target"])
            / sum(len(greedy[d]["target"]) for d in DOMAINS)
        ),
        "draft_vs_target_prose": results["prose"]["greedy"]["draft"]["speedup"],
        "target_vs_hf_target": pooled_speedup("target"),
        "draft_vs_our_target": median(
            [
                a["tokens_per_s"] / b["tokens_per_s"]
                for d in DOMAINS
                for a, b in zip(greedy[d]["draft"], greedy[d]["target"])
                if b["tokens_per_s"] > 0
            ]
        ),
        "draft_vs_our_target_code": median(
            [
                a["tokens_per_s"] / b["tokens_per_s"]
                for a, b in zip(greedy["code"]["draft"], greedy["code"]["target"])
                if b["tokens_per_s"] > 0
            ]
        ),
        "pld_vs_hf_pld": median(
            [
                a["tokens_per_s"] / b["tokens_per_s"]
                for d in DOMAINS
                for a, b in zip(greedy[d]["pld"], greedy[d]["hf_pld"])
                if b["tokens_per_s"] > 0
            ]
        ),
        "draft_dtype": costs["draft_dtype"],  # what it ran in ("auto" resolved, specops.core.draft_dtype)
        "draft_dtype_requested": cfg.draft_dtype,
        "draft_vs_draft_float32": pooled_ratio(greedy, "draft", "draft_float32"),
        "headline_k": cfg.k,
        "best_k": best_k,
        "speedup_by_k": {str(k): v for k, v in sorted(sweep.items())},
        "c": costs["c"],
        "alpha": {d: eq2[d]["alpha"] for d in DOMAINS},
        "acceptance_rate": {d: eq2[d]["acceptance_rate"] for d in DOMAINS},
        "eq2_speedup": {d: eq2[d]["eq2_speedup"] for d in DOMAINS},
        "pooling": "draft_vs_hf_assisted, target_vs_hf_target, draft_vs_our_target and speedup_by_k: median of "
        "per-prompt ratios over the greedy prompts "
        "of both domains; default_vs_target, auto_vs_target and target_vs_hf_target_by_domain: per domain, median "
        "of the per-prompt ratios over that domain's greedy prompts (as draft_vs_our_target_code), and "
        "default_vs_target_min, target_vs_hf_target_min: the smaller of the two domains' (the bar holds on both); "
        "greedy_identical: every greedy output of a speculative method against the target-only "
        "output of its own family (ours vs our target, HF's vs hf_target: the same kernels)",
    }
    default = serving_setting("default_method")
    arm = default_arm(default)
    s["default_method"] = default  # serving's (ServeConfig.default_method), read at run time
    s["default_arm"] = arm
    s["default_vs_target"] = by_domain(greedy, arm, "target")
    s["default_vs_target_min"] = worst(s["default_vs_target"])
    s["auto_vs_target"] = by_domain(greedy, "auto", "target")
    s["target_vs_hf_target_by_domain"] = by_domain(greedy, "target", REFERENCE)
    s["target_vs_hf_target_min"] = worst(s["target_vs_hf_target_by_domain"])
    s["bar_default_vs_target_met"] = bool(
        s["default_vs_target_min"] is not None and s["default_vs_target_min"] >= BAR_DEFAULT_VS_TARGET
    )
    s["bar_target_vs_hf_target_met"] = bool(
        s["target_vs_hf_target_min"] is not None and s["target_vs_hf_target_min"] >= BAR_TARGET_VS_HF_TARGET
    )
    s["bar_vs_hf_assisted_met"] = bool(s["draft_vs_hf_assisted"] and s["draft_vs_hf_assisted"] >= BAR_VS_HF_ASSISTED)
    s["bar_vs_target_code_met"] = bool(s["draft_vs_target_code"] and s["draft_vs_target_code"] > BAR_VS_TARGET_CODE)
    return s


def environment(cfg: BenchConfig) -> dict:
    return common_environment()

"""The adaptive benchmark's analysis and report (``benchmarks/adaptive.py`` is the command): per-phase
ratios against the best fixed arm and the oracle, the summary and its bars, the markdown section of
``docs/benchmarks.md`` and the plot."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

from benchmarks.common import fmt, save_png

DOC_BEGIN = "<!-- BEGIN adaptive (written by benchmarks/adaptive.py; edits inside are overwritten) -->"
DOC_END = "<!-- END adaptive -->"
SLICES = ("code", "prose", "rag", "repetition", "creative")
SUMMARY_KEYS = ("auto_vs_best_fixed", "auto_vs_oracle", "min_slice_vs_target", "greedy_identical")
BARS = {"auto_vs_best_fixed": 1.0, "auto_vs_oracle": 0.9, "min_slice_vs_target": 0.95}
NO_SHADOWS = "auto_noshadow"
"""The ablation arm (``--ablate-shadows``): ``auto`` with its copy shadows off, its own policy."""
ESTIMATOR_ARMS = {"auto_geometric": "geometric", "auto_mean": "mean", "auto_sum": "sum"}
"""The estimator ablation arms (``--ablate-estimator``): ``auto`` with another realized-speed
estimator (:class:`specops.core.auto_fits.SpeedCheck`), its own policy."""
CHAIN_ARM = "auto_chain"
"""The copy-chain ablation arm (``--ablate-chain``): ``auto`` pricing a copy's token ``i`` at the
match it would then have (``AutoPolicy(copy_chain=True)``), its own policy, today's estimator."""
VARIANT_ARMS = {**{arm: f"the `{e}` estimator" for arm, e in ESTIMATOR_ARMS.items()}, CHAIN_ARM: "the copy chain"}
"""Every ``auto`` variant that reports ``<arm>_gain`` (``auto`` time / its time) and ``<arm>_vs_best_fixed``."""
AUTO_ARMS = ("auto", NO_SHADOWS, *VARIANT_ARMS)


def current_rules() -> dict:
    """The rules a run decided by: LLMA's copy rule (serving's, issue 60), whether ``auto``
    scaled its estimates by the realized-speed check per load (``AutoPolicy.realized``), whether
    it charged a method for what it cost the other rows' steps (``AutoPolicy.corun``), and whether
    it learned from the copies it declined (``AutoPolicy.copy_shadows``)."""
    from specops.serving.proposers.llma import SERVING_RULE

    return {
        "llma": dict(SERVING_RULE),
        "auto_realized_check": True,
        "auto_corun_check": True,
        "auto_copy_shadows": True,
        "auto_realized_estimator": "mean",
    }


# ---------------------------------------------------------------- the report
def analyse(report: dict) -> dict:
    cases = report["cases"]
    arms = report["arms"]
    fixed = [a for a in arms if a not in AUTO_ARMS]
    out: dict = {}
    for conc, per in sorted(report["per_case"].items(), key=lambda kv: int(kv[0])):
        if not per["target"]:
            continue
        by_case = {a: {r["case"]: r for r in per[a]} for a in arms}
        idx = sorted(by_case["target"])
        if conc == "1":
            time_of = {a: {i: by_case[a][i]["wall_s"] for i in idx} for a in arms}
        else:  # the group's wall time, shared by its requests (so a per-request oracle is a per-group one)
            time_of = {a: {i: by_case[a][i]["group_wall_s"] / by_case[a][i]["group_size"] for i in idx} for a in arms}
        slices: dict[str, dict] = {}
        unit = {i: by_case["auto"][i].get("group", i) for i in idx}  # what ran together: a group, or a request
        for s in SLICES + ("all",):
            ids = [i for i in idx if s == "all" or cases[i]["slice"] == s]
            if not ids:
                continue
            tot = {a: sum(time_of[a][i] for i in ids) for a in arms}
            toks = {a: sum(by_case[a][i]["generated"] for i in ids) for a in arms}
            oracle = sum(min(time_of[a][i] for a in fixed) for i in ids)
            best = min(fixed, key=lambda a: tot[a])
            mix: dict[str, int] = {}
            for i in ids:
                for m, n in (by_case["auto"][i].get("policy") or {}).items():
                    mix[m] = mix.get(m, 0) + n
            steps = sum(mix.values()) or 1
            slices[s] = {
                "cases": len(ids),
                "total_s": {a: round(tot[a], 3) for a in arms},
                "tokens_per_s": {a: round(toks[a] / tot[a], 2) if tot[a] else None for a in arms},
                "speedup": {a: round(tot["target"] / tot[a], 3) for a in arms},
                "median_ratio_vs_target": {
                    a: round(statistics.median(time_of["target"][i] / time_of[a][i] for i in ids), 3) for a in arms
                },
                "best_fixed": best,
                "oracle_s": round(oracle, 3),
                "auto_vs_best_fixed": round(tot[best] / tot["auto"], 3),
                "auto_vs_oracle": round(oracle / tot["auto"], 3),
                "auto_vs_target": round(tot["target"] / tot["auto"], 3),
                "auto_mix": {m: round(n / steps, 3) for m, n in sorted(mix.items())},
            }
            if NO_SHADOWS in arms:  # the A/B: > 1 when auto with shadows took less time
                slices[s]["shadow_gain"] = round(tot[NO_SHADOWS] / tot["auto"], 3)
                slices[s]["noshadow_vs_best_fixed"] = round(tot[best] / tot[NO_SHADOWS], 3)
            for arm in VARIANT_ARMS:
                if arm in arms:  # the A/B: > 1 when the variant took less time than auto
                    slices[s][f"{arm}_gain"] = round(tot["auto"] / tot[arm], 3)
                    slices[s][f"{arm}_vs_best_fixed"] = round(tot[best] / tot[arm], 3)
        slices["all"].update(_held_out_best_fixed(idx, cases, unit, time_of, fixed))
        out[conc] = slices
    return out


CV_FOLDS_C1 = 4
"""Folds of the requests of each slice at concurrency 1 (at higher ones a fold is a group)."""
BOOTSTRAP = 2000


def _held_out_best_fixed(idx, cases, unit, time_of, fixed) -> dict:
    """Two readings of ``auto_vs_best_fixed`` that the in-sample best fixed method biases (the
    minimum of several noisy totals is lower than the best arm's expected total):

    - ``auto_vs_best_fixed_cv``: the fixed method an operator would have picked from
      measurements, chosen on the other folds and timed on each fold (a fold: one group of
      every slice; at concurrency 1, a quarter of each slice's requests);
    - ``auto_vs_best_fixed_ci90``: the 5th and 95th percentiles of the in-sample ratio over
      bootstrap resamples of the groups (requests at concurrency 1) within each slice."""
    arms = [*fixed, "auto"]
    units: dict[str, list] = {}
    for i in idx:
        units.setdefault(cases[i]["slice"], [])
        if unit[i] not in units[cases[i]["slice"]]:
            units[cases[i]["slice"]].append(unit[i])
    grouped = any(unit[i] != i for i in idx)
    fold = {u: (rank if grouped else rank % CV_FOLDS_C1) for us in units.values() for rank, u in enumerate(sorted(us))}
    per_unit = {u: {a: 0.0 for a in arms} for us in units.values() for u in us}
    for i in idx:
        for a in arms:
            per_unit[unit[i]][a] += time_of[a][i]
    held_out = 0.0
    for f in sorted(set(fold.values())):
        train = {a: sum(t[a] for u, t in per_unit.items() if fold[u] != f) for a in fixed}
        pick = min(fixed, key=lambda a: train[a])
        held_out += sum(t[pick] for u, t in per_unit.items() if fold[u] == f)
    auto_total = sum(t["auto"] for t in per_unit.values())
    rng = random.Random(0)
    ratios = []
    for _ in range(BOOTSTRAP):
        tot = dict.fromkeys(arms, 0.0)
        for us in units.values():
            for u in rng.choices(us, k=len(us)):
                for a in arms:
                    tot[a] += per_unit[u][a]
        ratios.append(min(tot[a] for a in fixed) / tot["auto"])
    ratios.sort()
    return {
        "auto_vs_best_fixed_cv": round(held_out / auto_total, 3),
        "auto_vs_best_fixed_ci90": [
            round(ratios[int(0.05 * BOOTSTRAP)], 3),
            round(ratios[int(0.95 * BOOTSTRAP) - 1], 3),
        ],
    }


def greedy_identical(report: dict) -> bool:
    cases = report["cases"]
    for per in report["per_case"].values():
        ref = {r["case"]: r["tokens"] for r in per["target"]}
        for arm, rows in per.items():
            for r in rows:
                if cases[r["case"]]["temperature"] == 0 and r["tokens"] != ref[r["case"]]:
                    return False
    return True


def concurrencies(report: dict) -> list[str]:
    return sorted(report["results"], key=int)


def summary(report: dict) -> dict:
    """Per concurrency the three ratios, the best fixed arm and the requests; at the top the
    worst of each ratio over the concurrencies (each must meet its bar at every one)."""
    res = report["results"]
    by: dict[str, dict] = {}
    for c in concurrencies(report):
        everything = res[c]["all"]
        by[c] = {
            "auto_vs_best_fixed": everything["auto_vs_best_fixed"],
            "auto_vs_oracle": everything["auto_vs_oracle"],
            "min_slice_vs_target": min(
                (v["auto_vs_target"] for s, v in res[c].items() if s != "all"), default=everything["auto_vs_target"]
            ),
            "best_fixed": everything["best_fixed"],
            "requests": everything["cases"],
            "auto_vs_best_fixed_cv": everything.get("auto_vs_best_fixed_cv"),
            "auto_vs_best_fixed_ci90": everything.get("auto_vs_best_fixed_ci90"),
        }
        if "shadow_gain" in everything:
            by[c]["shadow_gain"] = everything["shadow_gain"]
            by[c]["noshadow_vs_best_fixed"] = everything["noshadow_vs_best_fixed"]
        for arm in VARIANT_ARMS:
            for key in (f"{arm}_gain", f"{arm}_vs_best_fixed"):
                if key in everything:
                    by[c][key] = everything[key]
    return {
        **{key: min(v[key] for v in by.values()) for key in BARS},
        "auto_vs_best_fixed_cv": min(
            (v["auto_vs_best_fixed_cv"] for v in by.values() if v["auto_vs_best_fixed_cv"]), default=None
        ),
        "greedy_identical": greedy_identical(report),
        "rerun_after_llma_rule": report.get("rules", {}).get("llma") == current_rules()["llma"],
        "auto_realized_check": bool(report.get("rules", {}).get("auto_realized_check")),
        "auto_corun_check": bool(report.get("rules", {}).get("auto_corun_check")),
        "auto_copy_shadows": bool(report.get("rules", {}).get("auto_copy_shadows")),
        "cases": len(report["cases"]),
        "concurrency": [int(c) for c in by],
        "best_fixed": {c: v["best_fixed"] for c, v in by.items()},
        "by_concurrency": by,
        "bars": BARS,
        "cpu_model": report.get("environment", {}).get("cpu_model"),
    }


def phase_text(report: dict, conc: str) -> str:
    """What ran at ``conc``, from the results (so an older JSON reads right too)."""
    counts = sorted({v["cases"] for s, v in report["results"][conc].items() if s != "all"})
    n = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else str(counts[0])
    if conc == "1":
        return f"concurrency 1: {n} requests per slice, one at a time"
    groups = sorted({-(-v["cases"] // int(conc)) for s, v in report["results"][conc].items() if s != "all"})
    g = f"{groups[0]}-{groups[-1]}" if len(groups) > 1 else str(groups[0])
    return f"concurrency {conc}: {n} requests per slice, {g} group(s) of {conc} at once"


def markdown(report: dict, plot_rel: str | None) -> str:
    s, res = report["summary"], report["results"]
    a, env = report["args"], report.get("environment", {})
    concs = concurrencies(report)
    by = s.get("by_concurrency") or {}
    lines = [
        DOC_BEGIN,
        "",
        "### `auto`: the drafter and k chosen per step (benchmarks/adaptive.py)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Target {report.get('target', '?')}; {s['cases']} distinct held-out prompts; "
        + "; ".join(phase_text(report, c) for c in concs)
        + f"; {a['max_new_tokens']} new tokens each, one mixed stream, arms interleaved; "
        f"CPU {s.get('cpu_model') or '?'}, {env.get('cpu_count', '?')} CPUs.",
        "",
        "| summary | " + " | ".join(f"c={c}" for c in concs) + " | worst | bar |",
        "|---|" + "---|" * (len(concs) + 2),
    ]
    for key in SUMMARY_KEYS:
        bar = BARS.get(key)
        cells = [str(by.get(c, {}).get(key, "")) for c in concs] if bar is not None else [""] * len(concs)
        lines.append(
            f"| `{key}` | " + " | ".join(cells) + f" | {s[key]} | {'>= ' + str(bar) if bar is not None else 'true'} |"
        )
    lines.append("| best fixed | " + " | ".join(res[c]["all"]["best_fixed"] for c in concs) + " | | |")
    if all(by.get(c, {}).get("auto_vs_best_fixed_cv") is not None for c in concs):
        cv = [str(by[c]["auto_vs_best_fixed_cv"]) for c in concs]
        ci = ["{} - {}".format(*by[c]["auto_vs_best_fixed_ci90"]) for c in concs]
        lines.append(
            "| `auto_vs_best_fixed_cv` (best fixed chosen on the other folds) | "
            + " | ".join(cv)
            + f" | {s.get('auto_vs_best_fixed_cv')} | |"
        )
        lines.append("| `auto_vs_best_fixed`, 90 % bootstrap interval | " + " | ".join(ci) + " | | |")
    if all("shadow_gain" in by.get(c, {}) for c in concs):
        gain = " | ".join(str(by[c]["shadow_gain"]) for c in concs)
        lines.append(f"| `shadow_gain` (`{NO_SHADOWS}` time / `auto` time) | {gain} | | |")
        nb = " | ".join(str(by[c]["noshadow_vs_best_fixed"]) for c in concs)
        lines.append(f"| `{NO_SHADOWS}` vs best fixed (the ablation) | {nb} | | |")
    for arm, what in VARIANT_ARMS.items():
        if all(f"{arm}_gain" in by.get(c, {}) for c in concs):
            gain = " | ".join(str(by[c][f"{arm}_gain"]) for c in concs)
            lines.append(f"| `{arm}_gain` (`auto` time / `{arm}` time: {what}) | {gain} | | |")
            nb = " | ".join(str(by[c][f"{arm}_vs_best_fixed"]) for c in concs)
            lines.append(f"| `{arm}` vs best fixed | {nb} | | |")
    arms = report["arms"]
    for conc in concs:
        lines += [
            "",
            f"**Concurrency {conc}**: speed-up over target-only (total time; per slice)",
            "",
            "| slice | " + " | ".join(arms) + " | oracle | best fixed | auto's steps |",
            "|---|" + "---|" * (len(arms) + 3),
        ]
        for sl, v in res[conc].items():
            sp = v["speedup"]
            oracle = v["total_s"]["target"] / v["oracle_s"] if v["oracle_s"] else None
            cells = [f"**{fmt(sp[x])}**" if x == "auto" else fmt(sp[x]) for x in arms]
            mix = ", ".join(f"{m} {100 * p:.0f}%" for m, p in v["auto_mix"].items())
            lines.append(
                f"| {sl} ({v['cases']}) | " + " | ".join(cells) + f" | {fmt(oracle)} | {v['best_fixed']} | {mix} |"
            )
    if plot_rel:
        lines += ["", f"![auto against fixed methods]({plot_rel})"]
    lines += [
        "",
        "Ratios of total times over the same requests; the summary's worst is the least over the "
        "concurrencies. Oracle: per request (per group above concurrency 1) the fastest fixed arm, known "
        "after the fact. `auto_vs_best_fixed` picks the best fixed arm on the very times it is compared "
        "on (the least of several noisy totals, biased low); `_cv` picks it on the other folds (a group "
        "of every slice; at concurrency 1 a quarter of each slice's requests) and times it on each fold; "
        "the interval resamples the groups (requests at concurrency 1) within each slice. Above concurrency 1 a group's requests share target passes through one "
        "`TargetBatcher` and an arm's time is its groups' wall time. Times are wall clock on the CPU above.",
        "",
        DOC_END,
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    """One panel per concurrency: best fixed, auto and the oracle per slice, over target-only."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = report["results"]
    concs = concurrencies(report)
    fig, axes = plt.subplots(1, len(concs), figsize=(5.5 * len(concs), 3.8), squeeze=False, sharey=True)
    for ax, conc in zip(axes[0], concs):
        names = list(res[conc])
        xs = range(len(names))
        best = [res[conc][n]["speedup"][res[conc]["all"]["best_fixed"]] for n in names]
        auto = [res[conc][n]["speedup"]["auto"] for n in names]
        oracle = [res[conc][n]["total_s"]["target"] / res[conc][n]["oracle_s"] for n in names]
        w = 0.27
        ax.bar([x - w for x in xs], best, w, label=f"best fixed ({res[conc]['all']['best_fixed']})")
        ax.bar(list(xs), auto, w, label="auto")
        ax.bar([x + w for x in xs], oracle, w, label="oracle (per request)" if conc == "1" else "oracle (per group)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(BARS["min_slice_vs_target"], color="r", lw=0.6, ls="--")
        ax.set_xticks(list(xs), names, rotation=20)
        ax.set_title(f"concurrency {conc}")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("speed-up over target-only")
    return save_png(fig, path)

"""The OSD benchmark's summary: the headline numbers and bars of a report, of its offline arm,
of other domains' runs merged beside it and of the template-disjoint probe."""

from __future__ import annotations

from benchmarks.distill import scope
from benchmarks.distill.constants import (
    AUTO_STATIC_BAR,
    GAIN_BAR,
    OFFLINE_FRACTION_BAR,
    OTHER_KEYS,
    RECOVERY_BAR,
    SHIFT_MARGIN,
)
from benchmarks.distill.grid import grid_summary


# ---------------------------------------------------------------- 9. report
def summarise(report: dict) -> dict:
    """The headline numbers (also for ``--replot``)."""
    main = report["main"]
    clusters = [d for d in scope.DOMAINS if d in main["final"]]
    arm = lambda name: {d: main["final"][d][name]["alpha_token"] for d in clusters}  # noqa: E731
    static = {d: report["static"][d]["alpha_token"] for d in clusters}
    offline = {d: report["offline"][d]["alpha_token"] for d in clusters}
    gated, ungated = arm("gated"), arm("ungated")
    gain = {d: gated[d] - static[d] for d in clusters}
    frac = {d: (gated[d] - static[d]) / (offline[d] - static[d]) if offline[d] > static[d] else None for d in clusters}
    promos = main["promotions"]
    per_cluster = {d: sum(p["cluster"] == d for p in promos) for d in clusters}
    shift = report.get("shift") or {}
    out = {
        "chat": True,
        "distinct_prompts": bool(report.get("distinct_prompts")),
        "clusters": clusters,
        "requests_per_cluster": report["config"]["requests"],
        "alpha_token_static": static,
        "alpha_token_gated": gated,
        "alpha_token_ungated": ungated,
        "alpha_token_offline": offline,
        "alpha_drafted_static": {d: report["static"][d]["alpha_drafted"] for d in clusters},
        "alpha_drafted_gated": {d: main["final"][d]["gated"]["alpha_drafted"] for d in clusters},
        "gain_gated": gain,
        "gain_gated_min": min(gain.values()),
        "gain_ungated_min": min(ungated[d] - static[d] for d in clusters),
        **disjoint_summary(report, clusters),
        "offline_fraction": frac,
        "offline_fraction_min": min((f for f in frac.values() if f is not None), default=None),
        **offline_summary(report, clusters, static),
        **grid_summary(report),
        **other_summary(report),
        "promotions": len(promos),
        "promotions_per_cluster": per_cluster,
        "worse_promotions": sum(p["worse_beyond_noise"] for p in promos),
        "gate_candidates": len(main["gates"]),
        "recovery_requests": shift.get("recovery", {}).get("requests"),
        "routing_accuracy": report.get("routing", {}).get("accuracy"),
        "routing_accuracy_user_only": report.get("routing", {}).get("accuracy_user_only"),
        "engine_checks": {
            "n": len(report.get("engine_checks", [])),
            "identical": sum(c["identical"] for c in report.get("engine_checks", [])),
            "alpha_equal": sum(
                abs(c["alpha_engine"] - c["alpha_replayed"]) < 1e-9 for c in report.get("engine_checks", [])
            ),
        },
        "trainer_cpu_s_per_request": main["trainer_cpu_s"] / max(1, len(main["rows"])),
    }
    segs = shift.get("segments") or []
    if segs:
        out["shift_gated_minus_ungated_min"] = min(g["gated_minus_ungated_150"] for g in segs)
        out["shift_adapt_requests"] = {f"{g['segment']}:{g['domain']}": g["gated"]["adapt_requests"] for g in segs}
        out["shift_ungated_adapt_requests"] = {
            f"{g['segment']}:{g['domain']}": g["ungated"]["adapt_requests"] for g in segs
        }
        out["shift_worse_promotions"] = shift.get("worse_promotions")
        out["gate_window"] = shift.get("window")
        out["gate_fresh"] = shift.get("fresh", 0)
    if report.get("generic"):
        g = report["generic"]
        out["alpha_token_generic"] = {k: {d: g[k][d] for d in clusters} for k in ("static", "gated", "ungated")}
    if report.get("speed"):
        out["tokens_per_s_ratio"] = {d: report["speed"][d]["ratio_to_target"] for d in clusters if d in report["speed"]}
        autos = {
            d: report["speed"][d]["auto"] for d in clusters if "vs_static" in report["speed"].get(d, {}).get("auto", {})
        }
        if autos:
            out["auto_default_vs_static"] = {d: a["vs_static"] for d, a in autos.items()}
            out["auto_default_vs_target"] = {d: a["vs_target"] for d, a in autos.items()}
            out["auto_default_vs_static_min"] = min(out["auto_default_vs_static"].values())
            out["auto_default_vs_target_min"] = min(out["auto_default_vs_target"].values())
            out["auto_draft_step_share"] = {d: a["draft_step_share"] for d, a in autos.items()}
            out["auto_champion_alpha"] = {d: a["champion_alpha"] for d, a in autos.items()}
            bound = {d: a["offline_vs_static"] for d, a in autos.items() if a.get("offline_vs_static") is not None}
            if bound:  # the offline bound's draft under `auto` (same process): what any draft of this size reached
                out["auto_offline_vs_static"] = bound
    out["bars"] = {
        "gain_gated_min >= 0.10": out["gain_gated_min"] >= GAIN_BAR,
        "offline_fraction_min >= 0.8": (out["offline_fraction_min"] or 0) >= OFFLINE_FRACTION_BAR,
        ">= 1 promotion per cluster": all(v >= 1 for v in per_cluster.values()),
        "0 worse promotions": out["worse_promotions"] == 0,
        "recovery <= 300 requests": out["recovery_requests"] is not None and out["recovery_requests"] <= RECOVERY_BAR,
    }
    if "gain_template_disjoint_min" in out:
        out["bars"]["template-disjoint gain >= 0.10"] = out["gain_template_disjoint_min"] >= GAIN_BAR
    if "auto_default_vs_static_min" in out:
        out["bars"]["auto: champion >= 1.1x static"] = out["auto_default_vs_static_min"] >= AUTO_STATIC_BAR
        out["bars"]["auto: champion >= 1.0x target-only"] = out["auto_default_vs_target_min"] >= 1.0
    if segs:
        out["bars"]["shift: gated >= ungated - 0.05 after 150"] = out["shift_gated_minus_ungated_min"] >= -SHIFT_MARGIN
        out["bars"]["shift: adapted in <= 300 requests"] = all(
            v is not None and v <= 300 for v in out["shift_adapt_requests"].values()
        )
        out["bars"]["shift: 0 worse promotions"] = not shift.get("worse_promotions")
    for o in out.get("real_text", []):  # the real-text domains' own run, held to the same bars
        name = "+".join(o.get("clusters", []))
        out["bars"][f"real text {name}: gain >= 0.10"] = o.get("gain_gated_min", 0) >= GAIN_BAR
        if "gain_template_disjoint_min" in o:
            out["bars"][f"real text {name}: template-disjoint gain >= 0.10"] = (
                o["gain_template_disjoint_min"] >= GAIN_BAR
            )
        if "offline_fraction_min" in o:
            out["bars"][f"real text {name}: offline_fraction_min >= 0.8"] = (
                o["offline_fraction_min"] or 0
            ) >= OFFLINE_FRACTION_BAR
        out["bars"][f"real text {name}: 0 worse promotions"] = o.get("worse_promotions") == 0
    return out


def offline_summary(report: dict, clusters: list[str], static: dict) -> dict:
    """The swept offline bound (every configuration, the best) and the 10 % baseline, per cluster."""
    out: dict = {}
    sweep = report.get("offline_sweep") or {}
    if any(sweep.get(d) for d in clusters):
        out["offline_swept"] = {
            d: {
                "configs": len(sweep[d]),
                "best": max(sweep[d], key=lambda r: r["alpha_token"]),
                "default": next((r for r in sweep[d] if r.get("default")), None),
            }
            for d in clusters
            if sweep.get(d)
        }
    base = report.get("baseline_10pct") or {}
    if any(d in base for d in clusters):
        out["baseline_10pct"] = {d: base[d]["alpha_token"] for d in clusters if d in base}
        out["baseline_10pct_gain"] = {d: base[d]["alpha_token"] - static[d] for d in clusters if d in base}
    return out


def other_summary(report: dict) -> dict:
    """``real_text``: the headline numbers of runs of other domains merged beside this one
    (``--domains docs``: prompts from real documentation, not templates), per file; {} without."""
    other = report.get("other_domains") or []
    if not other:
        return {}
    return {
        "real_text": [
            {
                "file": o["file"],
                "command": o.get("command"),
                **{k: o["summary"][k] for k in OTHER_KEYS if k in o["summary"]},
            }
            for o in other
        ]
    }


def disjoint_summary(report: dict, clusters: list[str]) -> dict:
    """Per-token α on the template-disjoint probe per cluster and arm, each arm's gain over the
    static draft there, and the smallest gated gain (issue 55's bar); {} without that probe."""
    dj = report.get("disjoint") or {}
    cs = [d for d in clusters if "gated" in dj.get(d, {})]
    if not cs:
        return {}
    arms = [a for a in ("static", "gated", "ungated", "offline") if all(a in dj[d] for d in cs)]
    alpha = {a: {d: dj[d][a]["alpha_token"] for d in cs} for a in arms}
    gain = {a: {d: alpha[a][d] - alpha["static"][d] for d in cs} for a in arms if a != "static"}
    return {
        "alpha_token_disjoint": alpha,
        "gain_template_disjoint": gain,
        "gain_template_disjoint_min": min(gain["gated"].values()),
    }

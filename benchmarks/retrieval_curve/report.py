"""The retrieval curve's report (``benchmarks/dresd_curve.py`` is the benchmark, run by
``benchmarks/dresd.py --curve``): the summary, the key-layer pick, the dresd-curve section of
``docs/benchmarks.md`` and the plot."""

from __future__ import annotations

from pathlib import Path

from benchmarks.retrieval_curve.arms import ARMS
from specops.core.suffix import MAX_N


# ---------------------------------------------------------------- report
def summary(report: dict) -> dict:
    """The summary keys issue 38 names, from the curve."""
    curve = report["curve"]
    points = []
    for p in curve:
        row = {"entries": p["entries"]}
        for set_name, arms in p["sets"].items():
            sfx = "" if set_name == "id" else f"_{set_name}"
            for arm in ARMS:
                row[f"mar_{arm}{sfx}"] = arms[arm]["mar"]
                row[f"al_{arm}{sfx}"] = arms[arm]["al"]
                row[f"drafted_fraction_{arm}{sfx}"] = arms[arm]["drafted_fraction"]
        row["tokens_per_s_vs_target"] = {s: live["vs_target"] for s, live in p["live"].items()}
        row["search_p50_ms"] = p["search_p50_ms"]
        row["bytes_per_entry"] = p["bytes_per_entry"]
        points.append(row)
    pert = [p["sets"]["perturbed"] for p in curve if "perturbed" in p["sets"]]
    ratios = [s["dresd"]["al"] / s["rest"]["al"] if s["rest"]["al"] else None for s in pert]
    hybrid_vs_best = [
        arms["hybrid"]["al"] / max(arms["dresd"]["al"], arms["rest"]["al"], arms.get("rest_rule", {}).get("al", 0))
        for p in curve
        for arms in p["sets"].values()
        if max(arms["dresd"]["al"], arms["rest"]["al"]) > 0
    ]
    key_layer, key_gain = pick_key_layer(report.get("key_layer_sweep") or {})
    cfg = report["config"]
    last = curve[-1]["sets"] if curve else {}
    return {
        "split": cfg.get("split", "all"),
        "dense_below": cfg["dense_below"],
        "exact_nodes": cfg.get("exact_nodes"),
        "curve": points,
        "perturbed_al_ratio_vs_rest": round(min(r for r in ratios if r is not None), 3) if any(ratios) else None,
        "perturbed_al_ratio_vs_rest_by_size": [round(r, 3) if r is not None else None for r in ratios],
        "hybrid_al_vs_best": round(min(hybrid_vs_best), 3) if hybrid_vs_best else None,
        "hybrid_al_vs_best_at_largest": {
            name: round(arms["hybrid"]["al"] / max(arms[a]["al"] for a in ARMS if a != "hybrid"), 3)
            for name, arms in last.items()
            if max(arms[a]["al"] for a in ARMS if a != "hybrid") > 0
        },
        "hybrid_tokens_per_s_vs_target": min(p["live"]["id"]["vs_target"]["hybrid"] for p in curve),
        "hybrid_tokens_per_s_vs_target_by_size": [p["live"]["id"]["vs_target"]["hybrid"] for p in curve],
        "hybrid_live_priced_speedup_id": [p["sets"]["id"].get("hybrid_live", {}).get("priced_speedup") for p in curve],
        "key_layer": key_layer,
        "key_layer_gain_vs_final": key_gain,
        "greedy_identical": all(live["identical"] for p in curve for live in p["live"].values()),
        "crossing_entries_id": report["extrapolation"].get("id", {}).get("crossing_entries"),
        "largest_entries": curve[-1]["entries"] if curve else 0,
    }


KEY_LAYER_MARGIN = 1.05
"""Another key layer replaces the final state only if its accepted tokens per step, summed over the
prompt sets (so that a set where every layer accepts ~0.1 token per step cannot decide by noise),
are at least 5 % above the final state's: serving keys on the final state, which the verifier
returns with every verdict at no cost."""


def pick_key_layer(sweep: dict) -> tuple[str, float]:
    """The key layer to use and the best layer's pooled AL relative to the final state's."""
    if not sweep or "final" not in sweep:
        return "final", 1.0
    base = sum(sweep["final"].values())
    rel = {k: sum(sets.values()) / base if base else 1.0 for k, sets in sweep.items()}
    best = max(rel, key=rel.get)
    return (best if rel[best] >= KEY_LAYER_MARGIN else "final"), round(rel[best], 3)


def markdown(report: dict, plot_rel: str | None, command: str) -> str:
    from benchmarks.common import fmt

    s, cfg = report["summary"], report["config"]
    sizes = ", ".join(f"{p['entries']:,}" for p in report["curve"])
    lines = [
        DOC_BEGIN,
        "## Where dense retrieval pays: DReSD, REST and the hybrid along datastore size",
        "",
        f"`{command}`: datastores of {sizes} entries "
        f"(chunks of {cfg['chunk_tokens']} tokens of the bootstrap's training files plus the target's "
        f"{cfg['gen_tokens']}-token greedy continuation; DReSD and REST over the same documents), "
        f"prompt sets {cfg['set_prompts']} ({cfg['max_new_tokens']} new tokens, greedy)"
        + (
            f", split into a dev half (even-numbered prompts, {cfg['split_prompts']['dev']}: the hybrid's "
            f"settings are chosen there) and a test half (odd-numbered, {cfg['split_prompts']['test']}: "
            "every number below)"
            if cfg.get("split") == "test"
            else ""
        )
        + ". DReSD "
        f"{cfg['shape']}, REST {cfg['rest_choices']} trie nodes (through its library, a fresh reader per request, "
        f"and REST's rule in our code, `rest rule`), hybrid = REST's rule over the datastore's "
        f"tokens ({cfg['rest_choices']} nodes)"
        + (", LLMA's scored rule over the request's own context" if cfg.get("split") == "test" else "")
        + _dense_words(cfg)
        + f"CPU: {report.get('environment', {}).get('cpu_model', 'unknown')}. Replayed: MAR, accepted tokens per step (AL), fraction of steps "
        f"that drafted; live ({cfg['live_prompts']} prompts per set, arms interleaved, the CPU budgets: REST "
        f"native, DReSD 1 x 4, the hybrid's exact trie of {cfg.get('exact_nodes', 24)} nodes "
        + ("and no dense row): " if cfg["dense_below"] == 0 else "plus one dense row): ")
        + "tokens/s vs target-only."
        + (
            f" Verify cost (measured): {cfg['verify_cost_ms'][0]} ms + {cfg['verify_cost_ms'][1]} ms per token; "
            "`priced` is a replay's speed-up over target-only at that cost plus the drafter's own time."
            if cfg.get("verify_cost_ms")
            else ""
        ),
    ]
    priced = any("priced_speedup" in a for p in report["curve"] for arms in p["sets"].values() for a in arms.values())
    head = (
        "| entries | set | MAR dresd / rest / rest rule / hybrid | AL dresd / rest / rest rule / hybrid "
        "| drafted dresd / rest / rest rule / hybrid | tokens/s vs target dresd / rest / hybrid |"
    )
    lines += [
        "",
        head + (" priced dresd / rest / hybrid live |" if priced else ""),
        "|---" * (7 if priced else 6) + "|",
    ]
    for p in report["curve"]:
        for name, arms in p["sets"].items():
            live = p["live"].get(name, {}).get("vs_target")
            tps = " / ".join(fmt(live[a]) for a in ("dresd", "rest", "hybrid")) if live else "–"
            row = (
                f"| {p['entries']:,} | {name} | "
                + " | ".join(
                    " / ".join(fmt(arms[a][m], ".3f") if a in arms else "–" for a in ARMS)
                    for m in ("mar", "al", "drafted_fraction")
                )
                + f" | {tps} |"
            )
            if priced:
                row += (
                    " "
                    + " / ".join(fmt(arms.get(a, {}).get("priced_speedup")) for a in ("dresd", "rest", "hybrid_live"))
                    + " |"
                )
            lines.append(row)
    lines += [
        "",
        "| entries | docs | keys s | generate s | index s | search p50 ms dresd / rest / exact | "
        "bytes/entry dresd / rest / hybrid |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in report["curve"]:
        b, q, by = p["build_s"], p["search_p50_ms"], p["bytes_per_entry"]
        lines.append(
            f"| {p['entries']:,} | {p['docs']:,} | {b['keys_s']} | {b['generate_s']} | {b['fit_index_s']} | "
            f"{q['dresd']} / {q['rest']} / {q['hybrid_exact']} | {by['dresd']} / {by['rest']} / {by['hybrid']} |"
        )
    ex = report["extrapolation"].get("id") or {}
    if ex:
        cross = ex.get("crossing_entries")
        lines += [
            "",
            f"Extrapolation (a straight line of AL against log10 entries, ID set): DReSD "
            f"{ex['dresd']['slope_per_decade']:+.3f} per decade, REST {ex['rest']['slope_per_decade']:+.3f}; "
            + (
                f"the lines would cross near {cross:,.0f} entries (an extrapolation past the measured sizes)."
                if cross is not None
                else "the lines do not cross past the measured sizes (DReSD "
                + ("stays above" if ex.get("dresd_above_at_largest") else "stays below")
                + " REST's line)."
            ),
        ]
    if report.get("key_layer_sweep"):
        lines += [
            "",
            "Key layer (DReSD AL per set, replayed at the second size): "
            + "; ".join(
                f"{k}: " + ", ".join(f"{n} {v:.3f}" for n, v in sets.items())
                for k, sets in report["key_layer_sweep"].items()
            ),
        ]
    tuning = report.get("hybrid_tuning")
    if tuning:
        top = sorted(tuning["grid"], key=lambda g: -g["priced_speedup"])[:6]
        lines += [
            "",
            f"Hybrid settings chosen on the dev split at {cfg['sweep_entries']:,} entries ({tuning['objective']}; "
            f"{len(tuning['grid'])} settings): dense_below {tuning['chosen']['dense_below']}, exact_nodes "
            f"{tuning['chosen']['exact_nodes']}. Best six (dense_below / exact_nodes: priced speed-up, AL per set): "
            + "; ".join(
                f"{g['dense_below']} / {g['exact_nodes']}: {g['priced_speedup']:.3f} ("
                + ", ".join(f"{n} {v:.3f}" for n, v in g["al"].items())
                + ")"
                for g in top
            )
            + ".",
        ]
    if report.get("dense_below_sweep"):
        lines += [
            "",
            "Hybrid `dense_below` (AL per set, replayed at the second size): "
            + "; ".join(
                f"{b}: " + ", ".join(f"{n} {v:.3f}" for n, v in sets.items())
                for b, sets in report["dense_below_sweep"].items()
            ),
        ]
    if plot_rel:
        lines += ["", f"![DReSD, REST and the hybrid along datastore size]({plot_rel})"]
    lines += [
        "",
        "Summary: " + ", ".join(f"`{k}` {v}" for k, v in s.items() if k not in ("curve",)) + ".",
        "",
        DOC_END,
    ]
    return "\n".join(lines)


def _dense_words(cfg: dict) -> str:
    """When the hybrid adds DReSD's rows, in words."""
    below = cfg["dense_below"]
    if cfg.get("split") != "test":
        return f" plus DReSD's rows where the exact suffix is shorter than {below} tokens. "
    if below == 0:
        return "; DReSD's rows never join (`dense_below` 0, the dev split's choice). "
    if below > MAX_N:
        return " plus DReSD's rows at every step. "
    return f" plus DReSD's rows where the longer exact match is shorter than {below} tokens. "


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from benchmarks.common import save_png

    curve = report["curve"]
    x = [p["entries"] for p in curve]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    colors = {"dresd": "tab:blue", "rest": "tab:orange", "rest_rule": "tab:red", "hybrid": "tab:green"}
    styles = {"id": "-", "chat": ":", "perturbed": "--"}
    for ax, (metric, title) in zip(
        axes.flat[:3], (("al", "accepted tokens per step"), ("mar", "MAR"), ("drafted_fraction", "steps that drafted"))
    ):
        for set_name, ls in styles.items():
            for arm, col in colors.items():
                ys = [p["sets"].get(set_name, {}).get(arm, {}).get(metric) for p in curve]
                if any(y is not None for y in ys):
                    ax.plot(x, ys, ls, color=col, marker="o", label=f"{arm} {set_name}")
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("datastore entries")
    axes.flat[0].legend(fontsize=7, ncol=3)
    ax = axes.flat[3]
    for set_name, ls in (("id", "-"), ("chat", ":")):
        for arm, col in colors.items():
            if arm in curve[0]["live"][set_name]["vs_target"]:
                ax.plot(x, [p["live"][set_name]["vs_target"][arm] for p in curve], ls, color=col, marker="o")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_title("tokens/s vs target-only (solid ID, dotted chat)")
    ax = axes.flat[4]
    for arm, key in (("dresd", "dresd"), ("rest", "rest"), ("hybrid", "hybrid_exact")):
        ax.plot(x, [p["search_p50_ms"][key] for p in curve], color=colors[arm], marker="o", label=arm)
    ax.set_xscale("log")
    ax.set_title("search p50 (ms)")
    ax.legend(fontsize=7)
    ax = axes.flat[5]
    for arm in ("dresd", "rest", "hybrid"):
        ax.plot(x, [p["bytes_per_entry"][arm] for p in curve], color=colors[arm], marker="o", label=arm)
    ax.set_xscale("log")
    ax.set_title("bytes per entry")
    ax.legend(fontsize=7)
    return save_png(fig, path)


DOC_BEGIN = "<!-- BEGIN dresd-curve (written by benchmarks/dresd.py --curve; edits inside are overwritten) -->"
DOC_END = "<!-- END dresd-curve -->"

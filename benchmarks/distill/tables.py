"""The OSD benchmark's plot and its markdown table."""

from __future__ import annotations

from pathlib import Path

from benchmarks.distill import scope
from benchmarks.distill.constants import COLORS, WINDOW
from specops.workloads.chat_workload import HELD_OUT


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main, clusters = report["main"], [d for d in scope.DOMAINS if d in report["main"]["final"]]
    panels = len(clusters) + (1 if report.get("shift") else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.9), sharey=True)
    axes = list(axes) if panels > 1 else [axes]
    for ax, d in zip(axes, clusters):
        curve = main["curves"][d]
        x = [p["requests"] for p in curve]
        ax.plot(x, [p["gated"] for p in curve], "-o", ms=3, label="gated (served)", color=COLORS["gated"])
        ax.plot(x, [p["ungated"] for p in curve], "-s", ms=3, label="ungated", color=COLORS["ungated"])
        ax.axhline(report["static"][d]["alpha_token"], color=COLORS["static"], ls="--", label="static")
        ax.axhline(report["offline"][d]["alpha_token"], color=COLORS["offline"], ls=":", label="offline (bound)")
        if report.get("generic") and report["generic"].get("curves", {}).get(d):
            gc = report["generic"]["curves"][d]
            ax.plot(
                [p["requests"] for p in gc],
                [p["ungated"] for p in gc],
                "-",
                color=COLORS["generic_ungated"],
                label="generic start, ungated",
            )
        served_idx = {}
        for i, r in enumerate(main["rows"]):
            if r["cluster"] == d:
                served_idx[i] = len(served_idx) + 1
        for p in main["promotions"]:
            if p["cluster"] == d:
                ax.axvline(served_idx.get(p["request"], 0), color=COLORS["gated"], alpha=0.25, lw=0.8)
        ax.set_title(f"{d}: α on the held-out probe")
        ax.set_xlabel(
            f"requests of the cluster served (promotions: {sum(p['cluster'] == d for p in main['promotions'])})"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if report.get("shift"):
        ax = axes[-1]
        sh = report["shift"]
        ax.plot(range(1, len(sh["gated_curve"]) + 1), sh["gated_curve"], label="gated", color=COLORS["gated"])
        ax.plot(range(1, len(sh["ungated_curve"]) + 1), sh["ungated_curve"], label="ungated", color=COLORS["ungated"])
        for name, curve in (sh.get("window_curves") or {}).items():
            w = name[1:] if name[1:] != "0" else "all"
            ax.plot(range(1, len(curve) + 1), curve, label=f"gated, window {w}", lw=0.8, ls="--")
        for b in sh["boundaries"]:
            ax.axvline(b, color="grey", ls=":", lw=1)
        ax.set_title(" → ".join(sh["domains"]) + f" (one draft; gate window {sh.get('window', 'all')})")
        ax.set_xlabel(f"requests served (α over the last {WINDOW})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("per-token α (OSD §3)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    s = report["summary"]
    clusters = s["clusters"]
    gen = s.get("alpha_token_generic")
    ratio = s.get("tokens_per_s_ratio", {})
    head = "| cluster | static | gated | ungated | offline bound | gated gain | of offline gain | promotions |"
    lines = [
        head + (" generic start → gated / ungated |" if gen else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if gen else ""),
    ]
    for d in clusters:
        f = s["offline_fraction"][d]
        line = (
            f"| {d} | {s['alpha_token_static'][d]:.3f} | {s['alpha_token_gated'][d]:.3f} | "
            f"{s['alpha_token_ungated'][d]:.3f} | {s['alpha_token_offline'][d]:.3f} | {s['gain_gated'][d]:+.3f} | "
            f"{'–' if f is None else f'{f:.2f}'} | {s['promotions_per_cluster'][d]} |"
        )
        if gen:
            line += f" {gen['static'][d]:.3f} → {gen['gated'][d]:.3f} / {gen['ungated'][d]:.3f} |"
        lines.append(line)
    if ratio:
        arms = list(dict.fromkeys(a for r in ratio.values() for a in r))  # every arm any cluster ran
        lines += [
            "",
            "Tokens/s ÷ target-only (real engine, same probe prompts, interleaved): the draft method with each "
            "arm's final draft, and (`auto_*`) the default method, `auto`, continuing from a policy that served "
            "with the static draft: with it still (`auto_static`), with the final champion swapped in and its "
            "estimate re-seeded from the gate (`auto_gated`, what serving does), or kept (`auto_stale`, before "
            "issue 55)"
            + (
                "; where the offline part ran in the same process, with the offline bound's draft "
                "(`auto_offline`, re-seeded from its probe α):"
                if "auto_offline" in arms
                else ":"
            ),
            "",
            "| cluster | " + " | ".join(arms) + " |",
            "|---|" + "---:|" * len(arms),
        ]
        for d in clusters:
            lines.append(f"| {d} | " + " | ".join(f"{ratio[d][a]:.2f}x" if a in ratio[d] else "–" for a in arms) + " |")
    sw, b10 = s.get("offline_swept"), s.get("baseline_10pct")
    if sw or b10:
        lines += [
            "",
            "Offline arms: the bound swept over learning rate and epochs (best on the probe), and the "
            "paper's baseline of offline distillation on 10 % of the domain's served requests:",
            "",
        ]
        lines += [
            "| cluster | configurations | best (lr, epochs): α | default: α | 10 % baseline: α |",
            "|---|---:|---:|---:|---:|",
        ]
        for d in clusters:
            w = (sw or {}).get(d)
            best = f"{w['best']['lr']:g}, {w['best']['epochs']}: {w['best']['alpha_token']:.3f}" if w else "–"
            dflt = f"{w['default']['alpha_token']:.3f}" if w and w.get("default") else "–"
            ten = f"{b10[d]:.3f}" if b10 and d in b10 else "–"
            lines.append(f"| {d} | {w['configs'] if w else '–'} | {best} | {dflt} | {ten} |")
    dj = s.get("alpha_token_disjoint")
    if dj:
        arms = list(dj)
        lines += [
            "",
            "The same arms on the **template-disjoint probe** (prompts of families served traffic never had: "
            + "; ".join(f"{d}: {', '.join(sorted(HELD_OUT[d]))}" for d in clusters if d in HELD_OUT)
            + "), per-token α, and on the in-template probe above for comparison (gain over static):",
            "",
            "| cluster | " + " | ".join(arms) + " | gated gain, disjoint | gated gain, in-template |",
            "|---|" + "---:|" * (len(arms) + 2),
        ]
        for d in clusters:
            if d in dj[arms[0]]:
                lines.append(
                    f"| {d} | "
                    + " | ".join(f"{dj[a][d]:.3f}" for a in arms)
                    + f" | {s['gain_template_disjoint']['gated'][d]:+.3f} | {s['gain_gated'][d]:+.3f} |"
                )
    share = s.get("auto_draft_step_share")
    if share:
        arms = list(dict.fromkeys(a for r in share.values() for a in r))
        lines += [
            "",
            "`auto`: share of its steps on the draft model, and the champion's speed-up under `auto` "
            "(`auto_gated` ÷ `auto_static`; the gate's served score that re-seeded it):",
            "",
            "| cluster | " + " | ".join(f"draft steps, {a}" for a in arms) + " | auto_gated ÷ auto_static | seed |",
            "|---|" + "---:|" * (len(arms) + 2),
        ]
        for d in clusters:
            if d in share:
                seed = s["auto_champion_alpha"].get(d)
                lines.append(
                    f"| {d} | "
                    + " | ".join(f"{share[d][a]:.2f}" if a in share[d] else "–" for a in arms)
                    + f" | {s['auto_default_vs_static'][d]:.2f}x | {'–' if seed is None else f'{seed:.3f}'} |"
                )
    return "\n".join(lines)

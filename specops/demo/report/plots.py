"""The closed-loop demo report's PNG plots: α over time per cluster, and tokens/s per method."""

from __future__ import annotations

import math
from pathlib import Path

from specops.demo.report.data import (
    DemoRun,
    acceptance,
    clusters_of,
    draft_alpha,
    draft_share,
    has_alpha,
    phase_spans,
    served,
    served_speed,
    speed_ratio,
    speeds_of,
    token_alpha,
    version_label,
)

ROLLING = 20  # requests in the rolling α line of alpha.png
METHODS = ("target-only", "static draft", "online draft", "auto")
METHOD_COLORS = {"target-only": "#7f7f7f", "static draft": "#1f77b4", "online draft": "#2ca02c", "auto": "#ff7f0e"}
PHASE_COLORS = ("#fde7c8", "#d9ecf7", "#e3f2d9", "#f3dff0", "#eeeeee", "#fff5b8")
DPI = 110


def plot_alpha(run: DemoRun, path: Path) -> None:
    """α over time, one panel per cluster: per-request dots, rolling α, promotions, phases."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names = clusters_of(run) or ["(no requests)"]
    spans = phase_spans(run)
    # α where the server reported rejected steps; accepted / drafted otherwise (an older server)
    alpha_of, row_alpha, what = (
        (token_alpha, lambda r: r.alpha, "α (per token, OSD)")
        if has_alpha(run)
        else (acceptance, lambda r: r.acceptance, "acceptance (accepted / drafted)")
    )
    short = what.split(" (")[0]
    # the workload's clock: duration_s also covers start-up and the closing speed runs
    t_end = max([r.t for r in run.requests] + [p.t for p in run.promotions]) if run.requests else run.duration_s
    scale, unit = (60.0, "min") if t_end > 300 else (1.0, "s")
    phase_color = {p: PHASE_COLORS[i % len(PHASE_COLORS)] for i, p in enumerate(dict.fromkeys(s[0] for s in spans))}
    fig = Figure(figsize=(11, 2.9 * len(names) + 1.0), layout="constrained")
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names):
        for p, s, e in spans:
            ax.axvspan(s / scale, e / scale, color=phase_color[p], alpha=0.8, lw=0, zorder=0)
        rows = [r for r in served(run, name) if r.drafted]
        if rows:
            ax.scatter(
                [r.t / scale for r in rows], [row_alpha(r) for r in rows], s=9, alpha=0.35, color="#1f77b4", lw=0
            )
            rolling = [alpha_of(rows[max(0, i - ROLLING + 1) : i + 1]) for i in range(len(rows))]
            rolling = [math.nan if a is None else a for a in rolling]
            ax.plot([r.t / scale for r in rows], rolling, color="#d62728", lw=1.8)
        else:
            ax.text(0.5, 0.5, "no drafted tokens", transform=ax.transAxes, ha="center", color="grey")
        failed = [r.t / scale for r in run.requests if not r.ok and r.cluster == name]
        ax.scatter(failed, [0.02] * len(failed), marker="x", color="black", s=30, zorder=4)
        for p in (p for p in run.promotions if p.cluster == name):
            color = "#2ca02c" if p.kind == "promote" else "#9467bd"
            ax.axvline(p.t / scale, color=color, ls="--", lw=1.3, zorder=3)
            ax.text(
                p.t / scale,
                1.03,
                version_label(p.version),
                color=color,
                fontsize=8,
                rotation=90,
                ha="right",
                va="top",
                zorder=5,
            )
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(what)
        ax.set_title(f"cluster {name}", loc="left", fontsize=11)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(f"time since the workload started ({unit})")
    axes[-1].set_xlim(0, max(t_end, 1e-9) / scale)
    handles = [
        Line2D([], [], marker="o", ls="", color="#1f77b4", alpha=0.4, label=f"{short} of one request"),
        Line2D([], [], color="#d62728", lw=1.8, label=f"rolling {short} (last {ROLLING} requests, pooled)"),
        Line2D([], [], color="#2ca02c", ls="--", label="promotion (version)"),
        Line2D([], [], color="#9467bd", ls="--", label="rollback (version)"),
        Line2D([], [], marker="x", ls="", color="black", label="failed request"),
    ] + [Patch(color=c, label=f"phase: {p}") for p, c in phase_color.items()]
    fig.suptitle(
        "α over time (per token, OSD)"
        if alpha_of is token_alpha
        else "Acceptance over time (accepted / drafted: the server reported no rejected steps)",
        fontsize=12,
    )
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    fig.savefig(path, dpi=DPI)


def plot_speedup(run: DemoRun, path: Path) -> None:
    """Grouped bars per cluster: tokens/s per method, ratios to target-only annotated."""
    from matplotlib.figure import Figure

    names = sorted({s.cluster for s in run.speed})
    methods = list(METHODS) + sorted({s.method for s in run.speed} - set(METHODS))
    fig = Figure(figsize=(max(6.0, 2.6 * len(names) + 2), 4.4))
    ax = fig.subplots()
    if not names:
        ax.text(0.5, 0.5, "no speed measurements", transform=ax.transAxes, ha="center", color="grey")
        ax.set_axis_off()
    width = 0.8 / len(methods)
    labelled: set[str] = set()
    top = max([s.tokens_per_s for s in run.speed if math.isfinite(s.tokens_per_s)] + [1.0])
    for j, method in enumerate(methods):
        for i, name in enumerate(names):
            sp = speeds_of(run, name)
            row = sp.get(method)
            if row is None:
                continue
            x = i + (j - (len(methods) - 1) / 2) * width
            ax.bar(
                x,
                row.tokens_per_s,
                width * 0.92,
                color=METHOD_COLORS.get(method, "#bcbd22"),
                label=None if method in labelled else method,
            )
            labelled.add(method)
            label = f"{row.tokens_per_s:.1f}"
            vs_target = speed_ratio(row, sp.get("target-only"))
            if method != "target-only" and vs_target is not None:
                label += f"\n{vs_target:.2f}×"
            if method == "online draft" and speed_ratio(row, sp.get("static draft")) is not None:
                label += f"\n({speed_ratio(row, sp.get('static draft')):.2f}× static)"
            ax.text(x, row.tokens_per_s + top * 0.01, label, ha="center", va="bottom", fontsize=8)
    if names:
        ax.set_xticks(range(len(names)), [f"cluster {n}" for n in names])
        ax.set_ylim(0, top * 1.3)
        ax.set_ylabel("tokens/s (median over eval prompts)")
        ax.legend(fontsize=8, loc="upper left", ncol=len(methods))
        ax.grid(axis="y", alpha=0.3)
    ax.set_title(
        "Decoding speed: target-only vs static draft vs online draft (× = speedup over target-only)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def plot_auto(run: DemoRun, path: Path) -> None:
    """The default method over time, one panel per cluster: ``auto``'s share of steps on the
    draft model and the per-token α of those steps (rolling, pooled), its served tokens/s (right
    axis), promotions; the title gives its speed-up over target-only on the never-served prompts
    before the traffic and after it."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    names = [n for n in clusters_of(run) if any(r.steps is not None for r in served(run, n))] or ["(no auto requests)"]
    t_end = max([r.t for r in run.requests] + [p.t for p in run.promotions]) if run.requests else run.duration_s
    scale, unit = (60.0, "min") if t_end > 300 else (1.0, "s")
    fig = Figure(figsize=(11, 2.9 * len(names) + 1.0), layout="constrained")
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names):
        rows = [r for r in served(run, name) if r.steps is not None]
        ax2 = ax.twinx()
        if rows:
            t = [r.t / scale for r in rows]
            win = [rows[max(0, i - ROLLING + 1) : i + 1] for i in range(len(rows))]
            nan = lambda x: math.nan if x is None else x  # noqa: E731
            ax.plot(t, [nan(draft_share(w)) for w in win], color="#2ca02c", lw=1.8)
            ax.plot(t, [nan(draft_alpha(w)) for w in win], color="#d62728", lw=1.4, ls="--")
            ax2.plot(t, [nan(served_speed(w)) for w in win], color="#7f7f7f", lw=1.2, alpha=0.8)
        for p in (p for p in run.promotions if p.cluster == name and p.kind == "promote"):
            ax.axvline(p.t / scale, color="#2ca02c", ls=":", lw=1.0, zorder=0)
            ax.text(
                p.t / scale,
                1.03,
                version_label(p.version),
                color="#2ca02c",
                fontsize=8,
                rotation=90,
                ha="right",
                va="top",
            )
        before = {s.method: s for s in run.speed_before if s.cluster == name}
        after = speeds_of(run, name)
        ratio = lambda sp: speed_ratio(sp.get("auto"), sp.get("target-only"))  # noqa: E731
        b, a = ratio(before), ratio(after)
        note = (
            "auto vs target-only on never-served prompts: "
            + ("-" if b is None else f"{b:.2f}×")
            + " before the traffic → "
            + ("-" if a is None else f"{a:.2f}×")
            + " after"
        )
        ax.set_title(f"cluster {name}: {note}", loc="left", fontsize=10)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("share / α")
        ax2.set_ylabel("served tokens/s")
        ax2.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(f"time since the workload started ({unit})")
    handles = [
        Line2D(
            [], [], color="#2ca02c", lw=1.8, label=f"auto's steps on the draft model (share, last {ROLLING} requests)"
        ),
        Line2D([], [], color="#d62728", ls="--", lw=1.4, label="per-token α of those steps"),
        Line2D([], [], color="#7f7f7f", lw=1.2, label="served tokens/s (decode, right axis)"),
        Line2D([], [], color="#2ca02c", ls=":", label="promotion (version)"),
    ]
    fig.suptitle("The default method (auto) over time: how much it drafts with the learning draft", fontsize=12)
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.savefig(path, dpi=DPI)

"""The closed-loop demo's report: ``report/index.html``, ``summary.json``, PNG plots and ``run.json``.

``specops demo`` records what happened (one :class:`RequestRow` per request, the promotions and
rollbacks, the speed measurements, the registry versions) in a :class:`DemoRun` and calls
:func:`write_report`. ``python -m specops.report RUN_JSON OUT_DIR`` re-renders a saved run.

Two acceptance numbers, both pooled over a set of successful requests (never the mean of
per-request ratios):

- **α**, the OSD paper's per-token acceptance rate (§3; ``serving.engine.types.token_alpha``):
  ``Σ accepted / (Σ accepted + Σ rejected steps)``, a rejected step being a verification step
  that ended in a rejection. It estimates the probability that a draft token is accepted given
  that the ones before it in its step were. It needs each response's ``rejected_steps``
  (``speculation`` block); rows without it (an older server) give ``null``.
- **acceptance**: ``Σ accepted / Σ drafted``. Smaller than α for k > 1, as it also counts the
  tokens drafted after a rejection, which were never tried.

In ``summary.json`` each cluster gets

- ``alpha_first_100`` / ``alpha_last_100``: α over its first / last 100 successful requests by finish
  time. With fewer than 200 requests the two windows overlap (``alpha_window`` says how many
  requests each holds), so ``alpha_first_half`` / ``alpha_last_half`` (first ``n // 2`` requests,
  the rest) are given too; they never overlap.
- ``alpha_by_phase``: α over the cluster's requests in each workload phase.
- ``acceptance_first_100``, ``acceptance_last_100``, ``acceptance_first_half``,
  ``acceptance_last_half``, ``acceptance_by_phase``: accepted / drafted over the same requests.
- ``promotions`` (kind ``promote``), ``rollbacks``, ``draft_versions`` (served, in order of first use).
- ``speedup_vs_target`` / ``speedup_vs_static``: online-draft tokens/s over target-only / static-draft
  tokens/s; ``null`` when either side was not measured.

An α or acceptance with no tried (drafted) tokens is ``null``: ``summary.json`` and ``run.json`` are
strict JSON (no NaN).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WINDOW = 100  # requests in the first / last α window of summary.json
ROLLING = 20  # requests in the rolling α line of alpha.png
METHODS = ("target-only", "static draft", "online draft")
METHOD_COLORS = {"target-only": "#7f7f7f", "static draft": "#1f77b4", "online draft": "#2ca02c"}
PHASE_COLORS = ("#fde7c8", "#d9ecf7", "#e3f2d9", "#f3dff0", "#eeeeee", "#fff5b8")
DPI = 110


@dataclass(frozen=True)
class RequestRow:
    """One request replayed through the HTTP API."""

    t: float  # seconds since the workload started, when the request finished
    cluster: str  # the cluster that served it (router's or explicit)
    phase: str  # workload phase name, e.g. "code-heavy", "shift: prose-heavy"
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    draft_version: str  # registry version used ("base" = the bootstrap draft before any promotion)
    latency_s: float
    num_generated: int
    ok: bool = True  # False = the request failed (error response / exception)
    rejected_steps: int | None = None  # verification steps that ended in a rejection (None: not reported)
    domain: str = ""  # the workload's true domain of the prompt ("" when unknown)

    @property
    def alpha(self) -> float:
        """The OSD per-token α, accepted / (accepted + rejected steps); nan when nothing was
        tried or the rejected steps are unknown."""
        if self.rejected_steps is None or not self.accepted + self.rejected_steps:
            return math.nan
        return self.accepted / (self.accepted + self.rejected_steps)

    @property
    def acceptance(self) -> float:
        """accepted / drafted; nan when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else math.nan


@dataclass(frozen=True)
class Promotion:
    """A champion change of one cluster's draft."""

    t: float  # seconds since start
    cluster: str
    version: str
    kind: str = "promote"  # or "rollback"
    reason: str = ""


@dataclass(frozen=True)
class SpeedRow:
    """Decoding speed of one method on one cluster's eval prompts."""

    cluster: str
    method: str  # "target-only", "static draft", "online draft"
    draft_version: str  # "" for target-only, "base" for static, e.g. "7" for online
    tokens_per_s: float  # median over the eval prompts
    acceptance: float  # accepted / drafted over the eval prompts (nan for target-only)
    num_prompts: int
    identical: bool  # greedy outputs identical to target-only (losslessness check)
    alpha: float = math.nan  # OSD per-token α over the eval prompts (nan for target-only, or not measured)


@dataclass
class DemoRun:
    """Everything the demo recorded; ``run.json`` is this, as JSON."""

    started_at: str  # ISO time
    duration_s: float
    config: dict  # demo settings shown in the report
    requests: list[RequestRow]
    promotions: list[Promotion]
    speed: list[SpeedRow]
    registry_versions: list[dict]  # one dict per version; whatever keys exist are rendered
    mlflow_ui_url: str | None
    api_url: str | None
    notes: list[str] = field(default_factory=list)  # free-form lines shown at the top (e.g. warnings)


# ---------------------------------------------------------------------------------------------- numbers


ALPHA_DEFINITION = ("α = Σ accepted / (Σ accepted + Σ rejected steps), the OSD paper's per-token acceptance rate "
                    "(a rejected step: a verification step that ended in a rejection); acceptance = Σ accepted / "
                    "Σ drafted")


def token_alpha(rows: list[RequestRow]) -> float | None:
    """The OSD per-token α of ``rows``: Σ accepted / (Σ accepted + Σ rejected steps). None when
    they tried no draft token, or when a row has no ``rejected_steps`` (an older server)."""
    if any(r.rejected_steps is None for r in rows):
        return None
    tried = sum(r.accepted + r.rejected_steps for r in rows)
    return sum(r.accepted for r in rows) / tried if tried else None


def acceptance(rows: list[RequestRow]) -> float | None:
    """Σ accepted / Σ drafted of ``rows``; None when they drafted nothing."""
    drafted = sum(r.drafted for r in rows)
    return sum(r.accepted for r in rows) / drafted if drafted else None


def has_alpha(run: DemoRun) -> bool:
    """Every successful request reported its rejected steps (so α can be computed)."""
    ok = [r for r in run.requests if r.ok]
    return bool(ok) and all(r.rejected_steps is not None for r in ok)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def clusters_of(run: DemoRun) -> list[str]:
    """Cluster names seen anywhere in the run, sorted (a failed request with no cluster names none)."""
    names = {r.cluster for r in run.requests} | {p.cluster for p in run.promotions} | {s.cluster for s in run.speed}
    return sorted(n for n in names if n)


def served(run: DemoRun, cluster: str) -> list[RequestRow]:
    """The cluster's successful requests, by finish time."""
    return sorted((r for r in run.requests if r.ok and r.cluster == cluster), key=lambda r: r.t)


def phase_spans(run: DemoRun) -> list[tuple[str, float, float]]:
    """``(phase, start_s, end_s)`` of the workload, in order. Requests are ordered by start time
    (finish minus latency), so a request still in flight when the phase changes does not split it; each span
    runs to the start of the next."""
    rows = sorted(run.requests, key=lambda r: r.t - r.latency_s)
    spans: list[list[Any]] = []
    for r in rows:
        if not spans or spans[-1][0] != r.phase:
            spans.append([r.phase, 0.0 if not spans else max(0.0, r.t - r.latency_s), None])
    end = max([run.duration_s] + [r.t for r in rows]) if rows else run.duration_s
    for cur, nxt in zip(spans, spans[1:] + [[None, end, None]]):
        cur[2] = max(cur[1], nxt[1])
    return [(p, s, e) for p, s, e in spans]


def _speeds(run: DemoRun, cluster: str) -> dict[str, SpeedRow]:
    return {s.method: s for s in run.speed if s.cluster == cluster}  # the last row of a method wins


def _ratio(num: SpeedRow | None, den: SpeedRow | None) -> float | None:
    if num is None or den is None or not den.tokens_per_s or not math.isfinite(num.tokens_per_s / den.tokens_per_s):
        return None
    return num.tokens_per_s / den.tokens_per_s


def summarize(run: DemoRun) -> dict:
    """The content of ``summary.json`` (see the module docstring for what each number means)."""
    clusters = {}
    for name in clusters_of(run):
        rows = served(run, name)
        half = len(rows) // 2
        versions = list(dict.fromkeys(r.draft_version for r in rows if r.draft_version))
        kinds = Counter(p.kind for p in run.promotions if p.cluster == name)
        sp = _speeds(run, name)
        first, last = token_alpha(rows[:WINDOW]), token_alpha(rows[-WINDOW:])
        phases = list(dict.fromkeys(r.phase for r in rows))
        clusters[name] = {
            "requests": len(rows),
            "failed_requests": sum(1 for r in run.requests if r.cluster == name and not r.ok),
            "alpha_window": min(WINDOW, len(rows)),
            "alpha_first_100": _r(first),
            "alpha_last_100": _r(last),
            "alpha_delta": _r(last - first) if first is not None and last is not None else None,
            "alpha_first_half": _r(token_alpha(rows[:half])),
            "alpha_last_half": _r(token_alpha(rows[half:])),
            "alpha_by_phase": {p: _r(token_alpha([r for r in rows if r.phase == p])) for p in phases},
            "acceptance_first_100": _r(acceptance(rows[:WINDOW])),
            "acceptance_last_100": _r(acceptance(rows[-WINDOW:])),
            "acceptance_first_half": _r(acceptance(rows[:half])),
            "acceptance_last_half": _r(acceptance(rows[half:])),
            "acceptance_by_phase": {p: _r(acceptance([r for r in rows if r.phase == p])) for p in phases},
            "promotions": kinds["promote"],
            "rollbacks": kinds["rollback"],
            "draft_versions": versions,
            "speedup_vs_target": _r(_ratio(sp.get("online draft"), sp.get("target-only")), 3),
            "speedup_vs_static": _r(_ratio(sp.get("online draft"), sp.get("static draft")), 3),
        }
    return {
        "clusters": clusters,
        "alpha_definition": ALPHA_DEFINITION,
        "failed_requests": sum(1 for r in run.requests if not r.ok),
        "requests": len(run.requests),
        "duration_s": _r(run.duration_s, 2),
        "started_at": run.started_at,
    }


# ---------------------------------------------------------------------------------------------- JSON


def _strict(obj: Any) -> Any:
    """``obj`` with every non-finite float as None, so it dumps as strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def _dump(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(_strict(obj), indent=2, allow_nan=False, default=str) + "\n")


def _build(cls: type, d: dict) -> Any:
    """A dataclass from its dict: unknown keys ignored, None back to nan in float fields."""
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            kw[f.name] = math.nan if v is None and f.type == "float" else v
    return cls(**kw)


def load_run(path: Path) -> DemoRun:
    """Read a ``run.json`` written by :func:`write_report`."""
    d = json.loads(Path(path).read_text())
    d["requests"] = [_build(RequestRow, r) for r in d.get("requests", [])]
    d["promotions"] = [_build(Promotion, p) for p in d.get("promotions", [])]
    d["speed"] = [_build(SpeedRow, s) for s in d.get("speed", [])]
    return _build(DemoRun, d)


# ---------------------------------------------------------------------------------------------- plots


def _vlabel(version: str) -> str:
    return f"v{version}" if version.isdigit() else version


def plot_alpha(run: DemoRun, path: Path) -> None:
    """α over time, one panel per cluster: per-request dots, rolling α, promotions, phases."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names = clusters_of(run) or ["(no requests)"]
    spans = phase_spans(run)
    # α where the server reported rejected steps; accepted / drafted otherwise (an older server)
    alpha_of, row_alpha, what = ((token_alpha, lambda r: r.alpha, "α (per token, OSD)") if has_alpha(run)
                                 else (acceptance, lambda r: r.acceptance, "acceptance (accepted / drafted)"))
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
            ax.scatter([r.t / scale for r in rows], [row_alpha(r) for r in rows], s=9, alpha=0.35, color="#1f77b4",
                       lw=0)
            rolling = [alpha_of(rows[max(0, i - ROLLING + 1): i + 1]) for i in range(len(rows))]
            rolling = [math.nan if a is None else a for a in rolling]
            ax.plot([r.t / scale for r in rows], rolling, color="#d62728", lw=1.8)
        else:
            ax.text(0.5, 0.5, "no drafted tokens", transform=ax.transAxes, ha="center", color="grey")
        failed = [r.t / scale for r in run.requests if not r.ok and r.cluster == name]
        ax.scatter(failed, [0.02] * len(failed), marker="x", color="black", s=30, zorder=4)
        for p in (p for p in run.promotions if p.cluster == name):
            color = "#2ca02c" if p.kind == "promote" else "#9467bd"
            ax.axvline(p.t / scale, color=color, ls="--", lw=1.3, zorder=3)
            ax.text(p.t / scale, 1.03, _vlabel(p.version), color=color, fontsize=8, rotation=90,
                    ha="right", va="top", zorder=5)
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
    fig.suptitle("α over time (per token, OSD)" if alpha_of is token_alpha
                 else "Acceptance over time (accepted / drafted: the server reported no rejected steps)", fontsize=12)
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
            sp = _speeds(run, name)
            row = sp.get(method)
            if row is None:
                continue
            x = i + (j - (len(methods) - 1) / 2) * width
            ax.bar(x, row.tokens_per_s, width * 0.92, color=METHOD_COLORS.get(method, "#bcbd22"),
                   label=None if method in labelled else method)
            labelled.add(method)
            label = f"{row.tokens_per_s:.1f}"
            vs_target = _ratio(row, sp.get("target-only"))
            if method != "target-only" and vs_target is not None:
                label += f"\n{vs_target:.2f}×"
            if method == "online draft" and _ratio(row, sp.get("static draft")) is not None:
                label += f"\n({_ratio(row, sp.get('static draft')):.2f}× static)"
            ax.text(x, row.tokens_per_s + top * 0.01, label, ha="center", va="bottom", fontsize=8)
    if names:
        ax.set_xticks(range(len(names)), [f"cluster {n}" for n in names])
        ax.set_ylim(0, top * 1.3)
        ax.set_ylabel("tokens/s (median over eval prompts)")
        ax.legend(fontsize=8, loc="upper left", ncol=len(methods))
        ax.grid(axis="y", alpha=0.3)
    ax.set_title("Decoding speed: target-only vs static draft vs online draft (× = speedup over target-only)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


# ---------------------------------------------------------------------------------------------- HTML

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1150px;
color:#222;padding:0 1em}h1{margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.92em}th,td{border:1px solid #ddd;padding:.3em .6em;
text-align:left;vertical-align:top}th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.meta{color:#555}.note{background:#fff6d6;border-left:4px solid #e0b000;padding:.4em .8em;margin:.3em 0}
.up{color:#1a7f37}.down{color:#c62828}.bad{color:#c62828;font-weight:bold}tr.champion{background:#eef8ee}
img{max-width:100%;border:1px solid #eee}code{background:#f4f4f4;padding:0 .2em}
"""


@dataclass(frozen=True)
class _Raw:
    """A table cell whose HTML is already escaped."""

    html: str
    css: str = ""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _fmt(v: Any, nd: int = 3) -> str:
    """A value as escaped cell text: None / nan as an em dash, floats rounded, lists joined."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    if isinstance(v, (list, tuple)):
        return _e(", ".join(str(x) for x in v))
    if isinstance(v, dict):
        return _e(json.dumps(_strict(v), default=str))
    return _e(v)


def _num(v: float | None, spec: str = ".3f", suffix: str = "") -> Any:
    """A right-aligned number cell in the given format; an em dash when missing."""
    if v is None or not math.isfinite(v):
        return None
    return _Raw(_e(f"{v:{spec}}{suffix}"), "num")


def _table(header: list[str], rows: list[list[Any]], row_class: list[str] | None = None) -> str:
    """An HTML table; cells are values for :func:`_fmt` or :class:`_Raw`."""
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        cells = []
        for v in row:
            if isinstance(v, _Raw):
                cells.append(f'<td class="{v.css}">{v.html}</td>')
            else:
                num = isinstance(v, (int, float)) and not isinstance(v, bool)
                cells.append(f"<td{' class=num' if num else ''}>{_fmt(v)}</td>")
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table>" if rows else "<p class=meta>none</p>"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<a href="{_e(path.name)}"><img alt="{_e(alt)}" src="data:image/png;base64,{data}"></a>'


def render_html(run: DemoRun, summary: dict, out_dir: Path) -> str:
    """The report page; the PNGs in ``out_dir`` are inlined so the file stands alone."""
    s = summary
    links = "".join(
        f'<li>{label}: <a href="{_e(url)}">{_e(url)}</a></li>'
        for label, url in (("MLflow UI", run.mlflow_ui_url), ("API", run.api_url)) if url
    )
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>specops closed-loop demo</title>",
        f"<style>{CSS}</style></head><body><h1>specops closed-loop demo</h1>",
        (f"<p class=meta>started {_e(run.started_at)} · duration {run.duration_s:.1f} s · "
         f"{s['requests']} requests · <span class=\"{'bad' if s['failed_requests'] else ''}\">"
         f"{s['failed_requests']} failed</span></p>"),
    ]
    if links:
        parts.append(f"<ul>{links}</ul><p class=meta>These links only work while the demo is running.</p>")
    parts += [f"<div class=note>{_e(n)}</div>" for n in run.notes]

    rows = []
    for name, c in s["clusters"].items():
        d = c["alpha_delta"]
        delta = _Raw(f"{d:+.3f}", "num up" if d > 0 else "num down" if d < 0 else "num") if d is not None else None
        rows.append([name, c["requests"], c["alpha_first_100"], c["alpha_last_100"], delta, c["alpha_first_half"],
                     c["alpha_last_half"], c["acceptance_first_half"], c["acceptance_last_half"], c["alpha_by_phase"],
                     c["promotions"], c["rollbacks"], c["draft_versions"],
                     _num(c["speedup_vs_target"], ".2f", "×"), _num(c["speedup_vs_static"], ".2f", "×")])
    missing = "" if has_alpha(run) or not run.requests else (
        " <b>The server did not report rejected steps (<code>speculation.rejected_steps</code>), so α is not "
        "known here: read the acceptance columns.</b>")
    parts += [
        "<h2>Summary per cluster</h2>",
        _table(["cluster", "requests", f"α first {WINDOW}", f"α last {WINDOW}", "Δα", "α first half",
                "α last half", "acceptance first half", "acceptance last half", "α by phase", "promotions",
                "rollbacks", "draft versions served", "speedup vs target-only", "speedup vs static draft"], rows),
        (f"<p class=meta>α = Σ accepted / (Σ accepted + Σ rejected steps) over a cluster's first / last {WINDOW} "
         "successful requests (windows overlap when a cluster has fewer than 200): the OSD paper's per-token "
         "acceptance rate, a rejected step being a verification step that ended in a rejection. Acceptance = "
         "Σ accepted / Σ drafted over the same requests (smaller: it also counts the tokens drafted after a "
         "rejection, never tried). Speedups are online-draft tokens/s over target-only / static-draft tokens/s on "
         f"the eval prompts.{missing}</p>"),
        "<h2>Acceptance over time</h2>", _img(out_dir / "alpha.png", "α over time per cluster"),
        "<h2>Speed</h2>", _img(out_dir / "speedup.png", "tokens/s per method and cluster"),
    ]
    speed_rows = []
    for r in sorted(run.speed, key=lambda r: (r.cluster, METHODS.index(r.method) if r.method in METHODS else 9)):
        ratio = _ratio(r, _speeds(run, r.cluster).get("target-only"))
        ident = _Raw("yes") if r.identical else _Raw("NO", "bad")
        speed_rows.append([r.cluster, r.method, r.draft_version, _num(r.tokens_per_s, ".1f"), _num(ratio, ".2f", "×"),
                           _num(r.alpha), _num(r.acceptance), r.num_prompts, ident])
    parts.append(_table(["cluster", "method", "draft version", "tokens/s", "× target-only", "α", "acceptance",
                         "prompts", "identical to target-only (greedy)"], speed_rows))

    keys = list(dict.fromkeys(k for v in run.registry_versions for k in v))
    champion = ["champion" if "champion" in (v.get("aliases") or []) else "" for v in run.registry_versions]
    parts += ["<h2>Registry versions</h2>",
              _table(keys, [[v.get(k) for k in keys] for v in run.registry_versions], champion)]
    parts += ["<h2>Promotions and rollbacks</h2>",
              _table(["t (s)", "cluster", "kind", "version", "reason"],
                     [[_num(p.t, ".1f"), p.cluster, p.kind, _vlabel(p.version), p.reason]
                      for p in sorted(run.promotions, key=lambda p: p.t)])]
    parts += ["<h2>Workload phases</h2>",
              _table(["phase", "start (s)", "end (s)"], [[p, _num(a, ".1f"), _num(b, ".1f")] for p, a, b in phase_spans(run)])]
    parts += ["<h2>Config</h2>", _table(["setting", "value"], [[k, v] for k, v in run.config.items()]),
              "<p class=meta>Full data: <a href=run.json>run.json</a> · <a href=summary.json>summary.json</a></p>",
              "</body></html>"]
    return "\n".join(parts)


def write_report(run: DemoRun, out_dir: Path) -> Path:
    """Write ``run.json``, ``summary.json``, ``alpha.png``, ``speedup.png`` and ``index.html`` into
    ``out_dir``; return the path of ``index.html``. The JSON goes first, so a plotting failure loses no data."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _dump(dataclasses.asdict(run), out_dir / "run.json")
    summary = summarize(run)
    _dump(summary, out_dir / "summary.json")
    plot_alpha(run, out_dir / "alpha.png")
    plot_speedup(run, out_dir / "speedup.png")
    index = out_dir / "index.html"
    index.write_text(render_html(run, summary, out_dir), encoding="utf-8")
    logger.info("report written to %s (%d requests, %d failed)", index, summary["requests"],
                summary["failed_requests"])
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specops.report",
                                     description="Re-render the closed-loop demo report from a saved run.json.")
    parser.add_argument("run_json", type=Path, help="run.json written by `specops demo`")
    parser.add_argument("out_dir", type=Path, help="directory for index.html, summary.json and the PNGs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    index = write_report(load_run(args.run_json), args.out_dir)
    print(index)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

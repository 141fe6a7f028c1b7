"""The closed-loop demo's report: ``report/index.html``, ``summary.json``, PNG plots and ``run.json``.

``specops demo`` records what happened in a :class:`~specops.report_data.DemoRun` and calls
:func:`write_report`. ``python -m specops.report RUN_JSON OUT_DIR`` re-renders a saved run.

The record and the numbers of ``summary.json`` (α, acceptance, speedups: what each means) are in
:mod:`specops.report_data`; the plots in :mod:`specops.report_plots`; this module writes the
files and renders the HTML page.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.report_data import (
    WINDOW,
    DemoRun,
    dump_json,
    has_alpha,
    load_run,
    phase_spans,
    speed_ratio,
    speeds_of,
    strict_json,
    summarize,
    version_label,
)
from specops.report_plots import METHODS, plot_alpha, plot_speedup

logger = logging.getLogger(__name__)


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
        return _e(json.dumps(strict_json(v), default=str))
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
        for label, url in (("MLflow UI", run.mlflow_ui_url), ("API", run.api_url))
        if url
    )
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>specops closed-loop demo</title>",
        f"<style>{CSS}</style></head><body><h1>specops closed-loop demo</h1>",
        (
            f"<p class=meta>started {_e(run.started_at)} · duration {run.duration_s:.1f} s · "
            f'{s["requests"]} requests · <span class="{"bad" if s["failed_requests"] else ""}">'
            f"{s['failed_requests']} failed</span></p>"
        ),
    ]
    if links:
        parts.append(f"<ul>{links}</ul><p class=meta>These links only work while the demo is running.</p>")
    parts += [f"<div class=note>{_e(n)}</div>" for n in run.notes]

    rows = []
    for name, c in s["clusters"].items():
        d = c["alpha_delta"]
        delta = _Raw(f"{d:+.3f}", "num up" if d > 0 else "num down" if d < 0 else "num") if d is not None else None
        rows.append(
            [
                name,
                c["requests"],
                c["alpha_first_100"],
                c["alpha_last_100"],
                delta,
                c["alpha_first_half"],
                c["alpha_last_half"],
                c["acceptance_first_half"],
                c["acceptance_last_half"],
                c["alpha_by_phase"],
                c["promotions"],
                c["rollbacks"],
                c["draft_versions"],
                _num(c["speedup_vs_target"], ".2f", "×"),
                _num(c["speedup_vs_static"], ".2f", "×"),
            ]
        )
    missing = (
        ""
        if has_alpha(run) or not run.requests
        else (
            " <b>The server did not report rejected steps (<code>speculation.rejected_steps</code>), so α is not "
            "known here: read the acceptance columns.</b>"
        )
    )
    parts += [
        "<h2>Summary per cluster</h2>",
        _table(
            [
                "cluster",
                "requests",
                f"α first {WINDOW}",
                f"α last {WINDOW}",
                "Δα",
                "α first half",
                "α last half",
                "acceptance first half",
                "acceptance last half",
                "α by phase",
                "promotions",
                "rollbacks",
                "draft versions served",
                "speedup vs target-only",
                "speedup vs static draft",
            ],
            rows,
        ),
        (
            f"<p class=meta>α = Σ accepted / (Σ accepted + Σ rejected steps) over a cluster's first / last {WINDOW} "
            "successful requests (windows overlap when a cluster has fewer than 200): the OSD paper's per-token "
            "acceptance rate, a rejected step being a verification step that ended in a rejection. Acceptance = "
            "Σ accepted / Σ drafted over the same requests (smaller: it also counts the tokens drafted after a "
            "rejection, never tried). Speedups are online-draft tokens/s over target-only / static-draft tokens/s on "
            f"the eval prompts.{missing}</p>"
        ),
        "<h2>Acceptance over time</h2>",
        _img(out_dir / "alpha.png", "α over time per cluster"),
        "<h2>Speed</h2>",
        _img(out_dir / "speedup.png", "tokens/s per method and cluster"),
    ]
    speed_rows = []
    for r in sorted(run.speed, key=lambda r: (r.cluster, METHODS.index(r.method) if r.method in METHODS else 9)):
        ratio = speed_ratio(r, speeds_of(run, r.cluster).get("target-only"))
        ident = _Raw("yes") if r.identical else _Raw("NO", "bad")
        speed_rows.append(
            [
                r.cluster,
                r.method,
                r.draft_version,
                _num(r.tokens_per_s, ".1f"),
                _num(ratio, ".2f", "×"),
                _num(r.alpha),
                _num(r.acceptance),
                r.num_prompts,
                ident,
            ]
        )
    parts.append(
        _table(
            [
                "cluster",
                "method",
                "draft version",
                "tokens/s",
                "× target-only",
                "α",
                "acceptance",
                "prompts",
                "identical to target-only (greedy)",
            ],
            speed_rows,
        )
    )

    keys = list(dict.fromkeys(k for v in run.registry_versions for k in v))
    champion = ["champion" if "champion" in (v.get("aliases") or []) else "" for v in run.registry_versions]
    parts += [
        "<h2>Registry versions</h2>",
        _table(keys, [[v.get(k) for k in keys] for v in run.registry_versions], champion),
    ]
    parts += [
        "<h2>Promotions and rollbacks</h2>",
        _table(
            ["t (s)", "cluster", "kind", "version", "reason"],
            [
                [_num(p.t, ".1f"), p.cluster, p.kind, version_label(p.version), p.reason]
                for p in sorted(run.promotions, key=lambda p: p.t)
            ],
        ),
    ]
    parts += [
        "<h2>Workload phases</h2>",
        _table(
            ["phase", "start (s)", "end (s)"], [[p, _num(a, ".1f"), _num(b, ".1f")] for p, a, b in phase_spans(run)]
        ),
    ]
    parts += [
        "<h2>Config</h2>",
        _table(["setting", "value"], [[k, v] for k, v in run.config.items()]),
        "<p class=meta>Full data: <a href=run.json>run.json</a> · <a href=summary.json>summary.json</a></p>",
        "</body></html>",
    ]
    return "\n".join(parts)


def write_report(run: DemoRun, out_dir: Path) -> Path:
    """Write ``run.json``, ``summary.json``, ``alpha.png``, ``speedup.png`` and ``index.html`` into
    ``out_dir``; return the path of ``index.html``. The JSON goes first, so a plotting failure loses no data."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dump_json(dataclasses.asdict(run), out_dir / "run.json")
    summary = summarize(run)
    dump_json(summary, out_dir / "summary.json")
    plot_alpha(run, out_dir / "alpha.png")
    plot_speedup(run, out_dir / "speedup.png")
    index = out_dir / "index.html"
    index.write_text(render_html(run, summary, out_dir), encoding="utf-8")
    logger.info("report written to %s (%d requests, %d failed)", index, summary["requests"], summary["failed_requests"])
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specops.report", description="Re-render the closed-loop demo report from a saved run.json."
    )
    parser.add_argument("run_json", type=Path, help="run.json written by `specops demo`")
    parser.add_argument("out_dir", type=Path, help="directory for index.html, summary.json and the PNGs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    index = write_report(load_run(args.run_json), args.out_dir)
    print(index)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

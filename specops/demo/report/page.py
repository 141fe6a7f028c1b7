"""The closed-loop demo's report: ``report/index.html``, ``summary.json``, PNG plots and ``run.json``.

``specops demo`` records what happened in a :class:`~specops.demo.report.data.DemoRun` and calls
:func:`write_report`. ``python -m specops.demo.report.page RUN_JSON OUT_DIR`` re-renders a saved run.

The record and the numbers of ``summary.json`` (α, acceptance, speedups: what each means) are in
:mod:`specops.demo.report.data`; the plots in :mod:`specops.demo.report.plots`; this module writes the
files and renders the HTML page from ``specops/demo/templates/report.html.j2``.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from specops.demo.report.data import (
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
from specops.demo.report.plots import METHODS, plot_alpha, plot_auto, plot_speedup

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- HTML

# the page is specops/demo/templates/report.html.j2 (package data); autoescaping is on, so every value
# printed there (cluster names, notes, registry tags, URLs) is escaped, and nothing here writes HTML
_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("specops.demo", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)


@dataclass(frozen=True)
class Cell:
    """A table cell: plain text (the template escapes it) and its CSS class."""

    text: str
    css: str = ""


@dataclass(frozen=True)
class Row:
    cells: list[Cell]
    css: str = ""


@dataclass(frozen=True)
class Table:
    """A table for the template's ``table`` macro; no rows renders as "none"."""

    header: list[str]
    rows: list[Row]


@dataclass(frozen=True)
class Image:
    """A PNG inlined as a data URI, linked to its file beside ``index.html``."""

    name: str
    alt: str
    data: str  # base64


def _fmt(v: Any, nd: int = 3) -> str:
    """A value as cell text: None / nan as an em dash, floats rounded, lists joined."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v)
    if isinstance(v, dict):
        return json.dumps(strict_json(v), default=str)
    return str(v)


def _fmt_or(v: float | None, spec: str, suffix: str = "") -> str:
    """A number in ``spec`` (with ``suffix``), or an em dash when missing."""
    return "—" if v is None or not math.isfinite(v) else f"{v:{spec}}{suffix}"


def _cell(v: Any) -> Cell:
    """A :class:`Cell` as is; numbers right-aligned; anything else formatted by :func:`_fmt`."""
    if isinstance(v, Cell):
        return v
    num = isinstance(v, (int, float)) and not isinstance(v, bool)
    return Cell(_fmt(v), "num" if num else "")


def _num(v: float | None, spec: str = ".3f", suffix: str = "") -> Cell | None:
    """A right-aligned number cell in the given format; an em dash when missing."""
    if v is None or not math.isfinite(v):
        return None
    return Cell(f"{v:{spec}}{suffix}", "num")


def _table(header: list[str], rows: list[list[Any]], row_class: list[str] | None = None) -> Table:
    """A :class:`Table`; cells are values for :func:`_fmt` or :class:`Cell`."""
    return Table(
        [str(h) for h in header],
        [Row([_cell(v) for v in row], row_class[i] if row_class else "") for i, row in enumerate(rows)],
    )


def _img(path: Path, alt: str) -> Image:
    return Image(path.name, alt, base64.b64encode(path.read_bytes()).decode())


def render_html(run: DemoRun, summary: dict, out_dir: Path) -> str:
    """The report page; the PNGs in ``out_dir`` are inlined so the file stands alone."""
    s = summary
    links = [(label, url) for label, url in (("MLflow UI", run.mlflow_ui_url), ("API", run.api_url)) if url]

    rows = []
    for name, c in s["clusters"].items():
        d = c["alpha_delta"]
        delta = Cell(f"{d:+.3f}", "num up" if d > 0 else "num down" if d < 0 else "num") if d is not None else None
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
    clusters = _table(
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
    )

    speed_rows = []
    for r in sorted(run.speed, key=lambda r: (r.cluster, METHODS.index(r.method) if r.method in METHODS else 9)):
        ratio = speed_ratio(r, speeds_of(run, r.cluster).get("target-only"))
        ident = Cell("yes") if r.identical else Cell("NO", "bad")
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
    speed = _table(
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

    auto_rows = []
    for name, c in s["clusters"].items():
        if "auto_draft_share_first_half" not in c:
            continue
        arrow = lambda a, b, spec=".2f", suffix="": f"{_fmt_or(a, spec, suffix)} → {_fmt_or(b, spec, suffix)}"  # noqa: E731
        auto_rows.append(
            [
                name,
                arrow(c["auto_draft_share_first_half"], c["auto_draft_share_last_half"], ".0%"),
                arrow(c["auto_draft_alpha_first_half"], c["auto_draft_alpha_last_half"], ".3f"),
                arrow(c["auto_served_tokens_per_s_first_half"], c["auto_served_tokens_per_s_last_half"], ".1f"),
                arrow(c["auto_draft_share_before"], c["auto_draft_share_after"], ".0%"),
                arrow(c["auto_speedup_vs_target_before"], c["auto_speedup_vs_target"], ".2f", "×"),
            ]
        )
    auto = _table(
        [
            "cluster",
            "served: steps on the draft, first → last half",
            "served: draft α, first → last half",
            "served: tokens/s, first → last half",
            "never served: steps on the draft, before → after",
            "never served: auto vs target-only, before → after",
        ],
        auto_rows,
    )
    before_rows = [
        [
            r.cluster,
            r.method,
            r.draft_version,
            _num(r.tokens_per_s, ".1f"),
            _num(
                speed_ratio(r, {x.method: x for x in run.speed_before if x.cluster == r.cluster}.get("target-only")),
                ".2f",
                "×",
            ),
            _num(r.draft_share, ".0%"),
            _num(r.alpha),
            r.num_prompts,
            Cell("yes") if r.identical else Cell("NO", "bad"),
        ]
        for r in run.speed_before
    ]
    before = _table(
        [
            "cluster",
            "method",
            "draft version",
            "tokens/s",
            "× target-only",
            "auto: steps on the draft",
            "α",
            "prompts",
            "identical to target-only (greedy)",
        ],
        before_rows,
    )

    keys = list(dict.fromkeys(k for v in run.registry_versions for k in v))
    champion = ["champion" if "champion" in (v.get("aliases") or []) else "" for v in run.registry_versions]
    tables = {
        "clusters": clusters,
        "speed": speed,
        "auto": auto,
        "speed_before": before,
        "versions": _table(keys, [[v.get(k) for k in keys] for v in run.registry_versions], champion),
        "promotions": _table(
            ["t (s)", "cluster", "kind", "version", "reason"],
            [
                [_num(p.t, ".1f"), p.cluster, p.kind, version_label(p.version), p.reason]
                for p in sorted(run.promotions, key=lambda p: p.t)
            ],
        ),
        "phases": _table(
            ["phase", "start (s)", "end (s)"], [[p, _num(a, ".1f"), _num(b, ".1f")] for p, a, b in phase_spans(run)]
        ),
        "config": _table(["setting", "value"], [[k, v] for k, v in run.config.items()]),
    }
    return _ENV.get_template("report.html.j2").render(
        run=run,
        s=s,
        links=links,
        window=WINDOW,
        missing_alpha=bool(run.requests) and not has_alpha(run),
        tables=tables,
        images={
            "alpha": _img(out_dir / "alpha.png", "α over time per cluster"),
            "speedup": _img(out_dir / "speedup.png", "tokens/s per method and cluster"),
            "auto": _img(out_dir / "auto.png", "the default method over time per cluster"),
        },
    )


def write_report(run: DemoRun, out_dir: Path) -> Path:
    """Write ``run.json``, ``summary.json``, ``alpha.png``, ``speedup.png``, ``auto.png`` and ``index.html`` into
    ``out_dir``; return the path of ``index.html``. The JSON goes first, so a plotting failure loses no data."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dump_json(dataclasses.asdict(run), out_dir / "run.json")
    summary = summarize(run)
    dump_json(summary, out_dir / "summary.json")
    plot_alpha(run, out_dir / "alpha.png")
    plot_speedup(run, out_dir / "speedup.png")
    plot_auto(run, out_dir / "auto.png")
    index = out_dir / "index.html"
    index.write_text(render_html(run, summary, out_dir), encoding="utf-8")
    logger.info("report written to %s (%d requests, %d failed)", index, summary["requests"], summary["failed_requests"])
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specops.demo.report.page",
        description="Re-render the closed-loop demo report from a saved run.json.",
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

"""The end of a benchmark run: the JSON, the printed markdown table, the doc section between a
script's markers and its PNG plot."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_doc_section(path: Path, begin: str, end: str, section: str) -> None:
    """Replace the text between the ``begin``/``end`` markers of ``path`` with ``section``
    (which includes the markers); append it when the markers are absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else "# Benchmarks\n\nEach section is written by the script it names.\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        _, tail = rest.split(end, 1)
        new = head + section + tail
    else:
        new = old.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(new)


def write_json(report: dict, path: Path) -> None:
    """``report`` as indented JSON at ``path`` (its folder made; what JSON cannot hold as ``str``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))


def finish_report(report: dict, args, *, summary, markdown, plot, png_name: str, begin: str, end: str) -> str:
    """The end of a benchmark run (or of a ``--replot``): ``report["summary"] = summary(report)``,
    the plot (``args.plot``, else ``img/<png_name>`` beside ``args.doc``, else beside
    ``args.json``; ``plot(report, path)`` returns whether it drew one), the markdown table
    (``markdown(report, plot_path_relative_to_the_doc)``) printed, the JSON written to
    ``args.json`` and the doc section between ``begin`` and ``end`` of ``args.doc``. Returns the table."""
    report["summary"] = summary(report)
    plot_path = args.plot or (
        (args.doc.parent / "img" / png_name) if args.doc else args.json.with_suffix(".png") if args.json else None
    )
    plot_rel = None
    if plot_path is not None and plot(report, plot_path):
        plot_rel = os.path.relpath(plot_path, args.doc.parent) if args.doc else str(plot_path)
    text = markdown(report, plot_rel)
    print(text)
    if args.json:
        write_json(report, args.json)
    if args.doc:
        write_doc_section(args.doc, begin, end, text)
    return text


def save_png(fig, path: Path) -> bool:
    """Lay out ``fig``, write it to ``path`` (its folder made) and close it; True (a plot was drawn)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    """``x`` formatted with ``spec`` and ``suffix``; an en dash for None."""
    return "–" if x is None else f"{x:{spec}}{suffix}"

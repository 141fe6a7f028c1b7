"""Helpers shared by the benchmark scripts: the environment record and the doc writer."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The CPU's model name (benchmarks say which CPU their numbers come from)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """Versions, machine and git state, recorded next to every benchmark's numbers."""
    import torch
    import transformers

    def git(*args: str) -> str | None:
        try:
            return (
                subprocess.run(
                    ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
                ).stdout.strip()
                or None
            )
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "load_avg_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


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


def finish_report(report: dict, args, *, summary, markdown, plot, png_name: str, begin: str, end: str) -> str:
    """The end of a benchmark run (or of a ``--replot``): ``report["summary"] = summary(report)``,
    the plot (``args.plot``, else ``img/<png_name>`` beside ``args.doc``, else beside
    ``args.json``; ``plot(report, path)`` returns whether it drew one), the markdown table
    (``markdown(report, plot_path_relative_to_the_doc)``) printed, the JSON written to
    ``args.json`` and the doc section between ``begin`` and ``end`` of ``args.doc``. Returns the table."""
    import json

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
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
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
    return "–" if x is None else f"{x:{spec}}{suffix}"


def target_name(model_dir: Path) -> str:
    """The target's name in a bootstrap directory's manifest ("toy target" for older ones)."""
    try:
        from specops.trainer.bootstrap import load_manifest

        m = load_manifest(model_dir)
        return m.get("target", {}).get("name") or f"{m.get('kind', 'toy')} target"
    except (OSError, ValueError):
        return "unknown"

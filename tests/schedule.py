"""Longest files first: the order ``make test`` hands test files to its two xdist workers.

``make test`` runs ``pytest -n 2 --dist loadfile``: each file goes whole to one worker, so
module fixtures (a vLLM server, an MLflow server) start once. By default xdist hands out files
with the most tests first, which puts the heaviest files last: a file with one 75-second
end-to-end test (the fault soak, the bootstrap, the demo) ends the run with the other worker
idle. Measured on 2 cores, such a tail cost minutes.

Here files are ordered by how long they took (``tests/durations.json``, seconds per file,
setup and teardown included), longest first, the longest-processing-time rule; files it does
not list keep their collection order after the listed ones, and tests keep their order within
a file. ``make test`` passes ``--no-loadscope-reorder`` so xdist keeps this order.

``SPECOPS_DURATIONS_OUT=tests/durations.json make test`` rewrites the file from the run
(files that took at least :data:`MIN_LISTED_S`), measured on the controller from every
worker's reports.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
MIN_LISTED_S = 2.0
"""Files faster than this are left out of the durations file: their order hardly matters."""


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds per test file (path relative to the repository, ``/``-separated); {} without the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.get("seconds_per_file", {}).items()}


def longest_files_first(items: list, durations: dict[str, float]) -> list:
    """``items`` reordered: whole files, the longest first (stable: unlisted files keep their order)."""
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(_file_of(item.nodeid), len(order))

    def key(item) -> tuple[float, int]:
        file = _file_of(item.nodeid)
        return (-durations.get(file, 0.0), order[file])

    return sorted(items, key=key)  # sorted() is stable: tests keep their order within a file


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class DurationRecorder:
    """Sums each report's duration per file on the controller; writes the file at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seconds: dict[str, float] = defaultdict(float)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[_file_of(report.nodeid)] += report.duration

    @pytest.hookimpl
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        listed = {f: round(s, 1) for f, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]) if s >= MIN_LISTED_S}
        doc = {
            "about": "seconds per test file in one `make test` run (setup+call+teardown); tests/schedule.py "
            "hands the longest to the xdist workers first. Rewrite: SPECOPS_DURATIONS_OUT=tests/durations.json make test",
            "seconds_per_file": listed,
        }
        self.out.write_text(json.dumps(doc, indent=1) + "\n")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    items[:] = longest_files_first(items, load_durations())


def pytest_configure(config) -> None:
    out = os.environ.get("SPECOPS_DURATIONS_OUT")
    if out and not hasattr(config, "workerinput"):  # the controller (or a run without xdist) sees every report
        config.pluginmanager.register(DurationRecorder(Path(out)), "specops-duration-recorder")

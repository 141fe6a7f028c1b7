"""One style, checked here so `make test` (and CI) fails on a drift: `ruff format` and `ruff check`
with the settings in pyproject.toml, `# fmt: skip` kept for the rare table that reads better by
hand, and no source file over 600 lines, benchmarks/ included (split a file by role before it becomes a
junk drawer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")
SOURCE = ("serving", "trainer", "registry", "streams", "core", "specops", "benchmarks")
"""Top-level folders held to the line limit: the package's, and the benchmarks (issue 59)."""
MAX_LINES = 600
MAX_FMT_SKIPS = 50


def _python_files() -> list[Path]:
    tracked = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / f for f in tracked if (ROOT / f).is_file()]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_format_has_nothing_to_change():
    done = _ruff("format", "--check", "--diff", ".")
    assert done.returncode == 0, "run `.venv/bin/ruff format .`:\n" + (done.stdout + done.stderr)[-4000:]


def test_ruff_check_is_clean():
    done = _ruff("check", "--output-format", "concise", ".")
    assert done.returncode == 0, "run `.venv/bin/ruff check --fix .`:\n" + (done.stdout + done.stderr)[-4000:]


def test_fmt_skip_is_the_exception():
    skips = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _python_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: skip" in line
    ]
    assert len(skips) < MAX_FMT_SKIPS, skips


def test_no_source_file_is_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _python_files()
        if p.relative_to(ROOT).parts[0] in SOURCE
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by role: {long}"

"""tests/schedule.py: ``make test`` hands the longest files to its workers first, and can re-measure them."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

from tests.schedule import DURATIONS, load_durations, longest_files_first


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_longest_files_go_first_whole_and_the_rest_keep_their_order():
    items = _items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "d.py::t1", "b.py::t2")
    out = [i.nodeid for i in longest_files_first(items, {"c.py": 80.0, "b.py": 5.0})]
    assert out == ["c.py::t1", "b.py::t1", "b.py::t2", "a.py::t1", "a.py::t2", "d.py::t1"]


def test_the_committed_durations_name_test_files_that_exist():
    durations = load_durations()
    assert durations, f"{DURATIONS} lists no file"
    root = DURATIONS.parent.parent
    missing = [f for f in durations if not (root / f).is_file()]
    assert not missing, f"{DURATIONS.name} names files that are gone (rewrite it: see tests/schedule.py): {missing}"


def test_a_run_writes_seconds_per_file(tmp_path):
    (tmp_path / "test_slow.py").write_text("import time\ndef test_a():\n    time.sleep(0.3)\n")
    (tmp_path / "test_quick.py").write_text("def test_b():\n    pass\n")
    out = tmp_path / "durations.json"
    env = {"SPECOPS_DURATIONS_OUT": str(out), "PATH": "/usr/bin:/bin"}
    code = "import sys, pytest, tests.schedule as s; s.MIN_LISTED_S = 0.2; sys.exit(pytest.main(sys.argv[1:], plugins=[s]))"
    args = [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    run = subprocess.run(args, env=env, cwd=DURATIONS.parent.parent, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    seconds = json.loads(out.read_text())["seconds_per_file"]
    assert list(seconds) == ["test_slow.py"] and seconds["test_slow.py"] >= 0.3

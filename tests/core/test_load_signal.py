"""The load-signal file: what serving writes is what the trainer's scheduler reads."""

from __future__ import annotations

import json
import math

from specops.core.load_signal import read_load_file, write_load_signal


def test_written_signals_read_back_until_stale(tmp_path):
    path = tmp_path / "load.json"
    assert read_load_file(path, 30)[0] is None  # missing
    path.write_text("{not json")
    load, why = read_load_file(path, 30)
    assert load is None and "unreadable" in why
    write_load_signal(path, 0.5, now=1000.0)
    assert json.loads(path.read_text()) == {"load": 0.5, "time": 1000.0}
    assert read_load_file(path, 30, now=1020.0) == (0.5, "ok")
    load, why = read_load_file(path, 30, now=1031.0)
    assert load is None and "stale" in why
    path.write_text(json.dumps({"load": math.inf, "time": 1000.0}).replace("Infinity", "1e999"))
    assert read_load_file(path, 30, now=1000.0)[0] is None
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write leaves no temporary behind


def test_the_module_is_a_leaf():
    """Serving and the trainer both import it; it imports nothing of ours."""
    import ast
    from pathlib import Path

    import specops.core.load_signal as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    imported = {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"serving", "trainer", "registry", "streams", "specops"}

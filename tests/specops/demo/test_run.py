"""`specops demo` end to end on the tiny models: the stack starts, chat traffic (the default
workload) flows through the API, and the report and summary are written (a smoke test; the
loop's learning is asserted in tests/test_closed_loop.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.registry.mlflow_server import free_port

pytestmark = pytest.mark.slow  # the demo end to end


def test_demo_runs_end_to_end_and_writes_the_report(tiny_models, tmp_path):
    report = tmp_path / "report"
    env = {**os.environ, "SPECOPS_DATA_DIR": str(tmp_path / "data")}
    cmd = [
        sys.executable,
        "-m",
        "specops.cli.main",
        "--threads",
        "1",
        "demo",
        "--model-dir",
        str(tiny_models),
        "--quick",
        "--requests",
        "12",  # still both phases (the shift comes half-way): a smoke test; the learning is test_closed_loop's
        "--max-tokens",
        "8",
        "--report",
        str(report),
        "--ui-port",
        str(free_port()),
        "--no-linger",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["requests"] == 12 and summary["failed_requests"] == 0, summary
    assert set(summary["clusters"]) <= {"sql", "math", "api"} and summary["clusters"], summary
    # no method named: auto decoded every request (it may never have picked the tiny draft)
    assert all(c["draft_versions"][:1] in ([], ["base"]) for c in summary["clusters"].values())
    assert all("auto_draft_share_first_half" in c for c in summary["clusters"].values()), summary
    assert "rejected steps" in summary["alpha_definition"]
    run = json.loads((report / "run.json").read_text())
    assert run["config"]["workload"].startswith("chat") and "api-heavy" in run["config"]["phases"]
    assert {r["domain"] for r in run["requests"]} <= {"sql", "math", "api"}
    # the router was fitted on other prompts of each domain, rendered as served: it routes them home
    routed = sum(r["cluster"] == r["domain"] for r in run["requests"])
    assert routed >= 0.9 * len(run["requests"]), [(r["domain"], r["cluster"]) for r in run["requests"]]
    assert {r["method"] for r in run["requests"]} == {"auto"} and run["config"]["speculation"].startswith("none")
    assert run["speed"] and all(row["identical"] for row in run["speed"]), run["speed"]
    # auto's speed before the traffic, beside target-only, and after it with the champion
    assert {row["method"] for row in run["speed_before"]} == {"target-only", "auto"}
    assert all(row["identical"] for row in run["speed_before"]) and "auto" in {r["method"] for r in run["speed"]}
    assert (report / "auto.png").stat().st_size > 10_000 and "The default method over time" in (
        report / "index.html"
    ).read_text()
    assert {row["cluster"] for row in run["speed"]} <= {"sql", "math", "api"}
    page = (report / "index.html").read_text()
    assert "specops closed-loop demo" in page and (report / "alpha.png").stat().st_size > 10_000
    assert "Report:" in out and "MLflow UI:" in out
    assert (tmp_path / "data" / "demo" / "registry" / "mlflow.db").is_file()

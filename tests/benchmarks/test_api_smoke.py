"""The HTTP API benchmark runs end to end on a tiny bootstrap: every arm decodes, every
output is the target's, the JSON and the doc section are written (speed is never asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import api as bench

pytestmark = pytest.mark.slow  # benchmark scripts end to end


def test_api_benchmark_writes_json_and_doc(tiny_models, tmp_path):
    out, doc = tmp_path / "api.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nother sections stay\n")
    argv = [
        "--model-dir",
        str(tiny_models),
        "--prompts",
        "2",
        "--rounds",
        "2",
        "--concurrency",
        "2",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    arms = {a["arm"]: a for a in report["arms"]}
    assert set(arms) == {
        "engine target",
        "engine draft",
        "api draft c=1",
        "api target c=2",
        "api draft c=2, batching off",
        "api draft c=2, batching on",
    }
    assert all(a["identical_to_target"] for a in arms.values()) and report["summary"]["all_identical"] is True
    assert all(a["throughput_tok_s"] > 0 for a in arms.values())
    assert arms["engine target"]["vs_engine_target"] == 1.0
    text = doc.read_text()
    assert "other sections stay" in text and bench.DOC_BEGIN in text and "| api draft c=1 |" in text

"""The streams benchmark runs end to end on a tiny bootstrap, both backends included
(speed is never asserted)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import streams as bench

pytestmark = pytest.mark.slow  # benchmark scripts end to end


def test_streams_benchmark_writes_summary_json_and_doc(tiny_models, tmp_path):
    out, doc = tmp_path / "streams.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nother sections stay\n")
    argv = [
        "--model-dir",
        str(tiny_models),
        "--quick",
        "--prompts",
        "1",
        "--max-new-tokens",
        "8",
        "--records",
        "40",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    for key in (
        "logging_overhead",
        "logging_overhead_kafka",
        "kafka_produce_rps",
        "local_produce_rps",
        "bytes_per_miss_record",
    ):
        assert isinstance(s[key], float) and math.isfinite(s[key]), (key, s[key])
    assert s["kafka_produce_rps"] > 0 and s["local_produce_rps"] > 0 and s["bytes_per_miss_record"] > 0
    assert s["identical_outputs"] is True
    for arm in ("local", "kafka"):
        assert report["overhead"]["arms"][arm]["published"] > 0
        assert report["overhead"]["arms"][arm]["dropped"] == 0
    for name, r in report["throughput"].items():
        assert r["consumed"] >= r["records"], name
    text = doc.read_text()
    assert "other sections stay" in text and bench.DOC_BEGIN in text and "| kafka |" in text

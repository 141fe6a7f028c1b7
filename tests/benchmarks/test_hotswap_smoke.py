"""The hot-swap benchmark runs end to end on a tiny bootstrap: two promotions under load,
nothing fails, every output is the target's (speed is never asserted)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import hotswap as bench

pytestmark = pytest.mark.slow  # benchmark scripts end to end

SUMMARY_FLOATS = (
    "swap_latency_s",
    "slot_swap_latency_s",
    "event_latency_s",
    "fetch_validate_s",
    "p50_steady_s",
    "p99_steady_s",
    "p50_swap_s",
    "p99_swap_s",
    "p50_swap_over_steady",
    "p99_swap_over_steady",
)


def test_hotswap_benchmark_writes_summary_json_and_doc(tiny_models, tmp_path):
    out, doc = tmp_path / "hotswap.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nother sections stay\n")
    argv = [
        "--model-dir",
        str(tiny_models),
        "--quick",
        "--swaps",
        "2",
        "--concurrency",
        "2",
        "--prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--steady-s",
        "1",
        "--tail-s",
        "0.5",
        # one torch thread (the default is 2): the tiny models gain nothing from a second, and beside a
        # second xdist worker on a 2-core machine two threads spin at every barrier
        "--threads",
        "1",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    before = torch.get_num_threads()
    try:
        assert bench.main(argv) == 0
    finally:  # the benchmark sets the count for its process: give the tests after it theirs back
        torch.set_num_threads(before)
    report = json.loads(out.read_text())
    s = report["summary"]
    for key in SUMMARY_FLOATS:
        assert isinstance(s[key], float) and math.isfinite(s[key]), (key, s[key])
    assert s["swap_latency_s"] > 0 and s["p99_steady_s"] > 0 and s["p99_swap_s"] > 0
    assert s["failed_requests"] == 0 and s["identical_outputs"] is True
    assert s["swaps"] == 2 and s["requests_swap"] > 0 and s["requests_steady"] > 0
    assert s["slot_swap_latency_s"] <= s["swap_latency_s"]
    versions = report["config"]["versions"]
    assert [(w["from"], w["to"]) for w in report["per_swap"]] == [
        (versions["A"], versions["B"]),
        (versions["B"], versions["A"]),
    ]
    assert set(s["versions_served"]) >= {versions["A"], versions["B"]}
    text = doc.read_text()
    assert "other sections stay" in text and bench.DOC_BEGIN in text and bench.DOC_END in text
    assert "## Hot-swap" in text and "| steady |" in text

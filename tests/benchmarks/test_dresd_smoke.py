"""The DReSD benchmark runs end to end on a tiny bootstrap (speed is never asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import dresd

pytestmark = pytest.mark.slow  # benchmark scripts end to end

SUMMARY_KEYS = (
    "mar_ratio_vs_rest",
    "accepted_length_ratio_vs_rest",
    "tokens_per_s_ratio_vs_rest",
    "live_vs_ood_mar_ratio",
    "greedy_identical",
    "bytes_per_entry",
    "search_p50_ms",
)


def test_dresd_benchmark_writes_summary_json_and_doc(tiny_models, tmp_path):
    out, doc = tmp_path / "dresd.json", tmp_path / "benchmarks.md"
    assert (
        dresd.main(
            [
                "--model-dir",
                str(tiny_models),
                "--quick",
                "--prompts",
                "1",
                "--max-new-tokens",
                "6",
                "--id-prompts",
                "4",
                "--id-new-tokens",
                "8",
                "--scale",
                "3000",
                "--json",
                str(out),
                "--doc",
                str(doc),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    s = report["summary"]
    for key in SUMMARY_KEYS:
        assert key in s, key
    assert s["greedy_identical"] is True  # every arm equals target-only greedy decoding
    assert s["bytes_per_entry"] > 0 and s["search_p50_ms"] > 0
    assert {"target", "pld", "draft", "rest-id 10x6", "dresd-id 10x6", "dresd-ood 10x6"} <= set(report["results"])
    assert set(report["pca_sweep"]) == {"32", "64", "128"} or set(report["pca_sweep"]) == {32, 64, 128}
    assert any(a.endswith("(rebuild's)") for a in report["results"])  # serving's default: the measured shape
    assert report["first_step"] and s["first_step_passes_saved_at_most"] >= 0
    assert dresd.DOC_BEGIN in doc.read_text() and "First step" in doc.read_text()

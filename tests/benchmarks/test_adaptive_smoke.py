"""The adaptive (``auto``) benchmark runs end to end on a tiny bootstrap (speed is never asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import adaptive
from tests.benchmarks.test_llma_smoke import TEXT

pytestmark = pytest.mark.slow  # benchmark scripts end to end


def test_adaptive_benchmark_writes_summary_json_plot_and_doc(tiny_models, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"tool{i}.txt").write_text(TEXT.format(n=i) * 4)
    out, doc = tmp_path / "adaptive.json", tmp_path / "benchmarks.md"
    argv = [
        "--model-dir",
        str(tiny_models),
        "--quick",
        "--source",
        str(src),
        "--cache-dir",
        str(tmp_path / "c"),
        "--cases",
        "1",
        "--max-new-tokens",
        "8",
        "--prompt-tokens",
        "24",
        "--threads",
        "1",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert adaptive.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert set(adaptive.SUMMARY_KEYS) <= set(s)
    assert s["greedy_identical"] is True
    assert {"1", "4"} <= set(report["results"])
    slices = {c["slice"] for c in report["cases"]}
    assert {"code", "prose", "repetition", "creative"} <= slices
    for conc in ("1", "4"):
        assert "auto" in report["results"][conc]["all"]["speedup"]
    text = doc.read_text()
    assert adaptive.DOC_BEGIN in text and "auto_vs_oracle" in text
    assert adaptive.main(["--replot", str(out), "--json", str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["summary"] == s

"""The adaptive (``auto``) benchmark runs end to end on a tiny bootstrap, at three concurrencies
(speed is never asserted)."""

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
        "--concurrency",
        "1,2,3",
        "--groups",
        "2",
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
        "--ablate-shadows",
        "--ablate-estimator",
        "geometric",
        "--ablate-chain",
    ]
    assert adaptive.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert set(adaptive.SUMMARY_KEYS) <= set(s)
    assert s["greedy_identical"] is True
    assert set(report["results"]) == {"1", "2", "3"} == set(s["by_concurrency"]) == set(s["best_fixed"])
    assert s["concurrency"] == [1, 2, 3] and s["cpu_model"]
    for key in adaptive.BARS:  # the top level is the worst concurrency
        assert s[key] == min(v[key] for v in s["by_concurrency"].values())
    slices = {c["slice"] for c in report["cases"]}
    assert {"code", "prose", "repetition", "creative"} <= slices
    for conc, groups in report["groups"].items():
        c = int(conc)
        per_slice: dict[str, int] = {}
        for g in groups:  # a group: at most c requests, all of one slice
            assert 1 <= len(g) <= c and len({report["cases"][i]["slice"] for i in g}) == 1
            sl = report["cases"][g[0]]["slice"]
            per_slice[sl] = per_slice.get(sl, 0) + len(g)
        # concurrency 1 runs --cases per slice; c > 1 runs --groups x c (fewer where a slice runs short)
        assert max(per_slice.values()) == (1 if c == 1 else 2 * c), (conc, per_slice)
        for arm in report["arms"]:
            assert sum(len(g) for g in groups) == len(report["per_case"][conc][arm])
        assert "auto" in report["results"][conc]["all"]["speedup"]
        # the ablation runs as its own arm, never counted as a fixed method
        assert adaptive.NO_SHADOWS in report["arms"] and report["results"][conc]["all"]["best_fixed"] != "auto_noshadow"
        assert s["by_concurrency"][conc]["shadow_gain"] > 0
        assert "auto_geometric" in report["arms"] and report["results"][conc]["all"]["best_fixed"] != "auto_geometric"
        assert s["by_concurrency"][conc]["auto_geometric_gain"] > 0
        assert "auto_chain" in report["arms"] and report["results"][conc]["all"]["best_fixed"] != "auto_chain"
        assert s["by_concurrency"][conc]["auto_chain_gain"] > 0
    assert s["auto_copy_shadows"] is True and "policy_end_auto_noshadow" in report
    assert "policy_end_auto_geometric" in report and report["rules"]["auto_realized_estimator"] == "mean"
    assert "policy_end_auto_chain" in report
    text = doc.read_text()
    assert adaptive.DOC_BEGIN in text and "auto_vs_oracle" in text and "| `auto_vs_oracle` |" in text
    assert (
        "**Concurrency 3**" in text
        and "`shadow_gain`" in text
        and "`auto_geometric_gain`" in text
        and "`auto_chain_gain`" in text
    )
    assert adaptive.main(["--replot", str(out), "--json", str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["summary"] == s

"""``benchmarks/dresd.py --curve`` runs end to end on a tiny bootstrap (speed is never asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import dresd

pytestmark = pytest.mark.slow  # benchmark scripts end to end


def test_dresd_curve_writes_the_summary_keys_the_plot_and_the_doc(tiny_models, tmp_path, monkeypatch):
    from benchmarks import dresd_curve

    monkeypatch.setattr(dresd_curve, "CACHE", tmp_path / "cache")
    out, doc = tmp_path / "dresd.json", tmp_path / "benchmarks.md"
    argv = ["--curve", "--model-dir", str(tiny_models), "--sizes", "1500", "3000", "--set-prompts", "4"]
    argv += ["--live-prompts", "1", "--max-new-tokens", "8", "--json", str(out), "--doc", str(doc)]
    assert dresd.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    for key in (
        "curve",
        "perturbed_al_ratio_vs_rest",
        "hybrid_al_vs_best",
        "hybrid_tokens_per_s_vs_target",
        "key_layer",
    ):
        assert key in s
    assert [p["entries"] for p in s["curve"]] == sorted(p["entries"] for p in s["curve"]) and len(s["curve"]) == 2
    for key in ("mar_dresd", "mar_rest", "al_dresd", "al_rest", "drafted_fraction_dresd", "drafted_fraction_rest"):
        assert key in s["curve"][0]
    assert s["greedy_identical"] is True
    cfg, tuning = report["config"], report["hybrid_tuning"]
    assert s["split"] == cfg["split"] == "test" and cfg["tuned_on"] == "dev"
    assert sum(cfg["split_prompts"]["dev"].values()) + sum(cfg["split_prompts"]["test"].values()) == sum(
        cfg["set_prompts"].values()
    )  # even- and odd-numbered halves of each set
    assert any(
        (g["dense_below"], g["exact_nodes"]) == (cfg["dense_below"], cfg["exact_nodes"])
        and g["priced_speedup"] == max(h["priced_speedup"] for h in tuning["grid"])
        for g in tuning["grid"]
    )
    assert all("priced_speedup" in a for arms in report["curve"][0]["sets"].values() for a in arms.values())
    assert s["key_layer"] in ("final", "middle", "concat")
    assert "dresd-curve" in doc.read_text() and (tmp_path / "img" / "dresd_curve.png").exists()

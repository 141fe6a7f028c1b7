"""The OSD benchmark runs end to end on a tiny bootstrap (α values are never asserted)."""

from __future__ import annotations

import json

from benchmarks import osd


def test_osd_benchmark_writes_json_plot_and_doc(tiny_models, tmp_path):
    out, doc, png = tmp_path / "osd.json", tmp_path / "benchmarks.md", tmp_path / "img" / "osd.png"
    argv = ["--model-dir", str(tiny_models), "--requests", "6", "--max-new-tokens", "6", "--prompt-tokens", "16",
            "--interval", "2", "--steps", "1", "--offline-epochs", "1", "--generic-steps", "3", "--json", str(out), "--plot", str(png),
            "--doc", str(doc)]  # fmt: skip
    assert osd.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["lossless"] is True
    for d in osd.DOMAINS:
        arms = report["single_domain"][d]
        assert set(arms) == {"static", "offline_10pct", "online_fkl", "offline_upper", "offline_same"}
        assert set(report["ablation"][d]) == {"online_rkl", "online_jsd"}
        assert arms["online_fkl"]["summary"]["draft_versions"] >= 1  # the trainer updated and serving swapped
        assert len(arms["static"]["curve"]) == report["config"]["requests"]
    assert set(report["shift"]) == {"static", "online_fkl", "boundaries", "domains", "recovery"}
    assert report["shift"]["boundaries"] == [3, 6] and len(report["shift"]["recovery"]) == 2
    assert report["config"]["base"] == "generic" and (tiny_models / "draft-generic" / "generic.json").is_file()
    s = report["summary"]
    for key in ("alpha_gain_vs_static", "gap_to_offline_bound", "gap_to_offline_same", "trainer_cpu_s_per_request"):
        assert isinstance(s[key], float), key
    assert s["trainer_cpu_s_per_request"] > 0 and "recovery_requests" in s
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert osd.DOC_BEGIN in doc.read_text() and "img/osd.png" in doc.read_text()

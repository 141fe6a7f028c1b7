"""The OSD benchmark runs end to end on a tiny bootstrap (α values are never asserted), and its
replay of a request is the engine's step rule."""

from __future__ import annotations

import json

import pytest

from benchmarks import osd


@pytest.mark.slow
def test_osd_benchmark_writes_json_plot_and_doc(tiny_models, tmp_path):
    out, doc, png = tmp_path / "osd.json", tmp_path / "benchmarks.md", tmp_path / "img" / "osd.png"
    argv = ["--model-dir", str(tiny_models), "--requests", "8", "--max-new-tokens", "6", "--prompt-tokens", "16",
            "--interval", "2", "--offline-epochs", "1", "--ablation-requests", "4", "--recurring", "4",
            "--audit-window", "2", "--check-every", "3", "--json", str(out), "--plot", str(png), "--doc", str(doc)]  # fmt: skip
    assert osd.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["distinct_prompts"] is True and report["summary"]["distinct_prompts"] is True
    for d in osd.DOMAINS:
        arms = report["single_domain"][d]
        assert {k for k, v in arms.items() if isinstance(v, dict)} == {"static", "offline_10pct", "online", "offline_upper"}
        assert set(report["ablation"][d]) == {"static", "fkl", "rkl", "jsd"}
        assert arms["online"]["gates"], "the trainer produced candidates and the gate judged them"
        assert len(arms["static"]["curve"]) == report["config"]["requests"]
    assert report["shift"]["boundaries"] == [4, 8] and len(report["shift"]["recovery"]) == 2
    assert set(report["recurring"]) == {"static", "online"}
    s = report["summary"]
    for key in ("alpha_gain_vs_static", "gap_to_offline_bound", "trainer_cpu_s_per_request"):
        assert isinstance(s[key], float), key
    assert s["trainer_cpu_s_per_request"] > 0 and "recovery_requests" in s and "requests_to_gain" in s
    checks = s["engine_checks"]
    assert checks["n"] >= 2 and checks["identical"] == checks["n"] and checks["alpha_equal"] == checks["n"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert osd.DOC_BEGIN in doc.read_text() and "img/osd.png" in doc.read_text()


@pytest.mark.parametrize("pred, output, k, max_new, want", [
    # all agree: steps of k accepted + 1 bonus; the last step drafts only what fits
    ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], 2, 6, (2 + 2 + 0, 4, 2, [])),
    # a disagreement at output index 1: 1 accepted, the rejected position is 1
    ([1, 9, 3, 4], [1, 2, 3, 4], 3, 4, (3 + 1, 1 + 1, 2, [(1, 9, 2)])),
    # ends at an EOS before max_new: accepted drafts past its end do not count
    ([7, 8, 5], [7, 8], 4, 10, (4, 2, 1, [])),
    # k larger than what is left: k_step = max_new - j - 1
    ([5, 5, 5], [5, 6, 5], 8, 3, (2 + 0, 1, 2, [(1, 5, 6)])),
])  # fmt: skip
def test_replay_follows_the_engine_step_rule(pred, output, k, max_new, want):
    out = osd.replay(pred, output, k, max_new)
    assert (out.drafted, out.accepted, out.steps, out.rejected) == want

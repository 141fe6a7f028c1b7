"""``benchmarks/osd.py --teacher-forward`` runs end to end on a tiny bootstrap (seconds): both recipes,
both arms, the summary keys the report promises, and the doc section (α values are not asserted:
the tiny models are random); ``--replot`` rebuilds them from the JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks import osd, osd_teacher


@pytest.mark.slow
def test_teacher_forward_mode_writes_json_and_doc(tiny_models, tmp_path):
    out, doc = tmp_path / "osd_teacher.json", tmp_path / "benchmarks.md"
    argv = [
        "--teacher-forward",
        "--model-dir",
        str(tiny_models),
        "--quick",
        "--requests",
        "8",
        "--probe",
        "3",
        "--router-texts",
        "1",
        "--max-new-tokens",
        "6",
        "--interval",
        "2",
        "--threads",
        "1",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert osd.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert {"teacher_forward_alpha_gap", "teacher_s_per_request", "alpha_token_static", "alpha_token", "gain"} <= set(s)
    assert s["domains"] == ["sql"] and 0.0 <= s["teacher_forward_alpha_gap"] <= 1.0
    assert s["teacher_s_per_request"]["batched"] > 0 and s["teacher_s_per_request"]["one_at_a_time"] > 0
    for recipe in osd_teacher.RECIPES:
        arms = report["domains"]["sql"]["recipes"][recipe]["arms"]
        assert set(arms) == set(osd_teacher.ARMS)
        assert all(a["records_trained"] > 0 for a in arms.values())
    tf_all = report["domains"]["sql"]["recipes"]["all"]["arms"]["teacher_forward"]
    assert tf_all["teacher_batches"] < tf_all["teacher_forwards"]  # batched: fewer forwards than requests
    text = doc.read_text()
    assert osd_teacher.DOC_BEGIN in text and "teacher_forward_alpha_gap" in text
    doc.write_text("# Benchmarks\n")  # --replot re-derives the table and the section from the JSON alone
    assert osd.main(["--replot", str(out), "--doc", str(doc)]) == 0
    assert doc.read_text().count(osd_teacher.DOC_BEGIN) == 1
    # another domain in a run of its own, merged into one report
    other, merged = tmp_path / "math.json", tmp_path / "merged.json"
    argv[argv.index("--json") + 1] = str(other)
    assert osd.main([*argv, "--tf-domains", "math", "--no-doc"]) == 0
    assert osd.main(["--merge", str(out), str(other), "--json", str(merged), "--doc", str(doc)]) == 0
    both = json.loads(merged.read_text())
    assert both["summary"]["domains"] == ["sql", "math"] and len(both["merged_from"]) == 2
    assert "| math | rejected |" in doc.read_text()

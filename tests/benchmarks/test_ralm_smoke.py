"""The RaLM benchmark runs end to end on a tiny bootstrap and tiny KBs (speed is never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import ralm, ralm_curve, ralm_report

pytestmark = pytest.mark.slow  # benchmark scripts end to end

SUMMARY_KEYS = {
    "curve",
    "min_fraction_of_bound",
    "min_model_fraction_of_bound",
    "speedup_at_max_r",
    "max_r_save",
    "min_speedup",
    "knnlm_fraction_of_bound",
    "knnlm_speedup",
    "knnlm_full_length",
    "knnlm_model_fraction_of_bound",
    "knnlm_ivfpq_min_speedup",
    "outputs_identical",
}
TEXT = (
    "The {n} tool reads a configuration file, checks every entry, and writes a report of what it found. "
    "It runs every night from cron and mails the report to the administrator of host {n}. "
)


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from a second torch thread, and on a shared 2-core machine the
    benchmark's verification thread beside two intra-op threads oversubscribes the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_parse_point():
    p = ralm_curve.parse_point("milvus-server/exact/100000x8")
    assert (p.backend, p.retriever, p.passages, p.clients, p.embedder) == ("milvus-server", "exact", 100000, 8, "hash")
    assert ralm_curve.parse_point("memory/bm25/300/minilm").embedder == "minilm"
    for bad in ("disk/exact/10", "memory/exact/ten", "memory/exact", "memory/exact/10/other"):
        with pytest.raises(SystemExit):
            ralm_curve.parse_point(bad)


def test_ralm_benchmark_writes_curve_json_plot_and_doc(tiny_models, tmp_path, one_thread):
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(12):
        (src / f"tool{i}.txt").write_text(TEXT.format(n=i) * 4)
    out, doc = tmp_path / "ralm.json", tmp_path / "benchmarks.md"
    argv = [
        "--model-dir",
        str(tiny_models),
        "--quick",
        "--source",
        str(src),
        "--cache-dir",
        str(tmp_path / "c"),
        "--points",
        "memory/exact/200,milvus-lite/exact/200,milvus-server/exact/200x2",
        "--questions",
        "2",
        "--max-new-tokens",
        "12",
        "--knnlm-sizes",
        "300,600",
        "--knnlm-k",
        "4",
        "--ablations",
        "--resume",
        str(tmp_path / "ck.json"),
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert ralm.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert set(s) == SUMMARY_KEYS
    assert s["outputs_identical"] == 1.0  # every RaLMSpec arm = RaLMSeq; speculative kNN-LM = baseline
    assert [(c["backend"], c["clients"]) for c in s["curve"]] == [
        ("memory", 1),
        ("milvus-lite", 1),
        ("milvus-server", 2),
    ]
    for c in s["curve"]:
        assert 0 <= c["r_save"] < 1 and 0 <= c["r_encode"] < 1 and c["bound"] >= 1 and c["speedup"] > 0
        assert c["bound"] == pytest.approx(1 / (1 - c["r_save"]), rel=1e-3)
    point = report["points"][0]
    assert set(point["arms"]) == set(ralm_curve.ARMS) | set(ralm_curve.ABLATIONS)
    assert point["headline"] == ralm_curve.AUTO and point["speedup"] == point["arms"][ralm_curve.AUTO]["speedup"]
    # --ablations runs at the in-memory exact points only (--ablate-at's default)
    assert report["args"]["ablate_at"] == "memory-exact"
    assert [("ablation_prefetch_256_vs_default" in c) for c in s["curve"]] == [True, False, False]
    assert s["curve"][0]["ablation_prefetch_256_vs_default"] > 0
    assert set(report["points"][1]["arms"]) == set(ralm_curve.ARMS)
    assert s["knnlm_full_length"] is True
    assert point["gamma"] is None or 0 <= point["gamma"] <= 1
    assert point["model_a_s"] > 0 and "model_fraction_of_bound" in point
    assert all(c["model_fraction_of_bound"] is None or 0 < c["model_fraction_of_bound"] <= 1 for c in s["curve"])
    assert set(report["knnlm"]["sizes"]) == {"300", "600"}
    for size in report["knnlm"]["sizes"].values():
        assert {v["searcher"] for v in size["runs"].values()} == {"exact", "ivfpq"}
        assert all(v["bound"] >= 1 for v in size["runs"].values())
    text = doc.read_text()
    assert ralm_report.DOC_BEGIN in text and "r_save" in text and "kNN-LM" in text and "img/ralm.png" in text
    assert (tmp_path / "img" / "ralm.png").stat().st_size > 1000
    assert "Ablations" in text and "prefetch 256" in text
    # --resume: a run cut off after two points and one wave of the third goes on from there (the
    # third: Milvus in its own process; Milvus Lite embedded does not reopen a file in one process)
    ck = json.loads((tmp_path / "ck.json").read_text())
    assert len(ck["points"]) == 3 and set(ck["knnlm"]) == {"300", "600"} and ck["partial"] is None
    second = ck["points"][2]
    ck["points"] = ck["points"][:2]
    ck["partial"] = {"index": 2, "kb": second["kb_fingerprint"], "rows": second["rows"][:1], "cpu": "x"}
    (tmp_path / "ck.json").write_text(json.dumps(ck))
    assert ralm.main(argv[:-4] + ["--json", str(tmp_path / "resumed.json")]) == 0
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["points"][0]["rows"] == report["points"][0]["rows"]  # kept, not rerun
    assert resumed["points"][2]["rows"][0] == second["rows"][0] and len(resumed["points"][2]["rows"]) == len(
        second["rows"]
    )
    assert len(resumed["sessions"]) == 2 and resumed["summary"]["outputs_identical"] == 1.0
    with pytest.raises(SystemExit, match="questions"):  # settings that shape the measurement must match
        ralm.main([*argv[:-4], "--questions", "3"])
    from benchmarks.ralm_resume import _extends

    a, b = "[Point(x=1), Point(x=2)]", "[Point(x=1), Point(x=2), Point(x=3)]"
    assert _extends(a, b) and _extends(a, a) and not _extends(b, a) and not _extends(a, "[Point(x=1)]")
    # --replot re-derives the same summary from the JSON alone
    assert ralm.main(["--replot", str(out), "--json", str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["summary"] == s


def test_knnlm_alone_has_its_own_doc_section(tiny_models, tmp_path, one_thread):
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(6):
        (src / f"tool{i}.txt").write_text(TEXT.format(n=i) * 4)
    out, doc = tmp_path / "knn.json", tmp_path / "benchmarks.md"
    doc.write_text(f"# x\n\n{ralm_report.DOC_BEGIN}\nthe curve's\n{ralm_report.DOC_END}\n")
    common = ["--model-dir", str(tiny_models), "--quick", "--source", str(src), "--cache-dir", str(tmp_path / "c")]
    argv = [*common, "--no-curve", "--knnlm-sizes", "300", "--knnlm-k", "4", "--max-new-tokens", "8"]
    assert ralm.main([*argv, "--json", str(out), "--doc", str(doc)]) == 0
    report = json.loads(out.read_text())
    assert report["points"] == [] and set(report["knnlm"]["sizes"]) == {"300"}
    assert report["knnlm"]["sizes"]["300"]["prompts"] == 2  # the questions the curve would ask
    s = report["summary"]
    assert s["min_fraction_of_bound"] is None and s["knnlm_full_length"] is True and s["outputs_identical"] == 1.0
    text = doc.read_text()
    assert "the curve's" in text and ralm_report.KNN_BEGIN in text and "img/ralm_knnlm.png" in text
    assert (tmp_path / "img" / "ralm_knnlm.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="nothing to run"):
        ralm.main([*argv, "--no-knnlm"])

"""The RaLM benchmark runs end to end on a tiny bootstrap and tiny KBs (speed is never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import ralm

pytestmark = pytest.mark.slow  # benchmark scripts end to end

SUMMARY_KEYS = (
    "speedup_edr",
    "speedup_adr",
    "speedup_sr",
    "retrieval_share_edr",
    "amdahl_fraction_min",
    "speedup_knnlm",
    "outputs_identical",
    "async_overlap_s",
)
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


def test_ralm_benchmark_writes_summary_json_plot_and_doc(tiny_models, tmp_path, one_thread):
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
        "--questions",
        "2",
        "--ablation-questions",
        "1",
        "--max-new-tokens",
        "12",
        "--scale-passages",
        "300",
        "--retrievers",
        "exact,hnsw,bm25",
        "--knnlm-k",
        "4",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert ralm.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert set(SUMMARY_KEYS) == set(s)
    assert s["outputs_identical"] == 1.0  # RaLMSpec = RaLMSeq and speculative kNN-LM = baseline, everywhere
    assert set(report["settings"]) == {"realistic", "scale"}
    scale = report["settings"]["scale"]
    assert scale["kb"]["embedder"] == "hash" and scale["kb"]["window_step"] >= 1 and scale["kb"]["passages"] > 12
    exact = scale["retrievers"]["exact"]
    assert set(ralm.ARMS) == set(exact["arms"])  # RaLMSeq, PSA and every ablation ran on the subset
    assert (
        exact["rows"][0]["arms"].keys() == ralm.ARMS.keys() and exact["rows"][1]["arms"].keys() == ralm.MAIN_ARMS.keys()
    )
    assert 0 <= exact["r"] <= 1 and exact["em"] >= 1 and exact["amdahl_bound"] >= 1
    assert s["speedup_edr"] > 0 and s["speedup_adr"] > 0 and s["speedup_sr"] > 0
    knn = report["knnlm"]
    assert set(knn["bytes_per_entry"]) == {"exact", "ivfpq"} and {v["searcher"] for v in knn["runs"].values()} == {
        "exact",
        "ivfpq",
    }
    assert all(v > 0 for v in scale["kb"]["bytes_per_passage"].values())
    text = doc.read_text()
    assert ralm.DOC_BEGIN in text and "Amdahl" in text and "kNN-LM" in text and "img/ralm.png" in text
    assert (tmp_path / "img" / "ralm.png").stat().st_size > 1000
    # --replot re-derives the same summary from the JSON alone
    assert ralm.main(["--replot", str(out), "--json", str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["summary"] == s

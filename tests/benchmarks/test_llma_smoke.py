"""The LLMA benchmark runs end to end on a tiny bootstrap and tiny sets (speed is never asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import llma

pytestmark = pytest.mark.slow  # benchmark scripts end to end

TEXT = (
    "The {n} tool reads a configuration file, checks every entry, and writes a report of what it found. "
    "It runs every night from cron and mails the report to the administrator of host {n}. "
)
LICENCE = (
    "Permission is granted to copy, distribute and modify this program under the terms below.\n"
    "The program is provided as is, without warranty of any kind, express or implied.\n"
    "In no event shall the authors be liable for any claim, damages or other liability.\n"
)


def test_llma_benchmark_writes_summary_json_plot_and_doc(tiny_models, tmp_path):
    src, lic, docs = tmp_path / "src", tmp_path / "licenses", tmp_path / "doc"
    for d in (src, lic, docs):
        d.mkdir()
    for i in range(12):
        (src / f"tool{i}.txt").write_text(TEXT.format(n=i) * 4)
    (lic / "TOY-1").write_text(LICENCE * 3)
    for i in range(3):
        (docs / f"pkg{i}").mkdir()
        (docs / f"pkg{i}" / "copyright").write_text(
            f"Files: *\nCopyright: 20{i:02d} Someone {i}\nLicense: toy\n " + LICENCE
        )
    out, doc = tmp_path / "llma.json", tmp_path / "benchmarks.md"
    argv = [
        "--model-dir",
        str(tiny_models),
        "--quick",
        "--source",
        str(src),
        "--cache-dir",
        str(tmp_path / "c"),
        "--cases",
        "2",
        "--max-new-tokens",
        "12",
        "--sweep",
        "4,8",
        "--sweep-cases",
        "1",
        "--sampling-cases",
        "1",
        "--licenses-dir",
        str(lic),
        "--copyright-glob",
        str(docs / "*" / "copyright"),
        "--threads",
        "1",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert llma.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert set(llma.SUMMARY_KEYS) == set(s)
    assert s["cpu_model"] == report["environment"]["cpu_model"]
    if "suffix" not in report["sets"]["rag"]["arms"]:  # arctic-inference does not import here
        assert s["ratio_vs_suffix_rag"] is None and s["ratio_vs_suffix_cag"] is None
        assert "suffix arm not run" in doc.read_text()
    assert s["greedy_identical"] is True  # every greedy arm of every set equals target-only
    assert set(report["sets"]) == {"rag", "cag", "overlap"}
    for name, st in report["sets"].items():
        assert st["cases"] == 2, name
        assert {"hf_target", "target", "hf_pld", "pld", "draft", "llma"} <= set(st["arms"])
        assert set(st["sweep"]) == {"4", "8"} and st["sampling"]["cases"] == 1
        assert st["arms"]["llma"]["propose_us_per_step"] > 0 and st["arms"]["llma"]["speedup"] > 0
    assert report["overlap_index"]["licences"] == 1
    text = doc.read_text()
    assert llma.DOC_BEGIN in text and "k sweep" in text and "img/llma.png" in text
    assert (tmp_path / "img" / "llma.png").stat().st_size > 1000
    # the cag answers are cached: a second run generates nothing new; --replot re-derives the summary
    assert list((tmp_path / "c").glob("cag-answers-*.json"))
    assert llma.main(["--replot", str(out), "--json", str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["summary"] == s


def test_summary_ratios_vs_suffix_and_hf_pld():
    """LLMA over SuffixDecoding per set (total times, suffix / llma), None where the suffix arm
    did not run; the hf_pld ratio under both its names; the CPU from the environment."""

    def arms(**totals):
        return {"arms": {a: {"total_s": t, "speedup": 1.0, "identical": 1.0} for a, t in totals.items()}}

    report = {
        "sets": {
            "rag": arms(target=4.0, hf_pld=3.0, llma=2.0, suffix=3.0),
            "cag": arms(target=4.0, hf_pld=2.0, llma=2.5, suffix=2.0),
            "overlap": arms(target=4.0, hf_pld=3.0, llma=1.0),
        },
        "environment": {"cpu_model": "Toy CPU"},
    }
    s = llma.summary(report)
    assert set(s) == set(llma.SUMMARY_KEYS)
    assert s["ratio_vs_suffix_rag"] == 1.5 and s["ratio_vs_suffix_cag"] == 0.8
    assert s["ratio_vs_hf_pld_min"] == s["min_ratio_vs_hf_pld"] == 0.8
    assert s["cpu_model"] == "Toy CPU"
    del report["sets"]["cag"]["arms"]["suffix"]
    assert llma.summary(report)["ratio_vs_suffix_cag"] is None

"""The engine pass benchmark runs end to end at ``--quick`` size (tiny models: the timings are
never asserted), writing its JSON and its doc section."""

from __future__ import annotations

import json

from benchmarks import engine_pass


def test_engine_pass_quick_writes_json_and_doc(tmp_path):
    out, doc = tmp_path / "engine_pass.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nother sections stay\n")
    assert engine_pass.main(["--quick", "--json", str(out), "--doc", str(doc)]) == 0
    report = json.loads(out.read_text())
    routes = {(c["route"], c["path"]) for c in report["passes"]}
    assert routes == {("stock", "hf"), ("wx", "hf"), ("auto", "hf"), ("auto", "lean")}
    assert all(c["ms"] > 0 for c in report["passes"])
    s = report["summary"]
    assert set(s["profile_16_rows_ms"]) == {"linear products", "attention", "KV stores", "other operators"}
    assert s["in_process_tokens_per_s"]["2"] > 0 and s["lean_vs_stock_8_rows"] > 0
    text = doc.read_text()
    assert "other sections stay" in text and engine_pass.DOC_BEGIN in text and "| 8 decode rows |" in text

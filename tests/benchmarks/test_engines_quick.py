"""The engines benchmark (our engine next to vLLM's CPU build) runs end to end at ``--quick`` size
when the vLLM venv exists (speed and α are never asserted: the tiny models are random); its
reading of vLLM's spec-decode counters and its output comparison are checked without vLLM."""

from __future__ import annotations

import json

import pytest

from benchmarks import engines
from benchmarks.engines_clients import counter_delta, spec_counters, vllm_alpha
from specops.serving.vllm.process import VLLMError, vllm_python

try:
    vllm_python()
    NO_VLLM = ""
except VLLMError as exc:
    NO_VLLM = str(exc)

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} %(drafts)s
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} %(tokens)s
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} %(accepted)s
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} %(p0)s
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} %(p1)s
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} %(p2)s
vllm:num_requests_running{engine="0",model_name="target"} 0.0
"""


def test_vllm_counters_give_the_per_token_alpha():
    before = spec_counters(METRICS % {"drafts": 2.0, "tokens": 6.0, "accepted": 3.0, "p0": 2.0, "p1": 1.0, "p2": 0.0})
    # 10 more drafts of 3: 6 fully accepted, 4 rejected (accepting 2, 1, 0, 0): 18 + 3 = 21 accepted
    after = spec_counters(
        METRICS % {"drafts": 12.0, "tokens": 36.0, "accepted": 24.0, "p0": 10.0, "p1": 8.0, "p2": 6.0}
    )
    d = counter_delta(before, after)
    assert d["drafts"] == 10 and d["draft_tokens"] == 30 and d["accepted"] == 21 and d["per_pos"][2] == 6
    a = vllm_alpha(d, 3)
    assert a["alpha_token"] == pytest.approx(21 / (21 + 4)) and a["alpha_drafted"] == pytest.approx(21 / 30)
    assert a["basis"].startswith("accepted / (accepted")
    short = {**d, "draft_tokens": 28.0}  # drafts of varying length: only accepted / drafted is known
    assert vllm_alpha(short, 3)["alpha_token"] == pytest.approx(21 / 28)
    assert vllm_alpha(short, 3)["basis"].startswith("accepted / drafted")


def test_outputs_are_compared_per_arm_and_concurrency():
    def row(texts, ids=None):
        return {"texts": texts, "token_ids": ids}

    results = {
        "vllm_target": {"1": row(["a", "b"], [[1], [2]]), "2": row(["a", "b"], [[1], [2]])},
        "vllm_ngram": {"1": row(["a", "b"], [[1], [2]]), "2": row(["a", "x"], [[1], [3, 4]])},
        "specops_target": {"1": row(["a", "b"]), "2": row(["a", "b"])},
    }
    out = engines.compare(results, [1, 2])
    assert out["identical"] is False
    assert out["detail"]["vllm_ngram vs vllm_target (token ids)"] == {"1": [2, 2], "2": [1, 2]}
    assert out["detail"]["specops_target vs vllm_target (text)"] == {"1": [2, 2], "2": [2, 2]}
    assert out["mismatches"] == [
        {"comparison": "vllm_ngram vs vllm_target (token ids)", "concurrency": 2, "prompt": 1, "first_diff": 0}
    ]
    assert engines.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and engines.percentile([5.0], 0.99) == 5.0


@pytest.mark.slow
@pytest.mark.skipif(bool(NO_VLLM), reason=f"needs the vLLM venv: {NO_VLLM}")
def test_engines_quick_writes_json_and_doc(tmp_path):
    out, doc = tmp_path / "engines.json", tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nother sections stay\n")
    assert engines.main(["--quick", "--idle-check-s", "1", "--json", str(out), "--doc", str(doc)]) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert {
        "vllm_version",
        "by_concurrency",
        "learned_vs_bootstrap_draft",
        "ours_vs_vllm_target",
        "cpu",
        "prompts",
        "max_tokens",
        "identical_outputs",
        "ours_target_vs_vllm_target",
        "ours_best_vs_vllm_ngram",
        "p99_ratio_c8",
        "profile",
    } <= set(s)
    # the profile (issue 42): where our time went at the largest concurrency up to 4, per specops arm
    assert s["profile_concurrency"] == 2 and set(s["profile"]) == set(engines.SPECOPS_ARMS)
    for p in s["profile"].values():
        assert p["passes"] > 0 and 0 < p["request_shares"]["target_pass"] <= 1
        assert abs(sum(p["batcher_shares"].values()) - 1.0) < 1e-6 or p["batcher_shares"]["idle"] == 0.0
    assert s["prompts"] == 4 and s["max_tokens"] == 16 and set(s["by_concurrency"]) == {"1", "2"}
    for c in ("1", "2"):
        assert set(s["by_concurrency"][c]) == set(engines.ARMS)
        assert all(v["tokens_per_s"] > 0 and v["p99_s"] > 0 for v in s["by_concurrency"][c].values())
        assert s["learned_vs_bootstrap_draft"][c] > 0 and s["ours_vs_vllm_target"][c] > 0
    # fp32 greedy on both sides: target-only of the two engines agree
    detail = report["outputs"]["detail"]
    assert detail["specops_target vs vllm_target (text)"]["1"] == [4, 4]
    assert set(report["servers"]["idle_cpu_share"]) == {*engines.VLLM_ARMS, "specops"}
    text = doc.read_text()
    assert "other sections stay" in text and engines.DOC_BEGIN in text and "| 1 | vllm_learned_draft |" in text
    assert engines.main(["--replot", str(out), "--no-doc"]) == 0

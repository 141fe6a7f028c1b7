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


def test_isolated_protocol_runs_one_server_group_at_a_time(monkeypatch):
    """Each repeat starts every server group in turn and stops it before the next starts; the groups'
    order rotates; every arm serves every prompt at every concurrency; the fair summary keys are there."""
    from benchmarks.engines_clients import Arm, Reply
    from benchmarks.engines_report import summarise

    events, up = [], []

    class FakeServer:
        def __init__(self, group):
            assert not up, f"{group} started while {up} is up"
            self.label = group[0] if len(group) == 1 else "specops"
            self.url, self.ready_s = "http://127.0.0.1:1", 1.0
            up.append(self.label)
            events.append(("start", self.label))

        def stop(self):
            up.remove(self.label)
            events.append(("stop", self.label))

    def fake_batch(arm, prompts, c, max_tokens):
        speed = {"vllm_target": 2.0, "vllm_target_default": 1.0}.get(arm.name, 3.0)
        return 1.0, [Reply(i, int(speed * 2), 0.5, f"out{i}", token_ids=[i], ttft_s=0.1) for i, _ in prompts]

    monkeypatch.setattr(engines, "run_batch", fake_batch)
    monkeypatch.setattr(Arm, "profile", lambda self: None)
    args = engines.parse_args(
        ["--arms", "vllm_target,vllm_target_default,specops_target,specops_auto", "--prompts", "4"]
        + ["--concurrency", "1,2", "--repeats", "2", "--max-tokens", "4"]
    )
    results, facts = engines.measure([[1], [2], [3], [4]], args, FakeServer)
    assert not up and [e[0] for e in events] == ["start", "stop"] * 6  # never two servers up at once
    assert facts["group_order"] == [
        ["vllm_target", "vllm_target_default", "specops"],
        ["vllm_target_default", "specops", "vllm_target"],
    ]
    for arm in args.arms:
        for c in ("1", "2"):
            assert len(results[arm][c]["texts"]) == 4 and results[arm][c]["ttft_s"] == pytest.approx(0.1)
    report = {
        "arms": results,
        "config": {
            "concurrency": [1, 2],
            "isolated": True,
            "vllm_omp_bind": {"vllm_target": "0-1"},
            "prompts": 4,
            "max_tokens": 4,
        },
        "outputs": engines.compare(results, [1, 2]),
        "environment": {"cpu_model": "test CPU"},
    }
    s = summarise(report)
    assert s["isolated"] and s["vllm_every_core"] and s["cpu_model"] == "test CPU" and s["identical_outputs"]
    assert s["ours_target_vs_vllm_target_all"]["1"] == pytest.approx(1.5)
    assert s["ours_target_vs_vllm_target_default"]["2"] == pytest.approx(3.0)
    assert s["ours_best_vs_vllm_best_all"]["1"] == pytest.approx(1.5) and s["vllm_best_arm_all"]["1"] == "vllm_target"
    assert s["p99_ratio_c8_all"] is None and s["greedy_mismatches"] == 0


@pytest.mark.slow
@pytest.mark.skipif(bool(NO_VLLM), reason=f"needs the vLLM venv: {NO_VLLM}")
def test_engines_quick_writes_json_and_doc(tmp_path, monkeypatch):
    out, doc = tmp_path / "engines.json", tmp_path / "benchmarks.md"
    # vLLM's model in its engine-core process ("uni", allowed on a CPU only with V1 multiprocessing off)
    # and 64 KV blocks instead of a GiB: two processes to start instead of three, no GiB to fill
    # (as tests/serving/vllm/test_vllm_engine.py's servers); what this test checks is the benchmark's
    # run and report, not vLLM's executor
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm_args = "--enforce-eager --distributed-executor-backend uni --num-gpu-blocks-override 64"
    doc.write_text("# Benchmarks\n\nother sections stay\n")
    # one vLLM arm and one repeat: each vLLM server costs ~30 s of CPU to start (three processes importing
    # torch and vLLM), and the suite is CPU-bound. vLLM's default CPU binding (the vllm_target_default
    # arm), the rotation of server groups across repeats and the summary of both bindings are the
    # fake-server test's above; what only a real server shows (it starts, answers with counters, and its
    # greedy text is ours) needs one.
    arms = ["vllm_target", *engines.SPECOPS_ARMS]
    argv = ["--quick", "--repeats", "1", "--arms", ",".join(arms), "--json", str(out), "--doc", str(doc)]
    argv += ["--vllm-args", vllm_args]
    assert engines.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert {
        "vllm_version",
        "by_concurrency",
        "cpu",
        "cpu_model",
        "prompts",
        "max_tokens",
        "identical_outputs",
        "isolated",
        "vllm_every_core",
        "ours_target_vs_vllm_target_all",
        "ours_best_vs_vllm_best_all",
        "p99_ratio_c8_all",
        "ours_target_vs_vllm_target_default",
        "ours_best_vs_vllm_best_default",
        "profile",
    } <= set(s)
    assert s["isolated"] is True and s["vllm_every_core"] is True
    assert report["config"]["vllm_omp_bind"] == {"vllm_target": engines.omp_bind("all")}  # every core, as ours
    assert report["config"]["vllm_args"].endswith(f"--seed 0 {vllm_args}")
    # the profile: where our time went at the largest concurrency up to 8, per specops arm
    assert s["profile_concurrency"] == 2 and set(s["profile"]) == set(engines.SPECOPS_ARMS)
    for p in s["profile"].values():
        assert p["passes"] > 0 and 0 < p["request_shares"]["target_pass"] <= 1
    assert s["prompts"] == 4 and s["max_tokens"] == 16 and set(s["by_concurrency"]) == {"1", "2"}
    for c in ("1", "2"):
        assert set(s["by_concurrency"][c]) == set(arms)
        assert all(
            v["tokens_per_s"] > 0 and v["p99_s"] > 0 and v["ttft_s"] > 0 for v in s["by_concurrency"][c].values()
        )
        assert s["ours_target_vs_vllm_target_all"][c] > 0 and s["ours_best_vs_vllm_best_all"][c] > 0
        assert s["ours_best_vs_vllm_best_default"][c] is None  # no arm on vLLM's default binding here
    # fp32 greedy on both sides: target-only of the two engines agree
    detail = report["outputs"]["detail"]
    assert detail["specops_target vs vllm_target (text)"]["1"] == [4, 4]
    assert report["servers"]["group_order"] == [["vllm_target", "specops"]]
    text = doc.read_text()
    assert "other sections stay" in text and engines.DOC_BEGIN in text and "| 1 | vllm_target |" in text
    assert engines.main(["--replot", str(out), "--no-doc"]) == 0

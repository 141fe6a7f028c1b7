"""The spec_decode benchmark runs end to end on a tiny bootstrap (speed is never asserted)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import spec_decode

pytestmark = pytest.mark.slow  # benchmark scripts end to end


LOOP_OVERHEAD = {"tokens": 8, "reps": 1}
"""The loop-overhead probe's size here (the benchmark's is 32 tokens x 3 repeats of our loop and HF's,
about a third of this run): its keys and medians come out the same from one short repeat."""


@pytest.fixture(scope="module")
def report(tiny_models, tmp_path_factory):
    from benchmarks.specbench import run

    out = tmp_path_factory.mktemp("bench_out") / "spec_decode.json"
    argv = [
        "--model-dir",
        str(tiny_models),
        "--quick",
        "--prompts",
        "1",
        "--max-new-tokens",
        "8",
        "--prompt-tokens",
        "24",
        "--cost-reps",
        "5",
        "--min-cpu-share",
        "0",
        # one torch thread: the tiny models gain nothing from two, and the benchmark leaves its count set
        # in this process; two threads beside a second xdist worker on a 2-core machine spin at each barrier
        "--threads",
        "1",
        "--no-doc",
        "--json",
        str(out),
    ]
    real = run.measure_loop_overhead
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:  # a module fixture: no function-scoped monkeypatch
        mp.setattr(run, "measure_loop_overhead", lambda pair, ids: real(pair, ids, **LOOP_OVERHEAD))
        try:
            spec_decode.main(argv)
        finally:
            torch.set_num_threads(before)
    return json.loads(out.read_text())


def test_summary_has_headline_numbers(report):
    s = report["summary"]
    for key in spec_decode.SUMMARY_KEYS:
        if key not in ("model", "tree_greedy_identical"):
            assert isinstance(s[key], float) and math.isfinite(s[key]), (key, s[key])
    assert s["tree_greedy_identical"] is True  # the token-tree verifier's checks (benchmarks/tree_check.py)
    assert s["tree_chi2_p"] > 1e-3 and s["biased_rule_chi2_p"] < 1e-6
    assert isinstance(s["model"], str) and s["model"]
    assert s["draft_vs_hf_assisted"] > 0
    assert s["draft_vs_target_code"] > 0
    assert s["greedy_identical"] == 1.0
    assert s["headline_k"] == spec_decode.HEADLINE_K
    assert s["c"] > 0  # a ratio of timings: no upper bound (a fresh-clone run measured 18.7 on the tiny pair)


def test_summary_has_issue_39_bars(report):
    """Serving's default method and ``auto`` against our target-only loop, and our target-only loop
    against ``hf_target``, per domain and their worse domain; the CPU and the draft's served dtype."""
    from specops.serving.http.config import ServeKeys

    s = report["summary"]
    assert s["default_method"] == ServeKeys.model_fields["default_method"].default
    assert s["default_arm"] in report["results"]["code"]["greedy"]
    for key in ("default_vs_target", "auto_vs_target", "target_vs_hf_target_by_domain"):
        assert set(s[key]) == set(spec_decode.DOMAINS), key
        assert all(v > 0 for v in s[key].values()), (key, s[key])
    assert s["default_vs_target_min"] == min(s["default_vs_target"].values())
    assert s["target_vs_hf_target_min"] == min(s["target_vs_hf_target_by_domain"].values())
    assert isinstance(s["bar_default_vs_target_met"], bool) and isinstance(s["bar_target_vs_hf_target_met"], bool)
    assert isinstance(s["cpu_model"], str) and s["cpu_model"] == report["environment"]["cpu_model"]
    assert s["draft_dtype"] in ("float32", "bfloat16")  # what the loaded draft ran in, "auto" resolved
    assert report["our_settings"]["auto"]["max_k"] >= 1


def test_every_method_reported_per_domain_and_mode(report):
    methods = {"hf_target", "hf_assisted", "hf_pld", "target", "draft", "pld", "auto"}
    for domain in spec_decode.DOMAINS:
        for mode in spec_decode.MODES:
            rows = report["results"][domain][mode]
            assert methods <= set(rows), (domain, mode, set(rows))
            for name, row in rows.items():
                assert row["num_generated"] > 0, (domain, mode, name)
                assert row["tokens_per_s"] > 0, (domain, mode, name)
                assert row["tokens_per_target_forward"] >= 1.0 - 1e-9, (domain, mode, name, row)
                if row["acceptance_rate"] is not None:
                    assert 0.0 <= row["acceptance_rate"] <= 1.0, (domain, mode, name, row)
            assert rows["target"]["acceptance_rate"] is None
            # Target-only decoding: one target forward per emitted token, for HF and ours.
            assert rows["hf_target"]["tokens_per_target_forward"] == pytest.approx(1.0)
            assert rows["target"]["tokens_per_target_forward"] == pytest.approx(1.0)
    env = report["environment"]
    assert env["threads"] == 1 and env["torch"] and env["transformers"]
    assert "--quick" in report["command"]


def test_eq2_alpha_round_trips():
    for k in (1, 2, 4, 6):
        for alpha in (0.0, 0.3, 0.7, 0.95):
            m = spec_decode.expected_tokens(alpha, k)
            assert spec_decode.alpha_from_tokens_per_step(m, k) == pytest.approx(alpha, abs=1e-6)
    # Eq. 2 at α = 0.8, k = 4, c = 0.1: (1 - 0.8^5) / (0.2 * 1.4)
    assert spec_decode.eq2_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))


def test_doc_section_replaced_in_place(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## other\nkeep me\n")
    spec_decode.write_doc(doc, f"{spec_decode.DOC_BEGIN}\nfirst\n{spec_decode.DOC_END}")
    doc.write_text(doc.read_text() + "\n## later\nkeep me too\n")
    spec_decode.write_doc(doc, f"{spec_decode.DOC_BEGIN}\nsecond\n{spec_decode.DOC_END}")
    text = doc.read_text()
    assert "first" not in text and text.count("second") == 1
    assert "keep me\n" in text and "keep me too" in text
    assert text.count(spec_decode.DOC_BEGIN) == 1 and text.count(spec_decode.DOC_END) == 1

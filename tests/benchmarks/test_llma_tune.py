"""The LLMA tuning replay: its counts are the engine's, and the script runs end to end on a tiny
bootstrap (speed is never asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import llma, llma_tune
from benchmarks.llma_report import split_cases
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.serving.proposers.llma import LLMAProposer, ReferenceSet
from tests.benchmarks.test_llma_smoke import TEXT
from tests.conftest import random_prompts


@pytest.mark.parametrize("n_drafts", [1, 2])
def test_replay_counts_what_the_engine_counts(tiny_pair, n_drafts):
    """Greedy verification emits the target's tokens whatever is drafted, so replaying a rule
    on the target-only output gives the engine's verify steps, drafted and accepted tokens."""
    engine = SpecEngine(tiny_pair)
    rules = (
        dict(copy_factor=1.0, copy_offset=1.0, min_prob=0.1),
        dict(copy_factor=2.0, copy_offset=0.0, min_prob=0.3, min_n=2),
        dict(copy_factor=1.0, copy_offset=1.0, min_agreement=0.5, min_path=0.1),
        {},
    )
    checked = 0
    for i, prompt in enumerate(random_prompts(3, seed=320)):
        params = SamplingParams(max_new_tokens=40)
        out = list(plain_generate(engine, prompt, params, method="target").token_ids)
        wrong = list(out)
        for j in range(2 + i, len(wrong), 5):
            wrong[j] = (wrong[j] + 1) % 97
        for rule in rules:

            def proposer():
                refs = ReferenceSet.from_docs([wrong, out[: len(out) // 2]], max_n=8)
                return LLMAProposer(refs, max_n=8, n_drafts=n_drafts, **rule)

            res = plain_generate(engine, prompt, params, proposer=proposer(), k=8)
            assert list(res.token_ids) == out
            r = llma_tune.replay(proposer(), list(prompt), out, 8, params.max_new_tokens)
            s = res.stats
            assert (r["steps"], r["drafted"], r["accepted"]) == (s.num_verify_steps, s.num_drafted, s.num_accepted)
            assert r["verified"] >= r["drafted"] and (n_drafts > 1 or r["verified"] == r["drafted"])
            checked += s.num_drafted > 0
    assert checked >= 6  # most replays drafted something


def test_priced_speedup_follows_the_cost_model():
    totals = {"steps": 10, "drafted": 20, "verified": 20, "accepted": 15, "propose_s": 0.0, "tokens": 25}
    p = llma_tune.priced(totals, (0.04, 0.01))
    assert p["target_sim_s"] == pytest.approx(25 * 0.05)
    assert p["sim_s"] == pytest.approx(10 * 0.04 + 0.01 * 30)
    assert p["sim_speedup"] == pytest.approx(1.25 / 0.7) and p["acceptance"] == 0.75


def test_dev_and_test_splits_never_share_a_case():
    items = list(range(11))
    dev, test = split_cases(items, 5, "dev"), split_cases(items, 5, "test")
    assert dev == [0, 2, 4, 6, 8] and test == [1, 3, 5, 7, 9] and not set(dev) & set(test)
    assert split_cases(items, 3, "all") == [0, 1, 2]
    with pytest.raises(ValueError, match="split"):
        split_cases(items, 3, "train")


@pytest.mark.slow
def test_tune_and_the_test_split_run_end_to_end(tiny_models, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(16):
        (src / f"tool{i}.txt").write_text(TEXT.format(n=i) * 4)
    common = ["--model-dir", str(tiny_models), "--quick", "--source", str(src), "--cache-dir", str(tmp_path / "c")]
    common += ["--cases", "2", "--max-new-tokens", "10", "--threads", "1"]
    out, doc = tmp_path / "tune.json", tmp_path / "benchmarks.md"
    assert llma_tune.main([*common, "--json", str(out), "--doc", str(doc), "--cost-reps", "1"]) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert set(llma_tune.SUMMARY_KEYS) <= set(s) and s["split"] == "dev" and s["cases_per_set"] == 2
    assert report["results"][s["best_rule"]]["family"] == "scored"
    assert {"scored", "frequency", "paper"} <= {r["family"] for r in report["results"].values()}
    assert llma_tune.DOC_BEGIN in doc.read_text() and (tmp_path / "img" / "llma_tune.png").stat().st_size > 1000
    # the test split: other cases, the same sets; only the arms asked for (and suffix where it imports)
    test_out = tmp_path / "test.json"
    argv = [*common, "--split", "test", "--sets", "rag,cag", "--arms", "target,pld,llma", "--no-draft"]
    assert llma.main([*argv, "--sweep-cases", "0", "--sampling-cases", "0", "--json", str(test_out)]) == 0
    rep = json.loads(test_out.read_text())
    assert rep["summary"]["split"] == "test" and rep["summary"]["min_ratio_vs_hf_pld"] is None
    for name in ("rag", "cag"):
        assert set(rep["sets"][name]["arms"]) - {"suffix"} == {"target", "pld", "llma"}
        tuned_on = set(report["sets"][name])
        assert tuned_on and not tuned_on & {row["case"] for row in rep["per_case"][name]}, name
    assert "--arms: target is needed" in _error(llma.parse, ["--arms", "llma"])


def _error(parse, argv) -> str:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parse(argv)
    return err.getvalue()

"""The weight-averaging benchmark runs end to end on a tiny bootstrap (α values are never
asserted: the tiny models are random), its moving average is the stated recurrence, and bad
arguments are refused with the flag named."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import osd_average


@pytest.mark.slow
def test_osd_average_writes_json_table_and_doc(tiny_models, tmp_path):
    out, doc = tmp_path / "osd_average.json", tmp_path / "benchmarks.md"
    argv = [
        "--model-dir",
        str(tiny_models),
        "--domains",
        "sql",
        "--requests",
        "10",
        "--probe",
        "3",
        "--probe-disjoint",
        "3",
        "--max-new-tokens",
        "6",
        "--eval-every",
        "5",
        "--recipes",
        "1e-3:2,1e-3:2:recent:16",
        "--decays",
        "0.9",
        "--offline",
        "1e-3:1,2",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert osd_average.main(argv) == 0
    report = json.loads(out.read_text())
    sql = report["domains"]["sql"]
    assert [c["requests"] for c in sql["recipes"][0]["curve"]] == [0, 5, 10]
    assert [(r["replay"], r["capacity"]) for r in sql["recipes"]] == [("clear", 256), ("recent", 16)]
    assert {o["epochs"] for o in sql["offline"]} == {1, 2}
    rows = report["summary"]["per_domain"]["sql"]["rows"]
    assert [(r["recipe"], r["arm"]) for r in rows] == [
        ("lr 0.001, 2 steps", "trained"),
        ("lr 0.001, 2 steps", "avg0.9"),
        ("lr 0.001, 2 steps, recent 16", "trained"),
        ("lr 0.001, 2 steps, recent 16", "avg0.9"),
    ]
    assert all({"alpha", "gain", "alpha_disjoint", "gain_disjoint", "largest_drop"} <= set(r) for r in rows)
    assert set(report["summary"]["gain"]["sql"]) >= {"recipe", "trained", "averaged", "decay", "averaged_disjoint"}
    text = doc.read_text()
    assert osd_average.BEGIN in text and "| sql | lr 0.001, 2 steps | avg0.9 |" in text


def test_moving_average_is_the_stated_recurrence():
    learner = osd_average.Learner.__new__(osd_average.Learner)  # the averaging alone, no model
    learner.params = [torch.zeros(3)]
    learner.averages = {0.9: [torch.zeros(3)], 0.5: [torch.zeros(3)]}
    learner.params[0].fill_(1.0)
    learner.average()
    learner.average()
    torch.testing.assert_close(learner.averages[0.9][0], torch.full((3,), 0.19))  # 0.9·0.1 + 0.1·1
    torch.testing.assert_close(learner.averages[0.5][0], torch.full((3,), 0.75))


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--recipes", "1e-3"),
        ("--recipes", "0:4"),
        ("--recipes", "1e-3:4:recent"),
        ("--recipes", "1e-3:4:lifo:64"),
        ("--recipes", "1e-3:4:recent:4"),
        ("--decays", "1.0"),
        ("--offline", "1e-3:0"),
        ("--domains", "x"),
    ],
)
def test_bad_arguments_name_the_flag(flag, value):
    with pytest.raises(SystemExit, match=flag):
        osd_average.parse_args([flag, value])

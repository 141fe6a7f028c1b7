"""The adaptive benchmark's phases without models: its command line, which requests each
concurrency runs in which groups, and the summary's worst-over-concurrencies."""

from __future__ import annotations

from benchmarks import adaptive
from benchmarks.adaptive import Case


def stream(per_slice: dict[str, int]) -> list[Case]:
    """A mixed stream: the slices' cases round-robin (as a shuffle would interleave them)."""
    out, left = [], dict(per_slice)
    while any(left.values()):
        for s in list(left):
            if left[s]:
                out.append(Case(s, f"{s}{per_slice[s] - left[s]}", [1, 2, 3]))
                left[s] -= 1
    return out


def test_defaults_and_aliases():
    full, quick = adaptive.parse([]), adaptive.parse(["--quick"])
    assert (full.concurrency, full.groups, full.cases, full.max_new_tokens) == ([1, 4, 8], 3, 8, 64)
    assert (quick.concurrency, quick.groups, quick.cases) == ([1, 4], 1, 2)
    assert adaptive.parse(["--no-concurrency4"]).concurrency == [1]
    assert adaptive.parse(["--concurrency", "8,1,4,4"]).concurrency == [1, 4, 8]  # sorted, once each
    # the slices need max(cases, groups x c) prompts: 24 at the defaults
    assert max(adaptive.phase_size(full, c) for c in full.concurrency) == 24


def test_phase_groups_take_each_slices_first_requests_in_groups_of_one_slice():
    args = adaptive.parse(["--cases", "2", "--groups", "2", "--concurrency", "1,3"])
    cases = stream({"code": 6, "prose": 6, "rag": 4})
    one = adaptive.phase_groups(cases, args, 1)
    assert all(len(g) == 1 for g in one)
    assert [cases[g[0]].name for g in one] == ["code0", "prose0", "rag0", "code1", "prose1", "rag1"]
    three = adaptive.phase_groups(cases, args, 3)
    names = [[cases[i].name for i in g] for g in three]
    # groups of 3 of one slice, the slices interleaved; rag has 4 of the 6 it needs: its second group is short
    assert names == [
        ["code0", "code1", "code2"],
        ["prose0", "prose1", "prose2"],
        ["rag0", "rag1", "rag2"],
        ["code3", "code4", "code5"],
        ["prose3", "prose4", "prose5"],
        ["rag3"],
    ]


def test_summary_is_the_worst_over_concurrencies():
    def slice_(best: float, oracle: float, target: float) -> dict:
        return {
            "auto_vs_best_fixed": best,
            "auto_vs_oracle": oracle,
            "auto_vs_target": target,
            "best_fixed": "pld_k10",
            "cases": 4,
        }

    report = {
        "cases": [{"slice": "code", "temperature": 0.0}],
        "per_case": {},
        "environment": {"cpu_model": "test cpu"},
        "results": {
            "1": {"code": slice_(1.2, 0.9, 1.5), "prose": slice_(1.1, 0.95, 0.97), "all": slice_(1.1, 0.93, 1.2)},
            "8": {"code": slice_(0.9, 0.8, 0.99), "prose": slice_(1.0, 0.9, 1.3), "all": slice_(0.95, 0.85, 1.1)},
        },
    }
    s = adaptive.summary(report)
    assert s["by_concurrency"]["1"]["min_slice_vs_target"] == 0.97
    assert s["by_concurrency"]["8"]["auto_vs_oracle"] == 0.85
    assert (s["auto_vs_best_fixed"], s["auto_vs_oracle"], s["min_slice_vs_target"]) == (0.95, 0.85, 0.97)
    assert s["concurrency"] == [1, 8] and s["cpu_model"] == "test cpu" and s["greedy_identical"] is True


def test_the_held_out_best_fixed_arm_is_chosen_on_other_folds():
    """Two fixed arms that trade places between groups: in sample the better total wins, held out
    each fold runs the arm that won the others, so the noise the in-sample choice feeds on is gone."""
    cases = [{"slice": "code"}] * 6
    idx = list(range(6))
    unit = {i: i // 2 for i in idx}  # three groups of two requests
    a = {0: 1.0, 1: 1.0, 2: 3.0, 3: 3.0, 4: 2.0, 5: 2.0}
    b = {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0, 4: 2.5, 5: 2.5}
    auto = dict.fromkeys(idx, 2.0)
    out = adaptive._held_out_best_fixed(idx, cases, unit, {"a": a, "b": b, "auto": auto}, ["a", "b"])
    # per group (a, b, auto): (2, 4, 4), (6, 4, 4), (4, 5, 4); in sample a = 12 < b = 13: 12 / 12.
    # Held out: group 0 runs b (b 9 < a 10 on the others), group 1 a (6 < 9), group 2 a (8 = 8,
    # the first listed): 4 + 6 + 4 = 14 over auto's 12
    assert out["auto_vs_best_fixed_cv"] == round(14 / 12, 3)
    lo, hi = out["auto_vs_best_fixed_ci90"]
    assert lo <= 1.0 <= hi

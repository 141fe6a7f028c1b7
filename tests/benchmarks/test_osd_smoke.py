"""The OSD benchmark runs end to end on a tiny bootstrap with the chat workload (α values are
never asserted: the tiny models are random), its grid mode runs at tiny size, and its replay
of a request is the engine's step rule."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import osd

SUMMARY_KEYS = {
    "chat",
    "distinct_prompts",
    "clusters",
    "alpha_token_static",
    "alpha_token_gated",
    "alpha_token_ungated",
    "alpha_token_offline",
    "gain_gated_min",
    "offline_fraction_min",
    "promotions",
    "worse_promotions",
    "recovery_requests",
    "routing_accuracy",
    "shift_gated_minus_ungated_min",
    "shift_adapt_requests",
    "auto_default_vs_static_min",
    "gain_template_disjoint_min",
    "offline_swept",
    "baseline_10pct",
    "auto_default_vs_target_min",
}
"""Issue 55 adds two more, from other runs given to ``--merge``: ``sampling_grid`` (a ``--grid``
JSON) and ``real_text`` (a ``--domains docs`` run); both are checked below."""


ONE_THREAD = ("--threads", "1")
"""The benchmark's default is 2 torch threads: the tiny models gain nothing from a second, and beside a
second xdist worker on a 2-core machine two threads spin at every barrier (several times slower)."""


@pytest.fixture(scope="module", autouse=True)
def _threads_back():
    """The benchmark sets the thread count of its process: the tests after this module get theirs back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_osd_benchmark_writes_json_plot_and_doc(tiny_models, tmp_path):
    out, doc, png = tmp_path / "osd.json", tmp_path / "benchmarks.md", tmp_path / "img" / "osd.png"
    argv = [
        "--model-dir",
        str(tiny_models),
        *ONE_THREAD,
        "--requests",
        "10",
        "--probe",
        "3",
        "--probe-disjoint",
        "3",
        "--router-texts",
        "3",
        "--max-new-tokens",
        "6",
        "--interval",
        "2",
        "--probe-every",
        "5",
        "--offline-epochs",
        "1",
        "--offline-sweep",
        "3e-3:1,2",
        "--generic-requests",
        "4",
        "--generic-steps",
        "2",
        "--shift-requests",
        "5",
        "--gate-windows",
        "0,16:0",
        "--audit-window",
        "2",
        "--check-every",
        "7",
        "--speed-prompts",
        "1",
        "--auto-warm",
        "1",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--doc",
        str(doc),
    ]
    assert osd.main(argv) == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    assert SUMMARY_KEYS <= set(s)
    assert s["chat"] is True and s["distinct_prompts"] is True and s["clusters"] == list(osd.DOMAINS)
    for key in ("alpha_token_static", "alpha_token_gated", "alpha_token_ungated", "alpha_token_offline"):
        assert set(s[key]) == set(osd.DOMAINS) and all(0.0 <= v <= 1.0 for v in s[key].values()), key
    assert 0.0 <= s["routing_accuracy"] <= 1.0 and report["routing"]["requests"] == 3 * (10 + 3)
    main = report["main"]
    assert len(main["rows"]) == 30 and main["gates"], "the trainer produced candidates and the gate judged them"
    for d in osd.DOMAINS:
        assert [p["requests"] for p in main["curves"][d]][:3] == [0, 5, 10]  # the probe before, and every 5 requests
    sh = report["shift"]
    assert sh["boundaries"] == [5, 10] and sh["domains"] == ["sql", "math", "sql"]
    # the gate's defaults and more arms measured beside them (a window; a window without fresh evidence),
    # per segment after the first
    assert [g["segment"] for g in sh["segments"]] == [2, 3] and set(sh["windows"]) == {"0", "16f0"}
    assert sh["windows"]["16f0"]["fresh"] == 0 and sh["windows"]["0"]["fresh"] == sh["fresh"] > 0
    for g in sh["segments"]:
        assert {"gated", "ungated", "w0", "w16f0"} <= set(g) and set(g["gated"]["alpha_at"]) == {"5"}
    assert "16 fresh" not in doc.read_text() and "window 16, no fresh" in doc.read_text()
    assert set(s["shift_adapt_requests"]) == {"2:math", "3:sql"}
    assert "The gate after a drift" in doc.read_text()
    assert set(report["generic"]) >= {"static", "gated", "ungated"}
    assert set(s["tokens_per_s_ratio"]["sql"]) == {
        "static",
        "gated",
        "ungated",
        "offline",
        "auto_static",
        "auto_gated",
        "auto_stale",
        "auto_offline",  # the offline part ran in this process: `auto` with the bound's draft too
    }
    # the offline bound is the best of the default and the sweep's configurations; the 10 % baseline beside it
    assert [(r["lr"], r["epochs"]) for r in report["offline_sweep"]["sql"]] == [(1e-3, 1), (3e-3, 1), (3e-3, 2)]
    best = max(r["alpha_token"] for r in report["offline_sweep"]["sql"])
    assert s["offline_swept"]["sql"]["best"]["alpha_token"] == best == s["alpha_token_offline"]["sql"]
    assert s["offline_swept"]["sql"]["default"]["lr"] == 1e-3 and set(s["baseline_10pct"]) == set(osd.DOMAINS)
    assert report["baseline_10pct"]["sql"]["requests"] == 1  # a tenth of 10 served requests
    # the template-disjoint probe: every arm measured on families served traffic never had
    assert set(report["disjoint"]["sql"]) == {"static", "gated", "ungated", "offline"}
    assert (
        set(s["gain_template_disjoint"]) == {"gated", "ungated", "offline"} and "template-disjoint" in doc.read_text()
    )
    auto = report["speed"]["sql"]["auto"]  # the default method, after the policy's history with the static draft
    assert auto["warm_prompts"] == 1
    assert set(auto["draft_step_share"]) == {"auto_static", "auto_gated", "auto_stale", "auto_offline"}
    assert auto["offline_alpha"] == pytest.approx(s["alpha_token_offline"]["sql"])  # re-seeded from its probe α
    assert (
        s["auto_offline_vs_static"]["sql"] == pytest.approx(auto["offline_vs_static"]) and auto["offline_vs_static"] > 0
    )
    assert all(0.0 <= v <= 1.0 for v in auto["draft_step_share"].values())
    assert s["auto_default_vs_static"]["sql"] == pytest.approx(auto["vs_static"]) and "auto_static" in doc.read_text()
    checks = s["engine_checks"]
    assert checks["n"] >= 3 and checks["identical"] == checks["n"] and checks["alpha_equal"] == checks["n"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert osd.DOC_BEGIN in doc.read_text() and "img/osd.png" in doc.read_text()
    # --replot re-derives everything from the JSON alone
    assert osd.main(["--replot", str(out), "--plot", str(png), "--doc", str(doc)]) == 0


@pytest.mark.slow
def test_osd_grid_runs_at_tiny_size(tiny_models, tmp_path, main_json):
    out, doc = tmp_path / "grid.json", tmp_path / "benchmarks.md"
    argv = [
        "--model-dir",
        str(tiny_models),
        *ONE_THREAD,
        "--grid",
        "--grid-requests",
        "4",
        "--requests",
        "4",
        "--probe",
        "2",
        "--probe-disjoint",
        "2",
        "--router-texts",
        "1",
        "--max-new-tokens",
        "5",
        "--interval",
        "2",
        "--check-every",
        "0",
        "--json",
        str(out),
        "--doc",
        str(doc),
    ]
    assert osd.main(argv) == 0
    g = json.loads(out.read_text())
    names = [r["name"] for r in g["rows"]]
    assert names[0].startswith("center")
    for factor, levels in osd.GRID_FACTORS.items():  # every level of every factor was run (the center's once)
        for level in levels:
            assert any(n == f"{factor}={level}" for n in names) or osd._level_of(g["center"], factor) == level, (
                factor,
                level,
            )
    assert set(g["chosen"]) >= {"positions", "lr", "steps_per_update", "replay", "loss", "sampling"}
    # OSD Table 1: the center recipe under teacher, student and mixed sampling, marked for the summary
    sampling = {r["config"]["sampling"] for r in g["rows"] if r["sampling_row"]}
    assert sampling == {"teacher", "student", "mixed"}
    assert next(r for r in g["rows"] if r["name"] == "sampling=mixed")["config"]["mix"] == 0.5
    assert g["depth"] and all(v["c"] > 0 for v in g["depth"].values())
    pc = g["positions_cost"]
    assert pc["bytes_all"] > pc["bytes_rejected"] > 0 and pc["teacher_forward_s"] > 0
    assert osd.GRID_BEGIN in doc.read_text()
    # the grid's sampling rows reach the main report's summary through --merge
    png, merged = tmp_path / "merged.png", tmp_path / "merged.json"
    assert (
        osd.main(["--merge", str(main_json), str(out), "--json", str(merged), "--doc", str(doc), "--plot", str(png)])
        == 0
    )
    s = json.loads(merged.read_text())["summary"]
    assert set(s["sampling_grid"]) >= {"teacher", "student", "mixed"} and s["sampling_grid"]["requests_per_domain"] == 4
    assert s["sampling_grid"]["student"]["mean"] == pytest.approx(
        next(r for r in g["rows"] if r["name"] == "sampling=student")["mean"]
    )


@pytest.fixture(scope="module")
def main_json(tiny_models, tmp_path_factory):
    """One run of the default domains at :func:`_tiny_main` size, read (never written) by both tests that
    merge another run beside it: the same arguments gave the same run twice."""
    out = tmp_path_factory.mktemp("osd_main")
    assert osd.main([*_tiny_main(tiny_models, out / "osd.png"), "--json", str(out / "main.json"), "--no-doc"]) == 0
    return out / "main.json"


def _tiny_main(model_dir, plot) -> list[str]:
    """The smallest run of the arms a summary needs (main and offline), no other part; its plot to ``plot``."""
    return [
        "--model-dir",
        str(model_dir),
        *ONE_THREAD,
        "--plot",
        str(plot),
        "--parts",
        "main,offline",
        "--requests",
        "6",
        "--probe",
        "2",
        "--probe-disjoint",
        "2",
        "--router-texts",
        "2",
        "--max-new-tokens",
        "5",
        "--interval",
        "2",
        "--probe-every",
        "3",
        "--offline-epochs",
        "1",
        "--audit-window",
        "2",
        "--check-every",
        "0",
    ]


@pytest.mark.slow
def test_osd_runs_the_real_text_domain_alone_and_merges_it_beside_the_main_run(
    tiny_models, tmp_path, small_docs, main_json
):
    """Issue 55: ``--domains docs`` (documentation paragraphs, not templates) runs as its own
    cluster; merged beside a run of the default domains, its numbers are the summary's
    ``real_text``, held to the same bars."""
    docs, merged, doc = (tmp_path / n for n in ("docs.json", "merged.json", "b.md"))
    assert (
        osd.main(
            [
                *_tiny_main(tiny_models, tmp_path / "osd.png"),
                "--domains",
                "docs",
                "--json",
                str(docs),
                "--doc",
                str(doc),
            ]
        )
        == 0
    )
    d = json.loads(docs.read_text())
    assert d["summary"]["clusters"] == ["docs"] and set(d["disjoint"]) == {"docs"}
    png = tmp_path / "merged.png"
    assert (
        osd.main(["--merge", str(main_json), str(docs), "--json", str(merged), "--doc", str(doc), "--plot", str(png)])
        == 0
    )
    s = json.loads(merged.read_text())["summary"]
    assert s["clusters"] == list(osd.DOMAINS) and "docs" not in s["alpha_token_gated"]
    (rt,) = s["real_text"]
    assert rt["clusters"] == ["docs"] and rt["file"] == str(docs) and "gain_template_disjoint_min" in rt
    assert "real text docs: gain >= 0.10" in s["bars"]
    with pytest.raises(SystemExit, match="unknown"):
        osd.main(["--domains", "poetry", "--model-dir", str(tiny_models)])


@pytest.mark.parametrize(
    "pred, output, k, max_new, want",
    [
        # all agree: steps of k accepted + 1 bonus; the last step drafts only what fits
        ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], 2, 6, (2 + 2 + 0, 4, 2, [])),
        # a disagreement at output index 1: 1 accepted, the rejected position is 1
        ([1, 9, 3, 4], [1, 2, 3, 4], 3, 4, (3 + 1, 1 + 1, 2, [(1, 9, 2)])),
        # ends at an EOS before max_new: accepted drafts past its end do not count
        ([7, 8, 5], [7, 8], 4, 10, (4, 2, 1, [])),
        # k larger than what is left: k_step = max_new - j - 1
        ([5, 5, 5], [5, 6, 5], 8, 3, (2 + 0, 1, 2, [(1, 5, 6)])),
    ],
)
def test_replay_follows_the_engine_step_rule(pred, output, k, max_new, want):
    out = osd.replay(pred, output, k, max_new)
    assert (out.drafted, out.accepted, out.steps, out.rejected) == want


def test_shift_segments_reads_each_arm_against_the_right_reference():
    def row(a, r, ua, ur):
        return {"accepted": a, "rejected": r, "u_accepted": ua, "u_rejected": ur}

    n = 200
    rows = [row(3, 1, 3, 1)] * n  # segment 1 (sql): α 0.75 in both arms
    rows += [row(1, 3, 1, 3)] * 20 + [row(1, 3, 3, 1)] * 180  # segment 2 (math): ungated learns after 20
    rows += [row(1, 3, 3, 1)] * 30 + [row(3, 1, 3, 1)] * 170  # segment 3 (sql again): gated back after 30
    math, sql = osd.shift_segments(rows, ["sql", "math", "sql"], n, {"gated": "", "ungated": "u_"})
    # a new domain: the ungated arm's level over the segment's last 100 requests
    assert math["reference"] == pytest.approx(0.75) and "ungated" in math["reference_from"]
    # the trailing 50 reach 0.70 once 45 of them are learned: 20 + 45 requests into the segment
    assert math["ungated"]["adapt_requests"] == 65
    assert math["gated"]["adapt_requests"] is None and math["gated"]["alpha_at"] == {"50": 0.25, "150": 0.25}
    assert math["gated_minus_ungated_150"] == pytest.approx(0.25 - 0.75)
    # a domain served before: the gated arm's own level before it left (segment 1's last 100)
    assert sql["reference"] == pytest.approx(0.75) and "segment 1" in sql["reference_from"]
    assert sql["gated"]["alpha_at"]["50"] == pytest.approx((30 * 1 + 20 * 3) / (50 * 4))
    assert sql["gated"]["adapt_requests"] == 30 + 45


@pytest.mark.slow
def test_osd_parts_in_two_processes_merge_into_one_report(tiny_models, tmp_path):
    common = [
        "--model-dir",
        str(tiny_models),
        *ONE_THREAD,
        "--requests",
        "6",
        "--probe",
        "2",
        "--probe-disjoint",
        "2",
        "--router-texts",
        "2",
        "--max-new-tokens",
        "5",
        "--interval",
        "2",
        "--probe-every",
        "3",
        "--offline-epochs",
        "1",
        "--generic-requests",
        "2",
        "--generic-steps",
        "2",
        "--shift-requests",
        "3",
        "--check-every",
        "0",
        "--speed-prompts",
        "1",
        "--no-doc",
    ]
    a, b, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "osd.json"
    assert osd.main([*common, "--parts", "main,speed", "--json", str(a)]) == 0
    assert osd.main([*common, "--parts", "offline,generic,shift", "--json", str(b)]) == 0
    assert "main" in json.loads(a.read_text()) and "main" not in json.loads(b.read_text())
    assert (
        osd.main(["--merge", str(a), str(b), "--json", str(merged), "--plot", str(tmp_path / "osd.png"), "--no-doc"])
        == 0
    )
    report = json.loads(merged.read_text())
    assert SUMMARY_KEYS <= set(report["summary"]) and {"main", "offline", "generic", "shift", "speed"} <= set(report)
    assert [m["file"] for m in report["merged_from"]] == [str(a), str(b)]

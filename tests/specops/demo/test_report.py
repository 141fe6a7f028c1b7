"""The closed-loop demo report: summary numbers, files, escaping, run.json round trip."""

from __future__ import annotations

import json
import math

import pytest

from specops.demo.report.data import (
    DemoRun,
    Promotion,
    RequestRow,
    SpeedRow,
    load_run,
    phase_spans,
    summarize,
)
from specops.demo.report.page import main, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _strict_loads(text: str):
    """json.loads that refuses NaN / Infinity, as a strict JSON reader would."""

    def reject(c):
        raise ValueError(f"non-standard JSON constant {c}")

    return json.loads(text, parse_constant=reject)


def synthetic_run() -> DemoRun:
    """Two clusters, 250 requests.

    code: 150 successful requests at t = 0..149, 4 drafted each; 1 accepted before t = 100, 3 after;
      one rejected step each. Served by base (0..99), v3 (100..119), v5 (120..129), v3 again after
      the rollback (130..149).
    prose: 99 successful requests + 1 failed (index 60), 2 drafted each; 1 accepted for the first 50, 2 after;
      no rejected steps reported (an older server).
    """
    reqs = []
    for i in range(150):
        version = "base" if i < 100 else "5" if 120 <= i < 130 else "3"
        phase = "code-heavy" if i < 100 else "shift: prose-heavy"
        reqs.append(
            RequestRow(
                t=float(i),
                cluster="code",
                phase=phase,
                drafted=4,
                accepted=1 if i < 100 else 3,
                draft_version=version,
                latency_s=0.4,
                num_generated=32,
                rejected_steps=1,
            )
        )
    ok_prose = 0
    for i in range(100):
        phase = "code-heavy"  # t < 100: the whole of prose's traffic falls in the first phase
        if i == 60:
            reqs.append(
                RequestRow(
                    t=i + 0.5,
                    cluster="prose",
                    phase=phase,
                    drafted=0,
                    accepted=0,
                    draft_version="",
                    latency_s=0.1,
                    num_generated=0,
                    ok=False,
                )
            )
            continue
        reqs.append(
            RequestRow(
                t=i + 0.5,
                cluster="prose",
                phase=phase,
                drafted=2,
                accepted=1 if ok_prose < 50 else 2,
                draft_version="base",
                latency_s=0.3,
                num_generated=16,
            )
        )
        ok_prose += 1
    promotions = [
        Promotion(t=99.5, cluster="code", version="3", reason="gate: offline α 0.61 > 0.42"),
        Promotion(t=119.5, cluster="code", version="5"),
        Promotion(t=129.5, cluster="code", version="3", kind="rollback", reason="live α dropped"),
    ]
    speed = [
        SpeedRow("code", "target-only", "", 10.0, math.nan, 8, True),
        SpeedRow("code", "static draft", "base", 15.0, 0.25, 8, True),
        SpeedRow("code", "online draft", "3", 20.0, 0.75, 8, True),
        SpeedRow("prose", "target-only", "", 8.0, math.nan, 8, True),
        SpeedRow("prose", "static draft", "base", 10.0, 0.5, 8, True),
        SpeedRow("prose", "online draft", "base", 12.0, 0.7, 8, False),
    ]
    versions = [
        {
            "cluster": "code",
            "version": "3",
            "aliases": ["champion"],
            "registered_at": "2025-01-01T00:01:40",
            "gate_decision": "promote",
            "gate_reason": "offline α 0.61 > 0.42",
            "offline_acceptance": 0.61,
            "live_acceptance": 0.74,
        },
        {
            "cluster": "code",
            "version": "5",
            "aliases": [],
            "registered_at": "2025-01-01T00:02:00",
            "gate_decision": "promote",
            "gate_reason": "offline α 0.66 > 0.61",
            "offline_acceptance": 0.66,
        },
    ]
    return DemoRun(
        started_at="2025-01-01T00:00:00",
        duration_s=150.0,
        config={"quick": True, "requests": 250, "clusters": ["code", "prose"], "k": 4},
        requests=reqs,
        promotions=promotions,
        speed=speed,
        registry_versions=versions,
        mlflow_ui_url="http://127.0.0.1:5000",
        api_url="http://127.0.0.1:8000",
        notes=["<script>alert('x')</script> trainer was slow"],
    )


def test_summary_numbers():
    s = summarize(synthetic_run())
    assert (s["requests"], s["failed_requests"], s["duration_s"]) == (250, 1, 150.0)
    code, prose = s["clusters"]["code"], s["clusters"]["prose"]
    assert set(s["clusters"]) == {"code", "prose"}
    # α = accepted / (accepted + rejected steps): first 100 = 100 / 200; last 100 = rows 50..149 = 200 / 300
    assert code["alpha_first_100"] == 0.5
    assert code["alpha_last_100"] == 0.6667
    assert code["alpha_delta"] == 0.1667
    assert code["alpha_first_half"] == 0.5  # rows 0..74
    assert code["alpha_last_half"] == round((25 * 1 + 50 * 3) / (175 + 75), 4) == 0.7  # rows 75..149
    assert code["alpha_by_phase"] == {"code-heavy": 0.5, "shift: prose-heavy": 0.75}
    # acceptance = accepted / drafted: first 100 = 100 x 1/4; last 100 = rows 50..149 = (50*1 + 50*3) / 400
    assert code["acceptance_first_100"] == 0.25
    assert code["acceptance_last_100"] == 0.5
    assert code["acceptance_first_half"] == 0.25  # rows 0..74
    assert code["acceptance_last_half"] == round((25 * 1 + 50 * 3) / 300, 4) == 0.5833  # rows 75..149
    assert code["acceptance_by_phase"] == {"code-heavy": 0.25, "shift: prose-heavy": 0.75}
    assert "rejected steps" in s["alpha_definition"]
    assert (code["requests"], code["failed_requests"], code["alpha_window"]) == (150, 0, 100)
    assert (code["promotions"], code["rollbacks"]) == (2, 1)
    assert code["draft_versions"] == ["base", "3", "5"]
    assert (code["speedup_vs_target"], code["speedup_vs_static"]) == (2.0, 1.333)
    # prose: 99 served (the failed one is left out), both windows hold all of them; no rejected steps: no α
    assert prose["alpha_first_100"] is prose["alpha_last_100"] is prose["alpha_delta"] is None
    assert prose["alpha_by_phase"] == {"code-heavy": None}
    assert prose["acceptance_first_100"] == prose["acceptance_last_100"] == round((50 * 1 + 49 * 2) / (99 * 2), 4)
    assert prose["acceptance_first_half"] == 0.5  # 49 rows, 1 of 2 each
    assert prose["acceptance_last_half"] == 0.99  # 50 rows: one with 1, 49 with 2, of 100
    assert (prose["requests"], prose["failed_requests"], prose["alpha_window"]) == (99, 1, 99)
    assert (prose["promotions"], prose["rollbacks"], prose["draft_versions"]) == (0, 0, ["base"])
    assert (prose["speedup_vs_target"], prose["speedup_vs_static"]) == (1.5, 1.2)


def test_phase_spans_follow_request_start_times():
    spans = phase_spans(synthetic_run())
    assert [p for p, _, _ in spans] == ["code-heavy", "shift: prose-heavy"]
    # the shift starts when its first request (finished at 100 after 0.4 s) started; the last span ends the run
    assert spans[0][1:] == pytest.approx((0.0, 99.6)) and spans[1][1:] == pytest.approx((99.6, 150.0))


def test_write_report_files_and_html(tmp_path):
    run = synthetic_run()
    index = write_report(run, tmp_path / "report")
    out = tmp_path / "report"
    assert index == out / "index.html"
    for name in ("alpha.png", "speedup.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 20_000, name
    assert _strict_loads((out / "summary.json").read_text()) == _strict_loads(json.dumps(summarize(run)))
    page = index.read_text()
    assert "<title>specops closed-loop demo</title>" in page
    assert "<script>" not in page and "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page
    assert "offline α 0.66 &gt; 0.61" in page and "champion" in page  # the registry table, escaped
    assert "v3" in page and "v5" in page and "rollback" in page
    assert "http://127.0.0.1:5000" in page and "only work while the demo is running" in page
    assert "data:image/png;base64," in page and 'src="http' not in page  # self-contained
    assert ">NO<" in page  # the prose online draft was not lossless, and says so
    assert "per-token" in page and "did not report rejected steps" in page  # prose's rows have none


def test_alpha_is_per_token_and_the_report_plots_it(tmp_path):
    """α = Σ accepted / (Σ accepted + Σ rejected steps), beside accepted / drafted; a run whose every
    request reported its rejected steps plots α and carries no missing-field note."""
    from specops.demo.report.data import acceptance, has_alpha, token_alpha

    rows = [
        RequestRow(
            t=float(i),
            cluster="sql",
            phase="p",
            drafted=9,
            accepted=4,
            draft_version="base",
            latency_s=0.1,
            num_generated=12,
            rejected_steps=2,
        )
        for i in range(4)
    ]
    rows.append(
        RequestRow(
            t=4.0,
            cluster="sql",
            phase="p",
            drafted=3,
            accepted=3,
            draft_version="base",
            latency_s=0.1,
            num_generated=4,
            rejected_steps=0,
        )
    )
    assert rows[0].alpha == pytest.approx(4 / 6) and rows[0].acceptance == pytest.approx(4 / 9)
    assert token_alpha(rows) == pytest.approx(19 / 27) and acceptance(rows) == pytest.approx(19 / 39)
    assert token_alpha([]) is None and acceptance([]) is None
    run = DemoRun(
        started_at="",
        duration_s=5.0,
        config={},
        requests=rows,
        promotions=[],
        speed=[SpeedRow("sql", "static draft", "base", 10.0, 0.4, 2, True, alpha=0.6)],
        registry_versions=[],
        mlflow_ui_url=None,
        api_url=None,
    )
    assert has_alpha(run)
    write_report(run, tmp_path)
    c = _strict_loads((tmp_path / "summary.json").read_text())["clusters"]["sql"]
    assert c["alpha_first_100"] == round(19 / 27, 4) and c["acceptance_first_100"] == round(19 / 39, 4)
    page = (tmp_path / "index.html").read_text()
    assert "did not report rejected steps" not in page and ">0.600<" in page
    assert load_run(tmp_path / "run.json").requests == rows


def test_run_json_round_trip_and_cli(tmp_path, capsys):
    run = synthetic_run()
    write_report(run, tmp_path / "a")
    text = (tmp_path / "a" / "run.json").read_text()
    _strict_loads(text)  # nan acceptance is written as null
    back = load_run(tmp_path / "a" / "run.json")
    assert back.requests == run.requests and back.promotions == run.promotions
    assert back.registry_versions == run.registry_versions and back.notes == run.notes
    assert math.isnan(back.speed[0].acceptance) and back.speed[1:] == run.speed[1:]
    assert (back.started_at, back.duration_s, back.config) == (run.started_at, run.duration_s, run.config)

    assert main([str(tmp_path / "a" / "run.json"), str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "b" / "index.html")
    assert (tmp_path / "b" / "summary.json").read_text() == (tmp_path / "a" / "summary.json").read_text()
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "run.json" in capsys.readouterr().out


def test_edge_cases_no_drafts_no_promotions_no_speed(tmp_path):
    reqs = [
        RequestRow(
            t=float(i),
            cluster="retrieval",
            phase="warmup",
            drafted=0,
            accepted=0,
            draft_version="base",
            latency_s=0.2,
            num_generated=8,
        )
        for i in range(5)
    ]
    reqs.append(
        RequestRow(
            t=5.0,
            cluster="",
            phase="warmup",
            drafted=0,
            accepted=0,
            draft_version="",
            latency_s=0.0,
            num_generated=0,
            ok=False,
        )
    )  # failed before routing
    run = DemoRun(
        started_at="2025-01-01T00:00:00",
        duration_s=6.0,
        config={},
        requests=reqs,
        promotions=[],
        speed=[],
        registry_versions=[],
        mlflow_ui_url=None,
        api_url=None,
    )
    index = write_report(run, tmp_path)
    summary = _strict_loads((tmp_path / "summary.json").read_text())
    assert list(summary["clusters"]) == ["retrieval"]  # the unrouted failure names no cluster
    c = summary["clusters"]["retrieval"]
    assert c["alpha_first_100"] is None and c["alpha_last_100"] is None and c["alpha_delta"] is None
    assert c["speedup_vs_target"] is None and c["speedup_vs_static"] is None
    assert (c["promotions"], c["requests"], summary["failed_requests"], summary["requests"]) == (0, 5, 1, 6)
    assert (tmp_path / "speedup.png").read_bytes()[:8] == PNG_MAGIC
    assert "MLflow UI" not in index.read_text()

    empty = DemoRun(
        started_at="",
        duration_s=0.0,
        config={},
        requests=[],
        promotions=[],
        speed=[],
        registry_versions=[],
        mlflow_ui_url=None,
        api_url=None,
    )
    write_report(empty, tmp_path / "empty")
    assert _strict_loads((tmp_path / "empty" / "summary.json").read_text())["clusters"] == {}
    assert (tmp_path / "empty" / "alpha.png").read_bytes()[:8] == PNG_MAGIC


def test_user_strings_are_escaped_everywhere(tmp_path):
    """Cluster names, prompts' phases, registry tags and URLs reach the page escaped (the template
    autoescapes); the page's own markup is not."""
    hostile = '<b onclick="x()">c&d</b>'
    rows = [
        RequestRow(
            t=float(i),
            cluster=hostile,
            phase=hostile,
            drafted=2,
            accepted=1,
            draft_version=hostile,
            latency_s=0.1,
            num_generated=4,
            rejected_steps=1,
        )
        for i in range(3)
    ]
    run = DemoRun(
        started_at=hostile,
        duration_s=3.0,
        config={hostile: hostile},
        requests=rows,
        promotions=[Promotion(t=1.0, cluster=hostile, version="2", reason=hostile)],
        speed=[SpeedRow(hostile, "static draft", hostile, 10.0, 0.4, 2, True)],
        registry_versions=[{hostile: hostile, "aliases": ["champion"]}],
        mlflow_ui_url='http://127.0.0.1:5000/"><script>x()</script>',
        api_url=None,
        notes=[hostile],
    )
    page = write_report(run, tmp_path).read_text()
    assert "<b " not in page and "<script>" not in page and "c&d" not in page
    escaped = "&lt;b onclick=&#34;x()&#34;&gt;c&amp;d&lt;/b&gt;"
    assert page.count(escaped) >= 10  # cluster, phase, versions, config, promotion, speed, registry, note, start
    assert 'href="http://127.0.0.1:5000/&#34;&gt;&lt;script&gt;x()&lt;/script&gt;"' in page
    assert '<tr class="champion">' in page and "<h2>Registry versions</h2>" in page


def _auto_row(t: float, draft_steps: int, steps: int, acc: int, rej: int, decode_s: float) -> RequestRow:
    return RequestRow(
        t=t,
        cluster="sql",
        phase="p",
        drafted=8,
        accepted=5,
        draft_version="base",
        latency_s=1.0,
        num_generated=32,
        rejected_steps=2,
        method="auto",
        decode_s=decode_s,
        steps=steps,
        draft_steps=draft_steps,
        draft_accepted=acc,
        draft_rejected_steps=rej,
    )


def test_the_default_methods_numbers_over_time_and_before_after(tmp_path):
    """Issue 55: under auto, the summary gives its share of steps on the draft, the draft's α on
    them and the served tokens/s by halves, and its speed-up over target-only before the traffic
    and after it; the report has the section and its plot."""
    rows = [_auto_row(i, 1, 10, 1, 1, 4.0) for i in range(4)] + [_auto_row(4 + i, 5, 10, 6, 2, 2.0) for i in range(4)]
    sp = lambda m, tps, share=math.nan: SpeedRow("sql", m, "", tps, math.nan, 3, True, draft_share=share)  # noqa: E731
    run = DemoRun(
        started_at="2026-11-28T00:00:00+00:00",
        duration_s=10.0,
        config={"speculation": "none named"},
        requests=rows,
        promotions=[Promotion(t=4.0, cluster="sql", version="2")],
        speed=[sp("target-only", 10.0), sp("auto", 16.0, 0.6)],
        registry_versions=[],
        mlflow_ui_url=None,
        api_url=None,
        speed_before=[sp("target-only", 10.0), sp("auto", 12.0, 0.1)],
    )
    c = summarize(run)["clusters"]["sql"]
    assert c["auto_draft_share_first_half"] == 0.1 and c["auto_draft_share_last_half"] == 0.5
    assert c["auto_draft_alpha_first_half"] == 0.5 and c["auto_draft_alpha_last_half"] == 0.75
    assert c["auto_served_tokens_per_s_first_half"] == 8.0 and c["auto_served_tokens_per_s_last_half"] == 16.0
    assert c["auto_speedup_vs_target_before"] == 1.2 and c["auto_speedup_vs_target"] == 1.6
    assert (c["auto_draft_share_before"], c["auto_draft_share_after"]) == (0.1, 0.6)
    index = write_report(run, tmp_path)
    page = index.read_text()
    assert "The default method over time" in page and "1.20× → 1.60×" in page and "Before the traffic" in page
    assert (tmp_path / "auto.png").read_bytes()[:8] == PNG_MAGIC
    back = load_run(tmp_path / "run.json")
    assert back.speed_before == run.speed_before and back.requests == run.requests
    # a fixed method's run has none of these
    fixed = DemoRun(**{**run.__dict__, "requests": [RequestRow(0.0, "sql", "p", 4, 2, "base", 1.0, 8)], "speed": []})
    fixed.speed_before = []
    assert "auto_draft_share_first_half" not in summarize(fixed)["clusters"]["sql"]


def test_promotions_that_land_as_the_trainer_stops_are_reported():
    from types import SimpleNamespace

    from rich.console import Console

    from specops.demo.traffic import late_promotions

    champs = {"sql": SimpleNamespace(version="4", tags={"gate_reason": "beats"}), "math": None}
    champs["api"] = SimpleNamespace(version="2", tags={})
    drafts = SimpleNamespace(keys=lambda: list(champs), by_alias=lambda c: champs[c])
    registry = SimpleNamespace(artifact=lambda kind: drafts)
    run = DemoRun("", 0.0, {}, [_auto_row(7.5, 1, 2, 1, 0, 1.0)], [Promotion(3.0, "api", "2")], [], [], None, None)
    late_promotions(registry, run, Console(quiet=True))
    (late,) = [p for p in run.promotions if p.cluster == "sql"]
    assert (late.version, late.t, late.kind) == ("4", 7.5, "promote") and "as the trainer stopped" in late.reason
    assert len(run.promotions) == 2  # api's champion was already recorded; math has none

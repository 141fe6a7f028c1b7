"""The scheduled trainer: ticks train, serving load skips ticks, jobs persist in SQLite and
PostgreSQL job stores across restarts, and a failing job neither raises nor stops the scheduler."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from specops.core.load_signal import write_load_signal
from specops.streams import StreamConfig, open_stream
from specops.trainer import checkpoint as ckpt
from specops.trainer.acceptance import Acceptance
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.schedule import (
    EVAL_FUNC,
    EVAL_JOB_ID,
    TICK_FUNC,
    TICK_JOB_ID,
    ScheduleConfig,
    ScheduleConfigError,
    ScheduleError,
    TrainerScheduler,
    engine_url,
)
from tests.trainer.logged import log_requests

N_REQUESTS = 16
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run several times faster on one intra-op thread than on two busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def logged(close_pair, tmp_path_factory):
    """A local stream holding N_REQUESTS logged requests over two clusters, and the draft's dir."""
    return log_requests(
        close_pair,
        tmp_path_factory.mktemp("schedule"),
        N_REQUESTS,
        seed=31,
        hi=16,
        max_new_tokens=16,
        cluster_of=lambda i: "code" if i % 3 else "prose",
    )


def _trainer(logged, out: Path, group: str) -> OnlineTrainer:
    cfg, draft_dir = logged
    ocfg = OnlineConfig(
        positions="rejected",
        group=group,
        interval=2,
        holdout_every=4,
        steps_per_update=1,
        poll_records=4,
        poll_timeout_s=0.05,
    )
    return OnlineTrainer(cfg, draft_dir, out, ocfg)


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def _committed(cfg: StreamConfig, group: str) -> dict[int, int]:
    with open_stream(cfg) as s:
        return s.committed(group, cfg.topics.misses)


def _drained(cfg: StreamConfig, group: str) -> bool:
    with open_stream(cfg) as s:
        end = {p: o for p, o in s.end_offsets(cfg.topics.misses).items() if o}
        return s.committed(group, cfg.topics.misses) == end


def _ticks(outcome: str) -> float:
    return REGISTRY.get_sample_value("specops_trainer_ticks_total", {"outcome": outcome}) or 0.0


class FakeTrainer:
    """Just what TrainerScheduler uses of an OnlineTrainer; ``step`` raises its first ``fail`` calls."""

    def __init__(self, out: Path, fail: int = 0, eval_fails: bool = False) -> None:
        self.out, self.fail, self.eval_fails, self.steps = out, fail, eval_fails, 0
        self.clusters = {"c": None} if eval_fails else {}

    def step(self, max_records: int | None = None) -> int:
        self.steps += 1
        if self.steps <= self.fail:
            raise RuntimeError(f"boom {self.steps}")
        return 0

    def evaluate(self, cluster: str) -> Acceptance:
        raise RuntimeError("evaluation boom")


# ---------------------------------------------------------------- 1. ticks train
def test_ticks_consume_train_and_export_evaluation(logged, tmp_path):
    cfg, _ = logged
    out = tmp_path / "trainer"
    trainer = _trainer(logged, out, "ticks")
    sched = TrainerScheduler(trainer, ScheduleConfig(tick_seconds=0.2, eval_seconds=0.5))
    assert sched.jobstore_url == f"sqlite:///{out.resolve()}/schedule.sqlite"
    sched.start()
    try:
        # a tick commits before it counts itself: wait for both (one tick may drain everything)
        _wait(lambda: _drained(cfg, "ticks") and sched.ticks_run >= 1, 60, "the stream to be drained by ticks")
        evals = sched.evals_run
        _wait(lambda: sched.evals_run > evals, 10, "an evaluation after the last update")
    finally:
        sched.shutdown()
        trainer.close()
    assert sched.ticks_run >= 1 and sched.ticks_failed == 0 and sched.ticks_skipped == 0
    assert sched.records_consumed == N_REQUESTS
    for cluster in ("code", "prose"):
        latest = ckpt.latest_version(out, cluster)
        assert latest is not None, f"no update for {cluster}"
        assert ckpt.load_state(latest)["updates"] >= 1
    acc = trainer.evaluate("code")
    assert acc.num_positions > 0
    for kind, value in (("sampling", acc.sampling), ("greedy", acc.greedy)):
        got = REGISTRY.get_sample_value("specops_trainer_heldout_acceptance", {"cluster": "code", "kind": kind})
        assert got == pytest.approx(value, abs=1e-6), kind
    assert (out / "schedule.sqlite").exists()


# ---------------------------------------------------------------- 2. load-aware skip
def test_ticks_are_skipped_while_serving_is_busy(logged, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specops.trainer.schedule")
    cfg, _ = logged
    signal = tmp_path / "load.json"
    write_load_signal(signal, 0.95)
    trainer = _trainer(logged, tmp_path / "trainer", "load")
    skipped0, ran0 = _ticks("skipped_load"), _ticks("ran")
    sched = TrainerScheduler(
        trainer,
        ScheduleConfig(
            tick_seconds=0.2, eval_seconds=3600, load_signal=str(signal), load_threshold=0.8, load_stale_s=10
        ),
    )
    sched.start()
    try:
        # busy: ticks are skipped, logged and counted, and nothing is consumed
        _wait(lambda: sched.ticks_skipped >= 3, 10, "three skipped ticks")
        assert sched.ticks_run == 0 and sched.records_consumed == 0
        assert _committed(cfg, "load") == {}
        assert "skipped distillation tick: serving load 0.95 > 0.80" in caplog.messages
        # idle: ticks run and consume
        write_load_signal(signal, 0.1)
        # (a tick commits its offsets before it returns and counts what it consumed: wait for the count too, or a
        # loaded machine sees the stream drained while the last tick is still adding its records; CI saw 12 of 16)
        # (and for the tick's own count: it adds its records before it counts itself as run; CI once saw 0 ticks)
        _wait(
            lambda: _drained(cfg, "load") and sched.records_consumed == N_REQUESTS and sched.ticks_run > 0,
            60,
            "the stream to be drained and counted once serving is idle",
        )
        assert sched.ticks_run > 0 and sched.records_consumed == N_REQUESTS
        # a stale signal (serving gone) is unknown: it never causes a skip
        write_load_signal(signal, 0.95, now=time.time() - 60)
        runs, skipped = sched.ticks_run, sched.ticks_skipped
        _wait(lambda: sched.ticks_run >= runs + 3, 10, "three ticks with a stale signal")
        assert sched.ticks_skipped == skipped and sched.last_load is None
    finally:
        sched.shutdown()
        trainer.close()
    assert any("stale load signal" in m for m in caplog.messages)
    assert _ticks("skipped_load") - skipped0 == sched.ticks_skipped
    assert _ticks("ran") - ran0 == sched.ticks_run


def test_a_callable_load_signal(tmp_path):
    values = iter([0.9, None])
    sched = TrainerScheduler(FakeTrainer(tmp_path), ScheduleConfig(load_signal=lambda: next(values)))
    assert sched.tick() == "skipped_load" and sched.ticks_skipped == 1
    assert sched.tick() == "ran" and sched.ticks_run == 1  # None = unknown: not skipped
    assert sched.tick() == "ran"  # a raising callable (StopIteration) is unknown too


# ---------------------------------------------------------------- 3./4. persistent job stores
def _rows(url: str, table: str) -> dict[str, dict]:
    """The job store's rows: plain numbers per job id (specops.trainer.runtimes), nothing pickled."""
    from sqlalchemy import create_engine, text

    engine = create_engine(engine_url(url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(f"SELECT id, next_run_time, last_run_time, interval_s FROM {table}")).all()
    finally:
        engine.dispose()
    return {r[0]: {"next_run_time": r[1], "last_run_time": r[2], "interval_s": r[3]} for r in rows}  # epoch seconds


def _check_persistence(url: str, table: str, out: Path) -> None:
    cfg = ScheduleConfig(
        jobstore_url=url, jobstore_table=table, tick_seconds=3600, eval_seconds=7200, misfire_grace_s=7, coalesce=False
    )
    first = TrainerScheduler(FakeTrainer(out), cfg)
    t0 = datetime.now(UTC)
    first.start()
    try:
        for job_id, func in ((TICK_JOB_ID, TICK_FUNC), (EVAL_JOB_ID, EVAL_FUNC)):  # registered from configuration
            job = first._scheduler.get_job(job_id)
            assert job.func_ref == func and job.kwargs == {"trainer_id": first.trainer_id}
            assert job.max_instances == 1 and job.coalesce is False and job.misfire_grace_time == 7
    finally:
        first.shutdown()
    rows = _rows(url, table)
    assert set(rows) == {TICK_JOB_ID, EVAL_JOB_ID}
    for job_id, seconds in ((TICK_JOB_ID, 3600), (EVAL_JOB_ID, 7200)):
        job = rows[job_id]
        assert job["interval_s"] == seconds and job["last_run_time"] is None
        assert abs(job["next_run_time"] - (t0.timestamp() + seconds)) < 5

    # a restarted trainer on the same store finds the same jobs, keeps their next run times, adds no rows
    second = TrainerScheduler(FakeTrainer(out), cfg)
    second.start()
    try:
        jobs = second.jobs()
        assert set(jobs) == set(rows)
        assert all(abs(jobs[j].timestamp() - rows[j]["next_run_time"]) < 1e-3 for j in rows)
    finally:
        second.shutdown()
    again = _rows(url, table)
    assert set(again) == set(rows)
    assert {j: r["next_run_time"] for j, r in again.items()} == pytest.approx(
        {j: r["next_run_time"] for j, r in rows.items()}
    )

    # a shorter interval takes effect at once; the untouched job keeps its time
    third = TrainerScheduler(
        FakeTrainer(out), ScheduleConfig(jobstore_url=url, jobstore_table=table, tick_seconds=60, eval_seconds=7200)
    )
    third.start()
    try:
        assert third._scheduler.get_job(TICK_JOB_ID).coalesce is True
    finally:
        third.shutdown()
    last = _rows(url, table)
    assert set(last) == set(rows) and last[TICK_JOB_ID]["interval_s"] == 60
    assert last[TICK_JOB_ID]["next_run_time"] < rows[TICK_JOB_ID]["next_run_time"] - 3000
    assert last[EVAL_JOB_ID]["next_run_time"] == pytest.approx(rows[EVAL_JOB_ID]["next_run_time"])


def test_sqlite_job_store_survives_restart(tmp_path):
    db = tmp_path / "jobs" / "schedule.sqlite"
    _check_persistence(f"sqlite:///{db}", "specops_trainer_jobs", tmp_path / "trainer")
    assert db.exists()


def test_postgres_job_store_survives_restart(tmp_path):
    psycopg2 = pytest.importorskip("psycopg2")
    try:
        psycopg2.connect(PG_URL, connect_timeout=3).close()
    except psycopg2.OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable at 127.0.0.1:5432: {' '.join(str(exc).split())}")
    from sqlalchemy import create_engine, text

    table = f"test_jobs_{uuid.uuid4().hex[:12]}"
    try:
        _check_persistence(PG_URL, table, tmp_path / "trainer")
    finally:
        engine = create_engine(engine_url(PG_URL))
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
        engine.dispose()


# ---------------------------------------------------------------- 5. failing jobs
def test_failing_jobs_are_counted_and_do_not_stop_the_scheduler(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specops.trainer.schedule")
    errors0 = _ticks("error")
    trainer = FakeTrainer(tmp_path, fail=2, eval_fails=True)
    sched = TrainerScheduler(trainer, ScheduleConfig(tick_seconds=0.1, eval_seconds=0.1))
    sched.start()
    try:
        _wait(lambda: sched.ticks_failed >= 2 and sched.ticks_run >= 2, 10, "two failed then two good ticks")
        _wait(lambda: any("evaluation job failed" in m for m in caplog.messages), 10, "a failed evaluation")
        assert sched.running
    finally:
        sched.shutdown()
    assert not sched.running
    assert sched.ticks_failed == 2 and _ticks("error") - errors0 == 2
    failed = [r for r in caplog.records if r.getMessage().startswith("distillation tick failed")]
    assert len(failed) == 2 and all(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in failed)


def test_config_is_validated_and_one_trainer_is_scheduled_once(tmp_path):
    with pytest.raises(ScheduleConfigError, match="tick_seconds must be a positive"):
        ScheduleConfig(tick_seconds=0)
    with pytest.raises(ScheduleConfigError, match="sqlite:///... or postgresql://"):
        ScheduleConfig(jobstore_url="mysql://u@h/db")
    with pytest.raises(ScheduleConfigError, match="load_signal must be"):
        ScheduleConfig(load_signal=3)
    assert ScheduleConfig(tick_seconds=10).budget_s == 8.0
    unreachable = ScheduleConfig(jobstore_url="postgresql://postgres@127.0.0.1:1/none")
    with pytest.raises(ScheduleError, match="cannot open the job store postgresql://postgres@127.0.0.1:1/none"):
        TrainerScheduler(FakeTrainer(tmp_path), unreachable).start()
    a = TrainerScheduler(FakeTrainer(tmp_path), ScheduleConfig(tick_seconds=3600, eval_seconds=3600))
    a.start()
    try:
        with pytest.raises(ScheduleError, match="already scheduled"):
            TrainerScheduler(FakeTrainer(tmp_path), ScheduleConfig()).start()
    finally:
        a.shutdown()


def test_cli_train_schedule(logged, tmp_path, capsys):
    from specops.cli.main import main

    cfg, draft_dir = logged
    out = tmp_path / "trainer"
    rc = main(
        [
            "--threads",
            "1",
            "train",
            "--registry",
            "none",
            "--stream",
            cfg.url,
            "--draft",
            str(draft_dir),
            "--out",
            str(out),
            "--group",
            "cli",
            "--interval",
            "2",
            "--steps",
            "1",
            "--holdout-every",
            "4",
            "--positions",
            "rejected",
            "--schedule",
            "--tick-seconds",
            "0.2",
            "--load-threshold",
            "0.9",
            "--idle-exit",
            "1.5",
        ]
    )
    assert rc == 0
    assert f"consumed {N_REQUESTS} records" in capsys.readouterr().out
    assert _drained(cfg, "cli")
    assert set(_rows(f"sqlite:///{out}/schedule.sqlite", "specops_trainer_jobs")) == {TICK_JOB_ID, EVAL_JOB_ID}


@pytest.mark.parametrize("schedule", [False, True], ids=["loop", "schedule"])
def test_cli_train_max_records_stops_at_the_limit(logged, tmp_path, capsys, schedule):
    """--max-records N consumes, trains on and commits exactly N records, not the whole pass it is in."""
    from specops.cli.main import main

    cfg, draft_dir = logged
    out, group = tmp_path / "trainer", f"limit-{schedule}"
    args = [
        "--threads",
        "1",
        "train",
        "--registry",
        "none",
        "--stream",
        cfg.url,
        "--draft",
        str(draft_dir),
        "--out",
        str(out),
        "--group",
        group,
        "--interval",
        "2",
        "--steps",
        "1",
        "--max-records",
        "7",
        "--idle-exit",
        "5",
        "--positions",
        "rejected",
    ]
    if schedule:
        args += ["--schedule", "--tick-seconds", "0.2", "--load-threshold", "0.9"]
    assert main(args) == 0
    assert "consumed 7 records" in capsys.readouterr().out
    assert sum(_committed(cfg, group).values()) == 7 < N_REQUESTS

"""The trainer's job store holds run times, never code (issue 34, item 7): no row is pickled or
unpickled, a restarted scheduler computes its next runs from the persisted ones (a new interval
from the last run, a missed run at once), and a table left by APScheduler's pickling store is
converted without unpickling it."""

from __future__ import annotations

import pickle
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import create_engine, inspect, text

from specops.trainer.runtimes import RunTimes, next_run_after_restart
from specops.trainer.schedule import (
    EVAL_JOB_ID,
    TICK_FUNC,
    TICK_JOB_ID,
    ScheduleConfig,
    TrainerScheduler,
)
from tests.trainer.test_schedule import FakeTrainer, _wait

TABLE = "specops_trainer_jobs"
PICKLE_HEADERS = (b"\x80\x02}", b"\x80\x03}", b"\x80\x04\x95", b"\x80\x05\x95")
"""How a pickled job state starts (APScheduler pickles a dict: protocol 2 and 3 go straight to
EMPTY_DICT, 4 and 5 to a FRAME). Three bytes, not two: the file's REAL columns (run times as
floats, and their older values in free pages) hold two-byte pairs such as ``80 02`` by chance,
which failed this test once in CI."""


def _rows(db: Path) -> list[tuple]:
    engine = create_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(f"SELECT * FROM {TABLE}")).all()]
    finally:
        engine.dispose()


def _columns(db: Path) -> set[str]:
    engine = create_engine(f"sqlite:///{db}")
    try:
        return {c["name"] for c in inspect(engine).get_columns(TABLE)}
    finally:
        engine.dispose()


def test_the_store_holds_no_pickled_bytes_and_a_restart_counts_from_the_last_run(tmp_path):
    db = tmp_path / "schedule.sqlite"
    url = f"sqlite:///{db}"
    first = TrainerScheduler(
        FakeTrainer(tmp_path), ScheduleConfig(jobstore_url=url, tick_seconds=0.2, eval_seconds=3600)
    )
    first.start()
    try:
        _wait(lambda: first.ticks_run >= 3, 20, "three ticks")
    finally:
        first.shutdown()

    rows = _rows(db)
    assert _columns(db) == {"id", "next_run_time", "last_run_time", "interval_s", "updated_at"}
    assert {r[0] for r in rows} == {TICK_JOB_ID, EVAL_JOB_ID}
    for row in rows:  # text and numbers only: nothing to unpickle, no code reference
        assert isinstance(row[0], str) and all(v is None or isinstance(v, float) for v in row[1:]), row
    blob = db.read_bytes()
    assert not any(h in blob for h in PICKLE_HEADERS) and TICK_FUNC.encode() not in blob
    tick = {r[0]: r for r in rows}[TICK_JOB_ID]
    last_run = tick[2]
    assert last_run is not None and time.time() - 5 < last_run <= time.time()

    # Restarted with a longer interval: the next run counts from the persisted last run, not from now.
    time.sleep(0.5)
    second = TrainerScheduler(
        FakeTrainer(tmp_path), ScheduleConfig(jobstore_url=url, tick_seconds=600, eval_seconds=3600)
    )
    second.start()
    try:
        jobs = second.jobs()
        assert abs(jobs[TICK_JOB_ID].timestamp() - (last_run + 600)) < 1e-3
        assert abs(jobs[EVAL_JOB_ID].timestamp() - {r[0]: r for r in rows}[EVAL_JOB_ID][1]) < 1e-3  # unchanged: kept
    finally:
        second.shutdown()

    # A run that came due while the trainer was down (within the misfire grace) runs at once after a restart.
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(f"UPDATE {TABLE} SET next_run_time = :t WHERE id = :id"), {"t": time.time() - 2, "id": TICK_JOB_ID}
        )
    engine.dispose()
    third = TrainerScheduler(
        FakeTrainer(tmp_path), ScheduleConfig(jobstore_url=url, tick_seconds=600, eval_seconds=3600, misfire_grace_s=30)
    )
    third.start()
    try:
        _wait(lambda: third.ticks_run >= 1, 10, "the missed tick")
        assert third.jobs()[TICK_JOB_ID].timestamp() > time.time() + 500  # then one interval on
    finally:
        third.shutdown()


class _Trap:
    """Unpickling this touches a file: proof that a row was (or was not) unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_table_of_apscheduler_pickled_jobs_is_converted_without_unpickling(tmp_path):
    db = tmp_path / "schedule.sqlite"
    marker = tmp_path / "unpickled"
    due = time.time() + 1234.5
    engine = create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:  # APScheduler 3.x's SQLAlchemyJobStore table, one hostile row
        conn.execute(
            text(f"CREATE TABLE {TABLE} (id VARCHAR(191) PRIMARY KEY, next_run_time FLOAT, job_state BLOB NOT NULL)")
        )
        conn.execute(
            text(f"INSERT INTO {TABLE} VALUES (:id, :t, :state)"),
            {"id": TICK_JOB_ID, "t": due, "state": pickle.dumps(_Trap(marker))},
        )
    engine.dispose()

    sched = TrainerScheduler(
        FakeTrainer(tmp_path), ScheduleConfig(jobstore_url=f"sqlite:///{db}", tick_seconds=3600, eval_seconds=3600)
    )
    sched.start()
    try:
        assert abs(sched.jobs()[TICK_JOB_ID].timestamp() - due) < 1e-3  # its next run time carried over
    finally:
        sched.shutdown()
    assert not marker.exists()
    assert "job_state" not in _columns(db) and not any(h in db.read_bytes() for h in PICKLE_HEADERS[2:])


def test_next_run_after_restart():
    now = datetime(2025, 1, 1, tzinfo=UTC)
    t = now.timestamp()
    assert next_run_after_restart(None, 60, now) is None
    same = RunTimes("j", next_run_time=t + 30, last_run_time=t - 30, interval_s=60)
    assert next_run_after_restart(same, 60, now).timestamp() == t + 30  # unchanged interval: kept
    assert next_run_after_restart(same, 600, now).timestamp() == t + 570  # new interval: from the last run
    assert next_run_after_restart(same, 10, now).timestamp() == t - 20  # due since the last run + 10 s: at once
    late = RunTimes("j", next_run_time=t + 3000, last_run_time=None, interval_s=3600)
    assert next_run_after_restart(late, 60, now).timestamp() == t + 60  # never later than one interval from now
    never_ran = RunTimes("j", next_run_time=t + 30, last_run_time=None, interval_s=60)
    assert next_run_after_restart(never_ran, 600, now).timestamp() == t + 30
    overdue = RunTimes("j", next_run_time=t - 100, last_run_time=t - 160, interval_s=60)
    assert next_run_after_restart(overdue, 60, now) == now - timedelta(seconds=100)  # missed: at once

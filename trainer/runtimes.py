"""The trainer's schedule on disk: run times only, never code.

APScheduler's SQLAlchemy job store pickles each job (its function reference, trigger and
arguments) and unpickles the rows when it starts, so whoever can write that database can run
code in the trainer. Here the jobs live in APScheduler's in-memory store and are registered
again from configuration at every start (:class:`~specops.trainer.schedule.TrainerScheduler`); what
persists is one row of plain numbers per job id, in a table of our own:

====================  =====================================================================
``id``                the job id (``distill-tick``, ``evaluate``, ...)
``next_run_time``     epoch seconds of its next run (what the container healthcheck reads)
``last_run_time``     epoch seconds of the scheduled time of its last finished run, or NULL
``interval_s``        the interval it ran at
``updated_at``        epoch seconds of the write
====================  =====================================================================

:class:`RunTimesJobStore` writes a job's row whenever APScheduler adds, moves or removes it
(every dispatch moves ``next_run_time``); the scheduler records ``last_run_time`` when a run
finishes. At a restart :func:`next_run_after_restart` computes each job's next run from these
rows, so intervals and missed runs survive a restart. A table left by APScheduler's own store
(with a pickled ``job_state`` column) is converted at start: its ids and next run times are
read as numbers, never unpickled, and the table is rebuilt in this shape.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.util import datetime_to_utc_timestamp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunTimes:
    """One job's persisted row."""

    job_id: str
    next_run_time: float | None
    last_run_time: float | None = None
    interval_s: float | None = None


class RunTimesTable:
    """The table of run times at an SQLAlchemy URL (SQLite or PostgreSQL)."""

    def __init__(self, url: str, table: str, *, engine_options: dict | None = None) -> None:
        from sqlalchemy import Column, Float, MetaData, String, Table, create_engine

        self.engine = create_engine(url, **(engine_options or {}))
        self.name = table
        self.table = Table(
            table,
            MetaData(),
            Column("id", String(191), primary_key=True),
            Column("next_run_time", Float(25), index=True),
            Column("last_run_time", Float(25)),
            Column("interval_s", Float(25)),
            Column("updated_at", Float(25)),
        )

    def open(self) -> None:
        """Create the table, converting one left by APScheduler's pickling job store."""
        from sqlalchemy import inspect, select

        columns = (
            {c["name"] for c in inspect(self.engine).get_columns(self.name)}
            if inspect(self.engine).has_table(self.name)
            else set()
        )
        if columns and "job_state" in columns:
            from sqlalchemy import Column, Float, MetaData, Table, Unicode

            old = Table(self.name, MetaData(), Column("id", Unicode(191)), Column("next_run_time", Float(25)))
            with self.engine.begin() as conn:
                kept = [(r[0], r[1]) for r in conn.execute(select(old.c.id, old.c.next_run_time))]  # numbers only
                old.drop(conn)
                self.table.create(conn)
                for job_id, next_run in kept:
                    conn.execute(self.table.insert().values(id=job_id, next_run_time=next_run, updated_at=time.time()))
            log.warning(
                "job store table %s held APScheduler's pickled jobs; converted it to run times only (%d jobs: "
                "%s), nothing was unpickled",
                self.name,
                len(kept),
                ", ".join(j for j, _ in kept) or "none",
            )
        else:
            self.table.create(self.engine, checkfirst=True)

    def load(self) -> dict[str, RunTimes]:
        from sqlalchemy import select

        t = self.table
        with self.engine.connect() as conn:
            rows = conn.execute(select(t.c.id, t.c.next_run_time, t.c.last_run_time, t.c.interval_s)).all()
        return {r[0]: RunTimes(r[0], r[1], r[2], r[3]) for r in rows}

    def write(self, job_id: str, **values: float | None) -> None:
        """Set ``values`` (``next_run_time``, ``last_run_time``, ``interval_s``) on ``job_id``'s row, creating it."""
        t = self.table
        values = {**values, "updated_at": time.time()}
        with self.engine.begin() as conn:
            if conn.execute(t.update().where(t.c.id == job_id).values(**values)).rowcount == 0:
                conn.execute(t.insert().values(id=job_id, **values))

    def delete(self, job_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.table.delete().where(self.table.c.id == job_id))

    def prune(self, keep: set[str]) -> list[str]:
        """Delete the rows of jobs not in ``keep`` (switched off since the last run); returns their ids."""
        gone = sorted(set(self.load()) - keep)
        for job_id in gone:
            self.delete(job_id)
        return gone

    def close(self) -> None:
        self.engine.dispose()


class RunTimesJobStore(MemoryJobStore):
    """APScheduler's in-memory job store, writing each job's run times through to a :class:`RunTimesTable`."""

    def __init__(self, table: RunTimesTable) -> None:
        super().__init__()
        self.runs = table
        self.last_run: dict[str, float] = {}

    def start(self, scheduler, alias) -> None:
        super().start(scheduler, alias)
        self.runs.open()

    def add_job(self, job) -> None:
        super().add_job(job)
        self._write(job)

    def update_job(self, job) -> None:
        super().update_job(job)
        self._write(job)

    def remove_job(self, job_id) -> None:
        super().remove_job(job_id)
        self._persist(self.runs.delete, job_id)

    def shutdown(self) -> None:
        super().shutdown()  # forgets the jobs in memory; their rows stay for the next start
        self.runs.close()

    def record_run(self, job_id: str, scheduled: datetime) -> None:
        """A run of ``job_id`` scheduled at ``scheduled`` finished (ran or failed)."""
        when = datetime_to_utc_timestamp(scheduled)
        if when is not None and when > self.last_run.get(job_id, float("-inf")):
            self.last_run[job_id] = when
            self._persist(self.runs.write, job_id, last_run_time=when)

    def _write(self, job) -> None:
        interval = getattr(job.trigger, "interval", None)
        self._persist(
            self.runs.write,
            job.id,
            next_run_time=datetime_to_utc_timestamp(job.next_run_time),
            interval_s=interval.total_seconds() if interval is not None else None,
        )

    def _persist(self, write, *args, **kwargs) -> None:
        """A write that may fail (the database is down) without stopping the scheduler: the jobs
        run from memory, the next dispatch writes again, and the healthcheck sees the stale row."""
        from sqlalchemy.exc import SQLAlchemyError

        try:
            write(*args, **kwargs)
        except SQLAlchemyError as exc:
            log.warning("could not write run times to job store table %s: %s", self.runs.name, exc)


def next_run_after_restart(saved: RunTimes | None, interval_s: float, now: datetime) -> datetime | None:
    """When a job of interval ``interval_s`` runs next after a restart, from its saved row; None
    = in one interval (no row). The saved next run is kept when the interval is unchanged; a new
    interval counts from the last run (or the saved next run when it never ran). A time in the
    past runs at once (missed runs coalesced; later than the misfire grace, dropped by APScheduler);
    a time later than one interval from now is brought forward to it."""
    if saved is None or (saved.next_run_time is None and saved.last_run_time is None):
        return None
    if saved.interval_s is not None and abs(saved.interval_s - interval_s) < 1e-9 and saved.next_run_time is not None:
        at = saved.next_run_time
    elif saved.last_run_time is not None:
        at = saved.last_run_time + interval_s
    else:
        at = saved.next_run_time
    at = min(at, now.timestamp() + interval_s)
    return datetime.fromtimestamp(at, UTC)

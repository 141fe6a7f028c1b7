"""Settings and errors of the scheduled trainer (:mod:`specops.trainer.schedule`): when its jobs run,
when a job is skipped for serving load, and where the job store lives."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specops.core.errors import SpecOpsError

LoadSignal = str | os.PathLike | Callable[[], float | None] | None

_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class ScheduleError(SpecOpsError):
    """The scheduled trainer cannot start (job store unreachable, trainer already scheduled)."""


class ScheduleConfigError(ScheduleError, ValueError):
    """A schedule setting is invalid. The message says what to change."""


@dataclass
class ScheduleConfig:
    """When the trainer's jobs run and when a tick is skipped for serving load."""

    jobstore_url: str | None = None
    """SQLAlchemy URL of the persistent job store; None = ``sqlite:///<trainer out>/schedule.sqlite``."""
    jobstore_table: str = "specops_trainer_jobs"
    """Table holding the jobs; one table per trainer process (replicas use their own)."""
    tick_seconds: float = 5.0
    """Interval of the distillation tick, in seconds."""
    tick_budget_s: float | None = None
    """Seconds a tick keeps calling ``trainer.step()``; None = 0.8 * tick_seconds (one step may overrun it)."""
    eval_seconds: float = 60.0
    """Interval of the held-out evaluation job, in seconds."""
    misfire_grace_s: int = 30
    """How late a run may start and still run: covers a tick delayed by a long update or a short restart;
    runs later than this are dropped, since the next one is at most one interval away."""
    coalesce: bool = True
    """After downtime run a missed job once, not once per missed interval (a tick drains the backlog anyway)."""
    load_threshold: float = 0.8
    """Skip a tick while the serving load signal is above this value."""
    load_signal: LoadSignal = None
    """Serving load: a path to a JSON file ``{"load": float, "time": epoch}``, or a callable returning the load
    (None = unknown); None = never skip."""
    load_stale_s: float = 30.0
    """A file signal older than this is unknown and does not cause a skip (serving may have died)."""
    router_refit_s: float | None = None
    """Interval of the router refit job, in seconds; None (or 0) = no router refits."""
    datastore_rebuild_s: float | None = None
    """Interval of the DReSD datastore rebuild job, in seconds; None (or 0) = no rebuilds."""
    sessions_rebuild_s: float | None = None
    """Interval of the LLMA past-sessions rebuild job, in seconds; None (or 0) = no rebuilds."""

    def __post_init__(self) -> None:
        grace = self.misfire_grace_s
        if isinstance(grace, bool) or not isinstance(grace, int) or grace < 1:  # APScheduler takes whole seconds
            raise ScheduleConfigError(f"misfire_grace_s must be a whole number of seconds >= 1, got {grace!r}")
        if not self.router_refit_s:
            self.router_refit_s = None  # 0 means off, as on the command line
        if not self.datastore_rebuild_s:
            self.datastore_rebuild_s = None
        if not self.sessions_rebuild_s:
            self.sessions_rebuild_s = None
        optional = tuple(n for n in ("router_refit_s", "datastore_rebuild_s", "sessions_rebuild_s") if getattr(self, n))
        for name in ("tick_seconds", "eval_seconds", "load_stale_s", *optional):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ScheduleConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.tick_budget_s is not None and not (0 < self.tick_budget_s < math.inf):
            raise ScheduleConfigError(
                f"tick_budget_s must be > 0 (got {self.tick_budget_s!r}); leave it None for 0.8 * tick_seconds"
            )
        if not isinstance(self.load_threshold, int | float) or not math.isfinite(self.load_threshold):
            raise ScheduleConfigError(f"load_threshold must be a finite number (got {self.load_threshold!r}), e.g. 0.8")
        if not isinstance(self.coalesce, bool):
            raise ScheduleConfigError(f"coalesce must be True or False, got {self.coalesce!r}")
        signal = self.load_signal
        if signal is not None and not isinstance(signal, str | os.PathLike) and not callable(signal):
            raise ScheduleConfigError(
                f"load_signal must be a path to a JSON file written by serving, a callable returning the load, "
                f"or None to never skip; got {type(signal).__name__}"
            )
        if not _TABLE_NAME.match(self.jobstore_table):
            raise ScheduleConfigError(
                f"jobstore_table must be a plain SQL identifier (letters, digits, _), got {self.jobstore_table!r}"
            )
        if self.jobstore_url is not None:
            check_url(self.jobstore_url)

    @property
    def budget_s(self) -> float:
        """The tick's time budget in seconds."""
        return self.tick_budget_s if self.tick_budget_s is not None else 0.8 * self.tick_seconds


def check_url(url: str) -> None:
    """Raise :class:`ScheduleConfigError` unless ``url`` is an ``sqlite://`` or ``postgresql://`` SQLAlchemy URL."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ScheduleConfigError(
            f"jobstore URL {url!r} is not an SQLAlchemy URL: use sqlite:///path/schedule.sqlite "
            f"or postgresql://user@host:5432/db ({exc})"
        ) from exc
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ScheduleConfigError(
            f"jobstore URL must be sqlite:///... or postgresql://..., got {parsed.get_backend_name()!r}"
        )


def engine_url(url: str) -> str:
    """``url`` with a driver SQLAlchemy can load here: ``postgresql://`` means psycopg2 (SQLAlchemy 2.1's
    default PostgreSQL driver is psycopg 3, which is not a dependency)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg2")
    return parsed.render_as_string(hide_password=False)


def default_jobstore_url(out_dir: str | os.PathLike) -> str:
    """``sqlite:///<out_dir>/schedule.sqlite`` (absolute path)."""
    return f"sqlite:///{Path(out_dir).resolve() / 'schedule.sqlite'}"


def safe_url(url: str) -> str:
    """``url`` with its password hidden, for logs and errors."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def describe_signal(signal: LoadSignal) -> str:
    """The load signal as the start-up log line names it."""
    if signal is None:
        return "none (never skip)"
    return getattr(signal, "__name__", "callable") + "()" if callable(signal) else str(signal)

"""Scheduled jobs of the online trainer: the distillation tick, the evaluation, the router refit.

:class:`TrainerScheduler` runs an :class:`~specops.trainer.online.trainer.OnlineTrainer` under an
APScheduler 3.x ``BackgroundScheduler`` instead of the trainer's own loop:

- **distill-tick** (every ``tick_seconds``): unless serving is busy, call
  ``trainer.step()`` (consume, buffer, update, persist, commit) until the stream is
  drained or the tick's time budget is used;
- **evaluate** (every ``eval_seconds``): held-out expected acceptance of every
  cluster in memory (``OnlineConfig.max_loaded_clusters``), logged and exported as a Prometheus gauge;
- **router-refit** (every ``router_refit_s``, when set and a
  :class:`~specops.trainer.router_fit.RouterRefitter` is given): refit the prompt router from
  ``spec.generations``, register it and promote it through its gate. It skips under
  serving load like a tick, and does not wait for the distillation (it touches no draft).
  When it is off, a ``router-refit`` row left in the job store by an earlier run is removed.
- **datastore-rebuild** (every ``datastore_rebuild_s``, when set and a
  :class:`~specops.trainer.datastores.DatastoreRebuilder` is given): rebuild each cluster's DReSD
  datastore from its new ``spec.generations``, gate it on held-out MAR, register and promote
  it. Load-aware like the others (the target pass that makes the keys is its main cost).
- **sessions-rebuild** (every ``sessions_rebuild_s``, when set and a
  :class:`~specops.trainer.sessions.SessionIndexRebuilder` is given): rebuild each cluster's LLMA
  past-sessions index from its new ``spec.generations`` outputs, gate it on the held-out copy
  hit rate, register ``sessions-<cluster>`` and promote it. No model runs: it is cheap.

**Load-aware skip (the paper's "spare FLOPs").** Distillation should use the compute
serving leaves idle. Serving writes its load to a small JSON file
(``{"load": 0.42, "time": <epoch seconds>}``, see ``specops.core.load_signal``); a tick is
skipped while that load is above ``load_threshold``, logged at INFO and counted in
``specops_trainer_ticks_total{outcome="skipped_load"}``. A missing, unreadable or stale
signal (older than ``load_stale_s``) is *unknown* and never causes a skip: a crashed
serving process must not stall training forever. Skipping is safe: nothing is polled,
so nothing is uncommitted. A skip longer than the stream's ``max_poll_interval_s``
makes this trainer leave its consumer group; the next tick that runs rejoins and
resumes from the committed offsets (other replicas may own its partitions meanwhile).

**A job store that stores no code.** APScheduler's persistent job stores pickle each job and
unpickle the rows at start, which would let whoever can write the database run code in the
trainer. Here the jobs are re-registered from configuration at every start, in APScheduler's
in-memory store, and only their run times persist (:mod:`specops.trainer.runtimes`): one row per job
id in the table ``jobstore_table`` of ``jobstore_url`` (SQLite at
``<trainer out>/schedule.sqlite`` by default, or any ``postgresql://`` URL) with its next run
time, the scheduled time of its last finished run and its interval, as plain numbers. A table
left by APScheduler's pickling store is converted at start without unpickling anything. The
jobs are the module-level functions ``specops.trainer.schedule:_tick``, ``specops.trainer.schedule:_evaluate``
and so on, whose only argument is ``trainer_id``, a string key into this module's registry of
the schedulers running in this process. :meth:`TrainerScheduler.start` registers itself under
that key before any job can fire; :meth:`TrainerScheduler.shutdown` removes it.

**The schedule survives a restart.** The jobs have stable ids (``distill-tick``,
``evaluate``, ...). A restarted trainer on the same table reads each job's row
(:func:`~specops.trainer.runtimes.next_run_after_restart`): with the same interval it keeps the
pending next run time, a new interval counts from the last run, and neither is later than
one interval from now (a shorter interval takes effect at once). Runs missed while the
trainer was down are *coalesced* into one (``coalesce=True``) and dropped when later than
``misfire_grace_s``. The rows of jobs switched off since the last run are deleted. Each job
has ``max_instances=1``: a tick still running when the next is due makes APScheduler skip the
new one, never run two updates at once. The two jobs also share a lock, so an evaluation
never reads a draft mid-update.

One job store (URL and table) belongs to one trainer process: nothing coordinates
schedulers sharing a table. Replicas of a consumer group use separate
tables (``jobstore_table``) or databases.

The settings (:class:`ScheduleConfig`), the errors and the job store URL helpers are in
:mod:`specops.trainer.schedule_config`; they are importable from here too.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import Counter, Gauge

from specops.core.clusters import cluster_label
from specops.core.load_signal import read_load_file
from specops.trainer.runtimes import RunTimes, RunTimesJobStore, RunTimesTable, next_run_after_restart
from specops.trainer.schedule_config import (
    ScheduleConfig,
    ScheduleConfigError,
    ScheduleError,
    check_url,
    default_jobstore_url,
    describe_signal,
    engine_url,
    safe_url,
)

log = logging.getLogger(__name__)

TICK_JOB_ID = "distill-tick"
EVAL_JOB_ID = "evaluate"
TICK_FUNC = "specops.trainer.schedule:_tick"
EVAL_FUNC = "specops.trainer.schedule:_evaluate"
ROUTER_JOB_ID = "router-refit"
ROUTER_FUNC = "specops.trainer.schedule:_refit_router"
DATASTORE_JOB_ID = "datastore-rebuild"
DATASTORE_FUNC = "specops.trainer.schedule:_rebuild_datastores"
SESSIONS_JOB_ID = "sessions-rebuild"
SESSIONS_FUNC = "specops.trainer.schedule:_rebuild_sessions"

TICKS = Counter("specops_trainer_ticks_total", "Distillation ticks of the scheduled trainer", ["outcome"])
ROUTER_REFITS = Counter("specops_router_refits_total", "Router refit job runs", ["outcome"])
DATASTORE_REBUILDS = Counter("specops_datastore_rebuilds_total", "Datastore rebuild job runs", ["outcome"])
SESSIONS_REBUILDS = Counter("specops_sessions_rebuilds_total", "Past-sessions index rebuild job runs", ["outcome"])
HELDOUT_ACCEPTANCE = Gauge(
    "specops_trainer_heldout_acceptance", "Held-out expected acceptance of each cluster's draft", ["cluster", "kind"]
)

# ---------------------------------------------------------------- the jobs (picklable references)
_LIVE: dict[str, TrainerScheduler] = {}
_LIVE_LOCK = threading.Lock()


def _live(trainer_id: str, job: str) -> TrainerScheduler | None:
    with _LIVE_LOCK:
        sched = _LIVE.get(trainer_id)
    if sched is None:
        log.warning("%s job for trainer %s, which is not scheduled in this process: ignored", job, trainer_id)
    return sched


def _tick(trainer_id: str) -> None:
    """The ``distill-tick`` job: run one tick of the trainer registered as ``trainer_id``."""
    sched = _live(trainer_id, TICK_JOB_ID)
    if sched is None:
        TICKS.labels(outcome="error").inc()
        return
    sched.tick()


def _evaluate(trainer_id: str) -> None:
    """The ``evaluate`` job: evaluate every cluster of the trainer registered as ``trainer_id``."""
    sched = _live(trainer_id, EVAL_JOB_ID)
    if sched is not None:
        sched.evaluate_all()


def _rebuild_datastores(trainer_id: str) -> None:
    """The ``datastore-rebuild`` job: one rebuild run of the trainer registered as ``trainer_id``."""
    sched = _live(trainer_id, DATASTORE_JOB_ID)
    if sched is not None:
        sched.rebuild_datastores()


def _rebuild_sessions(trainer_id: str) -> None:
    """The ``sessions-rebuild`` job: one past-sessions rebuild run of the trainer registered as ``trainer_id``."""
    sched = _live(trainer_id, SESSIONS_JOB_ID)
    if sched is not None:
        sched.rebuild_sessions()


def _refit_router(trainer_id: str) -> None:
    """The ``router-refit`` job: one router refit of the trainer registered as ``trainer_id``."""
    sched = _live(trainer_id, ROUTER_JOB_ID)
    if sched is not None:
        sched.refit_router()


# ---------------------------------------------------------------- the scheduler
class TrainerScheduler:
    """Runs an OnlineTrainer's distillation ticks and evaluations on a persistent schedule.

    ``trainer`` needs ``step()``, ``evaluate(cluster)``, ``clusters`` and ``out`` (an
    :class:`~specops.trainer.online.trainer.OnlineTrainer`). ``trainer_id`` keys the job registry and is
    stored as the jobs' argument; the default (the trainer's resolved ``out`` directory)
    is stable across restarts. ``router_refitter`` (a RouterRefitter, with
    ``cfg.router_refit_s``) adds the router refit job. Plain counters for tests and the CLI:
    ``ticks_run``, ``ticks_skipped``, ``ticks_failed``, ``evals_run``, ``records_consumed``,
    ``router_refits`` (outcome -> runs).
    """

    def __init__(
        self,
        trainer: Any,
        cfg: ScheduleConfig | None = None,
        *,
        trainer_id: str | None = None,
        router_refitter: Any = None,
        datastore_rebuilder: Any = None,
        sessions_rebuilder: Any = None,
    ) -> None:
        self.trainer = trainer
        self.cfg = cfg or ScheduleConfig()
        if self.cfg.datastore_rebuild_s and datastore_rebuilder is None:
            raise ScheduleConfigError(
                "datastore_rebuild_s is set but no datastore rebuilder was given: pass "
                "datastore_rebuilder= (specops train --datastore-rebuild-every S builds one)"
            )
        self.datastore_rebuilder = datastore_rebuilder
        self.datastore_rebuilds: dict[str, int] = {}
        if self.cfg.sessions_rebuild_s and sessions_rebuilder is None:
            raise ScheduleConfigError(
                "sessions_rebuild_s is set but no sessions rebuilder was given: pass "
                "sessions_rebuilder= (specops train --sessions-rebuild-every S builds one)"
            )
        self.sessions_rebuilder = sessions_rebuilder
        self.sessions_rebuilds: dict[str, int] = {}
        if self.cfg.router_refit_s and router_refitter is None:
            raise ScheduleConfigError(
                "router_refit_s is set but no router refitter was given: pass router_refitter= "
                "(specops train --router-refit-every S builds one)"
            )
        self.router_refitter = router_refitter
        self.router_refits: dict[str, int] = {}
        self.trainer_id = trainer_id or str(Path(trainer.out).resolve())
        self.jobstore_url = self.cfg.jobstore_url or default_jobstore_url(trainer.out)
        self.ticks_run = self.ticks_skipped = self.ticks_failed = self.evals_run = self.records_consumed = 0
        self.max_records: int | None = None
        """Consume no more than this many records in all (``run_forever`` sets it)."""
        self.last_load: float | None = None
        self._last_records_at = time.monotonic()
        self._load_note = "ok"
        self._work_lock = threading.Lock()  # one of tick / evaluation touches the trainer at a time
        self._stop = threading.Event()
        self._scheduler: BackgroundScheduler | None = None

    # ------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._scheduler is not None and self._scheduler.running

    def _jobstore(self) -> RunTimesJobStore:
        """APScheduler's in-memory store over the table of run times (no job is ever pickled)."""
        from sqlalchemy.engine import make_url

        url = make_url(self.jobstore_url)
        if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        return RunTimesJobStore(
            RunTimesTable(
                engine_url(self.jobstore_url), self.cfg.jobstore_table, engine_options={"pool_pre_ping": True}
            )
        )

    def start(self) -> None:
        """Register the trainer, open the job store, (re)place both jobs and start running them."""
        if self._scheduler is not None:
            raise ScheduleError("this TrainerScheduler is already started")
        check_url(self.jobstore_url)
        with _LIVE_LOCK:
            if self.trainer_id in _LIVE:
                raise ScheduleError(f"trainer {self.trainer_id} is already scheduled in this process")
            _LIVE[self.trainer_id] = self
        self._stop.clear()
        self._last_records_at = time.monotonic()
        try:
            store = self._jobstore()
            scheduler = BackgroundScheduler(
                jobstores={"default": store},
                executors={"default": ThreadPoolExecutor(3)},
                timezone=UTC,
                daemon=True,
            )
            scheduler.start(paused=True)  # open the store; nothing runs until both jobs are in place
            saved = store.runs.load()
        except Exception as exc:
            self._unregister()
            raise ScheduleError(f"cannot open the job store {safe_url(self.jobstore_url)}: {exc}") from exc
        try:
            jobs = [
                (TICK_JOB_ID, TICK_FUNC, self.cfg.tick_seconds),
                (EVAL_JOB_ID, EVAL_FUNC, self.cfg.eval_seconds),
                (ROUTER_JOB_ID, ROUTER_FUNC, self.cfg.router_refit_s),
                (DATASTORE_JOB_ID, DATASTORE_FUNC, self.cfg.datastore_rebuild_s),
                (SESSIONS_JOB_ID, SESSIONS_FUNC, self.cfg.sessions_rebuild_s),
            ]
            for job_id, func, seconds in jobs:
                if seconds:  # an optional job is None when off
                    self._place_job(scheduler, job_id, func, seconds, saved.get(job_id))
            gone = store.runs.prune({job_id for job_id, _, seconds in jobs if seconds})
            if gone:
                log.info("jobs switched off since the last run, removed from the job store: %s", ", ".join(gone))
            scheduler.add_listener(
                lambda e: store.record_run(e.job_id, e.scheduled_run_time), EVENT_JOB_EXECUTED | EVENT_JOB_ERROR
            )
        except Exception:
            scheduler.shutdown(wait=False)
            self._unregister()
            raise
        self._scheduler = scheduler
        scheduler.resume()
        log.info(
            "scheduled trainer %s: tick every %gs (budget %gs), evaluation every %gs, router refit %s, "
            "job store %s, load signal %s",
            self.trainer_id,
            self.cfg.tick_seconds,
            self.cfg.budget_s,
            self.cfg.eval_seconds,
            f"every {self.cfg.router_refit_s:g}s" if self.cfg.router_refit_s else "off",
            safe_url(self.jobstore_url),
            describe_signal(self.cfg.load_signal),
        )

    def _place_job(
        self, scheduler: BackgroundScheduler, job_id: str, func: str, seconds: float, saved: RunTimes | None
    ) -> None:
        trigger = IntervalTrigger(seconds=seconds, timezone=UTC)
        kw: dict[str, Any] = {}
        at = next_run_after_restart(saved, seconds, _now())
        if at is not None:
            kw["next_run_time"] = at  # the schedule survives the restart
        scheduler.add_job(
            func,
            trigger,
            kwargs={"trainer_id": self.trainer_id},
            id=job_id,
            name=job_id,
            replace_existing=True,
            max_instances=1,
            coalesce=self.cfg.coalesce,
            misfire_grace_time=self.cfg.misfire_grace_s,
            **kw,
        )
        log.info(
            "job %s: %s every %gs, next run %s",
            job_id,
            func,
            seconds,
            f"{kw['next_run_time']} (from the job store)" if kw else "in one interval",
        )

    def jobs(self) -> dict[str, datetime | None]:
        """Id and next run time of every job in the store (while started)."""
        if self._scheduler is None:
            raise ScheduleError("the scheduler is not started")
        return {job.id: job.next_run_time for job in self._scheduler.get_jobs()}

    def shutdown(self, wait: bool = True) -> None:
        """Stop the jobs (finishing a running tick when ``wait``); the jobs stay in the store."""
        self._stop.set()
        scheduler, self._scheduler = self._scheduler, None
        try:
            if scheduler is not None and scheduler.running:
                scheduler.pause()  # no new submissions while the executor shuts down (APScheduler races otherwise)
                scheduler.shutdown(wait=wait)
        finally:
            self._unregister()

    def _unregister(self) -> None:
        with _LIVE_LOCK:
            if _LIVE.get(self.trainer_id) is self:
                del _LIVE[self.trainer_id]

    def run_forever(
        self,
        stop_event: threading.Event | None = None,
        *,
        max_idle_s: float | None = None,
        max_records: int | None = None,
        check_s: float = 0.5,
    ) -> int:
        """Run until ``stop_event`` is set, ``max_records`` were consumed (exactly: ticks poll only what is
        left) or nothing came for ``max_idle_s``
        (or Ctrl-C); then shut down, finishing the running tick. Returns the records consumed."""
        stop_event = stop_event or threading.Event()
        self.max_records = max_records
        if not self.running:
            self.start()
        try:
            while not stop_event.wait(check_s):
                if max_records is not None and self.records_consumed >= max_records:
                    break
                if max_idle_s is not None and time.monotonic() - self._last_records_at > max_idle_s:
                    log.info("no records for %.0fs; stopping", max_idle_s)
                    break
        finally:
            self.shutdown(wait=True)
        return self.records_consumed

    # ------------------------------------------------------------ the jobs
    def current_load(self) -> float | None:
        """The serving load now, or None when unknown (no signal, unreadable, stale)."""
        signal = self.cfg.load_signal
        if signal is None:
            return None
        if callable(signal):
            try:
                value = signal()
                load, note = (None, "load callable returned None") if value is None else (float(value), "ok")
            except Exception as exc:  # a broken signal must not stop training
                load, note = None, f"load callable failed: {type(exc).__name__}: {exc}"
        else:
            load, note = read_load_file(signal, self.cfg.load_stale_s)
        if note != self._load_note:  # log changes only, not every tick
            if load is None:
                log.warning("serving load signal: %s; not skipping ticks", note)
            else:
                log.info("serving load signal: %s; skipping ticks above %.2f", note, self.cfg.load_threshold)
            self._load_note = note
        self.last_load = load
        return load

    def _too_busy(self) -> float | None:
        load = self.current_load()
        return load if load is not None and load > self.cfg.load_threshold else None

    def tick(self) -> str:
        """One distillation tick; never raises. Returns the outcome (``ran``, ``skipped_load``, ``error``)."""
        try:
            busy = self._too_busy()
            if busy is not None:
                log.info("skipped distillation tick: serving load %.2f > %.2f", busy, self.cfg.load_threshold)
                self.ticks_skipped += 1
                TICKS.labels(outcome="skipped_load").inc()
                return "skipped_load"
            t0, consumed = time.monotonic(), 0
            with self._work_lock:
                while not self._stop.is_set():
                    left = None if self.max_records is None else self.max_records - self.records_consumed
                    if left is not None and left <= 0:
                        break
                    n = self.trainer.step() if left is None else self.trainer.step(left)
                    consumed += n
                    self.records_consumed += n
                    if n:
                        self._last_records_at = time.monotonic()
                    if n == 0 or time.monotonic() - t0 >= self.cfg.budget_s:
                        break
                    busy = self._too_busy()
                    if busy is not None:
                        log.info(
                            "distillation tick stopped early: serving load %.2f > %.2f", busy, self.cfg.load_threshold
                        )
                        break
            log.debug("distillation tick: %d records in %.2fs", consumed, time.monotonic() - t0)
            self.ticks_run += 1
            TICKS.labels(outcome="ran").inc()
            return "ran"
        except Exception:
            log.exception("distillation tick failed (the next tick retries)")
            self.ticks_failed += 1
            TICKS.labels(outcome="error").inc()
            return "error"

    def evaluate_all(self) -> dict[str, dict]:
        """Held-out acceptance of every cluster's draft, logged and exported; never raises."""
        results: dict[str, dict] = {}
        try:
            with self._work_lock:
                for cluster in sorted(self.trainer.clusters):
                    acc = self.trainer.evaluate(cluster)
                    if not acc.num_positions:
                        log.info("cluster %s: no held-out positions yet", cluster)
                        continue
                    results[cluster] = acc.to_dict()
                    HELDOUT_ACCEPTANCE.labels(cluster=cluster_label(cluster), kind="sampling").set(acc.sampling)
                    HELDOUT_ACCEPTANCE.labels(cluster=cluster_label(cluster), kind="greedy").set(acc.greedy)
                    log.info(
                        "cluster %s: held-out acceptance %.3f (greedy %.3f) over %d positions",
                        cluster,
                        acc.sampling,
                        acc.greedy,
                        acc.num_positions,
                    )
                self.evals_run += 1
        except Exception:
            log.exception("evaluation job failed (the next run retries)")
        return results

    def refit_router(self) -> str:
        """One router refit unless serving is busy; never raises. Returns the outcome: the refit's
        status (``promoted``, ``registered``, ``waiting``, ``no_new_records``), ``skipped_load`` or ``error``."""
        return self._guarded("router refit", self.router_refitter, self.router_refits, ROUTER_REFITS)

    def rebuild_datastores(self) -> str:
        """One datastore rebuild run unless serving is busy; never raises. Returns the outcome:
        ``promoted``, ``registered``, ``unchanged``, ``waiting``, ``no_new_records``, ``skipped_load`` or ``error``."""
        return self._guarded("datastore rebuild", self.datastore_rebuilder, self.datastore_rebuilds, DATASTORE_REBUILDS)

    def rebuild_sessions(self) -> str:
        """One past-sessions rebuild run unless serving is busy; never raises. Returns the outcome:
        ``promoted``, ``registered``, ``unchanged``, ``waiting``, ``no_new_records``, ``skipped_load`` or ``error``."""
        return self._guarded("sessions rebuild", self.sessions_rebuilder, self.sessions_rebuilds, SESSIONS_REBUILDS)

    def _guarded(self, what: str, job: Any, counts: dict[str, int], counter: Counter) -> str:
        """``job.run_once()`` unless serving is busy, its outcome counted; never raises."""
        try:
            busy = self._too_busy()
            if busy is not None:
                log.info("skipped %s: serving load %.2f > %.2f", what, busy, self.cfg.load_threshold)
                outcome = "skipped_load"
            else:
                outcome = job.run_once().status
        except Exception:
            log.exception("%s failed (the next run retries; nothing was committed)", what)
            outcome = "error"
        counts[outcome] = counts.get(outcome, 0) + 1
        counter.labels(outcome=outcome).inc()
        return outcome


def _now() -> datetime:
    return datetime.now(UTC)

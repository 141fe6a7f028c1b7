"""Container health of ``specops train``: exit 0 when healthy, 1 when not (the reason on stderr).

The trainer's only HTTP port is its optional metrics endpoint, which answers as long as the
process lives, stuck or not; so liveness is read where its work leaves a trace:

- **Scheduled** (``schedule = true``, or any ``*_every`` job in the config): the scheduler moves
  the ``distill-tick`` job's ``next_run_time`` in the job store's table of run times
  (``specops.trainer.runtimes``: numbers only, nothing pickled) every time it dispatches the tick, also
  when a tick is skipped for serving load or because the previous one is still running. A time more than ``SPECOPS_HEALTH_STALE_S`` seconds (default: the larger of
  120 s and 10 ticks) in the past means the scheduler loop is stuck or the job store (PostgreSQL)
  is unreachable: unhealthy.
- **Unscheduled**: a ``specops train`` process is alive. This is weak (tini ends the container
  when the trainer exits anyway); run the trainer scheduled in production.

The settings come from the same TOML file the trainer reads (``SPECOPS_TRAIN_CONFIG``, default
``/etc/specops/train.toml``), through the same loader (``specops.config_file``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

CONFIG_ENV = "SPECOPS_TRAIN_CONFIG"
DEFAULT_CONFIG = "/etc/specops/train.toml"
STALE_ENV = "SPECOPS_HEALTH_STALE_S"
JOB_ENABLING_KEYS = ("schedule", "router_refit_every", "datastore_rebuild_every", "sessions_rebuild_every")


def load_settings(path: str | Path) -> dict:
    """The trainer's settings from ``path`` (empty when the file does not exist), read by the loader
    of ``specops train --config`` itself: ``{option dest: value}``."""
    path = Path(path)
    if not path.is_file():
        return {}
    import argparse

    from specops import config_file
    from specops.cli.main import build_parser

    actions = build_parser()._actions
    train = next(a for a in actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    return config_file.load(path, train, "train")


def is_scheduled(settings: dict) -> bool:
    return any(bool(settings.get(key)) for key in JOB_ENABLING_KEYS)


def jobstore_url(settings: dict) -> str:
    """The job store the trainer uses: ``jobstore``, else SQLite under ``out`` (as ``specops train``)."""
    from specops.trainer.schedule import default_jobstore_url, engine_url

    if settings.get("jobstore"):
        return engine_url(str(settings["jobstore"]))
    out = settings.get("out") or str(Path(os.environ.get("SPECOPS_DATA_DIR", ".specops")) / "trainer")
    return default_jobstore_url(out)


def check_schedule(url: str, stale_s: float, now: float | None = None) -> tuple[bool, str]:
    """(healthy, why) from the ``distill-tick`` row of the trainer's job store at ``url``."""
    from sqlalchemy import create_engine, text

    from specops.trainer.schedule import TICK_JOB_ID, ScheduleConfig

    table = ScheduleConfig.jobstore_table  # the default table (a plain identifier, checked there)
    engine = create_engine(url, connect_args={"connect_timeout": 5} if url.startswith("postgresql") else {})
    try:
        with engine.connect() as conn:
            row = conn.execute(text(f"SELECT next_run_time FROM {table} WHERE id = :id"), {"id": TICK_JOB_ID}).first()
    except Exception as exc:  # noqa: BLE001 - any failure to read the store is "unhealthy", said why
        return False, f"cannot read the job store {engine.url.render_as_string(hide_password=True)}: {exc}"
    finally:
        engine.dispose()
    if row is None or row[0] is None:
        return False, f"no scheduled {TICK_JOB_ID!r} job in {table} (the scheduler has not started)"
    late = (time.time() if now is None else now) - float(row[0])
    if late > stale_s:
        return False, f"{TICK_JOB_ID!r} is {late:.0f}s overdue (limit {stale_s:.0f}s): the scheduler is stuck"
    return True, f"{TICK_JOB_ID!r} next run in {-late:.0f}s"


def trainer_process_alive(proc: Path = Path("/proc")) -> bool:
    """A process whose command line is ``... specops train ...`` exists."""
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            args = [a.decode(errors="replace") for a in cmdline.read_bytes().split(b"\0") if a]
        except OSError:
            continue
        names = [Path(a).name for a in args]
        if "specops" in names and "train" in args[names.index("specops") + 1 :]:
            return True
    return False


def main() -> int:
    settings = load_settings(os.environ.get(CONFIG_ENV, DEFAULT_CONFIG))
    if is_scheduled(settings):
        tick_s = float(settings.get("tick_seconds", 5.0))
        stale_s = float(os.environ.get(STALE_ENV) or max(120.0, 10 * tick_s))
        healthy, why = check_schedule(jobstore_url(settings), stale_s)
    else:
        healthy = trainer_process_alive()
        why = "specops train is running" if healthy else "no specops train process"
    print(why, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())

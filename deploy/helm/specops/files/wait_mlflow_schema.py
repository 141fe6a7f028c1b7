"""Wait until MLflow's database has the schema this image's MLflow needs (the mlflow-db-upgrade Job writes it).

Exits 0 when the database is at this MLflow's head revision, or at a revision this MLflow does not know (a newer
MLflow migrated it: a rollback of the chart keeps running, as MLflow's own server would). Exits 1 after
WAIT_TIMEOUT_S seconds otherwise. The password comes from $PGPASSWORD (libpq), never from the URI.
"""

import os
import sys
import time

import sqlalchemy
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from mlflow.store.db.utils import _get_alembic_config, _get_latest_schema_revision, _get_schema_version

uri = os.environ["MLFLOW_BACKEND_STORE_URI"]
timeout = float(os.environ["WAIT_TIMEOUT_S"])
head = _get_latest_schema_revision()
scripts = ScriptDirectory.from_config(_get_alembic_config(db_url=""))
engine = sqlalchemy.create_engine(uri, pool_pre_ping=True)
deadline = time.monotonic() + timeout
while True:
    try:
        current = _get_schema_version(engine)
    except sqlalchemy.exc.SQLAlchemyError as e:
        current, why = None, f"database unreachable ({type(e).__name__})"
    else:
        why = f"schema {current or 'empty'}"
    if current == head:
        print(f"MLflow schema is at {head}", flush=True)
        break
    if current is not None:
        try:
            scripts.get_revision(current)
        except CommandError:
            print(f"MLflow schema {current} is newer than this MLflow's {head}: going on", flush=True)
            break
    if time.monotonic() >= deadline:
        sys.exit(f"{why} after {timeout:g} s, this MLflow needs {head}: see the mlflow-db-upgrade Job's log")
    print(f"{why}, this MLflow needs {head}: waiting for the mlflow-db-upgrade Job", flush=True)
    time.sleep(5)

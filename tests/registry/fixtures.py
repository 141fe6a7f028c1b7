"""Registry fixtures: real MLflow stores (SQLite, PostgreSQL, an ``mlflow server`` over HTTP).

A pytest plugin (``pytest_plugins`` in tests/conftest.py), so serving and trainer tests use them too.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specops.registry import RegistryConfig, RegistryStore
from tests.registry.mlflow_server import MlflowServer

PG = "postgresql://postgres@127.0.0.1:5432"


def _pg_admin():
    import psycopg2

    conn = psycopg2.connect(f"{PG}/postgres", connect_timeout=3)
    conn.autocommit = True
    return conn


def pg_available() -> str | None:
    """None if PostgreSQL answers on 127.0.0.1:5432, else why not."""
    try:
        _pg_admin().close()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: skip
        return f"PostgreSQL not reachable at 127.0.0.1:5432 ({type(exc).__name__}: {str(exc).strip()[:120]})"


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables created once (migrations take seconds); tests copy it."""
    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    RegistryStore(RegistryConfig(uri=f"sqlite:///{db}")).artifact("draft").keys()
    return db


@pytest.fixture
def sqlite_uri(sqlite_template, tmp_path) -> str:
    db = tmp_path / "registry" / "mlflow.db"
    db.parent.mkdir(parents=True)
    shutil.copyfile(sqlite_template, db)
    return f"sqlite:///{db}"


@contextmanager
def fresh_pg_database(prefix: str) -> Iterator[str]:
    """A new, uniquely named PostgreSQL database (its ``postgresql://`` URI), dropped afterwards
    with its connections; skips the test, with the reason, where PostgreSQL is absent."""
    why = pg_available()
    if why:
        pytest.skip(why)
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = _pg_admin()
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG}/{name}"
    finally:
        with admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.close()


@pytest.fixture
def pg_uri(tmp_path):
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    with fresh_pg_database("specops_registry") as uri:
        yield uri


def _mlflow_server(tmp_path_factory, sqlite_template) -> Iterator[MlflowServer]:
    root = tmp_path_factory.mktemp("mlflow-server")
    shutil.copyfile(sqlite_template, root / "mlflow.db")
    server = MlflowServer(root).start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, sqlite_template) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` (SQLite store, served artifacts) shared by the session (one per xdist
    worker; it takes 10-20 s to start): its tests register under a cluster and an experiment of their
    own (``store_cfg``). A test that stops it starts it again on the same port and store before it ends
    (the hot-swap outage test)."""
    yield from _mlflow_server(tmp_path_factory, sqlite_template)


@pytest.fixture(params=["sqlite", "postgresql", "http"])
def store_cfg(request, tmp_path) -> RegistryConfig:
    """The same registry tests on every backend."""
    if request.param == "sqlite":
        return RegistryConfig(uri=request.getfixturevalue("sqlite_uri"))
    if request.param == "postgresql":
        uri = request.getfixturevalue("pg_uri")
        return RegistryConfig(uri=uri, artifact_root=str(tmp_path / "pg-artifacts"))
    server = request.getfixturevalue("mlflow_server")
    return RegistryConfig(uri=server.uri, experiment=f"specops-{uuid.uuid4().hex[:8]}")

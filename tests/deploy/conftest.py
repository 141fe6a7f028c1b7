"""Fixtures of the scale-out registry test: a fresh PostgreSQL database, an S3 endpoint (moto) with a
bucket, and a real ``mlflow server`` over both, started the way the Helm chart starts it
(``mlflow db upgrade`` first, as its initContainer does). Module-scoped: one server per test file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass

import pytest

from tests.registry.fixtures import fresh_pg_database
from tests.registry.mlflow_server import MlflowServer, free_port

AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
"""Dummy credentials: moto accepts any."""


@dataclass(frozen=True)
class S3Bucket:
    """A bucket on a local S3 endpoint."""

    endpoint: str
    """``http://127.0.0.1:<port>``: what ``MLFLOW_S3_ENDPOINT_URL`` points at."""
    bucket: str
    client: object
    """A boto3 S3 client on ``endpoint``."""

    @property
    def env(self) -> dict[str, str]:
        """Environment of a process that writes here through MLflow."""
        return {**AWS_ENV, "MLFLOW_S3_ENDPOINT_URL": self.endpoint}

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()


@pytest.fixture(scope="module")
def pg_database():
    """A fresh, uniquely named PostgreSQL database for the module (as ``postgresql+psycopg2://``), dropped after."""
    with fresh_pg_database("specops_deploy") as uri:
        yield uri.replace("postgresql://", "postgresql+psycopg2://")


@pytest.fixture(scope="module")
def s3_bucket():
    """moto's S3 server on a free loopback port, with one empty bucket."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (the deploy extras)")
    boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (the deploy extras)")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=AWS_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        )
        bucket = f"specops-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        yield S3Bucket(endpoint=endpoint, bucket=bucket, client=client)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pg_s3_server(pg_database, s3_bucket, tmp_path_factory):
    """``mlflow db upgrade`` on the fresh database, then ``mlflow server`` on PostgreSQL with its artifacts
    in ``s3://<bucket>/mlflow`` (served: clients never see the bucket), as the chart runs them."""
    upgrade = subprocess.run(
        [sys.executable, "-m", "mlflow", "db", "upgrade", pg_database],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **s3_bucket.env},
    )
    assert upgrade.returncode == 0, f"mlflow db upgrade failed ({upgrade.returncode}): {upgrade.stderr[-2000:]}"
    server = MlflowServer(
        tmp_path_factory.mktemp("mlflow-pg-s3"),
        backend_store_uri=pg_database,
        artifacts_destination=f"s3://{s3_bucket.bucket}/mlflow",
        env=s3_bucket.env,
    )
    server.start()  # the default 120 s: 60 was too short on a loaded 2-core machine
    try:
        yield server
    finally:
        server.kill()

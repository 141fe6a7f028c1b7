"""A real ``mlflow server`` process on a free loopback port (the registry's HTTP path)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specops.cli.registry import MLFLOW_SERVER_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` over a SQLite store in ``root``, serving artifacts from ``root/artifacts``
    (or over ``backend_store_uri``, serving ``artifacts_destination``: PostgreSQL and S3).

    ``kill()`` stops it hard (SIGKILL, the "server died" case); ``start()`` brings it back
    on the same port and store.
    """

    def __init__(
        self,
        root: Path,
        port: int | None = None,
        *,
        backend_store_uri: str | None = None,
        artifacts_destination: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.db = self.root / "mlflow.db"
        self.artifacts = self.root / "artifacts"
        self.backend_store_uri = backend_store_uri or f"sqlite:///{self.db}"
        """The server's store (default: the SQLite file ``root/mlflow.db``)."""
        self.artifacts_destination = artifacts_destination or str(self.artifacts)
        """Where the served artifacts go (default: ``root/artifacts``; an ``s3://`` URI works too)."""
        self.env = dict(env or {})
        """Extra environment of the server process (S3 endpoint and credentials)."""
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> MlflowServer:
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            self.backend_store_uri,
            "--artifacts-destination",
            self.artifacts_destination,
            "--serve-artifacts",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        log = open(self.root / "server.log", "ab")
        env = {**os.environ, **MLFLOW_SERVER_ENV, **self.env}  # no job runner: 8 processes fewer per server
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {self.proc.returncode}: "
                    f"{(self.root / 'server.log').read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.kill()
        raise TimeoutError(
            f"mlflow server on {self.uri} not healthy after {timeout_s}s: "
            f"{(self.root / 'server.log').read_text()[-2000:]}"
        )

    def kill(self) -> None:
        """SIGKILL the whole server process group (uvicorn workers included)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    stop = kill

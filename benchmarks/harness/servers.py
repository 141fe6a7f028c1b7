"""A server child process for a benchmark (``specops serve``, a vLLM server, an MLflow server):
started in its own session with its output appended to a log, ready when an HTTP path answers
200, stopped with its whole process group."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.env import REPO_ROOT

SPECOPS_URL_VARS = ("SPECOPS_STREAM_URL", "SPECOPS_REGISTRY_URI", "SPECOPS_API_KEYS")
"""Variables of this shell that would point a benchmark's server at the operator's stream,
registry or keys; :func:`serve_env` drops them."""


def free_port() -> int:
    """A loopback port free now (the kernel's pick)."""
    from specops.serving.vllm.process import free_port as _free_port

    return _free_port()


def serve_env(data_dir: Path | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a server child: unbuffered, no progress bars, none of
    :data:`SPECOPS_URL_VARS`, ``SPECOPS_DATA_DIR`` set to ``data_dir`` when given, then ``extra``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    if data_dir is not None:
        env["SPECOPS_DATA_DIR"] = str(data_dir)
    for var in SPECOPS_URL_VARS:
        env.pop(var, None)
    env.update(extra)
    return env


def specops_serve_argv(threads: int | None, options: dict[str, object]) -> list[str]:
    """``python -m specops.cli.main [--threads N] serve`` with ``options`` (``True``: a bare flag,
    ``None``: left out, else ``--key=value``, so a value may start with ``--``)."""
    argv = [sys.executable, "-m", "specops.cli.main"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    argv.append("serve")
    for key, value in options.items():
        if value is True:
            argv.append(key)
        elif value is not None and value is not False:
            argv.append(f"{key}={value}")
    return argv


class ServerProcess:
    """One server child: ``start()``, ``wait_ready()`` (seconds from the start until ``ready_path``
    answered 200), ``stop()``; ``log_tail()`` for the error a failed start raises."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        url: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        ready_path: str = "/readyz",
    ) -> None:
        self.name, self.argv, self.url, self.log_path = name, argv, url.rstrip("/"), Path(log_path)
        self.env = env if env is not None else serve_env()
        self.ready_path = ready_path
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_s: float | None = None

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as out:  # a pipe nobody reads would block a chatty server
            self.proc = subprocess.Popen(
                self.argv,
                cwd=REPO_ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() reaches its children too
            )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Seconds from ``start()`` until ``GET ready_path`` answered 200; raises (after stopping
        it) if the process exits first or ``timeout_s`` passes."""
        import urllib3

        http = urllib3.PoolManager()
        while time.monotonic() - self.started_at < timeout_s:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited before it was ready:\n{self.log_tail()}")
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                if http.request("GET", self.url + self.ready_path, timeout=2.0, retries=False).status == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
            time.sleep(poll_s)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM to its process group, SIGKILL after ``timeout_s``; False if it had already exited."""
        from specops.serving.vllm.process import stop_group

        return stop_group(self.proc, timeout_s)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def rss_mb(self) -> float | None:
        """The process's own resident memory in MiB (not its children's); None when unknown."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        except (OSError, AttributeError):
            return None
        return None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

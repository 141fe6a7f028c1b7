"""The processes and threads ``specops demo`` starts: the MLflow UI, the trainer and the API server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from specops.demo.run import DemoConfig


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return int(s.getsockname()[1])
            except OSError:
                continue
    raise RuntimeError("no free port")


class Stack:
    """The processes and threads the demo starts, stopped in reverse order."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.ui: subprocess.Popen | None = None
        self.train: subprocess.Popen | None = None
        self.server = None
        self._logs: list = []

    def _spawn(self, cmd: list[str], log_path: Path) -> subprocess.Popen:
        from specops.cli.registry import MLFLOW_SERVER_ENV

        f = open(log_path, "w")  # noqa: SIM115 (kept open for the child's lifetime)
        self._logs.append(f)
        env = {**os.environ, **MLFLOW_SERVER_ENV, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def mlflow_ui(self, registry, demo_dir: Path, port: int) -> str:
        from specops.cli.registry import mlflow_ui_command

        cmd = mlflow_ui_command(registry.cfg, "127.0.0.1", port)
        self.ui = self._spawn(cmd, demo_dir / "mlflow-ui.log")
        url = f"http://127.0.0.1:{port}"
        self.console.print(f"MLflow UI starting on [link={url}]{url}[/link] (log: {demo_dir / 'mlflow-ui.log'})")
        return url

    def trainer(self, model_dir: Path, demo_dir: Path, stream_url: str, registry_uri: str, cfg: DemoConfig) -> None:
        """``specops train --schedule``: the demo's plumbing (stream, registry, ticks, load signal,
        scheduled jobs) and its cadence (``--interval``, ``--holdout-every``, ``--gate-min-positions``);
        no recipe flag (``--lr``, ``--steps``, ``--replay``, ``--positions``, ...): those are the
        trainer's defaults."""
        cmd = [
            sys.executable,
            "-m",
            "specops.cli.main",
            "--threads",
            "1",
            "train",
            "--stream",
            stream_url,
            "--registry",
            registry_uri,
            "--model-dir",
            str(model_dir),
            "--out",
            str(demo_dir / "trainer"),
            "--schedule",
            "--tick-seconds",
            "2",
            "--interval",
            str(cfg.interval),
            "--poll-records",
            "64",
            "--holdout-every",
            str(cfg.holdout_every),
            "--gate-min-positions",
            str(cfg.gate_min_positions),
            "--average-decay",
            str(cfg.average_decay),
            "--keep-versions",
            "50",
            "--load-signal",
            str(demo_dir / "serving-load.json"),
            "--load-threshold",
            "0.95",
            "--router-refit-every",
            str(cfg.router_refit_s),
            "--datastore-rebuild-every",
            str(cfg.datastore_rebuild_s),
            "--datastore-min-new",
            str(cfg.datastore_min_new),
        ]
        self.train = self._spawn(cmd, demo_dir / "trainer.log")
        self.console.print(f"trainer started (specops train --schedule; log: {demo_dir / 'trainer.log'})")

    def api(self, model_dir: Path, demo_dir: Path, stream_url: str, registry_uri: str):
        from specops.cli.serve_runtime import Server
        from specops.serving.http.config import ServeConfig

        scfg = ServeConfig(
            model_dir=str(model_dir),
            port=0,
            stream=stream_url,
            registry=registry_uri,
            replica="demo",
            cache_dir=str(demo_dir / "serve"),
            poll_s=5.0,
            max_concurrency=2,
            max_queue=16,
            load_signal=str(demo_dir / "serving-load.json"),
        )
        self.server = Server(scfg, root=demo_dir).start()
        self.console.print(f"API server on {self.server.url}/v1, loading models ...")
        self.server.wait_ready()
        return self.server

    def stop_trainer(self, timeout_s: float = 60.0) -> None:
        if self.train is not None and self.train.poll() is None:
            self.train.send_signal(signal.SIGINT)  # checkpoints and commits what it has, then exits
            try:
                self.train.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.train.kill()
        self.train = None

    def close(self) -> None:
        self.stop_trainer()
        if self.server is not None:
            self.server.stop()
        if self.ui is not None and self.ui.poll() is None:
            os.killpg(self.ui.pid, signal.SIGTERM)
            try:
                self.ui.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.ui.pid, signal.SIGKILL)
        for f in self._logs:
            f.close()

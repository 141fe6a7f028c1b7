"""Helpers shared by the HTTP API tests: a real uvicorn server on a free port over the tiny models."""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from specops.cli.serve_runtime import Server
from specops.serving.http.config import ServeConfig

MODEL = "specops"


def serve_config(models: Path, **overrides) -> ServeConfig:
    """Loopback, any free port, no stream, registry or router unless a test asks for them."""
    values = {"model_dir": str(models), "port": 0, "stream": "none", "registry": "none", "router": "none"}
    return ServeConfig(**{**values, **overrides})


@contextmanager
def running(cfg: ServeConfig, root: Path, *, state=None, ready: bool = True):
    srv = Server(cfg, root=root, state=state).start()
    try:
        if ready:
            srv.wait_ready(120)
        yield srv
    finally:
        srv.stop()


def assert_error(resp: requests.Response, status: int, code: str, param: str | None = None) -> dict:
    """An OpenAI-shaped error body with exactly these status, code and param; returns ``error``."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert (err["code"], err["param"]) == (code, param), err
    return err


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample in ``text`` (0.0 when the labelled series does not exist yet)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if found == labels:
            return float(m.group(3))
    return 0.0


def wait_until(cond, timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step_s)
    return bool(cond())

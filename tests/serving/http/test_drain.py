"""Shutdown drains: ``specops serve`` as a real process gets SIGTERM (what the kubelet sends) while a
long streamed request is in flight; the request completes, then the process exits 0.

Through the drain the port keeps answering: ``/readyz`` 503, new requests 503 with ``Retry-After``,
``/healthz`` 200, ``Connection: close`` on every response; it closes once the stream is done.

With a short ``--shutdown-timeout-s`` the same request is stopped instead, and the process still
exits 0 (the drain's budget bounds how long a rollout waits). ``/healthz`` tells a failed load apart
from loading, so a liveness probe restarts a replica whose models cannot load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from specops.streams.tansu import free_port

pytestmark = pytest.mark.slow  # serving as a real process

ROOT = Path(__file__).resolve().parents[3]
READY_S = 120.0
LONG = 1000  # tokens: a few seconds of the tiny model on one thread


def _serve(tiny_models: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "SPECOPS_DATA_DIR": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    for var in ("SPECOPS_STREAM_URL", "SPECOPS_REGISTRY_URI"):
        env.pop(var, None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "specops.cli.main",
                "--threads",
                "1",
                "serve",
                "--model-dir",
                str(tiny_models),
                "--port",
                str(port),
                "--stream",
                "none",
                "--registry",
                "none",
                "--router",
                "none",
                "--no-auto-calibrate",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, f"http://127.0.0.1:{port}", log_path


def _wait_ready(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited while loading\n{log_path.read_text()[-4000:]}"
        try:
            if requests.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise AssertionError(f"not ready in {READY_S:.0f} s\n{log_path.read_text()[-4000:]}")


def _stream_then_signal(proc: subprocess.Popen, url: str) -> tuple[list[dict], bool]:
    """Start a long streamed completion, SIGTERM the server after its first chunk, read it to the end:
    (the chunks, whether ``[DONE]`` arrived)."""
    body = {"model": "specops", "prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0, "stream": True}
    body["ignore_eos"] = True  # the random tiny target may emit EOS within a few tokens: run to LONG
    body["speculation"] = {"method": "target"}
    chunks: list[dict] = []
    done = False
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 1:
                proc.send_signal(signal.SIGTERM)
    return chunks, done


def test_sigterm_lets_a_long_streamed_request_finish(tiny_models, tmp_path):
    proc, url, log_path = _serve(tiny_models, tmp_path, "--shutdown-timeout-s", "120")
    try:
        _wait_ready(proc, url, log_path)
        chunks, done = _stream_then_signal(proc, url)
        assert proc.wait(60) == 0, log_path.read_text()[-4000:]
    finally:
        proc.kill()
    log = log_path.read_text()
    assert done, f"the stream was cut after {len(chunks)} chunks\n{log[-4000:]}"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish and finish[-1] in ("length", "stop"), chunks[-3:]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert len(text) > 100, "the request was not long enough to test a drain"
    assert "draining: no new requests; 1 running" in log, log[-4000:]


def test_the_drain_stops_what_outlives_shutdown_timeout(tiny_models, tmp_path):
    proc, url, log_path = _serve(tiny_models, tmp_path, "--shutdown-timeout-s", "0.2", "--max-tokens-limit", "4096")
    try:
        _wait_ready(proc, url, log_path)
        started = time.monotonic()
        body = {
            "model": "specops",
            "prompt": "Once upon a time",
            "max_tokens": 4000,
            "temperature": 0,
            "ignore_eos": True,
        }
        body.update(stream=True, speculation={"method": "target"})
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            next(line for line in r.iter_lines() if line.startswith(b"data: "))
            proc.send_signal(signal.SIGTERM)
            try:
                for _ in r.iter_lines():
                    pass
            except requests.RequestException:
                pass  # the server closed the stream: expected
        assert proc.wait(60) == 0, log_path.read_text()[-4000:]
        assert time.monotonic() - started < 30
    finally:
        proc.kill()
    assert "stopped by the shutdown" in log_path.read_text()


def test_healthz_fails_once_loading_failed(tmp_path):
    empty = tmp_path / "models"
    (empty / "target").mkdir(parents=True)
    proc, url, log_path = _serve(empty, tmp_path)
    try:
        deadline = time.monotonic() + READY_S
        while True:
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            try:
                r = requests.get(url + "/healthz", timeout=5)
            except requests.RequestException:
                time.sleep(0.3)
                continue
            if r.status_code == 503:
                break
            assert r.status_code == 200
            time.sleep(0.3)
        assert r.json()["status"] == "failed" and r.json()["error"]
        ready = requests.get(url + "/readyz", timeout=5)
        assert ready.status_code == 503 and ready.json()["error"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            proc.kill()


def test_the_listener_answers_503_through_the_drain(tiny_models, tmp_path):
    """During the drain the socket stays open: a load balancer's new connection sees ``/readyz`` 503
    and a request 503 with ``Retry-After`` (not a refused connection), ``/healthz`` stays 200, a kept-alive
    connection is told ``Connection: close``; the stream in flight ends normally, then the port closes."""
    proc, url, log_path = _serve(tiny_models, tmp_path, "--shutdown-timeout-s", "120")
    port = int(url.rsplit(":", 1)[1])
    kept = requests.Session()
    try:
        _wait_ready(proc, url, log_path)
        assert kept.get(url + "/healthz", timeout=5).status_code == 200  # a kept-alive connection, idle from now
        body = {"model": "specops", "prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0, "stream": True}
        body["ignore_eos"] = True  # the random tiny target may emit EOS within a few tokens: run to LONG
        body["speculation"] = {"method": "target"}
        chunks: list[dict] = []
        done = False
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            assert r.status_code == 200, r.text
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith(b"data: "))
            chunks.append(json.loads(first[6:]))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # uvicorn alone had closed the socket within 0.15 s

            ready = requests.get(url + "/readyz", timeout=5)  # a new connection each
            assert ready.status_code == 503 and ready.json()["draining"] is True, ready.text
            assert ready.headers.get("connection", "").lower() == "close"
            assert requests.get(url + "/healthz", timeout=5).status_code == 200
            refused = requests.post(url + "/v1/completions", json={**body, "stream": False}, timeout=5)
            assert refused.status_code == 503, refused.text
            assert refused.headers.get("retry-after") == "1"
            error = refused.json()["error"]
            assert "shutting down" in error["message"] and error["type"] and "code" in error, error
            again = kept.get(url + "/readyz", timeout=5)  # the idle kept-alive connection: answered, then closed
            assert again.status_code == 503 and again.headers.get("connection", "").lower() == "close"
            assert proc.poll() is None, "the server exited with a stream in flight"

            for line in lines:
                if line == b"data: [DONE]":
                    done = True
                    break
                if line.startswith(b"data: "):
                    chunks.append(json.loads(line[6:]))
        assert proc.wait(60) == 0, log_path.read_text()[-4000:]
    finally:
        kept.close()
        proc.kill()
    log = log_path.read_text()
    assert done, f"the stream was cut after {len(chunks)} chunks\n{log[-4000:]}"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish and finish[-1] in ("length", "stop"), chunks[-3:]
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)

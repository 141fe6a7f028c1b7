"""Soak and fault benchmark: serving, training and the registry as separate processes under
load, while a driver SIGKILLs them at random points and restarts them.

The system under test, each its own OS process group on loopback:

- ``mlflow server`` on a SQLite store (the registry's HTTP path, artifacts served by it);
- ``specops serve`` (``--stream local://DIR``, ``--registry http://...``), cluster ``faults``;
- ``specops train`` consuming that stream, registering every update in the registry and
  promoting it through the gate (``--gate-margin -1``: every candidate with evidence is
  promoted, so promotions and hot-swaps happen all through the run).

``--clients`` threads send distinct greedy completion requests (random token-id prompts,
``X-Request-Id`` ``fault-c<client>-<seq>``) back to back. Meanwhile the driver kills one
component at a time with SIGKILL at seeded random points (each of ``--kills`` slots of the
run gets one kill at a random point inside it; the components take turns in a seeded
shuffled order, so each is killed equally often), keeps it down for a random moment
and restarts it on the same port, store, stream and checkpoint directory. At the end the
server gets SIGTERM (it must flush and exit 0), the trainer SIGINT, and the run is checked.

Definitions:

- **kill window** of a component: from the moment the driver sends SIGKILL to the moment
  the restarted process is back: ``/readyz`` 200 for the server, ``/health`` 200 for the
  MLflow server, for the trainer (it has no probe) its startup line in its log, written
  once its imports are done and its registry is open. Windows of different components may
  overlap (the server may restart while the registry is down); a component is killed again
  only ``--min-gap-s`` after it is back.
- A request **overlaps** a window when it started before the window closed and ended
  after it opened. Only the *server's* windows excuse a failure: the trainer and the
  registry are off the request path, so their kills must fail no request. A failed request
  that overlaps a server window is an **in-flight** request of the killed server when it
  started before the kill, else it was **sent while the server was down**; any other failed
  request is **failed outside the kill windows** (must be 0).
- A logged record is **accepted** once the serving stream logger's publish returned (the
  local log appended it); records still queued in a server's memory die with it
  (``serving/fleet/stream_logger.py``). The driver scrapes each server's
  ``specops_stream_logger_published_total`` every second and once more just before killing
  it. **Accepted records lost** (must be 0) counts, per topic (``spec.misses``,
  ``spec.generations``):
  - for the server stopped gracefully at the end: every answered request's record
    missing from the stream (SIGTERM flushes everything);
  - for each killed server: the larger of (a) its last scraped published count minus the
    records of its requests in the stream, and (b) the *holes*: answered requests whose
    record is missing although a record of a request sent *after that answer arrived* is
    in the stream (one cluster is one partition, and the logger publishes in the order it
    logged, so a later record on disk proves every earlier one was accepted).
  Answered requests of killed servers whose records are missing otherwise were still
  queued when the server died (the documented limit); they are counted apart. Records the
  logger refused (its ``specops_stream_logger_dropped_total``: a record it could not build,
  shedding) were never accepted either: they are counted apart and must be 0 as well.
- **Versions duplicated** (must be 0): registered versions of ``draft-faults`` whose
  ``source_id`` tag (trainer id / cluster / checkpoint version, the registration's
  idempotency key) or whose training window (``lineage_offsets``: the first and last
  offset trained on per partition, cumulative, so two updates of one trainer differ in it
  unless the second trained on no new record) equals an earlier version's.
- **Tenant isolation and bounded clusters** (``check_isolation``, on the last server once the
  load has stopped): the clients take turns between two API keys (tenants) and a third key
  sends only probes; ``/readyz`` names no cluster; requests naming made-up clusters are 400s
  naming ``cluster`` and never become metric labels or stream records; and the extraction
  replay of issue 34 (tenant E probing tenant A's sampled output through LLMA's past
  sessions, then guessing it token by token) finds nothing, while the same probe by A does
  (the positive control).
- **Outputs equal to target-only**: after the run every answered prompt is decoded greedily
  target-only in this process (``SpecEngine``, ``method="target"``) and compared with the
  response text, and token for token with the ``output_ids`` of its GenerationRecord when
  that is in the stream. An output that differs only where the target's top two logits tie
  (every served token within ``TIE_TOL`` of the target's maximum given the served prefix,
  computed in float64) is the target's greedy output with a float32 tie broken the other way
  by a batched verification (``serving/engine/batching.py``); it is counted apart. Any other
  difference is a **diverged** output (must be 0).

The models are a tiny random pair by default (a ``--tiny`` bootstrap's tokenizer, a
2-layer target with peaky logits as the tests use, and a noisy copy of it as the draft),
so the run fits on 2 CPU cores; ``--models DIR`` uses DIR's ``target/`` and ``draft/``.

Writes JSON (``--json``; ``summary`` holds the counts above and ``violations``), prints
tables and a one-line JSON summary, replaces the faults section of ``docs/benchmarks.md``
(``--no-doc`` skips that), and exits 1 if an invariant is violated.

    .venv/bin/python benchmarks/faults.py --json benchmarks/out/faults.json
    .venv/bin/python benchmarks/faults.py --quick --no-doc
    .venv/bin/python benchmarks/faults.py --components trainer --kills 8 --no-doc   # kill one component only
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, streams/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import requests
import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from benchmarks.common import environment, fmt, write_doc_section
from specops.streams.tansu import free_port

log = logging.getLogger("bench.faults")

DOC_BEGIN = "<!-- BEGIN faults (written by benchmarks/faults.py; edits inside are overwritten) -->"
DOC_END = "<!-- END faults -->"
CLUSTER = "faults"
COMPONENTS = ("server", "trainer", "mlflow")
TOPICS = ("spec.misses", "spec.generations")
DOWN_S = {"server": (0.0, 2.0), "trainer": (0.0, 3.0), "mlflow": (1.0, 5.0)}
"""How long a killed component stays down before the driver restarts it (uniform, seconds)."""
NOISY = ("alembic", "mlflow", "transformers", "urllib3", "trainer")
"""Loggers quietened in this process (the tiny bootstrap, the registry client, the references)."""
TIE_TOL = 1e-4
"""A served token other than the reference's is still the target's greedy choice when its float64
logit is within this of the maximum (an exact float32 tie; float32 logits of the tiny models are
within about 1e-6 of float64, and their top two logits are usually 0.03 or more apart)."""
TENANTS = {"alice": "faults-alice-key-01", "bob": "faults-bob-key-002", "eve": "faults-eve-key-0003"}
"""API keys (tenants). The clients take turns between the first two; the isolation checks probe alice's
output from eve's key, which sends nothing else (so even the size of its past sessions must be 0)."""
LOAD_TENANTS = 2
BOGUS_CLUSTERS = 40
"""Requests naming made-up clusters at the end of the load (each must be a 400 naming ``cluster``)."""
DECOYS = 11
"""Wrong guesses per token of the cross-tenant extraction replay (the right one is added to them)."""
TRAINER_UP = b"registering drafts in"
"""What ``specops train`` logs once its imports are done and its registry is open."""


# ---------------------------------------------------------------- models
def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise (``scale`` × each tensor's std) on every weight."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return out


def tiny_pair(dest: Path, seed: int) -> Path:
    """``dest/target`` and ``dest/draft``: a tiny random target with peaky logits (as the tests'
    tiny models: exact ties in its argmax are rare) and a noisy copy as draft, with a ``--tiny``
    bootstrap's tokenizer."""
    from transformers import AutoConfig, LlamaForCausalLM

    from specops.trainer.bootstrap import run as bootstrap

    boot = dest / "bootstrap"
    bootstrap(boot, tiny=True, seed=seed)
    cfg = AutoConfig.from_pretrained(boot / "target")
    cfg.initializer_range = 0.2  # as tests/conftest.py's tiny models
    torch.manual_seed(seed)
    target = LlamaForCausalLM(cfg).eval()
    for name, model in (("target", target), ("draft", perturbed(target, 0.6, seed + 1))):
        model.save_pretrained(dest / name, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(boot / "target" / f, dest / name / f)
    return dest


def make_prompt(seed: int, client: int, seq: int, vocab: int) -> list[int]:
    """The prompt of request ``seq`` of ``client``: 4-23 random token ids (distinct per request)."""
    rng = random.Random(f"{seed}-{client}-{seq}")
    return [rng.randrange(1, vocab) for _ in range(rng.randrange(4, 24))]


# ---------------------------------------------------------------- processes
class Proc:
    """One child process in its own session (SIGKILL reaches its children too), output appended to ``log_path``."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name, self.cmd, self.log_path, self.env = name, cmd, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, cwd=REPO_ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def stop(self, sig: int, timeout_s: float) -> int | None:
        """Send ``sig`` to the process and wait; None if it did not exit in time (then it is killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        finally:
            try:  # children (the MLflow server's workers) go with it
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.name} ({self.log_path}) ---\n{text[-chars:]}"


@dataclass
class Window:
    """One kill and the way back (times in s from the start of the load)."""

    component: str
    killed_at: float
    down_s: float
    back_at: float | None = None
    pid: int = 0
    epoch: int = 0
    """Server: the incarnation killed (0 is the first server)."""
    in_flight: int = 0
    """Server: requests in flight when it was killed."""
    published: dict[str, int] | None = None
    """Server: its ``published_total`` per topic at the last scrape before the kill."""


class Stack:
    """The MLflow server, the serving replica and the trainer, started, killed and restarted by name."""

    def __init__(self, work: Path, target: Path, draft: Path, args) -> None:
        self.work, self.args = work, args
        self.stream_url = f"local://{work / 'streams'}"
        self.mlflow_port, self.server_port = free_port(), free_port()
        (work / "registry").mkdir(parents=True, exist_ok=True)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "SPECOPS_DATA_DIR": str(work / "data"),
            "PYTHONUNBUFFERED": "1",
            "TQDM_DISABLE": "1",
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }  # no job-runner process: the registry needs none
        for var in ("SPECOPS_STREAM_URL", "SPECOPS_REGISTRY_URI"):
            env.pop(var, None)
        py, cli = sys.executable, [sys.executable, "-m", "specops.cli.main", "--threads", str(args.threads)]
        self.cmds = {
            "mlflow": [
                py,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{work / 'registry' / 'mlflow.db'}",
                "--artifacts-destination",
                str(work / "registry" / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.mlflow_port),
                "--workers",
                "1",
            ],
            "server": [
                *cli,
                "serve",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--port",
                str(self.server_port),
                "--stream",
                self.stream_url,
                "--registry",
                self.mlflow_url,
                "--replica",
                "faults",
                "--router",
                "none",
                "--clusters",
                CLUSTER,
                "--api-keys",
                ",".join(f"{name}:{key}" for name, key in TENANTS.items()),
                "--poll-s",
                "2",
                "--no-auto-rollback",
                "--max-concurrency",
                "2",
            ],
            "trainer": [
                *cli,
                "train",
                "--stream",
                self.stream_url,
                "--registry",
                self.mlflow_url,
                "--draft",
                str(draft),
                "--tokenizer",
                str(target),
                "--target",
                str(target),
                "--out",
                str(work / "trainer"),
                "--interval",
                "8",
                "--holdout-every",
                "3",
                "--gate-margin",
                "-1",
                "--gate-min-positions",
                "0",
                "--poll-records",
                "64",
            ],
        }
        self.env = env
        self.procs: dict[str, Proc] = {}
        self.log_mark: dict[str, int] = {}
        """Per component: the size of its log when it was last spawned."""
        self.epoch = 0
        """The server's incarnation: 0 for the first, +1 at every kill."""

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    @property
    def server_url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def spawn(self, name: str) -> Proc:
        log_path = self.work / "logs" / f"{name}.log"
        self.log_mark[name] = log_path.stat().st_size if log_path.exists() else 0
        proc = Proc(name, self.cmds[name], log_path, self.env).start()
        self.procs[name] = proc
        log.debug("started %s (pid %d)", name, proc.proc.pid)
        return proc

    def is_back(self, name: str) -> bool:
        """The server answers /readyz 200, the MLflow server /health 200, the trainer has logged
        ``TRAINER_UP`` (it has no probe; that line comes after its imports, before it joins the group)."""
        proc = self.procs[name]
        if not proc.alive:
            raise RuntimeError(f"{name} exited with {proc.proc.returncode} while starting\n{proc.tail()}")
        if name == "trainer":
            with open(proc.log_path, "rb") as f:
                f.seek(self.log_mark[name])
                return TRAINER_UP in f.read()
        url = f"{self.server_url}/readyz" if name == "server" else f"{self.mlflow_url}/health"
        try:
            r = requests.get(url, timeout=3)
        except requests.RequestException:
            return False
        if name == "server" and "error" in r.json():
            raise RuntimeError(f"the server failed to load: {r.json()}\n{proc.tail()}")
        return r.status_code == 200

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs.values())

    def close(self) -> None:
        for p in self.procs.values():
            if p.alive:
                p.kill()


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, dict[str, int]] | None:
    """The serving stream logger's counters from ``/metrics``: ``published`` per topic, ``dropped`` per reason."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = requests.get(url + "/metrics", timeout=timeout_s)
        r.raise_for_status()
    except requests.RequestException:
        return None
    out: dict[str, dict[str, int]] = {"published": {}, "dropped": {}}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == "specops_stream_logger_published_total":
                out["published"][s.labels["topic"]] = int(s.value)
            elif s.name == "specops_stream_logger_dropped_total":
                out["dropped"][s.labels["reason"]] = int(s.value)
    return out


# ---------------------------------------------------------------- load
@dataclass
class Attempt:
    """One request (times in s from the start of the load)."""

    rid: str
    client: int
    seq: int
    epoch: int
    """The server incarnation up when the request was sent."""
    start: float
    end: float = 0.0
    status: int | None = None
    text: str = ""
    draft_version: str = ""
    error: str = ""
    kind: str = ""
    """Set by the analysis: ``answered``, ``in_flight``, ``down`` or ``failed``."""


class Load:
    """``clients`` threads sending distinct greedy completion requests back to back."""

    def __init__(self, stack: Stack, t0: float, vocab: int, args) -> None:
        self.stack, self.t0, self.vocab, self.args = stack, t0, vocab, args
        self.attempts: list[Attempt] = []  # list.append is atomic: the clients share it
        self.in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), name=f"client-{i}", daemon=True)
            for i in range(args.clients)
        ]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _client(self, i: int) -> None:
        seq, failures = 0, 0
        url = self.stack.server_url + "/v1/completions"
        while not self._stop.is_set():
            rid = f"fault-c{i}-{seq:06d}"
            body = {
                "model": "specops",
                "prompt": make_prompt(self.args.seed, i, seq, self.vocab),
                "max_tokens": self.args.max_tokens,
                "temperature": 0,
                "cluster": CLUSTER,
                "speculation": {"method": "draft"},
            }
            a = Attempt(rid, i, seq, self.stack.epoch, self.now())
            with self._lock:
                self.in_flight.add(rid)
            key = list(TENANTS.values())[i % LOAD_TENANTS]  # the clients take turns between alice and bob
            try:  # a new connection per request: no pooled connection outlives a killed server
                r = requests.post(
                    url,
                    json=body,
                    headers={"X-Request-Id": rid, "Authorization": f"Bearer {key}"},
                    timeout=(5, self.args.request_timeout_s),
                )
                a.status = r.status_code
                if r.status_code == 200:
                    out = r.json()
                    a.text, a.draft_version = out["choices"][0]["text"], out["speculation"]["draft_version"] or ""
                else:
                    a.error = r.text[:200]
            except requests.RequestException as exc:
                a.error = f"{type(exc).__name__}: {str(exc)[:160]}"
            a.end = self.now()
            with self._lock:
                self.in_flight.discard(rid)
            self.attempts.append(a)
            seq += 1
            failures = 0 if a.status == 200 else failures + 1
            if failures:  # the server is down or restarting: back off (0.25 s doubling to 2 s)
                self._stop.wait(min(2.0, 0.25 * 2 ** (failures - 1)))

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.args.request_timeout_s + 10)


# ---------------------------------------------------------------- the run
class Driver:
    """Runs the load for ``duration_s`` and kills one component per slot, at a random point in it."""

    def __init__(self, stack: Stack, args) -> None:
        self.stack, self.args = stack, args
        self.rng = random.Random(args.seed)
        self.windows: list[Window] = []
        self.scrapes: dict[int, dict] = {}
        """Per server epoch: its last successful /metrics scrape."""
        self.load: Load | None = None
        self.bar: tqdm | None = None
        self.errors: list[BaseException] = []
        """Failed restarts (raised in the main thread)."""
        self.restarts: list[threading.Thread] = []
        self._stop = threading.Event()

    def plan(self) -> list[tuple[str, float, float]]:
        """(component, when, down for) per kill: the components in seeded shuffled turns, one kill per slot."""
        order: list[str] = []
        while len(order) < self.args.kills:
            turn = list(self.args.components)
            self.rng.shuffle(turn)
            order += turn
        slot = self.args.duration_s / max(1, self.args.kills)
        return [
            (c, (i + self.rng.uniform(0.2, 0.8)) * slot, self.rng.uniform(*DOWN_S[c]))
            for i, c in enumerate(order[: self.args.kills])
        ]

    def tick(self) -> None:
        if self.errors:
            raise self.errors[0]
        if self.bar is None or self.load is None:
            return
        second = min(int(self.load.now()), self.bar.total)
        if second > self.bar.n:
            done = list(self.load.attempts)
            self.bar.set_postfix(
                answered=sum(a.status == 200 for a in done),
                failed=sum(a.status != 200 for a in done),
                kills=len(self.windows),
                refresh=False,
            )
            self.bar.update(second - self.bar.n)

    def wait(self, cond, timeout_s: float, what: str) -> None:
        """Tick until ``cond()``; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.stack.logs()}")
            self.tick()
            time.sleep(0.2)

    def wait_until(self, t: float) -> None:
        self.wait(lambda: self.load.now() >= t, t - self.load.now() + 60, f"{t:.0f} s into the load")

    def wait_back(self, name: str) -> float:
        """Block until ``name`` is back (no ticking: restart threads call this too); returns the load time."""
        deadline = time.monotonic() + self.args.ready_timeout_s
        while not self.stack.is_back(name):
            if time.monotonic() > deadline or self._stop.is_set():
                raise TimeoutError(f"{name} not back after {self.args.ready_timeout_s:.0f} s\n{self.stack.logs()}")
            time.sleep(0.2)
        return self.load.now() if self.load is not None else 0.0

    def _monitor(self) -> None:
        """Scrape the server's logger counters every second (per epoch: the last scrape is kept)."""
        while not self._stop.wait(1.0):
            epoch = self.stack.epoch
            got = scrape(self.stack.server_url)
            if got is not None and epoch == self.stack.epoch:
                self.scrapes[epoch] = got

    def kill(self, name: str, down_s: float) -> Window:
        """SIGKILL ``name`` now; a thread restarts it after ``down_s`` and closes the window once it is back."""
        stack, load = self.stack, self.load
        proc = stack.procs[name]
        w = Window(name, 0.0, down_s, pid=proc.proc.pid, epoch=stack.epoch)
        if name == "server":
            got = scrape(stack.server_url)  # the last look at what this server has accepted
            if got is not None:
                self.scrapes[stack.epoch] = got
            w.published = dict(self.scrapes.get(stack.epoch, {}).get("published", {}))
            w.in_flight = len(load.in_flight)
        w.killed_at = load.now()
        proc.kill()
        if name == "server":
            stack.epoch += 1
        self.windows.append(w)
        log.info(
            "kill %d/%d at %.1f s: SIGKILL %s (pid %d)%s; restarting in %.1f s",
            len(self.windows),
            self.args.kills,
            w.killed_at,
            name,
            w.pid,
            f", {w.in_flight} request(s) in flight, accepted before the kill: {w.published}"
            if name == "server"
            else "",
            down_s,
        )

        def restart() -> None:
            try:
                if self._stop.wait(max(0.0, w.killed_at + down_s - load.now())):
                    return
                stack.spawn(name)
                w.back_at = self.wait_back(name)
                log.info(
                    "%s back at %.1f s (%s), %.1f s after the kill",
                    name,
                    w.back_at,
                    {"server": "/readyz 200", "mlflow": "/health 200", "trainer": "started up"}[name],
                    w.back_at - w.killed_at,
                )
            except BaseException as exc:  # noqa: BLE001 - the main thread raises it
                self.errors.append(exc)

        thread = threading.Thread(target=restart, name=f"restart-{name}", daemon=True)
        thread.start()
        self.restarts.append(thread)
        return w

    def run(self) -> dict:
        stack, args = self.stack, self.args
        t_setup = time.monotonic()
        for name in ("mlflow", "server", "trainer"):  # all at once: the server and trainer retry the registry
            stack.spawn(name)
        for name in ("mlflow", "server"):
            self.wait_back(name)
        setup_s = time.monotonic() - t_setup
        log.info(
            "stack up in %.1f s: MLflow %s, server %s, stream %s",
            setup_s,
            stack.mlflow_url,
            stack.server_url,
            stack.stream_url,
        )
        self.load = Load(stack, time.monotonic(), args.vocab, args).start()
        monitor = threading.Thread(target=self._monitor, name="monitor", daemon=True)
        monitor.start()
        self.bar = tqdm(total=int(args.duration_s), desc="soak", unit="s", mininterval=1.0, dynamic_ncols=True)
        try:
            for name, at, down_s in self.plan():
                prev = next((w for w in reversed(self.windows) if w.component == name), None)
                if prev is not None:  # a component is killed again only once it is back
                    self.wait(lambda: prev.back_at is not None, args.ready_timeout_s + 60, f"{name} to come back")
                    at = max(at, prev.back_at + args.min_gap_s)
                self.wait_until(at)
                self.kill(name, down_s)
            self.wait(
                lambda: all(w.back_at is not None for w in self.windows),
                args.ready_timeout_s + 60,
                "every killed component to come back",
            )
            self.wait_until(max([args.duration_s] + [w.back_at + args.tail_s for w in self.windows]))
        finally:
            self.load.stop()
            self._stop.set()
            for thread in self.restarts:  # none spawns a process after this
                thread.join(10)
            if not self.errors:
                self.tick()
            self.bar.close()
        load_s = self.load.now()
        try:  # on the last server, before it stops
            isolation = check_isolation(stack, self.args)
        except (requests.RequestException, KeyError, ValueError) as exc:
            log.error("the isolation checks failed to run: %s", exc)
            isolation = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        final = scrape(stack.server_url)
        if final is not None:
            self.scrapes[stack.epoch] = final
        log.info("load stopped at %.1f s; stopping the server (SIGTERM: it flushes the stream and exits)", load_s)
        server_rc = stack.procs["server"].stop(signal.SIGTERM, 60)
        trainer_rc = stack.procs["trainer"].stop(signal.SIGINT, 120)
        log.info("server exited %s, trainer exited %s", server_rc, trainer_rc)
        versions = read_registry(stack.mlflow_url)
        stack.procs["mlflow"].stop(signal.SIGTERM, 30)
        return {
            "attempts": self.load.attempts,
            "windows": self.windows,
            "scrapes": self.scrapes,
            "final_epoch": stack.epoch,
            "server_rc": server_rc,
            "trainer_rc": trainer_rc,
            "versions": versions,
            "records": read_stream(stack.stream_url),
            "setup_s": setup_s,
            "load_s": load_s,
            "isolation": isolation,
        }


def read_registry(uri: str) -> list[dict]:
    """Every version of ``draft-faults`` (archived included): version, tags, aliases."""
    from specops.registry import RegistryConfig, RegistryStore, VersionNotFoundError

    store = RegistryStore(RegistryConfig(uri=uri))
    try:
        found = store.artifact("draft").versions(CLUSTER, include_archived=True)
    except VersionNotFoundError:
        return []
    return [{"version": v.version, "tags": dict(v.tags), "aliases": list(v.aliases)} for v in found]


def read_stream(url: str) -> dict[str, list[dict]]:
    """Per topic, in log order: each record's offset, partition and decoded fields the checks need."""
    from specops.streams import StreamConfig, codec, open_stream

    out: dict[str, list[dict]] = {}
    with open_stream(StreamConfig(url=url)) as s:
        for topic in TOPICS:
            rows = []
            for m in s.read(topic, timeout_s=10):
                rec = codec.decode(m.value)
                row = {
                    "partition": m.partition,
                    "offset": m.offset,
                    "rid": rec.request_id.split("/", 1)[-1],  # records carry <tenant>/<X-Request-Id>
                    "cluster": getattr(rec, "cluster", None),
                }
                if hasattr(rec, "output_ids"):
                    row["output_ids"] = [int(t) for t in rec.output_ids]
                rows.append(row)
            out[topic] = rows
    return out


def metric_clusters(url: str) -> set[str]:
    """Every value of a ``cluster`` label on ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    return {
        s.labels["cluster"] for f in text_string_to_metric_families(r.text) for s in f.samples if "cluster" in s.labels
    }


def check_isolation(stack: Stack, args) -> dict:
    """Tenant scope and bounded cluster names on the last server, once the load has stopped (issue 34):

    - ``/readyz`` (no key) names no cluster;
    - ``BOGUS_CLUSTERS`` requests naming made-up clusters each get a 400 naming ``cluster``, and no
      made-up name becomes a ``cluster`` label on ``/metrics``;
    - the extraction replay: tenant A generates a sampled output with LLMA (it enters A's past
      sessions; its token ids are read from its GenerationRecord in the stream); A's probe with 8
      tokens of it and ``speculation: {method: "llma", n: 8}`` finds it (the positive control), the
      identical probe of E (a key that sent nothing else) must find nothing (``hits_sessions`` 0, and
      ``reference_tokens`` 0: not even the cache's size), and E's guess-and-extend attack from a
      known 8-token prefix must recover no token, while A's does.
    Probes ask for 4 tokens, under the past-sessions minimum of 8, so they never enter a cache."""
    url = stack.server_url
    alice, eve = f"Bearer {TENANTS['alice']}", f"Bearer {TENANTS['eve']}"
    rng = random.Random(f"{args.seed}-isolation")
    n_probe = 0

    def post(key: str, rid: str, **body) -> requests.Response:
        return requests.post(
            url + "/v1/completions",
            json={"model": "specops", "cluster": CLUSTER, **body},
            headers={"Authorization": key, "X-Request-Id": rid},
            timeout=(5, args.request_timeout_s),
        )

    def probe(key: str, tail: list[int]) -> dict:
        nonlocal n_probe
        n_probe += 1
        r = post(
            key,
            f"isolation-probe-{n_probe}",
            prompt=tail,
            max_tokens=4,
            temperature=0,
            speculation={"method": "llma", "n": 8},
        )
        r.raise_for_status()
        return r.json()["speculation"]["llma"]

    def extend(key: str, known: list[int], truth: list[int]) -> int:
        """Guess the token after ``known`` among decoys, keep the one whose 8-gram hits past sessions."""
        recovered: list[int] = []
        for right in truth:
            guesses = [c for c in rng.sample(range(1, args.vocab), DECOYS) if c != right] + [right]
            hits = [c for c in guesses if probe(key, (known + recovered + [c])[-8:])["hits_sessions"]]
            if len(hits) != 1 or hits[0] != right:
                break
            recovered.append(right)
        return len(recovered)

    out: dict = {"readyz_names_cluster": CLUSTER in requests.get(url + "/readyz", timeout=10).text}
    before = metric_clusters(url)
    codes = []
    for j in range(BOGUS_CLUSTERS):
        r = post(
            alice,
            f"isolation-bogus-{j}",
            prompt=make_prompt(args.seed, 10_000, j, args.vocab),
            max_tokens=2,
            temperature=0,
            cluster=f"made-up-{j}",
        )
        param = r.json().get("error", {}).get("param") if r.status_code == 400 else None
        codes.append((r.status_code, param))
    after = metric_clusters(url)
    out["bogus_clusters_sent"] = BOGUS_CLUSTERS
    out["bogus_clusters_refused"] = sum(c == (400, "cluster") for c in codes)
    out["bogus_cluster_answers"] = sorted({f"{c} {p}" for c, p in codes})
    out["metric_cluster_labels"] = {"before": sorted(before), "after": sorted(after)}
    out["made_up_labels"] = sorted(c for c in after if c.startswith("made-up"))

    secret: list[int] | None = None
    for attempt in range(3):  # a sampled output long and varied enough to probe
        rid = f"isolation-secret-{attempt}"
        r = post(
            alice,
            rid,
            prompt=make_prompt(args.seed, 10_001, attempt, args.vocab),
            max_tokens=32,
            temperature=1.0,
            seed=7 + attempt,
            speculation={"method": "llma"},
        )
        if r.status_code != 200:
            continue
        deadline = time.monotonic() + 30
        ids = None
        while ids is None and time.monotonic() < deadline:  # the logger publishes in the background
            ids = next(
                (
                    row.get("output_ids")
                    for row in read_stream(stack.stream_url).get("spec.generations", [])
                    if row["rid"] == rid
                ),
                None,
            )
            if ids is None:
                time.sleep(0.5)
        if ids and len(ids) >= 20 and len(set(ids[:12])) >= 8:
            secret = ids
            break
    out["secret_tokens"] = len(secret) if secret else 0
    if secret:
        window = secret[8:16]
        mine, theirs = probe(alice, window), probe(eve, window)
        out["control_hits"] = int(mine["hits_sessions"])
        out["cross_tenant_hits"] = int(theirs["hits_sessions"])
        out["cross_tenant_reference_tokens"] = int(theirs["reference_tokens"])
        out["control_tokens_recovered"] = extend(alice, secret[:8], secret[8:12])
        out["cross_tenant_tokens_recovered"] = extend(eve, secret[:8], secret[8:12])
    out["probes"] = n_probe
    return out


def isolation_violations(iso: dict, records: dict) -> list[str]:
    """What the isolation checks found wrong (``check_isolation``), and any stream record of a cluster
    other than the configured one."""
    bad = []
    if iso.get("readyz_names_cluster"):
        bad.append("/readyz (no key) names a cluster")
    if iso.get("bogus_clusters_refused") != iso.get("bogus_clusters_sent"):
        bad.append(
            f"requests naming made-up clusters were not all 400 naming `cluster`: {iso.get('bogus_cluster_answers')}"
        )
    if iso.get("made_up_labels"):
        bad.append(f"made-up clusters became metric labels: {iso['made_up_labels'][:5]}")
    logged = sorted({r.get("cluster") for rows in records.values() for r in rows} - {CLUSTER, None})
    if logged:
        bad.append(f"records of clusters other than {CLUSTER!r} reached the stream: {logged[:5]}")
    if iso.get("error"):
        bad.append(f"the isolation checks failed to run: {iso['error']}")
    elif not iso.get("secret_tokens"):
        bad.append("the extraction replay could not run: no sampled output of 20+ varied tokens was logged")
    elif not iso.get("control_hits") or not iso.get("control_tokens_recovered"):
        bad.append(
            "the extraction replay's positive control failed (the owner's own probe found nothing), so the "
            "cross-tenant result proves nothing"
        )
    elif (
        iso.get("cross_tenant_hits")
        or iso.get("cross_tenant_reference_tokens")
        or iso.get("cross_tenant_tokens_recovered")
    ):
        bad.append(f"another tenant's output leaked through LLMA's past sessions: {iso}")
    return bad


# ---------------------------------------------------------------- analysis
def classify(attempts: list[Attempt], windows: list[Window], end: float) -> None:
    """Set each attempt's ``kind`` against the server's kill windows."""
    server = [(w.killed_at, w.back_at if w.back_at is not None else end) for w in windows if w.component == "server"]
    for a in attempts:
        if a.status == 200:
            a.kind = "answered"
            continue
        hit = next(((k, b) for k, b in server if a.start < b and a.end > k), None)
        a.kind = "failed" if hit is None else ("in_flight" if a.start < hit[0] else "down")


def check_records(run: dict) -> dict:
    """Accepted records lost, per the module docstring, and what else the stream shows. Records the
    logger refused (``specops_stream_logger_dropped_total``: a build error, shedding) were never
    accepted: they are counted apart, as ``dropped``, and must be 0 too."""
    attempts: list[Attempt] = run["attempts"]
    by_rid = {a.rid: a for a in attempts}
    killed = {w.epoch: w for w in run["windows"] if w.component == "server"}
    dropped = {e: sum(got.get("dropped", {}).values()) for e, got in run.get("scrapes", {}).items()}
    out = {
        "lost": 0,
        "lost_detail": [],
        "unaccepted_at_kill": 0,
        "duplicates": 0,
        "unanswered_logged": 0,
        "checked": 0,
        "dropped": sum(dropped.values()),
    }
    for topic in TOPICS:
        rows = run["records"].get(topic, [])
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["rid"]] = counts.get(r["rid"], 0) + 1
        out["duplicates"] += sum(n - 1 for n in counts.values())
        out["unanswered_logged"] += sum(1 for rid in counts if rid in by_rid and by_rid[rid].status != 200)
        for epoch in range(run["final_epoch"] + 1):
            answered = [a for a in attempts if a.epoch == epoch and a.status == 200]
            out["checked"] += len(answered)
            missing = [a for a in answered if a.rid not in counts]
            refused = -(-dropped.get(epoch, 0) // len(TOPICS))  # a request's records are dropped together
            if epoch not in killed:  # stopped with SIGTERM: everything answered must be there
                lost = max(0, len(missing) - refused)
                why = f"{len(missing)} answered request(s) missing after the graceful stop, {refused} refused"
            else:
                present = [by_rid[rid] for rid in counts if rid in by_rid and by_rid[rid].epoch == epoch]
                latest_sent = max((a.start for a in present), default=float("-inf"))
                holes = [a for a in missing if a.end < latest_sent]
                accepted = (killed[epoch].published or {}).get(topic, 0)
                on_disk = sum(counts[a.rid] for a in present)
                lost = max(len(holes) - refused, accepted - on_disk, 0)
                out["unaccepted_at_kill"] += max(0, len(missing) - lost - refused)
                why = (
                    f"{len(holes)} hole(s) before a later record, {refused} refused; {accepted} accepted before "
                    f"the kill, {on_disk} in the stream"
                )
            if lost:
                out["lost_detail"].append(
                    {"topic": topic, "epoch": epoch, "lost": lost, "why": why, "missing": [a.rid for a in missing][:20]}
                )
            out["lost"] += lost
    return out


def check_versions(versions: list[dict]) -> dict:
    """Registered versions whose source_id or training window repeats an earlier version's."""
    seen_source, seen_window, dups = set(), set(), []
    for v in sorted(versions, key=lambda v: int(v["version"])):
        tags = v["tags"]
        source, window = tags.get("source_id"), tags.get("lineage_offsets")
        if (source and source in seen_source) or (window and window in seen_window):
            dups.append({"version": v["version"], "source_id": source, "lineage_offsets": window})
        seen_source.add(source)
        seen_window.add(window)
    promoted = [v for v in versions if v["tags"].get("gate_decision") == "promoted"]
    champion = next((v["version"] for v in versions if "champion" in v["aliases"]), None)
    return {
        "registered": len(versions),
        "duplicated": len(dups),
        "duplicates": dups,
        "promoted": len(promoted),
        "champion": champion,
    }


def check_outputs(attempts: list[Attempt], records: dict, model_dir: Path, args) -> dict:
    """Every answered request against target-only greedy decoding of its prompt in this process.

    *Identical*: the response text, and the token ids of its GenerationRecord when it was
    logged, equal the reference's. *Tie*: not identical, but every logged token is the
    target's greedy choice given the served prefix up to ``TIE_TOL`` (checked in float64): an
    exact float32 tie broken the other way by a batched verification, which
    ``serving/engine/batching.py`` documents. Anything else *diverged*."""
    from transformers import AutoModelForCausalLM

    from specops.core.models import load_model_dir
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams

    pair = load_model_dir(model_dir)
    engine, tok = SpecEngine(pair), pair.tokenizer
    params = SamplingParams(max_new_tokens=args.max_tokens)
    logged = {r["rid"]: r["output_ids"] for r in records.get("spec.generations", [])}
    target64 = None

    def worst_gap(prompt: list[int], out: list[int]) -> float:
        """Largest (max logit − logit of the served token) over the served positions, in float64."""
        nonlocal target64
        if target64 is None:
            target64 = AutoModelForCausalLM.from_pretrained(model_dir / "target", dtype=torch.float64).eval()
        with torch.no_grad():
            logits = target64(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]  # [len(out), vocab]
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        return float((logits.max(dim=-1).values - chosen).max())

    answered = [a for a in attempts if a.status == 200]
    identical, ties, diverged = 0, [], []
    for a in tqdm(answered, desc="target-only references", unit="req"):
        prompt = make_prompt(args.seed, a.client, a.seq, args.vocab)
        ref = list(engine.generate(prompt, params, method="target").token_ids)
        out = logged.get(a.rid)
        if a.text == tok.decode(ref, skip_special_tokens=True) and out in (None, ref):
            identical += 1
            continue
        row = {
            "rid": a.rid,
            "draft_version": a.draft_version,
            "text": a.text,
            "output_ids": out,
            "target_only": ref,
            "first_difference": next((i for i, (x, y) in enumerate(zip(out or [], ref)) if x != y), None),
        }
        if out is not None and a.text == tok.decode(out, skip_special_tokens=True):
            row["worst_gap"] = worst_gap(prompt, out)
            if row["worst_gap"] <= TIE_TOL:
                ties.append(row)
                continue
        diverged.append(row)
    return {
        "checked": len(answered),
        "identical": identical,
        "ties": len(ties),
        "diverged": len(diverged),
        "tokens_checked": sum(a.rid in logged for a in answered),
        "tie_detail": ties[:10],
        "diverged_detail": diverged[:10],
    }


def analyse(run: dict, model_dir: Path, args) -> dict:
    attempts: list[Attempt] = run["attempts"]
    iso = run.get("isolation", {})
    classify(attempts, run["windows"], run["load_s"])
    kinds = {k: sum(a.kind == k for a in attempts) for k in ("answered", "in_flight", "down", "failed")}
    records = check_records(run)
    versions = check_versions(run["versions"])
    outputs = check_outputs(attempts, run["records"], model_dir, args)
    windows = run["windows"]
    dropped = {}
    for got in run["scrapes"].values():  # per server incarnation, its last scrape
        for reason, n in got.get("dropped", {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    by_comp = {}
    for c in COMPONENTS:
        ws = [w for w in windows if w.component == c]
        spans = [(w.killed_at, w.back_at if w.back_at is not None else run["load_s"]) for w in ws]
        over = [a for a in attempts if any(a.start < b and a.end > k for k, b in spans)]
        lengths = [b - k for k, b in spans]
        by_comp[c] = {
            "kills": len(ws),
            "window_s_median": statistics.median(lengths) if ws else None,
            "window_s_max": max(lengths, default=None),
            "requests_overlapping": len(over),
            "answered_overlapping": sum(a.status == 200 for a in over),
        }
    summary = {
        "requests": len(attempts),
        "answered": kinds["answered"],
        "failed_outside_kill_windows": kinds["failed"],
        "failed_in_flight_at_server_kill": kinds["in_flight"],
        "failed_sent_while_server_down": kinds["down"],
        "kills": {c: by_comp[c]["kills"] for c in COMPONENTS},
        "accepted_records_lost": records["lost"],
        "records_checked": records["checked"],
        "answered_unaccepted_at_kill": records["unaccepted_at_kill"],
        "duplicate_records": records["duplicates"],
        "records_of_unanswered_requests": records["unanswered_logged"],
        "logger_dropped": dropped,
        "logger_dropped_records": records["dropped"],
        "versions_registered": versions["registered"],
        "versions_duplicated": versions["duplicated"],
        "promotions": versions["promoted"],
        "draft_versions_served": sorted(
            {a.draft_version for a in attempts if a.status == 200},
            key=lambda v: (v != "base", int(v) if v.isdigit() else 0),
        ),
        "outputs_checked": outputs["checked"],
        "outputs_identical": outputs["identical"],
        "outputs_tie_flips": outputs["ties"],
        "outputs_diverged": outputs["diverged"],
        "output_tokens_checked": outputs["tokens_checked"],
        "server_exit_on_sigterm": run["server_rc"],
        "trainer_exit_on_sigint": run["trainer_rc"],
        "unknown_clusters_refused": f"{iso.get('bogus_clusters_refused')} / {iso.get('bogus_clusters_sent')}",
        "cross_tenant_session_hits": iso.get("cross_tenant_hits"),
        "cross_tenant_tokens_recovered": iso.get("cross_tenant_tokens_recovered"),
        "own_tenant_tokens_recovered": iso.get("control_tokens_recovered"),
    }
    violations = []
    if summary["failed_outside_kill_windows"]:
        violations.append(
            f"{summary['failed_outside_kill_windows']} request(s) failed outside the server's kill windows"
        )
    if summary["accepted_records_lost"]:
        violations.append(f"{summary['accepted_records_lost']} accepted record(s) lost: {records['lost_detail']}")
    if summary["logger_dropped_records"]:
        violations.append(
            f"the serving logger dropped {summary['logger_dropped_records']} record(s): {dropped} "
            "(the server log says why)"
        )
    if summary["versions_duplicated"]:
        violations.append(f"{summary['versions_duplicated']} duplicated version(s): {versions['duplicates']}")
    if summary["outputs_diverged"]:
        violations.append(
            f"{summary['outputs_diverged']} output(s) diverged from target-only: {outputs['diverged_detail'][:3]}"
        )
    if not summary["answered"]:
        violations.append("no request was answered")
    if run["server_rc"] != 0:
        violations.append(f"the server did not exit 0 on SIGTERM (exit {run['server_rc']})")
    violations += isolation_violations(iso, run["records"])
    summary["violations"] = violations
    summary["invariants_hold"] = not violations
    failures = [
        {
            "rid": a.rid,
            "kind": a.kind,
            "epoch": a.epoch,
            "start": round(a.start, 3),
            "end": round(a.end, 3),
            "status": a.status,
            "error": a.error,
        }
        for a in attempts
        if a.status != 200
    ]
    return {
        "summary": summary,
        "components": by_comp,
        "records": records,
        "versions": versions,
        "outputs": outputs,
        "isolation": iso,
        "failures": failures,
    }


# ---------------------------------------------------------------- report
def tables(report: dict) -> tuple[list[Table], str]:
    s, comp = report["summary"], report["components"]
    rows = [
        ("requests sent", s["requests"], ""),
        ("answered (200)", s["answered"], ""),
        ("failed outside the kill windows", s["failed_outside_kill_windows"], "0"),
        ("killed server's in-flight requests (failed)", s["failed_in_flight_at_server_kill"], "counted apart"),
        ("sent while the server was down (failed)", s["failed_sent_while_server_down"], "counted apart"),
        ("accepted records lost (misses + generations)", s["accepted_records_lost"], "0"),
        ("records of answered requests still queued at a kill", s["answered_unaccepted_at_kill"], "counted apart"),
        ("records the serving logger dropped (never accepted)", s["logger_dropped_records"], "0"),
        (
            "versions registered / duplicated",
            f"{s['versions_registered']} / {s['versions_duplicated']}",
            "0 duplicated",
        ),
        ("outputs equal to target-only, token for token", f"{s['outputs_identical']} / {s['outputs_checked']}", "all"),
        ("  … the others: the target's choice at an exact tie", s["outputs_tie_flips"], "counted apart"),
        ("outputs diverged from target-only", s["outputs_diverged"], "0"),
        ("requests naming a made-up cluster refused (400 `cluster`)", s.get("unknown_clusters_refused"), "all"),
        ("another tenant's LLMA probe: past-session hits", s.get("cross_tenant_session_hits"), "0"),
        ("another tenant's extraction: tokens recovered", s.get("cross_tenant_tokens_recovered"), "0"),
        ("  … the owner's own extraction (positive control)", s.get("own_tenant_tokens_recovered"), "> 0"),
    ]
    head = Table(title="Soak under kills: invariants")
    for col in ("measure", "value", "required"):
        head.add_column(col, justify="left" if col != "value" else "right")
    md = ["| measure | value | required |", "|---|---:|---|"]
    for r in rows:
        head.add_row(*map(str, r))
        md.append(f"| {' | '.join(map(str, r))} |")
    kt = Table(title="Kill windows (SIGKILL → back)")
    cols = ("component", "kills", "window median", "window max", "requests overlapping", "answered overlapping")
    for col in cols:
        kt.add_column(col, justify="left" if col == "component" else "right")
    md += [
        "",
        "| component | kills | window median | window max | requests overlapping | answered overlapping |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c, v in comp.items():
        cells = (
            c,
            str(v["kills"]),
            fmt(v["window_s_median"], ".1f", " s"),
            fmt(v["window_s_max"], ".1f", " s"),
            str(v["requests_overlapping"]),
            str(v["answered_overlapping"]),
        )
        kt.add_row(*cells)
        md.append(f"| {' | '.join(cells)} |")
    return [head, kt], "\n".join(md)


def doc_section(report: dict, table: str) -> str:
    c, env, s = report["config"], report["environment"], report["summary"]
    kills = ", ".join(f"{w['component']} at {w['killed_at']:.0f} s" for w in report["kills"])
    return "\n".join(
        [
            DOC_BEGIN,
            "## Soak and faults (`benchmarks/faults.py`)",
            "",
            "Command:",
            "",
            f"    {report['command']}",
            "",
            f"Date {report['date'][:10]}; {env['cpu_count']} CPU cores, {c['threads']} torch thread(s) per process, no GPU; "
            f"commit {str(env['git_commit'])[:10]}{' (dirty)' if env['git_dirty'] else ''}. Models: {c['models']}. "
            f"`mlflow server` (SQLite store, served artifacts), `specops serve` (local stream log, registry over HTTP) "
            f"and `specops train` (`--gate-margin -1`: every update is registered and promoted) as separate processes; "
            f"{c['clients']} clients sending distinct greedy requests ({c['max_tokens']} new tokens, draft method) for "
            f"{report['load_s']:.0f} s; {sum(s['kills'].values())} SIGKILLs at seeded random points (seed {c['seed']}): "
            f"{kills}. Each killed process was restarted after a random 0-5 s on the same port, store, stream and "
            f"checkpoints; at the end the server got SIGTERM (exit {s['server_exit_on_sigterm']}) and the trainer SIGINT "
            f"(exit {s['trainer_exit_on_sigint']}). Run time {report['elapsed_s']:.0f} s. The clients take turns "
            f"between two API keys; after the load the driver checks tenant isolation and cluster bounds on the last "
            f"server (requests naming made-up clusters; the extraction replay of one key's output through LLMA's past "
            f"sessions by a third key that sends nothing else, with the owner's own probe as the positive control).",
            "",
            table,
            "",
            f"The trainer registered {s['versions_registered']} versions and promoted {s['promotions']}; requests were "
            f"served by {len(s['draft_versions_served'])} draft versions (base included). Logger drops: "
            f"{s['logger_dropped'] or 'none'}; duplicate records in the stream: {s['duplicate_records']}. Invariants: "
            f"{'all hold' if s['invariants_hold'] else 'VIOLATED: ' + '; '.join(s['violations'])}.",
            "",
            "A *kill window* runs from the SIGKILL to the restarted process being back (`/readyz` 200 for the server, "
            "`/health` 200 for MLflow, the restarted trainer's startup line in its log); windows of different components "
            "may overlap, and a component is killed again only once it is back. *Answered overlapping* a server window "
            "are requests the restarted server answered before the driver's next `/readyz` poll. Only the server's "
            "windows excuse a failed request: a failure overlapping one is an *in-flight* request of the killed server "
            "(sent before the kill) or was *sent while it was down*; the trainer and the registry are off the request path, so a request "
            "that failed anywhere else counts as *failed outside the kill windows*. A record is *accepted* once the "
            "serving stream logger's publish returned; *lost* counts, for the server stopped with SIGTERM, every "
            "answered request's missing record, and for each killed server the larger of its last scraped "
            "`specops_stream_logger_published_total` minus its records in the stream and the records missing before "
            "a later record of the same server (one cluster is one partition, published in order). Answered requests "
            "whose records were still queued in a killed server's memory are the documented limit and are counted "
            "apart. A version is *duplicated* when its `source_id` (trainer / cluster / checkpoint) or its training "
            "window (`lineage_offsets`) repeats an earlier version's. Outputs are compared with target-only greedy "
            f"decoding of every answered prompt in the benchmark's process ({s['output_tokens_checked']} of them also "
            "token for token with their GenerationRecord); an output that differs only where the target's top two "
            f"logits tie (every served token within {TIE_TOL:g} of the target's float64 maximum given the served "
            "prefix) is the target's output with a float32 tie broken the other way by a batched verification "
            "(`serving/engine/batching.py`), counted apart; any other difference is *diverged*.",
            DOC_END,
        ]
    )


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--models",
        type=Path,
        default=None,
        help="directory with target/ and draft/ (default: a tiny random pair built in the work directory)",
    )
    p.add_argument("--duration-s", type=float, default=None, help="seconds of load (default 240; 75 with --quick)")
    p.add_argument(
        "--kills", type=int, default=None, help="SIGKILLs, the components taking turns (default 9; 3 with --quick)"
    )
    p.add_argument(
        "--components", default=",".join(COMPONENTS), help="comma-separated components to kill, taking turns"
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill plan, the prompts and the tiny models")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of each process")
    p.add_argument(
        "--min-gap-s", type=float, default=3.0, help="least steady load between one window and the next kill"
    )
    p.add_argument("--tail-s", type=float, default=5.0, help="least steady load after the last window")
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="give up on a (re)start after this long")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="client read timeout per request")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the stream, registry, checkpoints and process logs here (default: a temporary "
        "directory, removed unless an invariant is violated)",
    )
    p.add_argument("--quick", action="store_true", help="75 s of load, one kill of each component")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument(
        "--doc-from",
        type=Path,
        default=None,
        metavar="JSON",
        help="only rewrite the doc section from a saved --json report",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    args.duration_s = args.duration_s if args.duration_s is not None else (75.0 if args.quick else 240.0)
    args.kills = args.kills if args.kills is not None else (3 if args.quick else 9)
    args.components = tuple(c.strip() for c in args.components.split(",") if c.strip())
    if not args.components or not set(args.components) <= set(COMPONENTS):
        p.error(f"--components takes a comma-separated subset of {','.join(COMPONENTS)}")
    if args.kills < 0 or args.clients < 1 or args.duration_s <= 0 or args.max_tokens < 1:
        p.error("need --kills >= 0, --clients >= 1, --duration-s > 0, --max-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.doc_from:
        report = json.loads(args.doc_from.read_text())
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, tables(report)[1]))
        return 0
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    levels = {name: logging.getLogger(name).level for name in (log.name, *NOISY)}
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.WARNING if args.verbose else logging.ERROR)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:  # called in-process by tests/test_faults.py: leave the caller's threads and log levels as they were
        return run_and_report(args, argv)
    finally:
        torch.set_num_threads(threads)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def run_and_report(args: argparse.Namespace, argv: list[str] | None) -> int:
    started = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="specops-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    stack = None
    try:
        if args.models is None:
            model_dir = tiny_pair(work / "models", args.seed)
            models = "tiny random pair (2-layer target, noisy copy as draft)"
        else:
            model_dir, models = args.models, str(args.models)
        args.vocab = int(json.loads((model_dir / "target" / "config.json").read_text())["vocab_size"])
        stack = Stack(work, model_dir / "target", model_dir / "draft", args)
        run = Driver(stack, args).run()
    except BaseException:
        if stack is not None:
            log.error("the run failed; process logs in %s\n%s", work / "logs", stack.logs())
        raise
    finally:
        if stack is not None:
            stack.close()
    result = analyse(run, model_dir, args)
    s = result["summary"]
    report = {
        "command": " ".join(
            [".venv/bin/python", "benchmarks/faults.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": {
            "models": models,
            "clients": args.clients,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "threads": args.threads,
            "duration_s": args.duration_s,
            "kills": args.kills,
            "components": args.components,
            "cluster": CLUSTER,
        },
        "summary": s,
        "kills": [
            {
                **asdict(w),
                "killed_at": round(w.killed_at, 2),
                "back_at": w.back_at and round(w.back_at, 2),
                "down_s": round(w.down_s, 2),
            }
            for w in run["windows"]
        ],
        "components": result["components"],
        "records": {k: v for k, v in result["records"].items()},
        "versions": result["versions"],
        "outputs": {k: v for k, v in result["outputs"].items()},
        "isolation": result["isolation"],
        "failures": result["failures"],
        "setup_s": round(run["setup_s"], 1),
        "load_s": run["load_s"],
        "environment": environment(),
        "elapsed_s": time.perf_counter() - started,
        "workdir": str(work),
    }
    rich_tables, table = tables(report)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    for t in rich_tables:
        console.print(t)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if not args.no_doc:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, table))
    print(json.dumps({k: v for k, v in s.items() if k != "violations"}))
    for v in s["violations"]:
        log.error("invariant violated: %s", v)
    if s["violations"]:
        log.error("process logs, stream and registry kept in %s", work)
    elif args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if s["invariants_hold"] else 1


if __name__ == "__main__":
    sys.exit(main())

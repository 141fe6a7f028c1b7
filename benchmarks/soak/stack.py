"""The soak's system under test (``benchmarks/faults.py`` is the command): its constants, the tiny
model pair and prompts, the processes (the MLflow server, the serving replica and the trainer) and
what they expose (the logger's counters, the registry's versions, the stream's records)."""

from __future__ import annotations

import copy
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import requests
import torch

from specops.streams.tansu import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]

log = logging.getLogger("bench.faults")

CLUSTER = "faults"
COMPONENTS = ("server", "trainer", "mlflow")
TOPICS = ("spec.misses", "spec.generations")
DOWN_S = {"server": (0.0, 2.0), "trainer": (0.0, 3.0), "mlflow": (1.0, 5.0)}
"""How long a killed component stays down before the driver restarts it (uniform, seconds)."""
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

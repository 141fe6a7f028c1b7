"""``specops demo``'s traffic: the workload replayed through the HTTP API, with a live α line
per cluster, and the registry's promotions and rollbacks recorded as they happen."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from rich.console import Console

from specops.demo.report.data import DemoRun, Promotion, acceptance, draft_share, token_alpha

if TYPE_CHECKING:
    from specops.demo.run import DemoConfig

log = logging.getLogger(__name__)


def replay_traffic(console: Console, server, registry, workload, cfg: DemoConfig) -> DemoRun:
    """Replay the workload's schedule through the API with a live line per cluster; the run's record
    (requests, promotions, notes, config shown in the report), speed and versions still empty."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specops.workloads.workload import Replayer, describe

    schedule = workload.schedule
    replayer = Replayer(
        server.url + "/v1",
        server.cfg.api.served_model_name,
        clients=cfg.clients,
        max_tokens=cfg.max_tokens,
        method=cfg.method or None,
    )
    watcher = PromotionWatcher(registry, console)
    rows, routed_ok, lock = [], [0, 0], threading.Lock()
    with Progress(
        TextColumn("[bold]traffic"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        refresh_per_second=4,
    ) as progress:
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
        notes.append(
            f"The router sent {routed_ok[0]} of {routed_ok[1]} requests to the cluster of their true domain "
            f"({routed_ok[0] / routed_ok[1]:.0%})."
        )
    if any(r.ok for r in rows) and any(r.ok and r.rejected_steps is None for r in rows):
        notes.append(
            "The server's responses carry no speculation.rejected_steps: the per-token α is unknown for "
            "this run, the acceptance (accepted / drafted) columns stand in."
        )
    from specops.serving.proposers.catalogue import DEFAULT_K

    chat = workload.name == "chat"
    config = {
        "workload": workload.name
        + (" (/v1/chat/completions: sql, math, api)" if chat else " (/v1/completions: held-out code and prose files)"),
        "requests": cfg.requests,
        "clients": cfg.clients,
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        **({} if chat else {"prompt_tokens": cfg.prompt_tokens}),
        "trainer_interval": cfg.interval,
        "trainer_holdout_every": cfg.holdout_every,
        "gate_min_positions": cfg.gate_min_positions,
        "trainer_average_decay": cfg.average_decay,
        "prompts": f"recurring: {cfg.recurring} per domain, drawn with replacement"
        if cfg.recurring
        else "distinct: every request a prompt never served before",
        "phases": describe(workload.phases),
        "router": "fitted on each domain's router prompts (disjoint from served and eval prompts)"
        if chat
        else "fitted on the bootstrap's training text",
        "speculation": f"{cfg.method}, k={DEFAULT_K.get(cfg.method, 'default')}"
        if cfg.method
        else "none named: the server's default, auto (the draft model, LLMA or target-only per step)",
    }
    rows.sort(key=lambda r: r.t)
    return DemoRun(
        started_at="",
        duration_s=0.0,
        config=config,
        requests=rows,
        promotions=watcher.events,
        speed=[],
        registry_versions=[],
        mlflow_ui_url=None,
        api_url=None,
        notes=notes,
    )


def _live(rows, watcher) -> str:
    """α per cluster over its last 20 requests (the OSD per-token α; accepted / drafted, as
    ``acc``, from a server that does not report rejected steps), ``auto``'s share of steps on
    the draft model there (when ``auto`` decoded them), its version, promotions."""
    parts = []
    for cluster in sorted({r.cluster for r in rows if r.ok}):
        recent = [r for r in rows if r.ok and r.cluster == cluster][-20:]
        alpha, name = token_alpha(recent), "α"
        if alpha is None and any(r.rejected_steps is None for r in recent):
            alpha, name = acceptance(recent), "acc"
        share = draft_share(recent)
        on_draft = "" if share is None else f" draft {share:.0%}"
        version = recent[-1].draft_version or "-"
        parts.append(f"{cluster} {name} {float('nan') if alpha is None else alpha:.2f}{on_draft} (v{version})")
    promos = sum(e.kind == "promote" for e in watcher.events)
    return " | ".join(parts) + f" | promotions {promos}"


def late_promotions(registry, run: DemoRun, console: Console) -> None:
    """Champions promoted after the traffic ended (the trainer finishes the update it is in when
    it stops, and its gate may promote it), added to ``run.promotions`` at the workload's end: the
    closing comparison serves them, so the report names them."""
    from specops.registry.errors import RegistryError

    last = {p.cluster: p.version for p in sorted(run.promotions, key=lambda p: p.t)}
    t_end = max([r.t for r in run.requests] + [p.t for p in run.promotions], default=0.0)
    try:
        drafts = registry.artifact("draft")
        for cluster in drafts.keys():
            champ = drafts.by_alias(cluster)
            if champ is None or last.get(cluster) == champ.version:
                continue
            reason = champ.tags.get("gate_reason", "") + " (promoted as the trainer stopped, after the traffic)"
            run.promotions.append(Promotion(t=t_end, cluster=cluster, version=champ.version, reason=reason))
            console.print(f"[green]promote draft-{cluster} → v{champ.version}[/] [dim](as the trainer stopped)[/]")
    except RegistryError as exc:  # best effort: the report still has everything else
        log.warning("could not read the registry's last champions: %s", exc)


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
        drafts = self.registry.artifact("draft")
        for cluster in drafts.keys():
            champ = drafts.by_alias(cluster)
            if champ is None or self._seen.get(cluster) == champ.version:
                continue
            prev = self._seen.get(cluster)
            self._seen[cluster] = champ.version
            kind = "rollback" if prev is not None and int(champ.version) < int(prev) else "promote"
            reason = champ.tags.get("gate_reason", "") if kind == "promote" else "rolled back"
            t = time.monotonic() - self._t0()
            self.events.append(Promotion(t=t, cluster=cluster, version=champ.version, kind=kind, reason=reason))
            self.console.print(
                f"[green]{time.strftime('%H:%M:%S')} {kind} draft-{cluster} → v{champ.version}[/]"
                f" [dim]{reason[:100]}[/]"
            )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        from specops.registry.errors import RegistryError

        try:
            self.poll()
        except RegistryError as exc:  # the last look is best effort
            log.warning("could not read the registry's last champions: %s", exc)

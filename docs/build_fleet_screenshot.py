#!/usr/bin/env python
"""The fleet dashboard of compose's profile ``monitoring``, drawn from a real run, for deploy/README.md.

Grafana cannot be installed on the machines this repository is built on (no container registry, no Debian
package), so this script does what Grafana would do, from the same two files, and says so in the picture:

1. starts a real fleet on this machine, as compose runs it (README, "Several processes"): two ``specops serve``
   replicas and ``specops train --schedule --metrics-port`` on one local stream and one SQLite registry, with
   the chat workload's first router registered (as ``specops demo`` does);
2. starts a real Prometheus (Debian's ``prometheus`` package) on compose's ``prometheus/prometheus.yml``, its
   targets moved to this machine and nothing else changed (``localize``: the ``serving`` DNS lookup becomes the
   two replicas' addresses, ``trainer:9400`` the trainer's; ``serving-vllm``, which has no process here, goes);
3. replays the chat workload through the OpenAI API, the requests spread over ``--duration`` seconds and
   alternated between the replicas (the gateway's leastconn, with one client);
4. runs every query of the chart's dashboard (``deploy/helm/specops/dashboards/specops.json``) through
   Prometheus' ``/api/v1/query_range`` over the run, with Grafana's variables filled in as Grafana would
   (``$cluster`` = All, ``$__interval`` and ``$__rate_interval`` from the data source's scrape interval), and
   draws the panels on the dashboard's own grid with matplotlib: one PNG.

Needs Debian's ``prometheus`` (``apt-get install prometheus``); this script installs nothing.

    .venv/bin/python docs/build_fleet_screenshot.py                          # bootstrapped models -> docs/img/
    .venv/bin/python docs/build_fleet_screenshot.py --model-dir /tmp/tiny --duration 120 --out /tmp/fleet.png
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml

log = logging.getLogger("build_fleet_screenshot")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_PROMETHEUS = ROOT / "deploy" / "compose" / "prometheus" / "prometheus.yml"
COMPOSE_DATASOURCE = ROOT / "deploy" / "compose" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD = ROOT / "deploy" / "helm" / "specops" / "dashboards" / "specops.json"
DEFAULT_OUT = ROOT / "docs" / "img" / "fleet-dashboard.png"
NUM_REPLICAS = 2


# ---------------------------------------------------------------- 1-2. the fleet and its Prometheus
def localize(config: dict, serving: list[str], trainer: str, prometheus: str) -> dict:
    """Compose's Prometheus config with its targets on this machine: the ``serving`` DNS lookup becomes
    ``serving`` (host:port each), ``trainer:<port>`` becomes ``trainer``, Prometheus' own ``localhost:9090``
    becomes ``prometheus``; a job with no process here (``serving-vllm``) is dropped. Intervals, paths and
    job names are kept."""
    out = copy.deepcopy(config)
    jobs = []
    for job in out["scrape_configs"]:
        names = [n for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
        statics = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        if names == ["serving"]:
            targets = serving
        elif len(statics) == 1 and statics[0].startswith("trainer:"):
            targets = [trainer]
        elif statics == ["localhost:9090"]:
            targets = [prometheus]
        else:
            log.info("job %s: no process here, dropped", job["job_name"])
            continue
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": targets}]
        jobs.append(job)
    assert {j["job_name"] for j in jobs} >= {"serving", "trainer"}, "compose's config lost a job"
    out["scrape_configs"] = jobs
    return out


def _free_port() -> int:
    from specops.demo.stack import free_port

    return free_port(0)


def _seconds(duration: str) -> float:
    """A Prometheus duration (``15s``, ``1m``) in seconds."""
    scale = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}
    for unit in ("ms", "s", "m", "h", "d"):
        if duration.endswith(unit) and duration[: -len(unit)].isdigit():
            return int(duration[: -len(unit)]) * scale[unit]
    raise ValueError(duration)


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return r.read()


def _wait(url: str, what: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        with contextlib.suppress(OSError):
            _get(url, timeout=2)
            return
        time.sleep(1)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s ({url})")


@dataclass
class Fleet:
    """The processes this script starts, stopped in reverse order by their own process ids."""

    work: Path
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        logf = open(self.work / f"{name}.log", "w")  # noqa: SIM115 (the child's, closed with it)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        self.procs.append((name, proc))
        log.info("%s started (pid %d, log %s)", name, proc.pid, self.work / f"{name}.log")
        return proc

    def close(self) -> None:
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT if name == "trainer" else signal.SIGTERM)
        for name, proc in reversed(self.procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in 60 s: killed", name)
                proc.kill()
                proc.wait(10)


def start_fleet(fleet: Fleet, model_dir: Path, prometheus_bin: str, cfg) -> tuple[list[str], str, str]:
    """The trainer, the replicas and Prometheus; returns (replica URLs, Prometheus URL, trainer target)."""
    work = fleet.work
    stream_url = f"local://{work / 'streams'}"
    registry_uri = f"sqlite:///{work / 'registry' / 'mlflow.db'}"
    py = [sys.executable, "-m", "specops.cli.main", "--threads", "1"]
    trainer_port = _free_port()
    fleet.spawn(
        "trainer",
        [
            *py,
            "train",
            "--stream",
            stream_url,
            "--registry",
            registry_uri,
            "--model-dir",
            str(model_dir),
            "--out",
            str(work / "trainer"),
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
            "--router-refit-every",
            str(cfg.router_refit_s),
            "--metrics-port",
            str(trainer_port),
        ],
    )
    replicas = []
    for i in range(1, NUM_REPLICAS + 1):
        port = _free_port()
        proc = fleet.spawn(
            f"serving-{i}",
            [
                *py,
                "serve",
                "--model-dir",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--replica",
                f"r{i}",
                "--stream",
                stream_url,
                "--registry",
                registry_uri,
                "--cache-dir",
                str(work / f"serve-{i}"),
                "--poll-s",
                "5",
            ],
        )
        replicas.append((f"http://127.0.0.1:{port}", proc))

    prom_port = _free_port()
    config = localize(
        yaml.safe_load(COMPOSE_PROMETHEUS.read_text()),
        serving=[urllib.parse.urlsplit(u).netloc for u, _ in replicas],
        trainer=f"127.0.0.1:{trainer_port}",
        prometheus=f"127.0.0.1:{prom_port}",
    )
    (work / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    prom = fleet.spawn(
        "prometheus",
        [
            prometheus_bin,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
    )
    prom_url = f"http://127.0.0.1:{prom_port}"
    _wait(prom_url + "/-/ready", "prometheus", prom, 60)
    for url, proc in replicas:
        _wait(url + "/readyz", url, proc, 900)
    log.info("fleet ready: %s, prometheus %s", ", ".join(u for u, _ in replicas), prom_url)
    return [u for u, _ in replicas], prom_url, f"127.0.0.1:{trainer_port}"


# ---------------------------------------------------------------- 3. traffic
def replay(replicas: list[str], workload, duration_s: float, clients: int, max_tokens: int) -> tuple[int, int]:
    """Request i starts no earlier than ``i * duration_s / N`` and goes to replica ``i % len(replicas)``;
    returns (ok, failed)."""
    from specops.workloads.workload import Replayer

    players = [Replayer(u + "/v1", "specops", clients=1, max_tokens=max_tokens) for u in replicas]
    schedule = workload.schedule
    gap = duration_s / max(len(schedule), 1)
    t0 = time.monotonic()
    for p in players:
        p.t0 = t0
    counts, lock, todo = [0, 0], threading.Lock(), iter(enumerate(schedule))

    def worker() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            i, planned = item
            time.sleep(max(0.0, t0 + i * gap - time.monotonic()))
            outcome = players[i % len(players)].one(planned)
            with lock:
                counts[0 if outcome.row.ok else 1] += 1
                if not outcome.row.ok:
                    log.warning("request %d failed: %s", i, outcome.error)
                done = sum(counts)
            if done % 10 == 0:
                log.info("%d/%d requests (%d failed), %.0f s", done, len(schedule), counts[1], time.monotonic() - t0)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts[0], counts[1]


# ---------------------------------------------------------------- 4. the dashboard's queries
@dataclass
class Series:
    legend: str
    times: list[float]
    values: list[float]


@dataclass
class PanelData:
    panel: dict
    series: list[Series]


def grafana_intervals(scrape_s: float, range_s: float, width_px: int) -> tuple[int, int]:
    """Grafana's ``$__interval`` (the range over the panel's width in points, at least the data source's
    scrape interval) and ``$__rate_interval`` (max(interval + scrape, 4 * scrape)), in whole seconds."""
    interval = max(scrape_s, math.ceil(range_s / width_px))
    return int(interval), int(max(interval + scrape_s, 4 * scrape_s))


def fill(expr: str, interval_s: int, rate_interval_s: int) -> str:
    """A dashboard query with Grafana's variables filled in: ``$cluster`` at All (the variable's allValue)."""
    return (
        expr.replace("$__rate_interval", f"{rate_interval_s}s")
        .replace("$__interval", f"{interval_s}s")
        .replace("$cluster", ".*")
    )


def legend(fmt: str, labels: dict[str, str]) -> str:
    import re

    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) if fmt else str(labels)


def query_panels(prom_url: str, dash: dict, start: float, end: float, scrape_s: float) -> list[PanelData]:
    interval, rate = grafana_intervals(scrape_s, end - start, width_px=900)
    out = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        series = []
        for target in panel["targets"]:
            q = urllib.parse.urlencode(
                {"query": fill(target["expr"], interval, rate), "start": start, "end": end, "step": interval}
            )
            body = json.loads(_get(f"{prom_url}/api/v1/query_range?{q}", timeout=30))
            assert body["status"] == "success", body
            for result in body["data"]["result"]:
                times = [float(t) for t, _ in result["values"]]
                values = [float(v) for _, v in result["values"]]
                series.append(Series(legend(target.get("legendFormat", ""), result["metric"]), times, values))
        out.append(PanelData(panel, series))
        log.info("%s: %d series", panel["title"], len(series))
    return out


# ---------------------------------------------------------------- 4. drawing
BG, PANEL, BORDER, TEXT, MUTED, GRID = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e8e", "#2c3235"
PALETTE = ["#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9", "#FADE2A", "#37872D"]
UNIT_PX, COL_PX, HEADER_PX, FOOTER_PX = 34, 76, 92, 34


def fmt_value(v: float, unit: str) -> str:
    if v is None or math.isnan(v):
        return "-"
    if unit == "percentunit":
        return f"{v:.1%}"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if unit == "reqps":
        return f"{v:.2f} req/s"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def render(panels: list[PanelData], dash: dict, out: Path, caption: str, start: float, end: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    width, height = 24 * COL_PX, HEADER_PX + bottom * UNIT_PX + FOOTER_PX
    fig = plt.figure(figsize=(width / 100, height / 100), dpi=100, facecolor=BG)

    def box(x_px: float, y_px: float, w_px: float, h_px: float) -> tuple[float, float, float, float]:
        return x_px / width, 1 - (y_px + h_px) / height, w_px / width, h_px / height

    t0, t1 = (datetime.fromtimestamp(t, UTC) for t in (start, end))
    fig.text(12 / width, 1 - 26 / height, dash["title"], color=TEXT, fontsize=17, weight="bold", va="center")
    fig.text(
        12 / width,
        1 - 58 / height,
        f"Data source  Prometheus      Cluster  All      {t0:%Y-%m-%d %H:%M} to {t1:%H:%M} UTC",
        color=MUTED,
        fontsize=10,
        va="center",
    )
    fig.text(1 - 12 / width, 1 - 26 / height, caption, color=MUTED, fontsize=9, ha="right", va="center")

    for p in dash["panels"]:
        if p["type"] != "row":
            continue
        g = p["gridPos"]
        fig.text(12 / width, 1 - (HEADER_PX + (g["y"] + 0.5) * UNIT_PX) / height, "\u25be " + p["title"],
                 color=TEXT, fontsize=12, weight="bold", va="center")  # fmt: skip

    for pd in panels:
        p, g = pd.panel, pd.panel["gridPos"]
        x, y, w, h = g["x"] * COL_PX + 4, HEADER_PX + g["y"] * UNIT_PX + 4, g["w"] * COL_PX - 8, g["h"] * UNIT_PX - 8
        fig.patches.append(
            Rectangle(box(x, y, w, h)[:2], w / width, h / height, transform=fig.transFigure, facecolor=PANEL,
                      edgecolor=BORDER, linewidth=1, zorder=-10)
        )  # fmt: skip
        fig.text((x + 8) / width, 1 - (y + 14) / height, p["title"], color=TEXT, fontsize=10, va="center")
        unit = p["fieldConfig"]["defaults"].get("unit", "short")
        shown = [s for s in pd.series if any(not math.isnan(v) for v in s.values)]
        legend_rows = min(len(shown), 5)
        legend_px = (legend_rows + 1) * 13 + 6 if shown else 0
        ax = fig.add_axes(box(x + 58, y + 28, w - 70, h - 28 - 22 - legend_px))
        ax.set_facecolor(PANEL)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.tick_params(colors=MUTED, labelsize=7, length=0)
        ax.grid(True, color=GRID, linewidth=0.6)
        ax.set_xlim(t0, t1)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=UTC))
        ax.xaxis.set_major_locator(MaxNLocator(6))
        ax.yaxis.set_major_locator(MaxNLocator(4))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: fmt_value(v, u)))
        defaults = p["fieldConfig"]["defaults"]
        bars = defaults.get("custom", {}).get("drawStyle") == "bars"
        if not shown:
            ax.text(0.5, 0.5, "No data", color=MUTED, fontsize=11, ha="center", va="center", transform=ax.transAxes)
            ax.set_ylim(defaults.get("min", 0), defaults.get("max", 1))
            ax.set_yticks([])
            continue
        top = 0.0
        for i, s in enumerate(shown):
            color = PALETTE[i % len(PALETTE)]
            times = [datetime.fromtimestamp(t, UTC) for t in s.times]
            if bars:
                ax.bar(times, s.values, width=(s.times[1] - s.times[0]) / 86400 * 0.8 if len(s.times) > 1 else 0.0002,
                       color=color, alpha=0.8)  # fmt: skip
            else:
                ax.plot(times, s.values, color=color, linewidth=1.2)
                ax.fill_between(times, s.values, color=color, alpha=0.05)
            top = max([top, *(v for v in s.values if not math.isnan(v))])
        ax.set_ylim(defaults.get("min", 0), defaults.get("max", top * 1.15 if top > 0 else 1))
        # Grafana's legend table: name, mean, last (not null)
        lx, ly = x + 12, y + h - legend_px - 2
        fig.text((lx + w - 190) / width, 1 - (ly + 6) / height, "Mean", color=MUTED, fontsize=7.5, ha="right")
        fig.text((lx + w - 40) / width, 1 - (ly + 6) / height, "Last *", color=MUTED, fontsize=7.5, ha="right")
        for i, s in enumerate(shown[:legend_rows]):
            vals = [v for v in s.values if not math.isnan(v)]
            row_y = 1 - (ly + 6 + (i + 1) * 13) / height
            fig.text(lx / width, row_y, "\u2501", color=PALETTE[i % len(PALETTE)], fontsize=8)
            name = s.legend if len(s.legend) <= 60 else s.legend[:57] + "..."
            fig.text((lx + 16) / width, row_y, name, color=TEXT, fontsize=7.5)
            fig.text((lx + w - 190) / width, row_y, fmt_value(sum(vals) / len(vals), unit), color=TEXT,
                     fontsize=7.5, ha="right")  # fmt: skip
            fig.text((lx + w - 40) / width, row_y, fmt_value(vals[-1], unit), color=TEXT, fontsize=7.5, ha="right")
        if len(shown) > legend_rows:
            fig.text((x + w - 10) / width, 1 - (y + 14) / height, f"{len(shown)} series, {legend_rows} in the legend",
                     color=MUTED, fontsize=7, ha="right", va="center")  # fmt: skip

    fig.text(12 / width, 12 / height, caption_footer(), color=MUTED, fontsize=8.5, va="bottom")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, facecolor=BG)
    plt.close(fig)
    log.info("wrote %s (%d KiB)", out, out.stat().st_size // 1024)


def caption_footer() -> str:
    return (
        "Drawn by docs/build_fleet_screenshot.py (matplotlib, not Grafana) from the dashboard's own queries "
        "(deploy/helm/specops/dashboards/specops.json) run on a real Prometheus scraping a real fleet "
        "with deploy/compose/prometheus/prometheus.yml."
    )


# ---------------------------------------------------------------- main
@contextlib.contextmanager
def workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="specops-fleet-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    from specops.paths import models_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=models_dir(), help="a bootstrapped pair (default %(default)s)")
    ap.add_argument("--requests", type=int, default=120, help="chat requests replayed (default %(default)s)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds the requests are spread over")
    ap.add_argument("--clients", type=int, default=1, help="concurrent clients (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=None, help="keep the run's state and logs here (default: a temp dir)")
    ap.add_argument("--prometheus", default=shutil.which("prometheus"), help="Prometheus binary (Debian: prometheus)")
    ap.add_argument(
        "--redraw", type=Path, default=None, help="draw again from a run's query results (its queries.json)"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    dash = json.loads(DASHBOARD.read_text())
    if args.redraw is not None:
        saved = json.loads(args.redraw.read_text())
        by_id = {p["id"]: p for p in dash["panels"]}
        panels = [PanelData(by_id[i], [Series(**s) for s in series]) for i, series in saved["panels"]]
        render(panels, dash, args.out, saved["caption"], saved["start"], saved["end"])
        return 0
    if not args.prometheus:
        ap.error("no prometheus binary: apt-get install prometheus (or --prometheus PATH)")

    from rich.console import Console

    from specops.cli.artifact import open_registry
    from specops.demo.run import DemoConfig, _first_router, _workload

    cfg = DemoConfig(requests=args.requests, max_tokens=args.max_tokens, clients=args.clients)
    prom_cfg = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    scrape_s = _seconds(prom_cfg["global"]["scrape_interval"])
    (source,) = yaml.safe_load(COMPOSE_DATASOURCE.read_text())["datasources"]
    assert _seconds(source["jsonData"]["timeInterval"]) == scrape_s
    console = Console(stderr=True)
    with workdir(args.work) as work:
        (work / "registry").mkdir(exist_ok=True)
        fleet = Fleet(work)
        try:
            registry = open_registry(f"sqlite:///{work / 'registry' / 'mlflow.db'}", f"local://{work / 'streams'}")
            workload = _workload(console, args.model_dir, cfg)
            _first_router(console, args.model_dir, registry, workload, cfg)
            replicas, prom_url, _ = start_fleet(fleet, args.model_dir, args.prometheus, cfg)
            start = time.time()
            ok, failed = replay(replicas, workload, args.duration, args.clients, args.max_tokens)
            time.sleep(2 * scrape_s + 1)  # the last requests' samples scraped
            end = time.time()
            log.info("traffic: %d ok, %d failed in %.0f s", ok, failed, end - start)
            panels = query_panels(prom_url, dash, start - scrape_s, end, scrape_s)
        finally:
            fleet.close()
        manifest = json.loads((args.model_dir / "manifest.json").read_text())
        models = "tiny random models" if manifest.get("tiny") else "the bootstrapped SmolLM2-135M-Instruct pair"
        caption = (
            f"{NUM_REPLICAS} specops serve replicas + specops train, {ok} chat requests over "
            f"{(end - start) / 60:.0f} min, {models}, CPU"
        )
        saved = {
            "start": start - scrape_s,
            "end": end,
            "caption": caption,
            "panels": [(pd.panel["id"], [vars(s) for s in pd.series]) for pd in panels],
        }
        (work / "queries.json").write_text(json.dumps(saved))
        render(panels, dash, args.out, caption, start - scrape_s, end)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

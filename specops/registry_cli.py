"""``specops registry ls|promote|rollback|retain|ui``: operate the draft registry."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from specops.paths import data_dir, streams_url

NONE = ("none", "off", "")


def registry_config(uri: str | None):
    """The registry at ``uri`` (``default``: $SPECOPS_REGISTRY_URI or SQLite under the data dir)."""
    from specops.registry import RegistryConfig

    return RegistryConfig.default(data_dir(), uri=None if uri in (None, "default") else uri)


def open_registry(uri: str | None, stream: str | None = None):
    """A RegistryStore that announces alias moves on ``stream``'s spec.events (unless ``none``)."""
    from specops.registry import RegistryStore

    on_change = None
    if stream and stream.lower() not in NONE:
        from specops.serving.fleet.events import EventPublisher
        from specops.streams import StreamConfig

        on_change = EventPublisher(StreamConfig.from_env(url=stream))
    return RegistryStore(registry_config(uri), on_change=on_change)


def add_registry_args(p: argparse.ArgumentParser, *, events: bool = True) -> None:
    p.add_argument("--registry", default="default", metavar="URI",
                   help="MLflow store: sqlite:////abs/mlflow.db, postgresql://user@host:5432/db or http://host:port "
                   "(default: $SPECOPS_REGISTRY_URI, else SQLite under the data directory)")  # fmt: skip
    if events:
        p.add_argument("--stream", default=streams_url(), metavar="URL",
                       help="announce promotions and rollbacks as ModelEvents on this stream's spec.events, so "
                       "serving swaps at once ('none': serving picks the change up at its next poll) "
                       "(default: %(default)s)")  # fmt: skip


def _fmt(value: str | None, digits: int = 3) -> str:
    if value in (None, ""):
        return "-"
    try:
        return f"{float(value):.{digits}f}"
    except ValueError:
        return str(value)


def cmd_ls(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    reg = open_registry(args.registry, None)
    clusters = [args.cluster] if args.cluster else reg.clusters()
    rows = []
    for cluster in clusters:
        for v in reg.versions(cluster, include_archived=args.all):
            status = "archived" if v.archived else "rolled back" if "rolled_back" in v.tags else ""
            rows.append({"model": v.name, "version": v.version, "aliases": ",".join(v.aliases),
                         "created": time.strftime("%m-%d %H:%M:%S", time.localtime(v.created_ms / 1000)),
                         "offline_sampling": v.metric("offline_acceptance_sampling"),
                         "offline_greedy": v.metric("offline_acceptance_greedy"), "gate": v.tags.get("gate_decision", ""),
                         "live": v.metric("live_acceptance"), "live_requests": v.metric("live_requests"),
                         "status": status, "parent": v.tags.get("parent_version", ""),
                         "lineage": v.tags.get("lineage_offsets", "")})  # fmt: skip
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    table = Table(title=f"draft versions in {reg.cfg.uri}")
    for col in ("model", "version", "aliases", "created", "offline α (sampling)", "offline α (greedy)", "gate",
                "live α", "live requests", "status", "lineage offsets"):
        table.add_column(col, justify="right" if "α" in col or col in ("version", "live requests") else "left")
    for r in rows:
        table.add_row(r["model"], r["version"], r["aliases"], r["created"], _fmt(r["offline_sampling"]),
                      _fmt(r["offline_greedy"]), r["gate"], _fmt(r["live"]),
                      _fmt(r["live_requests"], 0), r["status"], r["lineage"])  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 220).print(table)
    if not rows:
        print("no draft versions registered yet (the trainer registers one per update)")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    reg = open_registry(args.registry, args.stream)
    change = reg.promote(args.cluster, args.version, reason=args.reason)
    print(f"{change.model_name}: champion {change.previous_version or 'none'} -> {change.version}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    reg = open_registry(args.registry, args.stream)
    change = reg.rollback(args.cluster, reason=args.reason, to=args.to)
    assert change is not None
    print(f"{change.model_name}: champion {change.previous_version} -> {change.version} (rolled back)")
    return 0


def cmd_retain(args: argparse.Namespace) -> int:
    reg = open_registry(args.registry, None)
    clusters = [args.cluster] if args.cluster else reg.clusters()
    for cluster in clusters:
        archived = reg.retain(cluster, keep_last=args.keep, delete_artifacts=not args.keep_artifacts)
        print(f"draft-{cluster}: archived {', '.join(archived) if archived else 'nothing'}")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    cfg = registry_config(args.registry)
    if cfg.is_http:
        print(f"the registry is an MLflow server: open {cfg.uri}")
        return 0
    from specops.registry import RegistryStore

    RegistryStore(cfg)  # creates the store's tables on first use, so the UI opens on a ready store
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", cfg.uri, "--host", args.host,
           "--port", str(args.port), "--workers", "1"]  # fmt: skip
    if cfg.resolved_artifact_root:
        cmd += ["--default-artifact-root", cfg.resolved_artifact_root]
    print(f"MLflow UI on http://{args.host}:{args.port}  (store {cfg.uri}; Ctrl-C stops it)", flush=True)
    try:
        return subprocess.call(cmd, env={**os.environ, "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"})
    except KeyboardInterrupt:
        return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "registry",
        help="the draft registry (MLflow): list versions, promote, roll back, retention, UI",
        description="Every trained draft is a version of the registered model draft-<cluster>. Alias 'champion' "
        "is what serving uses (it follows the alias and hot-swaps); 'challenger' is the latest candidate. "
        "Promotions made here skip the gate; they and rollbacks are recorded on the versions and announced on "
        "spec.events.",
    )
    rsub = p.add_subparsers(dest="registry_command", required=True, metavar="SUBCOMMAND")
    q = rsub.add_parser("ls", help="list draft versions with aliases, acceptance, gate decisions and lineage",
                        description="One row per version: aliases, offline acceptance (held-out, sampling and "
                        "greedy), the gate's decision, live acceptance reported by serving, and the stream offsets "
                        "it trained on. Archived versions are hidden unless --all.")  # fmt: skip
    add_registry_args(q, events=False)
    q.add_argument("--cluster", default=None, help="only this cluster")
    q.add_argument("--all", action="store_true", help="include archived versions")
    q.add_argument("--json", action="store_true", help="one JSON object per version")
    q.set_defaults(func=cmd_ls)
    q = rsub.add_parser("promote", help="point champion at a version (no gate: an operator's decision)",
                        description="Moves alias champion of draft-CLUSTER to VERSION, records when, why and which "
                        "version it replaced (the rollback target), and announces it on spec.events.")  # fmt: skip
    add_registry_args(q)
    q.add_argument("cluster")
    q.add_argument("version")
    q.add_argument("--reason", default="manual promotion", help="recorded on the version")
    q.set_defaults(func=cmd_promote)
    q = rsub.add_parser("rollback", help="move champion back to the version it replaced",
                        description="Marks the current champion rolled back (with --reason) and points champion at "
                        "the version it replaced, skipping versions rolled back before; or at --to.")  # fmt: skip
    add_registry_args(q)
    q.add_argument("cluster")
    q.add_argument("--to", default=None, metavar="VERSION", help="roll back to this version instead")
    q.add_argument("--reason", default="manual rollback", help="recorded on the version")
    q.set_defaults(func=cmd_rollback)
    q = rsub.add_parser("retain", help="archive old unaliased versions, keeping the newest N",
                        description="Tags old versions archived and deletes their weights. Aliased versions and the "
                        "champion's rollback target are always kept.")  # fmt: skip
    add_registry_args(q, events=False)
    q.add_argument("--cluster", default=None, help="only this cluster (default: all)")
    q.add_argument("--keep", type=int, default=20, help="newest versions kept per cluster (default: %(default)s)")
    q.add_argument("--keep-artifacts", action="store_true", help="tag archived but keep the weights")
    q.set_defaults(func=cmd_retain)
    q = rsub.add_parser("ui", help="start the MLflow UI on the registry's store",
                        description="Runs `mlflow server` on the configured store (SQLite or PostgreSQL) so operators "
                        "can browse registered drafts, versions, aliases, metrics and lineage tags.")  # fmt: skip
    add_registry_args(q, events=False)
    q.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    q.add_argument("--port", type=int, default=5000, help="port (default: %(default)s)")
    q.set_defaults(func=cmd_ui)

"""``specops registry ls|promote|rollback|retain|ui``: the draft registry.

``ls``, ``promote``, ``rollback`` and ``retain`` are ``specops artifact draft ...`` (``specops.cli.artifact``)
under the name operators know; ``ui`` opens the MLflow UI on the registry's store."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from specops.cli.artifact import (
    add_ls,
    add_promote,
    add_registry_args,
    add_retain,
    add_rollback,
    registry_config,
)

MLFLOW_SERVER_ENV = {
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    # MLflow 3's server starts a job runner and 7 huey consumer processes for its GenAI jobs by default:
    # the registry uses none of them
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}
"""Environment for an ``mlflow server`` this project starts (the UI, the demo's, the tests')."""


def mlflow_ui_command(cfg, host: str, port: int) -> list[str]:
    """The ``mlflow server`` command line of the MLflow UI over the registry ``cfg`` (one worker)."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", cfg.uri]
    cmd += ["--host", host, "--port", str(port), "--workers", "1"]
    if cfg.resolved_artifact_root:
        cmd += ["--default-artifact-root", cfg.resolved_artifact_root]
    return cmd


def cmd_ui(args: argparse.Namespace) -> int:
    cfg = registry_config(args.registry)
    if cfg.is_http:
        print(f"the registry is an MLflow server: open {cfg.uri}")
        return 0
    from specops.registry import RegistryStore

    RegistryStore(cfg)  # creates the store's tables on first use, so the UI opens on a ready store
    cmd = mlflow_ui_command(cfg, args.host, args.port)
    print(f"MLflow UI on http://{args.host}:{args.port}  (store {cfg.uri}; Ctrl-C stops it)", flush=True)
    try:
        return subprocess.call(cmd, env={**os.environ, **MLFLOW_SERVER_ENV})
    except KeyboardInterrupt:
        return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "registry",
        help="the draft registry (MLflow): list versions, promote, roll back, retention, UI",
        description="Every trained draft is a version of the registered model draft-<cluster>. Alias 'champion' "
        "is what serving uses (it follows the alias and hot-swaps); 'challenger' is the latest candidate. "
        "Promotions made here skip the gate; they and rollbacks are recorded on the versions and announced on "
        "spec.events. The same commands for every artifact kind: `specops artifact KIND ...`.",
    )
    rsub = p.add_subparsers(dest="registry_command", required=True, metavar="SUBCOMMAND")
    add_ls(
        rsub,
        "draft",
        key_flag="--cluster",
        help="list draft versions with aliases, acceptance, gate decisions and lineage",
        description="One row per version: aliases, offline acceptance (held-out, sampling and greedy), the "
        "gate's decision, live acceptance reported by serving, and the stream offsets it trained on. Archived "
        "versions are hidden unless --all.",
    )
    add_promote(
        rsub,
        "draft",
        key_name="cluster",
        description="Moves alias champion of draft-CLUSTER to VERSION, records when, why and which version "
        "it replaced (the rollback target), and announces it on spec.events.",
    )
    add_rollback(
        rsub,
        "draft",
        key_name="cluster",
        description="Marks the current champion rolled back (with --reason) and points champion at the "
        "version it replaced, skipping versions rolled back before; or at --to.",
    )
    add_retain(
        rsub,
        "draft",
        key_flag="--cluster",
        description="Tags old versions archived and deletes their weights. Aliased versions and the "
        "champion's rollback target are always kept.",
    )
    q = rsub.add_parser(
        "ui",
        help="start the MLflow UI on the registry's store",
        description="Runs `mlflow server` on the configured store (SQLite or PostgreSQL) so operators "
        "can browse registered drafts, versions, aliases, metrics and lineage tags.",
    )
    add_registry_args(q, events=False)
    q.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    q.add_argument("--port", type=int, default=5000, help="port (default: %(default)s)")
    q.set_defaults(func=cmd_ui)

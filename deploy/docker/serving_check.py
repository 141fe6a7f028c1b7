"""What the serving images must be able to run, checked in the Python that runs it.

The Dockerfile runs this at the end of each serving builder (``builder-serving-*``: the venv holds only
``requirements-serving.txt``), and ``tests/deploy/test_images.py`` runs it in the dev venv restricted to the
distributions those requirements resolve to. It exits non-zero, saying why, when:

1. ``specops serve``'s entry point cannot import, or cannot build its app (the FastAPI app and uvicorn's server
   around it; nothing loads a model until the app starts);
2. that entry point imported a module serving needs only on a feature path (:data:`LAZY`: the registry client,
   the Milvus client and its pandas / pyarrow; what the image does not have at all fails to import in 1);
3. a module of the packages serving runs (serving, core, registry, streams) cannot import;
4. MLflow's client cannot open a registry of a kind ``specops serve`` follows: an MLflow server (http://, what
   compose and the chart give it; nothing is contacted here) and the default SQLite store (created here).

Usage: ``python serving_check.py`` (stdlib and the installed ``specops`` only).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import tempfile
from pathlib import Path

LAZY = ("mlflow", "pymilvus", "milvus_lite", "pandas", "pyarrow")
"""In the serving set, but imported only on the path that needs them (the registry, a Milvus knowledge base)."""

PACKAGES = ("specops.serving", "specops.core", "specops.registry", "specops.streams")
"""What serving runs. ``specops.serving.vllm.plugin`` is left out: it runs inside vLLM's own Python."""

SKIP = ("specops.serving.vllm.plugin",)


def check_entry_point(root: Path) -> None:
    """1 and 2: parse ``specops serve``, load its config and build the server as ``cmd_serve`` does."""
    from specops.cli.main import build_parser
    from specops.cli.serve_runtime import Server
    from specops.serving.http.config import ServeConfig, overrides_from_args

    args = build_parser().parse_args(["serve", "--port", "0"])
    assert args.func.__module__ == "specops.cli.serve", args.func
    cfg = ServeConfig.load(None, overrides=overrides_from_args(args))
    import torch  # cmd_serve sizes its thread team with it

    from specops.core.threads import reserve_for_compute

    assert callable(reserve_for_compute) and torch.get_num_threads() > 0
    server = Server(cfg, root=root)
    routes = {getattr(r, "path", "") for r in server.app.routes}
    missing = {"/v1/completions", "/v1/chat/completions", "/healthz", "/readyz", "/metrics"} - routes
    assert not missing, f"the app lacks {sorted(missing)}"
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(LAZY))
    assert not loaded, f"`specops serve` imports {loaded} before it serves; import them where they are used"


def check_modules() -> list[str]:
    """3: import every module of :data:`PACKAGES`."""
    names = []
    for package in PACKAGES:
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, package + "."):
            if info.name.startswith(SKIP):
                continue
            importlib.import_module(info.name)
            names.append(info.name)
    return names


def check_registry(root: Path) -> None:
    """4: the registry store ``specops serve`` opens, on a server URI (no call made) and on SQLite (created)."""
    from specops.cli.artifact import open_registry

    server = open_registry("http://127.0.0.1:9", None)
    assert server is not None
    store = open_registry(f"sqlite:///{root / 'mlflow.db'}", None)
    assert store.artifact("draft").keys() == []  # a new store: MLflow created its schema


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        check_entry_point(root)
        modules = check_modules()
        check_registry(root)
    print(f"serving check: entry point and app, {len(modules)} modules, registry client: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

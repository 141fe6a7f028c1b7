"""Run the CUDA path on a machine that has torch, transformers, safetensors, numpy and pytest but
not this project's pinned dependencies (the GPU machine of ``benchmarks/gpu_check.py``).

Two of the pins are imported at module level by the code the CUDA check needs, for work that
check does not do: ``prometheus_client`` (metrics of the batcher, the trainer's losses and the
hot-swap slots) and ``tenacity`` (the registry's retries, imported by ``specops.core.datastore`` through
``specops.registry``). :func:`install` puts a no-op stand-in in ``sys.modules`` for each one that
is **absent** (an installed one is always used); everything else the check imports must exist.
``pydantic`` (the catalogue's method options models) gets a working stand-in, ``benchmarks.gpu_pydantic``.

The GPU machine also has no install of this project: with ``PYTHONPATH=.`` only ``specops/`` is
found, not the top-level folders that ``pyproject.toml``'s ``package-dir`` installs as
``specops.serving``, ``specops.core`` and so on. :func:`map_repository` adds an import finder for
exactly that mapping (read from ``pyproject.toml``) when no install provides it.

Imported as a pytest plugin (``pytest -p benchmarks.gpu_compat``) it installs them before the
test modules are collected.

``SPECOPS_SIMULATE_ABSENT=name,name,...`` makes those modules unimportable first (``sys.modules[name] =
None``), in this process and, through the environment, in the pytest process it starts: the
GPU machine's missing pins, simulated where they are installed (``tests/benchmarks/test_gpu_check.py``);
the name ``specops-install`` among them also sets this project's editable install aside.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import tomllib
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

STUBBED = ("prometheus_client", "tenacity", "pydantic")
"""Modules replaced by a stand-in when they are not installed (pydantic: ``benchmarks.gpu_pydantic``, for
the catalogue's method options models)."""

SIMULATE_ENV = "SPECOPS_SIMULATE_ABSENT"
"""Comma-separated top-level modules to treat as not installed (tests only)."""


class _Metric:
    """Counter, Gauge, Histogram or Summary that records nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def labels(self, *args, **kwargs) -> _Metric:
        return self

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _stub(name: str) -> types.ModuleType:
    if name == "pydantic":
        from benchmarks import gpu_pydantic

        mod = gpu_pydantic.module()
        mod.__dict__["SPECOPS_STUB"] = True
        return mod
    mod = types.ModuleType(name, f"no-op stand-in for {name} (benchmarks.gpu_compat): it is not installed here")
    mod.__dict__["SPECOPS_STUB"] = True
    if name == "prometheus_client":
        for attr in ("Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"):
            setattr(mod, attr, _Metric)
        mod.REGISTRY = None
        mod.CONTENT_TYPE_LATEST = "text/plain"
        mod.generate_latest = lambda *args, **kwargs: b""
        mod.start_http_server = lambda *args, **kwargs: None
    return mod


def _absent(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is None
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


class RepositoryLayout(importlib.abc.MetaPathFinder):
    """Finds ``specops.serving``, ``specops.core``, ... in the repository's top-level folders, as
    ``pyproject.toml``'s ``[tool.setuptools] package-dir`` installs them."""

    def __init__(self, package_dirs: dict[str, str]) -> None:
        self.package_dirs = package_dirs

    def find_spec(self, name, path=None, target=None):
        folder = self.package_dirs.get(name)
        if folder is None:
            return None
        init = REPO_ROOT / folder / "__init__.py"
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])


def map_repository() -> bool:
    """Add :class:`RepositoryLayout` when no install maps ``specops.core``; True when it was added."""
    try:
        if importlib.util.find_spec("specops.core") is not None:
            return False
    except ImportError:
        pass
    setup = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: folder for name, folder in setup["package-dir"].items() if name != "specops"}
    sys.meta_path.append(RepositoryLayout(dirs))
    return True


def _simulate_absent() -> None:
    for name in filter(None, os.environ.get(SIMULATE_ENV, "").split(",")):
        if name == "specops-install":  # setuptools' editable finder of this project
            assert not any(m.startswith("specops.") for m in sys.modules), "set it aside before importing specops"
            sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
            sys.path_importer_cache.clear()
        elif not isinstance(sys.modules.get(name), types.ModuleType):
            sys.modules[name] = None


def install() -> list[str]:
    """Install a stand-in for each module of :data:`STUBBED` that is absent; returns their names."""
    done = []
    for name in STUBBED:
        if _absent(name):
            sys.modules[name] = _stub(name)
            done.append(name)
    return done


_simulate_absent()
STUBS_INSTALLED = install()
"""What importing this module stubbed (a pytest plugin import included)."""
REPOSITORY_MAPPED = map_repository()
"""Whether importing this module added :class:`RepositoryLayout` (no install of this project found)."""

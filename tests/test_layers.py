"""The floors of the house (docs/architecture.md, "The house (issue 35)"), checked in `make test`.

- Each contract of ``.importlinter`` (import-linter): the floors (composition modules of
  ``specops`` > serving | trainer > core > registry | streams, every module of ``specops`` on
  one), serving's own floors (every subpackage and module of ``specops.serving`` on one: http >
  replica > vllm > fleet > modes > served | ralm > config | plan > engine : proposers > retrieval |
  metrics), ``specops.serving.engine`` importing neither ``specops.serving.fleet`` nor ``specops.serving.http``, and no
  trainer module importing serving. One test per contract, failing with import-linter's report
  of the imports that break it. Imports under ``if TYPE_CHECKING:`` are left out (they never run).
- No import circle anywhere (grimp): the import graph of ``specops``, function-level (lazy)
  imports included, has no strongly connected component of more than one module. Imports under
  ``if TYPE_CHECKING:`` are left out of this one check: they never run, and they are how a
  module names, for annotations only, the type of the module that imports it.

The top-level folders install as ``specops.<folder>`` through pyproject.toml's package-dir, so
they are not inside the ``specops/`` folder that grimp walks; both checks run, in a subprocess,
on a staging folder where ``specops/`` holds links to the package's files and to those folders.
"""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _contracts() -> list[str]:
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    prefix = "importlinter:contract:"
    return [s[len(prefix) :] for s in parser.sections() if s.startswith(prefix)]


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose ``specops/`` is the package as it installs, made of symbolic links."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    stage = tmp_path_factory.mktemp("house")
    pkg = stage / "specops"
    pkg.mkdir()
    for entry in (ROOT / "specops").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in mapped.items():
        if name.startswith("specops."):  # specops.serving -> serving/
            (pkg / name.split(".", 1)[1]).symlink_to(ROOT / folder)
    return stage


def _run(cmd: list[str], stage: Path) -> subprocess.CompletedProcess[str]:
    # cwd and PYTHONPATH: the staged package comes before the editable install's own finder
    env = {**os.environ, "PYTHONPATH": str(stage)}
    return subprocess.run(cmd, cwd=stage, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("contract", _contracts())
def test_import_contract_holds(staged: Path, contract: str) -> None:
    proc = _run([str(LINT_IMPORTS), str(CONFIG), "--contract", contract, "--no-cache", "--no-logo"], staged)
    report = (proc.stdout + proc.stderr).strip()
    print(report)
    assert proc.returncode == 0, f"contract {contract!r} of .importlinter is broken:\n\n{report}"


def test_no_import_cycles(staged: Path) -> None:
    proc = _run([sys.executable, "-P", __file__, "--cycles"], staged)  # -P: not tests/ first on the path
    assert proc.returncode == 0, proc.stderr
    cycles = json.loads(proc.stdout)
    lines = []
    for i, cycle in enumerate(cycles, 1):
        lines.append(f"cycle {i} ({len(cycle['modules'])} modules): {', '.join(cycle['modules'])}")
        lines += [f"    {edge}" for edge in cycle["imports"]]
    text = "\n".join(lines)
    print(text)
    assert not cycles, f"{len(cycles)} import cycles (function-level imports included):\n{text}"


def _strongly_connected(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def _cycles() -> list[dict]:
    """Run in the staging folder: every import cycle of ``specops``, with the imports that make it."""
    import grimp

    graph = grimp.build_graph("specops", cache_dir=None, exclude_type_checking_imports=True)
    missing = {
        "specops.cli.main",
        "specops.serving",
        "specops.trainer",
        "specops.core",
        "specops.registry",
    } - graph.modules
    assert not missing, f"the staged package lacks {sorted(missing)}"
    nodes = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in nodes}
    found = []
    for component in _strongly_connected(nodes, edges):
        members = set(component)
        imports = []
        for importer in component:
            for imported in edges[importer]:
                if imported in members:
                    for d in graph.get_import_details(importer=importer, imported=imported):
                        imports.append(f"{importer}:{d['line_number']} -> {imported}   ({d['line_contents']})")
        found.append({"modules": component, "imports": imports})
    return found


if __name__ == "__main__" and sys.argv[1:] == ["--cycles"]:
    print(json.dumps(_cycles()))

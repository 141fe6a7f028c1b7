"""The engine's seams stay narrow (issue 59): it takes a proposer and ``k``, never a method name.

``SpecEngine.generate`` and ``DecodeSession.__init__`` take at most six parameters (the per-request
hooks travel as one ``RequestHooks``, the session's set-up as one ``SessionSetup``), and no module
of ``specops.serving.engine`` imports the method catalogue: the plan (``specops.serving.plan``)
looks the method up once, and the node builds the proposer from it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from specops.serving.engine.session import DecodeSession
from specops.serving.engine.spec import SpecEngine

ENGINE = Path(__file__).resolve().parents[3] / "serving" / "engine"


@pytest.mark.parametrize("fn", [SpecEngine.generate, DecodeSession.__init__])
def test_at_most_six_parameters(fn):
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    assert len(params) <= 6, (fn.__qualname__, params)


def test_the_engine_never_imports_the_catalogue():
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.endswith("proposers.catalogue") for n in names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders

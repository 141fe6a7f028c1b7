"""The modes call the serving node only through ``ModeHost`` (issue 59): a typed interface a floor
below both, which the node implements; no mode reaches for a member it does not list."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

from specops.serving import modes
from specops.serving.fleet.node import ServingNode
from specops.serving.served import ModeHost
from specops.serving.vllm.node import VLLMNode

MEMBERS = {name for name in vars(ModeHost) if not name.startswith("_")} | set(ModeHost.__annotations__)


def test_modes_use_only_the_members_mode_host_lists():
    tree = ast.parse(Path(modes.__file__).read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "node"
    }
    assert used and used <= MEMBERS, used - MEMBERS
    for spec in modes.MODES.values():  # every runner takes a ModeHost
        assert typing.get_type_hints(spec.run)["node"] is ModeHost, spec.name


def test_the_nodes_implement_mode_host():
    for cls in (ServingNode, VLLMNode):
        for name in MEMBERS - {"pair"}:
            want = list(inspect.signature(getattr(ModeHost, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
        assert "self.pair = " in inspect.getsource(cls.__init__) or issubclass(cls, ServingNode), cls.__name__

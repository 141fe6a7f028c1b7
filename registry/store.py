"""The registry: ``RegistryStore(cfg).artifact(kind)`` is its one API.

Every artifact kind (``specops.registry.kinds``: draft, router, datastore, kb, knnlm, sessions,
policy) has the same operations through :meth:`RegistryStore.artifact`, which returns a
:class:`~specops.registry.kind_store.KindStore`: ``register``, ``versions``, ``get``,
``by_alias``, ``keys``, ``promote``, ``rollback``, ``retain``, ``describe``, ``fetch``,
``apply_gate``. Every version is one :class:`~specops.registry.version.ArtifactVersion`.

Layers, each importing only those below it: ``kinds`` (names) < ``version`` (data) <
``models`` (MLflow, by registered-model name) < ``packers`` (a kind's files) < ``kind_store``
< this module.
"""

from __future__ import annotations

from collections.abc import Callable

from specops.registry.config import RegistryConfig
from specops.registry.kind_store import KindStore
from specops.registry.kinds import KINDS
from specops.registry.models import ModelStore
from specops.registry.version import AliasChange


class RegistryStore:
    """Typed access to the MLflow registry, one artifact kind at a time. Thread-safe."""

    def __init__(self, cfg: RegistryConfig, *, on_change: Callable[[AliasChange], None] | None = None) -> None:
        self.models = ModelStore(cfg, on_change=on_change)

    @property
    def cfg(self) -> RegistryConfig:
        return self.models.cfg

    @property
    def on_change(self) -> Callable[[AliasChange], None] | None:
        """Called with every move of a ``champion`` alias (serving's ``EventPublisher``)."""
        return self.models.on_change

    @on_change.setter
    def on_change(self, hook: Callable[[AliasChange], None] | None) -> None:
        self.models.on_change = hook

    def artifact(self, kind: str) -> KindStore:
        """The registry's operations for one artifact kind (``specops.registry.kinds.KINDS``)."""
        if kind not in KINDS:
            raise ValueError(f"unknown artifact kind {kind!r}; choose one of {', '.join(KINDS)}")
        return KindStore(self.models, KINDS[kind])

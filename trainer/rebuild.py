"""One shape for every job that turns served traffic into a registered artifact.

A :class:`Rebuilder` is one artifact kind (``specops.registry.kinds``) rebuilt from ``spec.generations``
in its own consumer group. :meth:`Rebuilder.run_once` reads top to bottom:

1. **consume** new records (:meth:`~Rebuilder.consume`);
2. for each key that is due (:meth:`~Rebuilder.due`), **build** a candidate
   (:meth:`~Rebuilder.build`), unless the same inputs are already registered
   (:meth:`~Rebuilder.already_registered`: a restart re-read records it had registered);
3. **gate** it (:meth:`~Rebuilder.gate`: passed, and why);
4. **register** it as a new version (:meth:`~Rebuilder.register`, lineage and metrics on it);
5. **promote** it when its outcome (:meth:`~Rebuilder.outcome`) says so;
6. **commit** the offsets, only now, and only when :meth:`~Rebuilder.may_commit`: a crash before
   this re-reads the records, and the registration is idempotent.

Subclasses: ``specops.trainer.datastores.DatastoreRebuilder`` (DReSD), ``specops.trainer.sessions.SessionIndexRebuilder``
(LLMA), ``specops.trainer.router_fit.RouterRefitter`` (the router) and ``specops.trainer.policy_fit.PolicyFitter``
(the ``auto`` policy's priors). Draft training (``specops.trainer.online.trainer`` with ``specops.trainer.promote.Promoter``)
is not one: it consumes continuously, trains for many steps between registrations, and commits on
its checkpoints, so only its register -> gate -> promote tail has this shape.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from specops.registry import ArtifactVersion, KindStore
from specops.trainer.generations import GenerationsReader

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Candidate:
    """One key's rebuilt artifact on its way through the gate and the registry."""

    artifact: Any
    """What :meth:`Rebuilder.build` made (a datastore, a router, sessions...)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The subclass's numbers (the champion's, the gate's, sizes...)."""
    passed: bool = False
    reason: str = ""
    version: ArtifactVersion | None = None
    outcome: str = ""
    """``promoted``, ``registered`` (the gate kept the champion) or ``unchanged``."""


class Rebuilder(Generic[T]):
    """consume -> build -> gate -> register -> promote -> commit, for one artifact kind."""

    kind: str = ""
    """The artifact kind registered (``specops.registry.kinds``)."""
    gate_name: str = "rebuild gate"
    """How a promotion's reason starts (``<gate_name>: <the gate's reason>``)."""

    def __init__(self, stream_cfg, registry, cfg, *, reader=None) -> None:
        """``reader``: where records come from; by default ``spec.generations`` in ``cfg.group``."""
        self.stream_cfg, self.registry, self.cfg = stream_cfg, registry, cfg
        self.reader = reader or GenerationsReader(
            stream_cfg,
            cfg.group,
            poll_records=cfg.poll_records,
            poll_timeout_s=cfg.poll_timeout_s,
            max_polls=cfg.max_polls,
        )
        self._champions: dict[str, tuple[str, T]] = {}

    @property
    def artifacts(self) -> KindStore:
        """This kind's registry operations."""
        return self.registry.artifact(self.kind)

    def close(self) -> None:
        """Leave the group without committing (uncommitted records come back)."""
        self.reader.close()

    # ------------------------------------------------------------ the run
    def run_once(self):
        result = self.start(self.consume())  # 1.
        due = self.due()
        for key in due:
            if self.already_registered(key, result):  # a restart re-read what is registered
                continue
            c = self.build(key)  # 2.
            c.passed, c.reason = self.gate(key, c)  # 3.
            c.version = self.register(key, c)  # 4.
            c.outcome = self.outcome(key, c)
            if c.outcome == "promoted":  # 5.
                self.artifacts.promote(key, c.version.version, reason=self.promote_reason(c))
            self.record(key, c, result)
        if due and self.may_commit():  # 6.
            self.commit()
        return self.finish(result)

    # ------------------------------------------------------------ steps a subclass writes
    def consume(self) -> int:
        """Step 1: take new records into the subclass's buffers; returns the records consumed."""
        raise NotImplementedError

    def due(self) -> list[str]:
        """The keys to rebuild now (``[""]`` for an unkeyed kind)."""
        raise NotImplementedError

    def build(self, key: str) -> Candidate:
        """Step 2: the candidate artifact of ``key``."""
        raise NotImplementedError

    def gate(self, key: str, c: Candidate) -> tuple[bool, str]:
        """Step 3: (passed, reason)."""
        raise NotImplementedError

    def register(self, key: str, c: Candidate) -> ArtifactVersion:
        """Step 4: a new version of ``key``'s model (idempotent where the subclass gives a source id)."""
        raise NotImplementedError

    # ------------------------------------------------------------ hooks with a default
    def start(self, consumed: int):
        """The result this run fills in (:meth:`record`), from the records consumed."""
        return consumed

    def already_registered(self, key: str, result) -> bool:
        """True when ``key``'s inputs are already in a registered version (nothing to build)."""
        return False

    def outcome(self, key: str, c: Candidate) -> str:
        return "promoted" if c.passed else "registered"

    def promote_reason(self, c: Candidate) -> str:
        return f"{self.gate_name}: {c.reason}"

    def record(self, key: str, c: Candidate, result) -> None:
        """After step 5: note ``key``'s outcome in ``result`` and reset its buffers' counters."""

    def may_commit(self) -> bool:
        """Step 6's condition, once something was due: every consumed record is in a registered version."""
        return True

    def commit(self) -> None:
        """Step 6: commit the offsets consumed."""
        self.reader.commit()

    def finish(self, result):
        return result

    # ------------------------------------------------------------ shared by subclasses
    def champion(self, key: str, load: Callable[[Path, str], T]) -> tuple[str, T] | None:
        """``key``'s champion version and its loaded artifact (``load(directory, version)``), fetched
        and verified once per version; None before the first promotion."""
        v = self.artifacts.by_alias(key)
        if v is None:
            return None
        held = self._champions.get(key)
        if held is None or held[0] != v.version:
            with tempfile.TemporaryDirectory(prefix=f"specops-{self.kind}-") as tmp:
                self.artifacts.fetch(v, Path(tmp) / self.kind)
                held = (v.version, load(Path(tmp) / self.kind, v.version))
            self._champions[key] = held
        return held

"""The registry's operations for one artifact kind: ``RegistryStore.artifact(kind)``.

The same register / versions / get / by-alias / promote / rollback / retain / describe /
fetch / gate for every kind in ``specops.registry.kinds``: a draft per cluster, the router, a
datastore per cluster, a knowledge base per name... ``key`` is the cluster (or name) of a
keyed kind and ignored (``""``) for an unkeyed one (the router, the policy).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from specops.registry.errors import VersionNotFoundError
from specops.registry.kinds import ArtifactKind
from specops.registry.models import ModelStore
from specops.registry.packers import PACKERS, pack_any
from specops.registry.version import (
    CHALLENGER,
    CHAMPION,
    AliasChange,
    ArtifactVersion,
    GateResult,
    now,
)

log = logging.getLogger(__name__)

SERVED_BY = "served_by."
"""Prefix of a registered model's tags in which each serving replica reports what it serves."""


class KindStore:
    """One kind's view of the registry (cheap: build one per use)."""

    def __init__(self, models: ModelStore, kind: ArtifactKind) -> None:
        self.models = models
        self.kind = kind

    def name(self, key: str = "") -> str:
        """The registered model of ``key``."""
        return self.kind.model_name(key)

    # ------------------------------------------------------------ reads
    def keys(self, *, alias: str | None = None) -> list[str]:
        """Every key with a registered model of this kind (with ``alias``: only those whose model
        has that alias, e.g. the clusters with a champion draft), over every page of the search."""
        pattern = f"{self.kind.name}-%" if self.kind.keyed else self.kind.name
        return sorted(
            k
            for m in self.models.model_names(pattern)
            if (k := self.kind.key_of(m.name)) is not None and (alias is None or alias in (m.aliases or {}))
        )

    def aliases(self, key: str = "") -> dict[str, str]:
        """``{alias: version}`` of ``key``'s model (raises VersionNotFoundError when there is none)."""
        return self.models.aliases(self.name(key))

    def versions(self, key: str = "", *, include_archived: bool = True) -> list[ArtifactVersion]:
        """Every version, oldest first ([] before the first registration)."""
        try:
            out = self.models.versions(self.name(key))
        except VersionNotFoundError:
            return []
        return out if include_archived else [v for v in out if not v.archived]

    def get(self, key: str, version: str) -> ArtifactVersion:
        return self.models.get(self.name(key), str(version))

    def by_alias(self, key: str = "", alias: str = CHAMPION) -> ArtifactVersion | None:
        """The version ``alias`` points to, or None when the model or the alias does not exist."""
        return self.models.by_alias(self.name(key), alias)

    def find_source(self, key: str, source_id: str) -> ArtifactVersion | None:
        """The version registered from ``source_id`` (idempotent registration), if any."""
        return self.models.find_source(self.name(key), source_id)

    def describe(self, key: str = "") -> dict:
        """What an operator asks of a model: aliases, and per version its tags, gate and live numbers."""
        versions = self.versions(key)
        return {
            "kind": self.kind.name,
            "key": key,
            "model": self.name(key),
            "aliases": {a: v.version for v in versions for a in v.aliases},
            "versions": [
                {
                    "version": v.version,
                    "aliases": list(v.aliases),
                    "archived": v.archived,
                    "created_ms": v.created_ms,
                    "tags": dict(v.tags),
                }
                for v in versions
            ],
        }

    # ------------------------------------------------------------ writes
    def register(
        self,
        key: str,
        src_dir: Path,
        *,
        meta: dict | None = None,
        tags: dict[str, str] | None = None,
        metrics: dict[str, float] | None = None,
        params: dict[str, object] | None = None,
        lineage: dict | None = None,
        parent_version: str | None = None,
        source_id: str | None = None,
        alias: str | None = CHALLENGER,
        retries: int = 5,
        **pack_options,
    ) -> ArtifactVersion:
        """Register the artifact in ``src_dir`` as a new version of ``key``'s model.

        The kind's packer (``specops.registry.packers``) checks and copies the directory; a draft takes
        ``tokenizer_sha256`` (required), ``tokenizer_dir`` and ``config_sha256`` as
        ``pack_options``. ``source_id`` makes it idempotent: a version already registered from
        the same source is returned, not duplicated. ``tags`` are stamped on the version;
        ``lineage`` is ``{"topic", "offsets": {partition: [first, last]}}``."""
        name = self.name(key)
        if source_id is not None and (found := self.models.find_source(name, source_id)) is not None:
            log.info("%s: %s is already version %s", name, source_id, found.version)
            return found
        pack = PACKERS.get(self.kind.name)
        staging = Path(tempfile.mkdtemp(prefix="specops-register-"))
        try:
            if pack is None:
                manifest_sha, kind_tags, model_tags = pack_any(self.kind, key, src_dir, staging, meta, **pack_options)
            else:
                manifest_sha, kind_tags, model_tags = pack(self.kind, key, src_dir, staging, meta, **pack_options)
            all_tags = {
                **(tags or {}),
                **kind_tags,
                "manifest_sha256": manifest_sha,
                "parent_version": parent_version or "",
                "registered_at": now(),
            }
            mv = self.models.register(
                name,
                staging,
                self.kind.artifact_path,
                all_tags,
                metrics=metrics,
                params=params,
                lineage=lineage,
                source_id=source_id,
                retries=retries,
                model_tags=model_tags,
                description=self.kind.description.format(key=key),
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if alias:
            self.models.set_alias(name, alias, mv.version)
            mv = self.get(key, mv.version)
        log.info(
            "%s: registered version %s (%s)",
            name,
            mv.version,
            ", ".join(f"{k}={v:.4f}" for k, v in (metrics or {}).items()) or "no metrics",
        )
        return mv

    def set_alias(self, key: str, alias: str, version: str) -> None:
        self.models.set_alias(self.name(key), alias, str(version))

    def set_tags(self, key: str, version: str, tags: dict[str, object]) -> None:
        self.models.set_tags(self.name(key), str(version), tags)

    def report_served(self, key: str, replica: str, serving: str, refused: str = "") -> None:
        """What one replica serves of this model (``serving``: its version, or ``base``) and the last
        version it refused (``"<version>: <why>"``), on the registered model as tag
        ``served_by.<replica>``: ``ls`` shows it beside the versions."""
        value = json.dumps({"serving": serving, "refused": refused[:400], "at": int(time.time())})
        self.models.set_model_tag(self.name(key), SERVED_BY + replica, value)

    def served(self, key: str = "") -> dict[str, dict]:
        """Every replica's last report on this model (:meth:`report_served`), by replica."""
        out = {}
        for tag, value in self.models.model_tags(self.name(key)).items():
            if tag.startswith(SERVED_BY):
                try:
                    out[tag.removeprefix(SERVED_BY)] = dict(json.loads(value))
                except (ValueError, TypeError):
                    continue  # not ours: ignored
        return out

    def _change(self, what: str, key: str, version: str, previous: str, reason: str) -> AliasChange:
        """The announcement of a champion move: a draft's names its cluster, any other kind its model."""
        if self.kind.name == "draft":
            return AliasChange(what, key, version, previous, reason)
        return AliasChange(what, "", version, previous, reason, self.name(key))

    def promote(self, key: str, version: str, *, reason: str = "manual") -> AliasChange:
        """Point ``champion`` at ``version`` (recording when, why and what it replaced); announced
        through the store's ``on_change``. Also a way back to any earlier version."""
        version = str(version)
        return self.models.promote(
            self.name(key), version, reason, lambda prev: self._change("promotion", key, version, prev, reason)
        )

    def rollback(
        self, key: str = "", *, reason: str, to: str | None = None, expect_current: str | None = None
    ) -> AliasChange | None:
        """Move ``champion`` back to the version it replaced (or to ``to``), and mark the current
        one rolled back. With ``expect_current``, do nothing (return None) unless the champion is
        still that version (a concurrent promotion wins)."""

        def change(version: str, previous: str) -> AliasChange:
            return self._change("rollback", key, version, previous, reason)

        return self.models.rollback(
            self.name(key), reason=reason, to=to, expect_current=expect_current, change_from=change
        )

    def retain(self, key: str = "", *, keep_last: int = 10, delete_artifacts: bool = True) -> list[str]:
        """Archive old unaliased versions, keeping the newest ``keep_last``, every aliased one and
        the champion's rollback target. Archived versions stay listed; their files are deleted
        when ``delete_artifacts``. Returns the archived."""
        return self.models.retain(self.name(key), keep_last=keep_last, delete_artifacts=delete_artifacts)

    def log_metric(self, key: str, version: str, metric: str, value: float, *, step: int = 0) -> None:
        """A metric on the version's run (plotted) and as a tag on the version (listed)."""
        self.models.log_metric(self.get(key, version), metric, value, step=step)

    def record_gate(self, key: str, result: GateResult) -> None:
        """Write the gate's decision and numbers on the candidate version (tags, and metrics on its run)."""
        self.set_tags(key, result.candidate, result.tags())
        v = self.get(key, result.candidate)
        with self.models.call("log gate metrics"):
            if v.run_id:
                self.models.client.log_metric(v.run_id, "gate_candidate_acceptance", result.candidate_score)
                if result.champion_score is not None:
                    self.models.client.log_metric(v.run_id, "gate_champion_acceptance", result.champion_score)

    def apply_gate(self, key: str, result: GateResult) -> AliasChange | None:
        """Record the decision; promote the candidate when the gate says so."""
        self.record_gate(key, result)
        if not result.promoted:
            log.info("%s: gate kept the champion: version %s %s", self.name(key), result.candidate, result.reason)
            return None
        return self.promote(key, result.candidate, reason=f"gate: {result.reason}")

    # ------------------------------------------------------------ files
    def fetch(self, version: ArtifactVersion, dest: Path) -> dict:
        """Download ``version`` into ``dest`` (a new directory) and verify every checksum against its
        manifest and the manifest against the version's tag. Returns the manifest; raises
        ArtifactIntegrityError and leaves nothing at ``dest`` on failure."""
        return self.models.fetch(version, dest)

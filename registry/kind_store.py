"""The registry's operations for one artifact kind: ``RegistryStore.artifact(kind)``.

The same register / versions / get / by-alias / promote / rollback / retain / describe /
fetch for every kind in ``registry.kinds``: a draft per cluster, the router, a datastore
per cluster, a knowledge base per name. ``key`` is the cluster (or knowledge-base name) of
a keyed kind and ignored for the router.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from specops.registry import artifacts
from specops.registry.errors import VersionNotFoundError
from specops.registry.kinds import ArtifactKind

if TYPE_CHECKING:
    from specops.registry.store import AliasChange, ArtifactVersion, RegistryStore

log = logging.getLogger(__name__)


class KindStore:
    """One kind's view of a :class:`~registry.store.RegistryStore` (cheap: build one per use)."""

    def __init__(self, store: "RegistryStore", kind: ArtifactKind) -> None:
        self.store = store
        self.kind = kind

    def name(self, key: str = "") -> str:
        """The registered model of ``key``."""
        return self.kind.model_name(key)

    # ------------------------------------------------------------ reads
    def keys(self, *, alias: str | None = None) -> list[str]:
        """Every key with a registered model of this kind (with ``alias``: only those whose model
        has that alias, e.g. the clusters with a champion draft), over every page of the search."""
        pattern = f"{self.kind.name}-%" if self.kind.keyed else self.kind.name
        models, token = [], None
        with self.store._call(f"list registered {self.kind.name} models"):
            while True:
                page = self.store.client.search_registered_models(filter_string=f"name LIKE '{pattern}'",
                                                                  max_results=1000, page_token=token)  # fmt: skip
                models.extend(page)
                token = getattr(page, "token", None)
                if not token:
                    break
        return sorted(k for m in models if (k := self.kind.key_of(m.name)) is not None
                      and (alias is None or alias in (m.aliases or {})))  # fmt: skip

    def versions(self, key: str = "", *, include_archived: bool = True) -> list["ArtifactVersion"]:
        """Every version, oldest first ([] before the first registration)."""
        try:
            out = self.store._versions(self.name(key))
        except VersionNotFoundError:
            return []
        return out if include_archived else [v for v in out if not v.archived]

    def get(self, key: str, version: str) -> "ArtifactVersion":
        return self.store._get(self.name(key), str(version))

    def by_alias(self, key: str = "", alias: str = "champion") -> "ArtifactVersion | None":
        """The version ``alias`` points to, or None when the model or the alias does not exist."""
        return self.store._by_alias(self.name(key), alias)

    def describe(self, key: str = "") -> dict:
        """What an operator asks of a model: aliases, and per version its tags, gate and live numbers."""
        versions = self.versions(key)
        return {
            "kind": self.kind.name,
            "key": key,
            "model": self.name(key),
            "aliases": {a: v.version for v in versions for a in v.aliases},
            "versions": [{"version": v.version, "aliases": list(v.aliases), "archived": v.archived,
                          "created_ms": v.created_ms, "tags": dict(v.tags)} for v in versions],  # fmt: skip
        }

    # ------------------------------------------------------------ writes
    def register(self, key: str, src_dir: Path, *, meta: dict | None = None, tags: dict[str, str] | None = None,
                 metrics: dict[str, float] | None = None, params: dict[str, object] | None = None,
                 lineage: dict | None = None, parent_version: str | None = None, source_id: str | None = None,
                 alias: str | None = "challenger", retries: int = 5) -> "ArtifactVersion":  # fmt: skip
        """Register the artifact in ``src_dir`` as a new version of ``key``'s model.

        Drafts and routers have their own packers (``RegistryStore.register_draft`` and
        ``register_router`` check what those directories must hold); any other kind is packed
        with ``registry.artifacts.pack_files`` (safetensors and JSON). ``source_id`` makes it
        idempotent; ``tags`` are stamped on the version (config and tokenizer hashes...)."""
        assert self.kind.name not in ("draft", "router"), "use register_draft / register_router: they check the files"
        name = self.name(key)
        if source_id is not None and (found := self.store._find_source(name, source_id)) is not None:
            log.info("%s: %s is already version %s", name, source_id, found.version)
            return found
        staging = Path(tempfile.mkdtemp(prefix="specops-register-"))
        try:
            manifest_sha = artifacts.pack_files(src_dir, staging, self.kind.format, meta={"key": key, **(meta or {})})
            all_tags = {**(tags or {}), "kind": self.kind.name, "key": key, "manifest_sha256": manifest_sha,
                        "parent_version": parent_version or "", "registered_at": _now()}  # fmt: skip
            mv = self.store._register(name, staging, self.kind.artifact_path, all_tags, metrics=metrics, params=params,
                                      lineage=lineage, source_id=source_id, retries=retries,
                                      model_tags={"kind": self.kind.name, "key": key},
                                      description=self.kind.description.format(key=key))  # fmt: skip
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if alias:
            self.store._set_alias(name, alias, mv.version)
            mv = self.get(key, mv.version)
        log.info("%s: registered version %s", name, mv.version)
        return mv

    def set_alias(self, key: str, alias: str, version: str) -> None:
        self.store._set_alias(self.name(key), alias, str(version))

    def promote(self, key: str, version: str, *, reason: str = "manual") -> "AliasChange":
        """Point ``champion`` at ``version`` (recording when, why and what it replaced)."""
        from specops.registry.store import AliasChange

        name = self.name(key)
        cluster = key if self.kind.name == "draft" else ""
        return self.store._promote(name, str(version), reason, lambda prev: AliasChange(
            "promotion", cluster, str(version), prev, reason, "" if cluster else name))  # fmt: skip

    def rollback(self, key: str = "", *, reason: str, to: str | None = None,
                 expect_current: str | None = None) -> "AliasChange | None":  # fmt: skip
        """Move ``champion`` back to the version it replaced (or to ``to``)."""
        from specops.registry.store import AliasChange

        name = self.name(key)
        cluster = key if self.kind.name == "draft" else ""
        return self.store._rollback(name, reason=reason, to=to, expect_current=expect_current,
                                    change_from=lambda v, prev: AliasChange("rollback", cluster, v, prev, reason,
                                                                            "" if cluster else name))  # fmt: skip

    def retain(self, key: str = "", *, keep_last: int = 10, delete_artifacts: bool = True) -> list[str]:
        """Archive old unaliased versions, keeping the newest ``keep_last`` and the rollback target."""
        return self.store._retain(self.name(key), keep_last=keep_last, delete_artifacts=delete_artifacts)

    def log_metric(self, key: str, version: str, metric: str, value: float, *, step: int = 0) -> None:
        """A metric on the version's run (plotted) and as a tag on the version (listed)."""
        v = self.get(key, version)
        with self.store._call(f"log {metric} on {v.name} version {version}"):
            if v.run_id:
                self.store.client.log_metric(v.run_id, metric, float(value), step=int(step))
            self.store.client.set_model_version_tag(v.name, str(version), metric, f"{float(value):.6f}")

    def fetch(self, version: "ArtifactVersion", dest: Path) -> dict:
        """Download and verify a version into ``dest`` (``RegistryStore.fetch``)."""
        return self.store.fetch(version, dest)


def _now() -> str:
    from specops.registry.store import _now as now

    return now()

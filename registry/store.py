"""The registry over MLflow: per-cluster draft versions, aliases, promotion, rollback, retention.

One registered model per cluster, ``draft-<cluster>``. Each version is backed by one
MLflow run (experiment ``specops-drafts``) that holds the artifact (``draft/``, see
``registry.artifacts``), the offline and live acceptance metrics and the parameters it
was trained with; the version itself carries the tags an operator filters on. Aliases:

- ``champion``: what serving uses;
- ``challenger``: the latest candidate.

Promotion history is kept on the versions themselves (``promoted_at`` and
``previous_champion`` tags), so :meth:`RegistryStore.rollback` needs no other state.
Every MLflow failure reaches callers as a ``registry.errors`` exception.

The prompt router is one more registered model, ``router`` (:class:`RouterVersion`,
``register_router``/``router_by_alias``/``promote_router``/``fetch``): centroids and the
embedder's config hash (``serving.fleet.router``), with the same aliases, lineage tags,
manifest check and ``on_change`` announcements as drafts. ``clusters()`` lists drafts only.

**Any kind** (``registry.kinds``: draft, router, datastore, kb) has the same operations
through :meth:`RegistryStore.artifact`, which returns a :class:`~registry.kind_store.KindStore`:
``register``, ``versions``, ``get``, ``by_alias``, ``promote``, ``rollback``, ``retain``,
``describe``, ``fetch``. The draft- and router-named methods above are that, for two kinds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from pathlib import Path

from specops.registry import artifacts
from specops.registry.config import RegistryConfig
from specops.registry.errors import ArtifactFormatError, RegistryError, RegistryUnavailableError, VersionNotFoundError
from specops.registry.kinds import KINDS, kind_of

if TYPE_CHECKING:
    from specops.registry.kind_store import KindStore

log = logging.getLogger(__name__)

PREFIX = "draft-"
CHAMPION, CHALLENGER = "champion", "challenger"
ARTIFACT_PATH = "draft"
ROUTER = "router"
"""Registered model name of the prompt router (one router for the whole deployment)."""
ROUTER_ARTIFACT_PATH = "router"


def model_name(cluster: str) -> str:
    return f"{PREFIX}{cluster}"


class _VersionTags:
    """Readings of a registered version's tags, shared by drafts and routers."""

    tags: dict[str, str]

    @property
    def archived(self) -> bool:
        return "archived" in self.tags

    @property
    def manifest_sha256(self) -> str | None:
        return self.tags.get("manifest_sha256")

    def metric(self, key: str) -> float | None:
        value = self.tags.get(key)
        return None if value in (None, "") else float(value)


@dataclass(frozen=True)
class DraftVersion(_VersionTags):
    """One registered version of a cluster's draft."""

    cluster: str
    version: str
    run_id: str
    source: str
    """Artifact URI of the draft directory."""
    tags: dict[str, str]
    aliases: tuple[str, ...] = ()
    created_ms: int = 0

    @property
    def name(self) -> str:
        return model_name(self.cluster)

    @property
    def tokenizer_sha256(self) -> str:
        return self.tags.get("tokenizer_sha256", "")


@dataclass(frozen=True)
class RouterVersion(_VersionTags):
    """One registered version of the router (registered model ``router``)."""

    version: str
    run_id: str
    source: str
    """Artifact URI of the router directory (``router.safetensors``, ``router.json``, manifest)."""
    tags: dict[str, str]
    aliases: tuple[str, ...] = ()
    created_ms: int = 0

    @property
    def name(self) -> str:
        return ROUTER

    @property
    def clusters(self) -> tuple[str, ...]:
        """The cluster names of the centroids, in order."""
        return tuple(c for c in self.tags.get("clusters", "").split(",") if c)

    @property
    def embedder_kind(self) -> str:
        return self.tags.get("embedder_kind", "")

    @property
    def embedder_sha256(self) -> str:
        return self.tags.get("embedder_sha256", "")


@dataclass(frozen=True)
class ArtifactVersion(_VersionTags):
    """One registered version of an artifact of any kind (``registry.kinds``)."""

    kind: str
    key: str
    """The cluster (or knowledge-base name) for a keyed kind; empty otherwise."""
    version: str
    run_id: str
    source: str
    """Artifact URI of the version's directory."""
    tags: dict[str, str]
    aliases: tuple[str, ...] = ()
    created_ms: int = 0

    @property
    def name(self) -> str:
        return KINDS[self.kind].model_name(self.key)


@dataclass(frozen=True)
class AliasChange:
    """A move of ``champion``: what serving must react to (published as a ModelEvent)."""

    kind: str
    """``promotion`` or ``rollback``."""
    cluster: str
    """The draft's cluster; empty for a model that is not a draft (see ``registered_model``)."""
    version: str
    previous_version: str
    reason: str
    registered_model: str = ""
    """The registered model when it is not ``draft-<cluster>`` (``router``, ``datastore-<cluster>``...)."""

    @property
    def model_name(self) -> str:
        return self.registered_model or model_name(self.cluster)

    @property
    def artifact(self) -> str:
        """The artifact kind that changed (``draft``, ``router``, ...)."""
        found = kind_of(self.model_name)
        return found[0].name if found else ""


@dataclass(frozen=True)
class GateResult:
    """The promotion gate's decision on one candidate, with its numbers."""

    candidate: str
    champion: str | None
    """Version compared against (None: the cluster had no champion; ``base`` scores the base draft)."""
    candidate_score: float
    champion_score: float | None
    margin: float
    metric: str
    num_positions: int
    promoted: bool
    reason: str
    extra: dict[str, float] = field(default_factory=dict)


def decide(candidate: str, champion: str | None, candidate_score: float, champion_score: float | None, *,
           margin: float, num_positions: int, min_positions: int, metric: str = "sampling",
           stderr: float | None = None, z: float = 1.645) -> GateResult:  # fmt: skip
    """Promote iff the candidate beats the champion by ``margin`` on at least ``min_positions``
    shared held-out positions. Both scores must come from the same records.

    With ``stderr`` (the standard error of the paired difference), the win must also be
    beyond noise: ``delta - z * stderr >= margin`` (a one-sided 95 % bound at the default z).
    Without it a difference of a few held-out positions can promote a draft that serves
    worse. ``margin=-1`` promotes every candidate with enough positions, noise or not."""
    kw = dict(candidate=candidate, champion=champion, candidate_score=candidate_score, champion_score=champion_score,
              margin=margin, metric=metric, num_positions=num_positions)  # fmt: skip
    extra = {} if stderr is None else {"stderr": stderr, "z": z}
    if num_positions < min_positions:
        return GateResult(**kw, promoted=False, extra=extra,
                          reason=f"only {num_positions} held-out positions (< {min_positions}): not enough evidence")
    if champion_score is None:
        return GateResult(**kw, promoted=True, extra=extra, reason="no champion yet")
    delta = candidate_score - champion_score
    noise = "" if stderr is None else f" ± {stderr:.4f}"
    if delta < margin:
        return GateResult(**kw, promoted=False, extra=extra,
                          reason=f"{metric} acceptance {candidate_score:.4f} vs {champion_score:.4f} ({delta:+.4f}{noise}) "
                                 f"is not a win by {margin}")  # fmt: skip
    if stderr is not None and margin > -1.0 and delta - z * stderr < margin:
        return GateResult(**kw, promoted=False, extra=extra,
                          reason=f"{metric} acceptance {candidate_score:.4f} vs {champion_score:.4f} ({delta:+.4f}{noise}) "
                                 f"is within noise (needs {delta:+.4f} - {z} x {stderr:.4f} >= {margin})")  # fmt: skip
    return GateResult(**kw, promoted=True, extra=extra,
                      reason=f"{metric} acceptance {candidate_score:.4f} beats {champion_score:.4f} by {delta:+.4f}{noise} "
                             f">= {margin}")  # fmt: skip


class RegistryStore:
    """Typed access to the MLflow registry. Thread-safe (calls are serialised)."""

    def __init__(self, cfg: RegistryConfig, *, on_change: Callable[[AliasChange], None] | None = None) -> None:
        # an MLflow server that is down must fail a call in seconds, not retry for minutes
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(cfg.timeout_s)))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(cfg.max_retries))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # our logs say what was fetched
        from mlflow import MlflowClient  # imported here: ~3 s, and only the registry needs it

        self.cfg = cfg
        self.on_change = on_change
        self.client = MlflowClient(tracking_uri=cfg.uri, registry_uri=cfg.uri)
        self._lock = threading.RLock()
        self._experiment_id: str | None = None

    # ------------------------------------------------------------ plumbing
    @contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """Serialise, and turn MLflow's failures into registry errors."""
        from mlflow.exceptions import MlflowException

        with self._lock:
            try:
                yield
            except RegistryError:
                raise
            except MlflowException as exc:
                code = getattr(exc, "error_code", "")
                msg = str(exc)
                if code == "RESOURCE_DOES_NOT_EXIST" or "not found" in msg.lower():
                    raise VersionNotFoundError(f"{what}: {msg.splitlines()[0]}") from exc
                raise RegistryUnavailableError(f"{what}: {msg.splitlines()[0][:300]}") from exc
            except (OSError, ConnectionError) as exc:
                raise RegistryUnavailableError(f"{what}: {exc}") from exc
            except Exception as exc:  # sqlalchemy/requests errors escaping MLflow
                raise RegistryUnavailableError(f"{what}: {type(exc).__name__}: {str(exc)[:300]}") from exc

    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        if self._experiment_id is None:
            exp = self.client.get_experiment_by_name(self.cfg.experiment)
            if exp is None:
                try:
                    self._experiment_id = self.client.create_experiment(
                        self.cfg.experiment, artifact_location=self.cfg.resolved_artifact_root,
                        tags={"specops": "draft versions, one run per registered version"})  # fmt: skip
                except MlflowException:  # created by a concurrent process
                    exp = self.client.get_experiment_by_name(self.cfg.experiment)
                    if exp is None:
                        raise
                    self._experiment_id = exp.experiment_id
            else:
                self._experiment_id = exp.experiment_id
        return self._experiment_id

    def _ensure_model(self, name: str, tags: dict[str, str], description: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            try:
                self.client.create_registered_model(name, tags=tags, description=description)
            except MlflowException:
                self.client.get_registered_model(name)  # a concurrent process created it

    def _to_version(self, mv, aliases: dict[str, str] | None = None) -> DraftVersion | RouterVersion | ArtifactVersion:
        if aliases is None:
            names = tuple(getattr(mv, "aliases", ()) or ())
        else:
            names = tuple(sorted(a for a, v in aliases.items() if str(v) == str(mv.version)))
        common = {"version": str(mv.version), "run_id": mv.run_id or "", "source": mv.source,
                  "tags": dict(mv.tags or {}), "aliases": names,
                  "created_ms": int(mv.creation_timestamp or 0)}  # fmt: skip
        if mv.name == ROUTER:
            return RouterVersion(**common)
        kind, key = kind_of(mv.name) or (KINDS["draft"], mv.name.removeprefix(PREFIX))
        if kind.name == "draft":
            return DraftVersion(cluster=key, **common)
        return ArtifactVersion(kind=kind.name, key=key, **common)

    def _versions(self, name: str) -> list:
        """Every version of registered model ``name``, oldest first."""
        with self._call(f"versions of {name}"):
            aliases = {a: str(v) for a, v in (self.client.get_registered_model(name).aliases or {}).items()}
            found = self.client.search_model_versions(f"name = '{name}'", max_results=10000)
        return sorted((self._to_version(mv, aliases) for mv in found), key=lambda v: int(v.version))

    def _get(self, name: str, version: str):
        with self._call(f"{name} version {version}"):
            return self._to_version(self.client.get_model_version(name, str(version)))

    def _by_alias(self, name: str, alias: str):
        try:
            with self._call(f"{name}@{alias}"):
                return self._to_version(self.client.get_model_version_by_alias(name, alias))
        except VersionNotFoundError:
            return None

    def _find_source(self, name: str, source_id: str):
        try:
            versions = self._versions(name)
        except VersionNotFoundError:  # no such registered model yet
            return None
        for v in reversed(versions):
            if v.tags.get("source_id") == source_id:
                return v
        return None

    # ------------------------------------------------------------ reads
    def clusters(self) -> list[str]:
        with self._call("list registered drafts"):
            models = self.client.search_registered_models(filter_string=f"name LIKE '{PREFIX}%'")
        return sorted(m.name[len(PREFIX):] for m in models)

    def aliases(self, cluster: str) -> dict[str, str]:
        with self._call(f"aliases of {model_name(cluster)}"):
            return {a: str(v) for a, v in (self.client.get_registered_model(model_name(cluster)).aliases or {}).items()}

    def versions(self, cluster: str, *, include_archived: bool = True) -> list[DraftVersion]:
        """Every version, oldest first."""
        out = self._versions(model_name(cluster))
        return out if include_archived else [v for v in out if not v.archived]

    def get(self, cluster: str, version: str) -> DraftVersion:
        return self._get(model_name(cluster), version)

    def by_alias(self, cluster: str, alias: str = CHAMPION) -> DraftVersion | None:
        """The version ``alias`` points to, or None when the model or alias does not exist."""
        return self._by_alias(model_name(cluster), alias)

    def find_source(self, cluster: str, source_id: str) -> DraftVersion | None:
        """The version registered from ``source_id`` (idempotent registration), if any."""
        return self._find_source(model_name(cluster), source_id)

    def router_versions(self, *, include_archived: bool = True) -> list[RouterVersion]:
        """Every router version, oldest first ([] before the first registration)."""
        try:
            out = self._versions(ROUTER)
        except VersionNotFoundError:
            return []
        return out if include_archived else [v for v in out if not v.archived]

    def router_version(self, version: str) -> RouterVersion:
        return self._get(ROUTER, version)

    def router_by_alias(self, alias: str = CHAMPION) -> RouterVersion | None:
        """The router version ``alias`` points to, or None when there is none."""
        return self._by_alias(ROUTER, alias)

    # ------------------------------------------------------------ writes
    def register_draft(
        self,
        cluster: str,
        model_dir: Path,
        *,
        tokenizer_sha256: str,
        tokenizer_dir: Path | None = None,
        metrics: dict[str, float] | None = None,
        params: dict[str, object] | None = None,
        lineage: dict | None = None,
        parent_version: str | None = None,
        config_sha256: str | None = None,
        source_id: str | None = None,
        alias: str | None = CHALLENGER,
        retries: int = 5,
    ) -> DraftVersion:
        """Register the draft in ``model_dir`` as a new version of ``draft-<cluster>``.

        ``source_id`` makes it idempotent: a version already registered from the same
        source (a trainer checkpoint re-registered after a crash) is returned, not
        duplicated. ``lineage`` is ``{"topic", "offsets": {partition: [first, last]}}``.
        """
        if source_id is not None:
            found = self.find_source(cluster, source_id)
            if found is not None:
                log.info("%s: %s is already version %s", model_name(cluster), source_id, found.version)
                return found
        staging = Path(tempfile.mkdtemp(prefix="specops-register-"))
        try:
            manifest_sha = artifacts.pack(model_dir, staging, tokenizer_dir=tokenizer_dir,
                                          meta={"cluster": cluster, "tokenizer_sha256": tokenizer_sha256})  # fmt: skip
            cfg_sha = config_sha256 or artifacts.config_hash(staging)
            tags = {"cluster": cluster, "tokenizer_sha256": tokenizer_sha256, "config_sha256": cfg_sha,
                    "manifest_sha256": manifest_sha, "parent_version": parent_version or "",
                    "registered_at": _now()}  # fmt: skip
            name = model_name(cluster)
            mv = self._register(name, staging, ARTIFACT_PATH, tags, metrics=metrics, params=params, lineage=lineage,
                                source_id=source_id, retries=retries,
                                model_tags={"cluster": cluster, "kind": "draft"},
                                description=f"Speculative-decoding draft of cluster '{cluster}'. Alias 'champion' is "
                                            "served; 'challenger' is the latest candidate.")  # fmt: skip
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if alias:
            self.set_alias(cluster, alias, mv.version)
            mv = self.get(cluster, mv.version)
        log.info("%s: registered version %s (%s)", model_name(cluster), mv.version,
                 ", ".join(f"{k}={v:.4f}" for k, v in (metrics or {}).items()) or "no metrics")  # fmt: skip
        return mv

    def register_router(
        self,
        router_dir: Path,
        *,
        metrics: dict[str, float] | None = None,
        params: dict[str, object] | None = None,
        lineage: dict | None = None,
        parent_version: str | None = None,
        source_id: str | None = None,
        alias: str | None = CHALLENGER,
        retries: int = 5,
    ) -> RouterVersion:
        """Register the router saved in ``router_dir`` (``router.safetensors`` + ``router.json``,
        see ``serving.fleet.router.Router.save``) as a new version of ``router``.

        The version's tags carry the cluster names, the embedder kind and config hash, the
        manifest hash, lineage and metrics, as for drafts; ``source_id`` makes it idempotent.
        """
        if source_id is not None:
            found = self._find_source(ROUTER, source_id)
            if found is not None:
                log.info("%s: %s is already version %s", ROUTER, source_id, found.version)
                return found
        info = _router_info(Path(router_dir))
        staging = Path(tempfile.mkdtemp(prefix="specops-register-"))
        try:
            manifest_sha = artifacts.pack_router(router_dir, staging, meta=info)
            tags = {"kind": "router", "clusters": ",".join(info["clusters"]),
                    "num_clusters": str(len(info["clusters"])),
                    "embedder_kind": info["embedder_kind"], "embedder_sha256": info["embedder_sha256"],
                    "config_sha256": info["embedder_sha256"], "manifest_sha256": manifest_sha,
                    "parent_version": parent_version or "", "registered_at": _now()}  # fmt: skip
            mv = self._register(ROUTER, staging, ROUTER_ARTIFACT_PATH, tags, metrics=metrics, params=params,
                                lineage=lineage, source_id=source_id, retries=retries, model_tags={"kind": "router"},
                                description="Prompt router: embedding config and one centroid per cluster. Alias "
                                            "'champion' is served; 'challenger' is the latest refit.")  # fmt: skip
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if alias:
            self._set_alias(ROUTER, alias, mv.version)
            mv = self.router_version(mv.version)
        log.info("%s: registered version %s, clusters %s (%s)", ROUTER, mv.version, ",".join(info["clusters"]),
                 ", ".join(f"{k}={v:.4f}" for k, v in (metrics or {}).items()) or "no metrics")  # fmt: skip
        return mv

    def _register(self, name: str, staging: Path, artifact_path: str, tags: dict[str, str], *,
                  metrics: dict[str, float] | None, params: dict[str, object] | None, lineage: dict | None,
                  source_id: str | None, retries: int, model_tags: dict[str, str], description: str):  # fmt: skip
        """One run holding the packed artifact in ``staging``, params and metrics; then a new
        version of ``name`` pointing at it, tagged with ``tags``, lineage and metrics."""
        tags = dict(tags)
        if source_id is not None:
            tags["source_id"] = source_id
        if lineage:
            offsets = lineage.get("offsets", {})
            tags["lineage_topic"] = str(lineage.get("topic", ""))
            tags["lineage_partitions"] = ",".join(sorted(offsets, key=int))
            tags["lineage_offsets"] = json.dumps(offsets, sort_keys=True)
        for key, value in (metrics or {}).items():
            tags[key] = f"{float(value):.6f}"
        with self._call(f"register {name}"):
            run = self.client.create_run(self._experiment(), run_name=name, tags=dict(tags))
            rid = run.info.run_id
            for key, value in (params or {}).items():
                self.client.log_param(rid, key, str(value)[:6000])
            for key, value in (metrics or {}).items():
                self.client.log_metric(rid, key, float(value))
            self.client.log_artifacts(rid, str(staging), artifact_path)
            self.client.set_terminated(rid)
            self._ensure_model(name, model_tags, description)
        return self._create_version(name, f"{run.info.artifact_uri}/{artifact_path}", rid, tags, source_id, retries)

    def _create_version(self, name: str, source: str, run_id: str, tags: dict, source_id: str | None,
                        retries: int):  # fmt: skip
        """create_model_version, retried on a version-number race with another writer. Before
        each retry, look for the version by ``source_id``: a call that failed on the way back
        may have created it."""
        delay = 0.05
        for attempt in range(retries + 1):
            try:
                with self._call(f"create a version of {name}"):
                    return self._to_version(self.client.create_model_version(
                        name, source=source, run_id=run_id, tags=tags))  # fmt: skip
            except RegistryUnavailableError as exc:
                if attempt == retries:
                    raise
                log.warning("%s (attempt %d/%d); retrying", exc, attempt + 1, retries + 1)
                time.sleep(delay)
                delay *= 2
                if source_id is not None and (found := self._find_source(name, source_id)) is not None:
                    return found
        raise AssertionError("unreachable")

    def set_alias(self, cluster: str, alias: str, version: str) -> None:
        self._set_alias(model_name(cluster), alias, version)

    def _set_alias(self, name: str, alias: str, version: str) -> None:
        with self._call(f"set {name}@{alias}"):
            self.client.set_registered_model_alias(name, alias, str(version))

    def _set_tags(self, name: str, version: str, tags: dict[str, object]) -> None:
        with self._call(f"tag {name} version {version}"):
            for key, value in tags.items():
                self.client.set_model_version_tag(name, str(version), key, str(value))

    def log_metric(self, cluster: str, version: str, key: str, value: float, *, step: int = 0) -> None:
        """A metric on the version's run (plotted in the UI) and as a tag on the version (listed)."""
        dv = self.get(cluster, version)
        with self._call(f"log {key} on {model_name(cluster)} version {version}"):
            if dv.run_id:
                self.client.log_metric(dv.run_id, key, float(value), step=int(step))
            self.client.set_model_version_tag(model_name(cluster), str(version), key, f"{float(value):.6f}")

    def record_gate(self, cluster: str, result: GateResult) -> None:
        """Write the gate's decision and numbers on the candidate version."""
        tags = {"gate_decision": "promoted" if result.promoted else "rejected", "gate_reason": result.reason,
                "gate_champion": result.champion or "", "gate_margin": result.margin, "gate_metric": result.metric,
                "gate_positions": result.num_positions, "gate_candidate_acceptance": f"{result.candidate_score:.6f}",
                "gate_at": _now()}  # fmt: skip
        if result.champion_score is not None:
            tags["gate_champion_acceptance"] = f"{result.champion_score:.6f}"
        for key, value in result.extra.items():
            tags[f"gate_{key}"] = f"{value:.6f}"
        self._set_tags(model_name(cluster), result.candidate, tags)
        dv = self.get(cluster, result.candidate)
        with self._call("log gate metrics"):
            if dv.run_id:
                self.client.log_metric(dv.run_id, "gate_candidate_acceptance", result.candidate_score)
                if result.champion_score is not None:
                    self.client.log_metric(dv.run_id, "gate_champion_acceptance", result.champion_score)

    def apply_gate(self, cluster: str, result: GateResult) -> AliasChange | None:
        """Record the decision; promote the candidate when the gate says so."""
        self.record_gate(cluster, result)
        if not result.promoted:
            log.info("%s: gate kept the champion: version %s %s", model_name(cluster), result.candidate, result.reason)
            return None
        return self.promote(cluster, result.candidate, reason=f"gate: {result.reason}")

    def promote(self, cluster: str, version: str, *, reason: str = "manual") -> AliasChange:
        """Point ``champion`` at ``version`` (recording when, why and what it replaced)."""
        return self._promote(model_name(cluster), str(version), reason,
                             lambda prev: AliasChange("promotion", cluster, str(version), prev, reason))  # fmt: skip

    def promote_router(self, version: str, *, reason: str = "manual") -> AliasChange:
        """Point the router's ``champion`` at ``version``; announced like a draft promotion
        (an AliasChange whose ``model_name`` is ``router``). Also the way to roll a router back."""
        return self._promote(ROUTER, str(version), reason,
                             lambda prev: AliasChange("promotion", "", str(version), prev, reason, ROUTER))  # fmt: skip

    def _promote(self, name: str, version: str, reason: str, change_from) -> AliasChange:
        """Move ``name@champion`` to ``version``; ``change_from(previous_version)`` makes the announcement."""
        if self._get(name, version).archived:
            raise RegistryError(f"{name} version {version} is archived; its weights are gone")
        previous = self._by_alias(name, CHAMPION)
        prev = previous.version if previous is not None else ""
        change = change_from(prev)
        if prev == version:
            log.info("%s: version %s is already the champion", name, version)
            return change
        self._set_tags(name, version, {"promoted_at": _now(), "promoted_ts": f"{time.time():.6f}",
                                       "previous_champion": prev, "promotion_reason": reason})  # fmt: skip
        self._set_alias(name, CHAMPION, version)
        log.info("%s: champion %s -> %s (%s)", name, prev or "none", version, reason)
        self._notify(change)
        return change

    def rollback(self, cluster: str, *, reason: str, to: str | None = None,
                 expect_current: str | None = None) -> AliasChange | None:  # fmt: skip
        """Move ``champion`` back to the version it replaced (or to ``to``), and mark the
        current one rolled back. With ``expect_current``, do nothing (return None) unless
        the champion is still that version (a concurrent promotion wins)."""
        return self._rollback(model_name(cluster), reason=reason, to=to, expect_current=expect_current,
                              change_from=lambda v, prev: AliasChange("rollback", cluster, v, prev, reason))  # fmt: skip

    def _rollback(self, name: str, *, reason: str, to: str | None, expect_current: str | None,
                  change_from) -> AliasChange | None:  # fmt: skip
        current = self._by_alias(name, CHAMPION)
        if current is None:
            raise VersionNotFoundError(f"{name} has no champion to roll back")
        if expect_current is not None and current.version != str(expect_current):
            log.info("%s: not rolling back %s: the champion is now %s", name, expect_current, current.version)
            return None
        target = str(to) if to else self._previous_champion(name, current)
        if target is None:
            raise VersionNotFoundError(f"{name} version {current.version} has no earlier champion "
                                       "to roll back to; name one with --to")  # fmt: skip
        if self._get(name, target).archived:
            raise RegistryError(f"cannot roll back to archived version {target} of {name}")
        self._set_tags(name, current.version, {"rolled_back": reason, "rolled_back_at": _now()})
        self._set_tags(name, target, {"restored_at": _now(), "restored_ts": f"{time.time():.6f}"})
        self._set_alias(name, CHAMPION, target)
        change = change_from(target, current.version)
        log.warning("%s: rolled back champion %s -> %s (%s)", name, current.version, target, reason)
        self._notify(change)
        return change

    def _previous_champion(self, name: str, current) -> str | None:
        """The version ``current`` replaced, skipping any since rolled back or archived."""
        by_version = {v.version: v for v in self._versions(name)}
        seen, prev = {current.version}, current.tags.get("previous_champion")
        while prev and prev not in seen:
            seen.add(prev)
            dv = by_version.get(prev)
            if dv is None:
                return None
            if "rolled_back" not in dv.tags and not dv.archived:
                return prev
            prev = dv.tags.get("previous_champion")
        return None

    def retain(self, cluster: str, *, keep_last: int = 10, delete_artifacts: bool = True) -> list[str]:
        """Archive versions that are old and unaliased, keeping the newest ``keep_last`` and
        the champion's rollback target. Archived versions stay listed, with their tags and
        metrics; their weights are deleted when ``delete_artifacts``. Returns the archived."""
        return self._retain(model_name(cluster), keep_last=keep_last, delete_artifacts=delete_artifacts)

    def _retain(self, name: str, *, keep_last: int, delete_artifacts: bool) -> list[str]:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        versions = self._versions(name)
        keep = {v.version for v in versions[-keep_last:]} | {v.version for v in versions if v.aliases}
        champion = next((v for v in versions if CHAMPION in v.aliases), None)
        if champion is not None and (prev := self._previous_champion(name, champion)):
            keep.add(prev)
        archived = []
        for v in versions:
            if v.version in keep or v.archived:
                continue
            self._set_tags(name, v.version, {"archived": _now()})
            if delete_artifacts:
                self._delete_artifacts(v)
            archived.append(v.version)
        if archived:
            log.info("%s: archived versions %s (keeping the last %d and every aliased one)", name,
                     ", ".join(archived), keep_last)  # fmt: skip
        return archived

    def artifact(self, kind: str) -> "KindStore":
        """The registry's operations for one artifact kind (``registry.kinds.KINDS``)."""
        from specops.registry.kind_store import KindStore

        if kind not in KINDS:
            raise ValueError(f"unknown artifact kind {kind!r}; choose one of {', '.join(KINDS)}")
        return KindStore(self, KINDS[kind])

    def _delete_artifacts(self, v: DraftVersion | RouterVersion | ArtifactVersion) -> None:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        try:
            with self._call(f"delete the weights of {v.name} version {v.version}"):
                get_artifact_repository(v.source, tracking_uri=self.cfg.uri).delete_artifacts()
        except (RegistryError, NotImplementedError) as exc:
            log.warning("archived %s version %s but could not delete its artifacts: %s", v.name, v.version, exc)

    # ------------------------------------------------------------ artifacts
    def fetch(self, dv: DraftVersion | RouterVersion | ArtifactVersion, dest: Path) -> dict:
        """Download the version's draft (or router) into ``dest`` (a new directory) and verify
        every checksum against its manifest and the manifest against the version's tag. Returns
        the manifest; raises ArtifactIntegrityError and leaves nothing at ``dest`` on failure."""
        from mlflow.artifacts import download_artifacts

        if dv.archived:
            raise RegistryError(f"{dv.name} version {dv.version} is archived; its weights are gone")
        dest = Path(dest)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent if dest.parent.exists() else None))
        try:
            with self._call(f"download {dv.name} version {dv.version}"):
                got = Path(download_artifacts(artifact_uri=dv.source, dst_path=str(tmp), tracking_uri=self.cfg.uri))
            found = kind_of(dv.name)
            fmt = found[0].format if found else artifacts.FORMAT
            manifest = artifacts.verify_dir(got, dv.manifest_sha256, fmt)
            if dest.exists():
                shutil.rmtree(dest)
            shutil.move(str(got), dest)
            return manifest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _notify(self, change: AliasChange) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(change)
        except Exception:  # the alias moved; a lost push is covered by serving's polling
            log.exception("could not announce %s of %s version %s", change.kind, change.model_name, change.version)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _router_info(router_dir: Path) -> dict:
    """Cluster names and embedder of a saved router, read from its ``router.json``."""
    path = router_dir / "router.json"
    try:
        meta = json.loads(path.read_text())
        clusters = [str(c) for c in meta["clusters"]]
        embedder = meta["embedder"]
        info = {"clusters": clusters, "embedder_kind": str(embedder["kind"]),
                "embedder_sha256": str(embedder["config_sha256"])}  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArtifactFormatError(f"{path} is not a saved router's description ({type(exc).__name__}: {exc}); "
                                  "save routers with serving.fleet.router.Router.save") from exc  # fmt: skip
    if not clusters or any(not c or "," in c for c in clusters):
        raise ArtifactFormatError(f"{path}: cluster names must be non-empty and contain no comma, got {clusters}")
    return info

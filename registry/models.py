"""The registry's MLflow layer: registered models by name, their versions, aliases and runs.

One registered model per artifact (``draft-<cluster>``, ``router``, ``datastore-<cluster>``...,
named by ``specops.registry.kinds``). Each version is backed by one MLflow run (experiment
``specops-drafts``) holding the artifact directory, the metrics and the parameters it was
built with; the version carries the tags an operator filters on. Promotion history is kept
on the versions themselves (``promoted_at`` and ``previous_champion`` tags), so a rollback
needs no other state. Every MLflow failure reaches callers as a ``specops.registry.errors`` exception.

Callers use ``RegistryStore.artifact(kind)`` (``specops.registry.kind_store``), which speaks in keys;
this layer speaks in registered-model names and knows nothing of kinds' files.
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
from pathlib import Path

import tenacity

from specops.registry import artifacts
from specops.registry.config import RegistryConfig
from specops.registry.errors import (
    RegistryError,
    RegistryUnavailableError,
    VersionNotFoundError,
)
from specops.registry.kinds import KINDS, kind_of
from specops.registry.version import CHAMPION, AliasChange, ArtifactVersion, now

log = logging.getLogger(__name__)


def _retrying(retries: int) -> tenacity.Retrying:
    """Retry a :class:`RegistryUnavailableError` ``retries`` times, after 0.05 s doubling per
    try (capped at 2 s) plus up to 0.05 s of jitter, so two racing writers drift apart; a
    warning per retry, and the last error re-raised as it is."""

    def warn(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        sleep = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("%s (attempt %d/%d); retrying in %.2fs", exc, state.attempt_number, retries + 1, sleep)

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(RegistryUnavailableError),
        stop=tenacity.stop_after_attempt(retries + 1),
        wait=tenacity.wait_exponential_jitter(multiplier=0.05, max=2.0, jitter=0.05),
        before_sleep=warn,
        reraise=True,
    )


class ModelStore:
    """Typed access to MLflow's registered models. Thread-safe (calls are serialised)."""

    def __init__(self, cfg: RegistryConfig, *, on_change: Callable[[AliasChange], None] | None = None) -> None:
        # an MLflow server that is down must fail a call in seconds, not retry for minutes
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(cfg.timeout_s)))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(cfg.max_retries))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # our logs say what was fetched
        from mlflow import (
            MlflowClient,  # imported here: ~3 s, and only the registry needs it
        )

        self.cfg = cfg
        self.on_change = on_change
        self.client = MlflowClient(tracking_uri=cfg.uri, registry_uri=cfg.uri)
        self._lock = threading.RLock()
        self._experiment_id: str | None = None

    # ------------------------------------------------------------ plumbing
    @contextmanager
    def call(self, what: str) -> Iterator[None]:
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
                        self.cfg.experiment,
                        artifact_location=self.cfg.resolved_artifact_root,
                        tags={"specops": "draft versions, one run per registered version"},
                    )
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

    def _to_version(self, mv, aliases: dict[str, str] | None = None) -> ArtifactVersion:
        if aliases is None:
            names = tuple(getattr(mv, "aliases", ()) or ())
        else:
            names = tuple(sorted(a for a, v in aliases.items() if str(v) == str(mv.version)))
        kind, key = kind_of(mv.name) or (KINDS["draft"], mv.name.removeprefix("draft-"))
        return ArtifactVersion(
            kind=kind.name,
            key=key,
            version=str(mv.version),
            run_id=mv.run_id or "",
            source=mv.source,
            tags=dict(mv.tags or {}),
            aliases=names,
            created_ms=int(mv.creation_timestamp or 0),
        )

    # ------------------------------------------------------------ reads
    def model_names(self, pattern: str) -> list:
        """The registered models whose name is ``LIKE pattern``, over every page of the search."""
        models, token = [], None
        with self.call(f"list registered models {pattern}"):
            while True:
                page = self.client.search_registered_models(
                    filter_string=f"name LIKE '{pattern}'", max_results=1000, page_token=token
                )
                models.extend(page)
                token = getattr(page, "token", None)
                if not token:
                    break
        return models

    def aliases(self, name: str) -> dict[str, str]:
        with self.call(f"aliases of {name}"):
            return {a: str(v) for a, v in (self.client.get_registered_model(name).aliases or {}).items()}

    def versions(self, name: str) -> list[ArtifactVersion]:
        """Every version of registered model ``name``, oldest first."""
        with self.call(f"versions of {name}"):
            aliases = {a: str(v) for a, v in (self.client.get_registered_model(name).aliases or {}).items()}
            found = self.client.search_model_versions(f"name = '{name}'", max_results=10000)
        return sorted((self._to_version(mv, aliases) for mv in found), key=lambda v: int(v.version))

    def get(self, name: str, version: str) -> ArtifactVersion:
        with self.call(f"{name} version {version}"):
            return self._to_version(self.client.get_model_version(name, str(version)))

    def by_alias(self, name: str, alias: str) -> ArtifactVersion | None:
        try:
            with self.call(f"{name}@{alias}"):
                return self._to_version(self.client.get_model_version_by_alias(name, alias))
        except VersionNotFoundError:
            return None

    def find_source(self, name: str, source_id: str) -> ArtifactVersion | None:
        try:
            versions = self.versions(name)
        except VersionNotFoundError:  # no such registered model yet
            return None
        for v in reversed(versions):
            if v.tags.get("source_id") == source_id:
                return v
        return None

    # ------------------------------------------------------------ writes
    def register(
        self,
        name: str,
        staging: Path,
        artifact_path: str,
        tags: dict[str, str],
        *,
        metrics: dict[str, float] | None,
        params: dict[str, object] | None,
        lineage: dict | None,
        source_id: str | None,
        retries: int,
        model_tags: dict[str, str],
        description: str,
    ) -> ArtifactVersion:
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
        with self.call(f"register {name}"):
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

    def _create_version(
        self, name: str, source: str, run_id: str, tags: dict, source_id: str | None, retries: int
    ) -> ArtifactVersion:
        """create_model_version, retried on a version-number race with another writer (up to
        ``retries`` more tries, :func:`_retrying`). Before each retry, look for the version by
        ``source_id``: a call that failed on the way back may have created it."""
        for attempt in _retrying(retries):
            with attempt:
                if attempt.retry_state.attempt_number > 1 and source_id is not None:
                    if (found := self.find_source(name, source_id)) is not None:
                        return found
                with self.call(f"create a version of {name}"):
                    return self._to_version(
                        self.client.create_model_version(name, source=source, run_id=run_id, tags=tags)
                    )
        raise AssertionError("unreachable: _retrying re-raises the last error")

    def set_alias(self, name: str, alias: str, version: str) -> None:
        """Point ``name@alias`` at ``version``; idempotent, so retried (:func:`_retrying`): two writers
        setting a new alias at once race on its first insert in a SQL store (a unique violation for
        one of them), and the retry then updates the row the other one made."""
        for attempt in _retrying(max(1, self.cfg.max_retries)):
            with attempt, self.call(f"set {name}@{alias}"):
                self.client.set_registered_model_alias(name, alias, str(version))

    def set_tags(self, name: str, version: str, tags: dict[str, object]) -> None:
        with self.call(f"tag {name} version {version}"):
            for key, value in tags.items():
                self.client.set_model_version_tag(name, str(version), key, str(value))

    def set_model_tag(self, name: str, key: str, value: str) -> None:
        """A tag on the registered model itself (not on a version)."""
        with self.call(f"tag {name}"):
            self.client.set_registered_model_tag(name, key, value)

    def model_tags(self, name: str) -> dict[str, str]:
        """The registered model's own tags ({} when it does not exist)."""
        from mlflow.exceptions import MlflowException

        with self.call(f"read {name}"):
            try:
                return dict(self.client.get_registered_model(name).tags or {})
            except MlflowException:
                return {}

    def log_metric(self, v: ArtifactVersion, metric: str, value: float, *, step: int = 0) -> None:
        """A metric on the version's run (plotted in the UI) and as a tag on the version (listed)."""
        with self.call(f"log {metric} on {v.name} version {v.version}"):
            if v.run_id:
                self.client.log_metric(v.run_id, metric, float(value), step=int(step))
            self.client.set_model_version_tag(v.name, v.version, metric, f"{float(value):.6f}")

    # ------------------------------------------------------------ champion moves
    def promote(self, name: str, version: str, reason: str, change_from: Callable[[str], AliasChange]) -> AliasChange:
        """Move ``name@champion`` to ``version``; ``change_from(previous_version)`` makes the announcement."""
        if self.get(name, version).archived:
            raise RegistryError(f"{name} version {version} is archived; its weights are gone")
        previous = self.by_alias(name, CHAMPION)
        prev = previous.version if previous is not None else ""
        change = change_from(prev)
        if prev == version:
            log.info("%s: version %s is already the champion", name, version)
            return change
        self.set_tags(
            name,
            version,
            {
                "promoted_at": now(),
                "promoted_ts": f"{time.time():.6f}",
                "previous_champion": prev,
                "promotion_reason": reason,
            },
        )
        self.set_alias(name, CHAMPION, version)
        log.info("%s: champion %s -> %s (%s)", name, prev or "none", version, reason)
        self._notify(change)
        return change

    def rollback(
        self,
        name: str,
        *,
        reason: str,
        to: str | None,
        expect_current: str | None,
        change_from: Callable[[str, str], AliasChange],
    ) -> AliasChange | None:
        """Move ``champion`` back to the version it replaced (or to ``to``), and mark the
        current one rolled back. With ``expect_current``, do nothing (return None) unless
        the champion is still that version (a concurrent promotion wins)."""
        current = self.by_alias(name, CHAMPION)
        if current is None:
            raise VersionNotFoundError(f"{name} has no champion to roll back")
        if expect_current is not None and current.version != str(expect_current):
            log.info("%s: not rolling back %s: the champion is now %s", name, expect_current, current.version)
            return None
        target = str(to) if to else self.previous_champion(name, current)
        if target is None:
            raise VersionNotFoundError(
                f"{name} version {current.version} has no earlier champion to roll back to; name one with --to"
            )
        if self.get(name, target).archived:
            raise RegistryError(f"cannot roll back to archived version {target} of {name}")
        self.set_tags(name, current.version, {"rolled_back": reason, "rolled_back_at": now()})
        self.set_tags(name, target, {"restored_at": now(), "restored_ts": f"{time.time():.6f}"})
        self.set_alias(name, CHAMPION, target)
        change = change_from(target, current.version)
        log.warning("%s: rolled back champion %s -> %s (%s)", name, current.version, target, reason)
        self._notify(change)
        return change

    def previous_champion(self, name: str, current: ArtifactVersion) -> str | None:
        """The version ``current`` replaced, skipping any since rolled back or archived."""
        by_version = {v.version: v for v in self.versions(name)}
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

    def retain(self, name: str, *, keep_last: int, delete_artifacts: bool) -> list[str]:
        """Archive versions that are old and unaliased, keeping the newest ``keep_last`` and
        the champion's rollback target. Archived versions stay listed, with their tags and
        metrics; their files are deleted when ``delete_artifacts``. Returns the archived."""
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        versions = self.versions(name)
        keep = {v.version for v in versions[-keep_last:]} | {v.version for v in versions if v.aliases}
        champion = next((v for v in versions if CHAMPION in v.aliases), None)
        if champion is not None and (prev := self.previous_champion(name, champion)):
            keep.add(prev)
        archived = []
        for v in versions:
            if v.version in keep or v.archived:
                continue
            self.set_tags(name, v.version, {"archived": now()})
            if delete_artifacts:
                self._delete_artifacts(v)
            archived.append(v.version)
        if archived:
            log.info(
                "%s: archived versions %s (keeping the last %d and every aliased one)",
                name,
                ", ".join(archived),
                keep_last,
            )
        return archived

    def _delete_artifacts(self, v: ArtifactVersion) -> None:
        from mlflow.store.artifact.artifact_repository_registry import (
            get_artifact_repository,
        )

        try:
            with self.call(f"delete the weights of {v.name} version {v.version}"):
                get_artifact_repository(v.source, tracking_uri=self.cfg.uri).delete_artifacts()
        except (RegistryError, NotImplementedError) as exc:
            log.warning("archived %s version %s but could not delete its artifacts: %s", v.name, v.version, exc)

    # ------------------------------------------------------------ artifacts
    def fetch(self, v: ArtifactVersion, dest: Path) -> dict:
        """Download the version's directory into ``dest`` (a new directory) and verify every
        checksum against its manifest (of its kind's format) and the manifest against the
        version's tag. Returns the manifest; raises ArtifactIntegrityError and leaves nothing at ``dest``
        on failure."""
        from mlflow.artifacts import download_artifacts

        if v.archived:
            raise RegistryError(f"{v.name} version {v.version} is archived; its weights are gone")
        dest = Path(dest)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent if dest.parent.exists() else None))
        try:
            with self.call(f"download {v.name} version {v.version}"):
                got = Path(download_artifacts(artifact_uri=v.source, dst_path=str(tmp), tracking_uri=self.cfg.uri))
            manifest = artifacts.verify_dir(got, v.manifest_sha256, KINDS[v.kind].format)
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

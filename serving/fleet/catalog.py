"""Named artifacts a request asks for by name: knowledge bases (``kb-<name>``) and kNN-LM
datastores (``knnlm-<name>``).

Unlike drafts and DReSD datastores (one per cluster, followed from startup), a serving
replica may hold many of these and a request names one (``retrieval.kb``, ``knnlm.datastore``),
so they load on first use:

1. a local directory given at startup (``--kb-dir`` / ``--knnlm-dir``) is served under the
   name in its own metadata, version ``local``;
2. otherwise the registry's ``<kind>-<name>@champion`` is fetched (verified), loaded and kept;
3. every ``poll_s`` a background thread checks the champion of each name in use and loads a
   new one beside the old; the swap is one reference assignment, so a request that already
   holds the old artifact finishes with it and none fails.

An unknown name is the caller's error (a 400 naming the field), listing what is available.

**A refused version.** A champion that fails verification (a checksum, a malformed or foreign
file) or cannot be fetched is refused once, logged at ERROR, and counted in
``specops_named_artifact_refusals_total{kind}``; it is not fetched again on every request.
While a good version of the name is loaded it keeps serving. With none, a request gets a 503
naming the field (``retrieval.kb``: :class:`~specops.core.errors.ArtifactUnavailableError`). The
fetch is retried with exponential backoff (``backoff_initial_s`` doubling to
``backoff_max_s``), by the next request or poll after the delay; a new champion version is
tried at once.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter

from specops.core.errors import ArtifactUnavailableError, InvalidRequestError

log = logging.getLogger(__name__)

REFUSALS = Counter(
    "specops_named_artifact_refusals_total",
    "Champions of named artifacts (kb, knnlm) refused or not fetched, per failed attempt",
    ["kind"],
)


@dataclass(frozen=True)
class Loaded:
    name: str
    version: str
    artifact: object


@dataclass(frozen=True)
class Refusal:
    """Why a name's champion is not loaded, and when to try again."""

    version: str
    """The version refused ("" when the registry could not say which)."""
    reason: str
    attempts: int
    """Consecutive failed attempts at this version."""
    retry_at: float
    """``time.monotonic()`` before which no fetch is tried."""


class NamedArtifacts:
    """``get(name) -> Loaded`` for one artifact kind, loading on first use."""

    def __init__(
        self,
        kind: str,
        load_dir: Callable[[Path], object],
        *,
        registry=None,
        cache_dir: Path,
        local: dict[str, object] | None = None,
        field: str,
        poll_s: float = 10.0,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ) -> None:
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError(f"need 0 < backoff_initial_s <= backoff_max_s, got {backoff_initial_s}, {backoff_max_s}")
        self.kind, self.load_dir, self.registry, self.cache_dir, self.field = (
            kind,
            load_dir,
            registry,
            Path(cache_dir),
            field,
        )
        self.poll_s = poll_s
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.refused: dict[str, Refusal] = {}
        """Names whose champion was refused (or not fetched) and is not loaded."""
        self.attempts: dict[str, int] = {}
        """Fetch-and-load attempts per name (tests and operators)."""
        self._loaded: dict[str, Loaded] = {name: Loaded(name, "local", a) for name, a in (local or {}).items()}
        self._local = set(self._loaded)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ reads
    def names(self) -> list[str]:
        names = set(self._loaded)
        if self.registry is not None:
            try:
                names.update(self.registry.artifact(self.kind).keys())
            except Exception as exc:  # the registry is down: what is loaded still serves
                log.warning("cannot list %s artifacts: %s", self.kind, exc)
        return sorted(names)

    def get(self, name: str) -> Loaded:
        """The artifact ``name`` (loading its champion on first use); a 400 naming the field if
        unknown, a 503 naming it while its champion is refused and nothing good is loaded."""
        loaded = self._loaded.get(name)
        if loaded is not None:
            return loaded
        with self._lock:  # one load per name, however many requests ask at once
            loaded = self._loaded.get(name)
            if loaded is None:
                refusal = self.refused.get(name)
                if refusal is not None and time.monotonic() < refusal.retry_at:
                    raise self._unavailable(name, refusal)
                loaded = self._try_champion(name)
                if loaded is None:
                    known = ", ".join(self.names()) or "none"
                    raise InvalidRequestError(
                        f"{self.field} {name!r}: no such {self.kind} here (available: {known})", self.field
                    )
                self._loaded[name] = loaded
        return loaded

    def _unavailable(self, name: str, refusal: Refusal) -> ArtifactUnavailableError:
        which = f"version {refusal.version} of {self.kind}-{name}" if refusal.version else f"{self.kind}-{name}"
        wait = max(0.0, refusal.retry_at - time.monotonic())
        return ArtifactUnavailableError(
            f"{self.field} {name!r}: {which} could not be loaded ({refusal.reason}) and no earlier version is loaded "
            f"here; the server retries in {wait:.0f}s (its log has the details)",
            self.field,
        )

    def _try_champion(self, name: str) -> Loaded | None:
        """The champion loaded, None when the name has none; a failure is refused (logged once,
        retried with backoff) and raised as a 503 naming the field."""
        version = ""
        try:
            champion = (
                self.registry.artifact(self.kind).by_alias(name, "champion") if self.registry is not None else None
            )
            if champion is None:
                return None
            version = str(champion.version)
            loaded = self._load_version(name, champion)
        except Exception as exc:  # noqa: BLE001 - corrupt, foreign, unreachable: refused, never a 500 per request
            raise self._unavailable(name, self._refuse(name, version, exc)) from None
        self.refused.pop(name, None)
        return loaded

    def _refuse(self, name: str, version: str, exc: Exception) -> Refusal:
        previous = self.refused.get(name)
        attempts = previous.attempts + 1 if previous is not None and previous.version == version else 1
        delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (attempts - 1))
        reason = f"{type(exc).__name__}"
        refusal = Refusal(version, reason, attempts, time.monotonic() + delay)
        self.refused[name] = refusal
        REFUSALS.labels(self.kind).inc()
        serving = self._loaded.get(name)
        keeps = f"keeping version {serving.version}" if serving is not None else "nothing else loaded: requests get 503"
        if attempts == 1:
            log.error(
                "%s-%s version %s refused: %s: %s (%s; retrying in %.0fs, backing off to %.0fs)",
                self.kind,
                name,
                version or "?",
                type(exc).__name__,
                exc,
                keeps,
                delay,
                self.backoff_max_s,
            )
        else:
            log.warning(
                "%s-%s version %s refused again (attempt %d): %s: %s; next try in %.0fs",
                self.kind,
                name,
                version or "?",
                attempts,
                type(exc).__name__,
                exc,
                delay,
            )
        return refusal

    def _load_version(self, name: str, version) -> Loaded:
        self.attempts[name] = self.attempts.get(name, 0) + 1
        store = self.registry.artifact(self.kind)
        dest = self.cache_dir / f"{self.kind}-{name}" / str(version.version)
        if not dest.exists():
            tmp = dest.with_name(dest.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.fetch(version, tmp)
            tmp.rename(dest)
        try:
            artifact = self.load_dir(dest)
        except Exception:  # re-raised
            shutil.rmtree(dest, ignore_errors=True)  # a retry fetches it again, not the same bad copy
            raise
        if hasattr(artifact, "version"):
            try:
                artifact.version = str(version.version)
            except AttributeError:
                pass
        log.info("%s %s: loaded version %s", self.kind, name, version.version)
        return Loaded(name, str(version.version), artifact)

    # ------------------------------------------------------------------ following champions
    def start(self) -> NamedArtifacts:
        if self.registry is not None and self._thread is None:
            self._thread = threading.Thread(target=self._follow, name=f"follow-{self.kind}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self) -> list[str]:
        """Load a new champion for every registry-backed name in use (and retry a refused name
        whose backoff is over); returns the names swapped or loaded. A refused version is tried
        again only after its backoff, a new version at once; what is loaded keeps serving."""
        swapped = []
        names = [n for n in self._loaded if n not in self._local] + [n for n in self.refused if n not in self._loaded]
        for name in names:
            current = self._loaded.get(name)
            try:
                champion = self.registry.artifact(self.kind).by_alias(name, "champion")
            except Exception as exc:  # noqa: BLE001 - the registry is down: keep what is loaded, retry next poll
                log.warning("%s follow of %s: %s", self.kind, name, exc)
                continue
            if champion is None or (current is not None and str(champion.version) == current.version):
                continue
            refusal = self.refused.get(name)
            if refusal is not None and refusal.version == str(champion.version) and time.monotonic() < refusal.retry_at:
                continue  # refused before: wait out its backoff
            with self._lock:
                try:
                    fresh = self._load_version(name, champion)
                except Exception as exc:  # noqa: BLE001 - refused and logged; what is loaded keeps serving
                    self._refuse(name, str(champion.version), exc)
                    continue
                self.refused.pop(name, None)
                self._loaded[name] = fresh  # one assignment: requests holding the old one finish with it
            swapped.append(name)
        return swapped

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception as exc:  # keep serving what is loaded; try again next poll
                log.warning("%s follow: %s", self.kind, exc)

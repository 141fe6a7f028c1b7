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
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serving.errors import InvalidRequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    name: str
    version: str
    artifact: object


class NamedArtifacts:
    """``get(name) -> Loaded`` for one artifact kind, loading on first use."""

    def __init__(self, kind: str, load_dir: Callable[[Path], object], *, registry=None, cache_dir: Path,
                 local: dict[str, object] | None = None, field: str, poll_s: float = 10.0) -> None:  # fmt: skip
        self.kind, self.load_dir, self.registry, self.cache_dir, self.field = kind, load_dir, registry, Path(cache_dir), field
        self.poll_s = poll_s
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
        """The artifact ``name`` (loading its champion on first use); a 400 naming the field if unknown."""
        loaded = self._loaded.get(name)
        if loaded is not None:
            return loaded
        with self._lock:  # one load per name, however many requests ask at once
            loaded = self._loaded.get(name)
            if loaded is None:
                loaded = self._load_champion(name)
                if loaded is None:
                    known = ", ".join(self.names()) or "none"
                    raise InvalidRequestError(f"{self.field} {name!r}: no such {self.kind} here (available: {known})",
                                              self.field)  # fmt: skip
                self._loaded[name] = loaded
        return loaded

    def _load_champion(self, name: str) -> Loaded | None:
        if self.registry is None:
            return None
        store = self.registry.artifact(self.kind)
        version = store.by_alias(name, "champion")
        if version is None:
            return None
        dest = self.cache_dir / f"{self.kind}-{name}" / str(version.version)
        if not dest.exists():
            tmp = dest.with_name(dest.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            store.fetch(version, tmp)
            tmp.rename(dest)
        artifact = self.load_dir(dest)
        if hasattr(artifact, "version"):
            try:
                artifact.version = str(version.version)
            except AttributeError:
                pass
        log.info("%s %s: loaded version %s", self.kind, name, version.version)
        return Loaded(name, str(version.version), artifact)

    # ------------------------------------------------------------------ following champions
    def start(self) -> "NamedArtifacts":
        if self.registry is not None and self._thread is None:
            self._thread = threading.Thread(target=self._follow, name=f"follow-{self.kind}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self) -> list[str]:
        """Load a new champion for every registry-backed name in use; returns the names swapped."""
        swapped = []
        for name, current in list(self._loaded.items()):
            if name in self._local:
                continue
            champion = self.registry.artifact(self.kind).by_alias(name, "champion")
            if champion is None or str(champion.version) == current.version:
                continue
            fresh = self._load_champion(name)
            if fresh is not None:
                self._loaded[name] = fresh  # one assignment: requests holding the old one finish with it
                swapped.append(name)
        return swapped

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception as exc:  # keep serving what is loaded; try again next poll
                log.warning("%s follow: %s", self.kind, exc)

"""Where the registry lives: one URI picks the MLflow backend.

| URI | backend |
|---|---|
| ``sqlite:////abs/path/mlflow.db`` (the default) | embedded SQLite store, artifacts on the local disk |
| ``postgresql://user@host:5432/db`` | PostgreSQL backend store, artifacts on the local disk (or ``artifact_root``) |
| ``http://host:port`` | an ``mlflow server``; it stores the artifacts (``--serve-artifacts``) |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REGISTRY_URI_ENV = "SPECOPS_REGISTRY_URI"
ARTIFACT_ROOT_ENV = "SPECOPS_REGISTRY_ARTIFACTS"
SCHEMES = ("sqlite", "postgresql", "mysql", "http", "https", "file")


@dataclass(frozen=True)
class RegistryConfig:
    """How to reach the registry."""

    uri: str
    """MLflow tracking/registry URI (see the module docstring)."""
    artifact_root: str | None = None
    """Where new experiments keep artifacts (a path or URI). None: next to a SQLite file,
    under the data directory for other database stores, the server's choice over HTTP."""
    experiment: str = "specops-drafts"
    """MLflow experiment holding one run per registered draft version."""
    timeout_s: float = 10.0
    """HTTP request timeout against an MLflow server."""
    max_retries: int = 2
    """HTTP retries against an MLflow server before a call fails as unavailable."""

    def __post_init__(self) -> None:
        if self.uri.startswith("postgresql://"):
            # SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3; the driver installed is psycopg2
            object.__setattr__(self, "uri", "postgresql+psycopg2://" + self.uri[len("postgresql://") :])
        scheme = self.uri.split(":", 1)[0].split("+", 1)[0]
        if scheme not in SCHEMES:
            raise ValueError(
                f"registry URI {self.uri!r} has an unknown scheme {scheme!r}; use one of "
                "sqlite:////path/mlflow.db, postgresql://user@host/db or http://host:port"
            )
        if self.timeout_s <= 0 or self.max_retries < 0:
            raise ValueError("timeout_s must be > 0 and max_retries >= 0")

    @property
    def is_http(self) -> bool:
        return self.uri.startswith(("http://", "https://"))

    @property
    def resolved_artifact_root(self) -> str | None:
        if self.artifact_root:
            root = self.artifact_root
            return root if "://" in root else Path(root).expanduser().resolve().as_uri()
        if self.uri.startswith("sqlite:///"):
            db = Path(self.uri[len("sqlite:///") :])
            return (db.parent / "artifacts").resolve().as_uri()
        return None

    @classmethod
    def default(
        cls, data_dir: Path | str = ".specops", uri: str | None = None, artifact_root: str | None = None, **kw
    ) -> RegistryConfig:
        """``uri``, else ``$SPECOPS_REGISTRY_URI``, else SQLite under ``data_dir/registry``."""
        uri = uri or os.environ.get(REGISTRY_URI_ENV)
        artifact_root = artifact_root or os.environ.get(ARTIFACT_ROOT_ENV)
        if not uri:
            db = Path(data_dir).expanduser().resolve() / "registry" / "mlflow.db"
            db.parent.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{db}"
        elif not artifact_root and not uri.startswith(("http://", "https://", "sqlite:")):
            artifact_root = str(Path(data_dir).expanduser().resolve() / "registry" / "artifacts")
        return cls(uri=uri, artifact_root=artifact_root, **kw)

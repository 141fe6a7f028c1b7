"""The MLflow-backed registry of draft versions (a leaf: imports nothing of ours)."""

from registry.config import RegistryConfig
from registry.errors import (
    ArtifactFormatError,
    ArtifactIntegrityError,
    RegistryError,
    RegistryUnavailableError,
    VersionNotFoundError,
)
from registry.store import CHALLENGER, CHAMPION, AliasChange, DraftVersion, GateResult, RegistryStore, decide, model_name

__all__ = [
    "CHALLENGER", "CHAMPION", "AliasChange", "ArtifactFormatError", "ArtifactIntegrityError", "DraftVersion",
    "GateResult", "RegistryConfig", "RegistryError", "RegistryStore", "RegistryUnavailableError",
    "VersionNotFoundError", "decide", "model_name",
]  # fmt: skip

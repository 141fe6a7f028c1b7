"""The MLflow-backed registry of draft and router versions (a leaf: imports nothing of ours)."""

from registry.config import RegistryConfig
from registry.errors import (
    ArtifactFormatError,
    ArtifactIntegrityError,
    RegistryError,
    RegistryUnavailableError,
    VersionNotFoundError,
)
from registry.store import (
    CHALLENGER,
    CHAMPION,
    ROUTER,
    AliasChange,
    DraftVersion,
    GateResult,
    RegistryStore,
    RouterVersion,
    decide,
    model_name,
)

__all__ = [
    "CHALLENGER", "CHAMPION", "AliasChange", "ArtifactFormatError", "ArtifactIntegrityError", "DraftVersion",
    "GateResult", "ROUTER", "RegistryConfig", "RegistryError", "RegistryStore", "RegistryUnavailableError",
    "RouterVersion", "VersionNotFoundError", "decide", "model_name",
]  # fmt: skip

"""The MLflow-backed registry of versioned artifacts: drafts, the router, datastores, knowledge bases
(``registry.kinds``; a leaf: imports nothing of ours)."""

from specops.registry.config import RegistryConfig
from specops.registry.errors import (
    ArtifactFormatError,
    ArtifactIntegrityError,
    RegistryError,
    RegistryUnavailableError,
    VersionNotFoundError,
)
from specops.registry.kinds import KINDS, ArtifactKind, kind_of
from specops.registry.store import (
    CHALLENGER,
    CHAMPION,
    ROUTER,
    AliasChange,
    ArtifactVersion,
    DraftVersion,
    GateResult,
    RegistryStore,
    RouterVersion,
    decide,
    model_name,
)

__all__ = [
    "CHALLENGER", "CHAMPION", "KINDS", "AliasChange", "ArtifactKind", "ArtifactVersion", "kind_of", "ArtifactFormatError", "ArtifactIntegrityError", "DraftVersion",
    "GateResult", "ROUTER", "RegistryConfig", "RegistryError", "RegistryStore", "RegistryUnavailableError",
    "RouterVersion", "VersionNotFoundError", "decide", "model_name",
]  # fmt: skip

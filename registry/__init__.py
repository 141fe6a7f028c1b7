"""The MLflow-backed registry of versioned artifacts: drafts, the router, datastores, knowledge bases,
kNN-LM datastores, sessions and the auto policy (``specops.registry.kinds``). One API for all of them:
``RegistryStore(cfg).artifact(kind)``; one version type, :class:`ArtifactVersion`. A leaf: imports
nothing of ours above it."""

from specops.registry.config import RegistryConfig
from specops.registry.errors import (
    ArtifactFormatError,
    ArtifactIntegrityError,
    RegistryError,
    RegistryUnavailableError,
    VersionNotFoundError,
)
from specops.registry.kind_store import KindStore
from specops.registry.kinds import KINDS, ArtifactKind, kind_of
from specops.registry.store import RegistryStore
from specops.registry.version import (
    CHALLENGER,
    CHAMPION,
    AliasChange,
    ArtifactVersion,
    GateResult,
    decide,
)

__all__ = [
    "CHALLENGER",
    "CHAMPION",
    "KINDS",
    "AliasChange",
    "ArtifactFormatError",
    "ArtifactIntegrityError",
    "ArtifactKind",
    "ArtifactVersion",
    "GateResult",
    "KindStore",
    "RegistryConfig",
    "RegistryError",
    "RegistryStore",
    "RegistryUnavailableError",
    "VersionNotFoundError",
    "decide",
    "kind_of",
]

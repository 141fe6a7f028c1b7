"""Typed errors of the registry. Callers catch these, never MLflow's own exceptions."""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every registry error."""

    code = "registry"


class RegistryUnavailableError(RegistryError):
    """The store cannot be reached (server down, database refused). Retry later; whoever
    serves keeps its current version."""

    code = "registry_unavailable"


class VersionNotFoundError(RegistryError, LookupError):
    """No such registered model, version or alias."""

    code = "not_found"


class ArtifactIntegrityError(RegistryError):
    """A downloaded artifact does not match its manifest (checksum, size, an unexpected
    file or a format other than safetensors/JSON). The version is refused."""

    code = "artifact_integrity"


class ArtifactFormatError(RegistryError, ValueError):
    """A model directory cannot be registered as it is (no safetensors weights, a file the
    registry refuses to carry)."""

    code = "artifact_format"

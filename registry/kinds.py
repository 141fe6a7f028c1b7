"""Artifact kinds: what the registry versions, each described once.

Every kind gets the same operations from ``RegistryStore.artifact(kind)``: register,
versions, get, by-alias, promote, rollback, retain, describe and fetch. A kind says how its
registered models are named, where its files sit in a version's run, and which manifest
format its directory carries (``specops.registry.artifacts``).

- ``draft``: a draft model per cluster, ``draft-<cluster>`` (OSD);
- ``router``: the one prompt router, ``router``;
- ``datastore``: a retrieval datastore per cluster, ``datastore-<cluster>`` (DReSD);
- ``kb``: a knowledge base per name, ``kb-<name>`` (RaLMSpec, kNN-LM);
- ``knnlm``: a kNN-LM datastore per name, ``knnlm-<name>`` (RaLMSpec §5.3);
- ``sessions``: the past outputs LLMA copies from, per cluster, ``sessions-<cluster>``;
- ``policy``: the ``auto`` policy's priors (acceptance per cluster and method), ``policy``.
"""

from __future__ import annotations

from dataclasses import dataclass

from specops.registry import artifacts


@dataclass(frozen=True)
class ArtifactKind:
    """One kind of versioned artifact."""

    name: str
    keyed: bool
    """True: one registered model per key (``<name>-<key>``); False: one for the deployment (``<name>``)."""
    artifact_path: str
    """Folder of the version's run that holds the files."""
    format: str
    """Manifest format of the artifact directory."""
    description: str
    """What a registered model of this kind is (shown in the MLflow UI)."""

    def model_name(self, key: str = "") -> str:
        if self.keyed:
            assert key, f"a {self.name} needs a key"
            return f"{self.name}-{key}"
        return self.name

    def key_of(self, model_name: str) -> str | None:
        """The key of a registered model of this kind; None if it is not of this kind."""
        if self.keyed:
            prefix = f"{self.name}-"
            return (
                model_name[len(prefix) :] if model_name.startswith(prefix) and len(model_name) > len(prefix) else None
            )
        return "" if model_name == self.name else None


KINDS: dict[str, ArtifactKind] = {
    k.name: k
    for k in (
        ArtifactKind(
            "draft",
            True,
            "draft",
            artifacts.FORMAT,
            "Speculative-decoding draft of cluster '{key}'. Alias 'champion' is served; 'challenger' is the "
            "latest candidate.",
        ),
        ArtifactKind(
            "router",
            False,
            "router",
            artifacts.ROUTER_FORMAT,
            "Prompt router: centroids of the clusters and the embedder they were fitted with.",
        ),
        ArtifactKind(
            "datastore",
            True,
            "datastore",
            artifacts.DATASTORE_FORMAT,
            "Retrieval datastore of cluster '{key}' (DReSD): keys, next tokens, index.",
        ),
        ArtifactKind(
            "kb",
            True,
            "kb",
            artifacts.KB_FORMAT,
            "Knowledge base '{key}' (RaLMSpec, kNN-LM): passages and their index.",
        ),
        ArtifactKind(
            "knnlm",
            True,
            "knnlm",
            artifacts.KNNLM_FORMAT,
            "kNN-LM datastore '{key}': target hidden states and next tokens.",
        ),
        ArtifactKind(
            "sessions",
            True,
            "sessions",
            artifacts.SESSIONS_FORMAT,
            "Past sessions of cluster '{key}' (LLMA, cache-assisted): its recent outputs to copy from.",
        ),
        ArtifactKind(
            "policy",
            False,
            "policy",
            artifacts.POLICY_FORMAT,
            "Priors of speculation.method 'auto': acceptance per cluster, method and temperature, fitted "
            "from its logged decisions (priors.json).",
        ),
    )
}


def kind_of(model_name: str) -> tuple[ArtifactKind, str] | None:
    """The kind and key of a registered model name, or None for a name of no kind."""
    for kind in KINDS.values():
        key = kind.key_of(model_name)
        if key is not None:
            return kind, key
    return None

"""What the registry hands out: one version type for every kind, the alias moves it announces,
and the promotion gate's decision. Plain data; no MLflow."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specops.registry.kinds import KINDS, kind_of

CHAMPION, CHALLENGER = "champion", "challenger"
"""``champion``: what serving uses; ``challenger``: the latest candidate."""


def now() -> str:
    """The time stamp written on versions (UTC, ISO 8601, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class ArtifactVersion:
    """One registered version of an artifact of any kind (``specops.registry.kinds``)."""

    kind: str
    key: str
    """The cluster (or knowledge-base name) for a keyed kind; empty otherwise."""
    version: str
    run_id: str
    source: str
    """Artifact URI of the version's directory."""
    tags: dict[str, str]
    aliases: tuple[str, ...] = ()
    created_ms: int = 0

    @property
    def name(self) -> str:
        """The registered model (``draft-<cluster>``, ``router``...)."""
        return KINDS[self.kind].model_name(self.key)

    @property
    def cluster(self) -> str:
        """The key, under the name serving and the trainer use for drafts and datastores."""
        return self.key

    @property
    def archived(self) -> bool:
        return "archived" in self.tags

    @property
    def manifest_sha256(self) -> str | None:
        return self.tags.get("manifest_sha256")

    @property
    def tokenizer_sha256(self) -> str:
        return self.tags.get("tokenizer_sha256", "")

    @property
    def clusters(self) -> tuple[str, ...]:
        """The ``clusters`` tag as a tuple (a router's centroids, in order)."""
        return tuple(c for c in self.tags.get("clusters", "").split(",") if c)

    @property
    def embedder_kind(self) -> str:
        return self.tags.get("embedder_kind", "")

    @property
    def embedder_sha256(self) -> str:
        return self.tags.get("embedder_sha256", "")

    def metric(self, key: str) -> float | None:
        value = self.tags.get(key)
        return None if value in (None, "") else float(value)


@dataclass(frozen=True)
class AliasChange:
    """A move of ``champion``: what serving must react to (published as a ModelEvent)."""

    kind: str
    """``promotion`` or ``rollback``."""
    cluster: str
    """The draft's cluster; empty for a model that is not a draft (see ``registered_model``)."""
    version: str
    previous_version: str
    reason: str
    registered_model: str = ""
    """The registered model when it is not ``draft-<cluster>`` (``router``, ``datastore-<cluster>``...)."""

    @property
    def model_name(self) -> str:
        return self.registered_model or KINDS["draft"].model_name(self.cluster)

    @property
    def artifact(self) -> str:
        """The artifact kind that changed (``draft``, ``router``, ...)."""
        found = kind_of(self.model_name)
        return found[0].name if found else ""


@dataclass(frozen=True)
class GateResult:
    """The promotion gate's decision on one candidate, with its numbers."""

    candidate: str
    champion: str | None
    """Version compared against (None: the cluster had no champion; ``base`` scores the base draft)."""
    candidate_score: float
    champion_score: float | None
    margin: float
    metric: str
    num_positions: int
    promoted: bool
    reason: str
    extra: dict[str, float] = field(default_factory=dict)

    def tags(self) -> dict[str, object]:
        """The decision and its numbers, as tags on the candidate version."""
        tags: dict[str, object] = {
            "gate_decision": "promoted" if self.promoted else "rejected",
            "gate_reason": self.reason,
            "gate_champion": self.champion or "",
            "gate_margin": self.margin,
            "gate_metric": self.metric,
            "gate_positions": self.num_positions,
            "gate_candidate_acceptance": f"{self.candidate_score:.6f}",
            "gate_at": now(),
        }
        if self.champion_score is not None:
            tags["gate_champion_acceptance"] = f"{self.champion_score:.6f}"
        for key, value in self.extra.items():
            tags[f"gate_{key}"] = f"{value:.6f}"
        return tags


def decide(
    candidate: str,
    champion: str | None,
    candidate_score: float,
    champion_score: float | None,
    *,
    margin: float,
    num_positions: int,
    min_positions: int,
    metric: str = "sampling",
    stderr: float | None = None,
    z: float = 1.645,
) -> GateResult:
    """Promote iff the candidate beats the champion by ``margin`` on at least ``min_positions``
    shared held-out positions. Both scores must come from the same records.

    With ``stderr`` (the standard error of the paired difference), the win must also be
    beyond noise: ``delta - z * stderr >= margin`` (a one-sided 95 % bound at the default z).
    Without it a difference of a few held-out positions can promote a draft that serves
    worse. ``margin=-1`` promotes every candidate with enough positions, noise or not."""
    kw = {
        "candidate": candidate,
        "champion": champion,
        "candidate_score": candidate_score,
        "champion_score": champion_score,
        "margin": margin,
        "metric": metric,
        "num_positions": num_positions,
    }
    extra = {} if stderr is None else {"stderr": stderr, "z": z}
    if num_positions < min_positions:
        return GateResult(
            **kw,
            promoted=False,
            extra=extra,
            reason=f"only {num_positions} held-out positions (< {min_positions}): not enough evidence",
        )
    if champion_score is None:
        return GateResult(**kw, promoted=True, extra=extra, reason="no champion yet")
    delta = candidate_score - champion_score
    noise = "" if stderr is None else f" ± {stderr:.4f}"
    scores = f"{metric} acceptance {candidate_score:.4f} vs {champion_score:.4f} ({delta:+.4f}{noise})"
    if delta < margin:
        return GateResult(**kw, promoted=False, extra=extra, reason=f"{scores} is not a win by {margin}")
    if stderr is not None and margin > -1.0 and delta - z * stderr < margin:
        return GateResult(
            **kw,
            promoted=False,
            extra=extra,
            reason=f"{scores} is within noise (needs {delta:+.4f} - {z} x {stderr:.4f} >= {margin})",
        )
    return GateResult(
        **kw,
        promoted=True,
        extra=extra,
        reason=f"{metric} acceptance {candidate_score:.4f} beats {champion_score:.4f} by "
        f"{delta:+.4f}{noise} >= {margin}",
    )

"""Fit the ``auto`` policy's priors from its logged decisions, and report how it did.

Serving logs, with every finished ``auto`` request, what the policy chose
(``GenerationRecord.policy``: steps, drafted and accepted per method, and the request's
acceptance counts per key: ``draft``, ``dresd``, ``llma.<source>@m<N>`` for a copy from
a source at match length N and more). This module sums them per cluster, key and temperature bucket into a priors
artifact (``specops.core.auto_policy.AutoPolicy.load_priors`` reads it; ``specops policy fit``
registers it as the ``policy`` kind through :class:`PolicyFitter`), and into a report: per cluster, the share of steps
each method got and its acceptance.

Costs are not fitted here: they belong to a replica's hardware and are measured by each
replica at load (``specops.serving.proposers.auto.calibrate``) and while it serves.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from specops.core.auto_policy import PRIORS_FORMAT, key_chain
from specops.registry import ArtifactVersion
from specops.trainer.rebuild import Candidate, Rebuilder


@dataclass
class ClusterReport:
    requests: int = 0
    steps: dict[str, int] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        total = sum(self.steps.values()) or 1
        return {
            "requests": self.requests,
            "steps": dict(sorted(self.steps.items())),
            "step_share": {m: round(n / total, 4) for m, n in sorted(self.steps.items())},
            "acceptance": {m: round(self.accepted.get(m, 0) / d, 4) for m, d in sorted(self.drafted.items()) if d},
        }


def fit_priors(records: Iterable, *, max_trials: float = 1000.0) -> tuple[dict, dict[str, ClusterReport], int]:
    """``(priors, report per cluster, auto records used)`` from ``GenerationRecord``s (others are skipped).

    ``max_trials`` bounds each key's counts (scaled down together): the priors say what the
    traffic was like, and serving caps them further (``PRIOR_TRIALS``) so a request's own
    evidence soon outweighs them."""
    counts: dict[tuple[str, str, str], list[float]] = {}
    report: dict[str, ClusterReport] = {}
    used = 0
    for rec in records:
        pol = getattr(rec, "policy", None)
        if getattr(rec, "method", "") != "auto" or not pol:
            continue
        used += 1
        r = report.setdefault(rec.cluster, ClusterReport())
        r.requests += 1
        for m, v in (pol.get("methods") or {}).items():
            r.steps[m] = r.steps.get(m, 0) + int(v.get("steps", 0))
            r.drafted[m] = r.drafted.get(m, 0) + int(v.get("drafted", 0))
            r.accepted[m] = r.accepted.get(m, 0) + int(v.get("accepted", 0))
        temp = str(pol.get("temperature", "greedy"))
        for key, (acc, rej) in (pol.get("counts") or {}).items():
            for k in key_chain(key):  # and its parents: the fallbacks for keys a replica has not seen
                c = counts.setdefault((rec.cluster, k, temp), [0.0, 0.0])
                c[0] += float(acc)
                c[1] += float(rej)
    rows = []
    for (cluster, key, temp), (acc, rej) in sorted(counts.items()):
        scale = min(1.0, max_trials / (acc + rej)) if acc + rej else 1.0
        rows.append(
            {
                "cluster": cluster,
                "key": key,
                "temperature": temp,
                "accepted": round(acc * scale, 3),
                "rejected": round(rej * scale, 3),
            }
        )
    return {"format": PRIORS_FORMAT, "counts": rows, "requests": used}, report, used


class _ReadAll:
    """Every record of an iterable, outside any consumer group: nothing to commit, no lineage."""

    def __init__(self, records: Iterable) -> None:
        self.records = records

    def lineage(self) -> dict:
        return {}

    def commit(self) -> None:
        pass

    def close(self) -> None:
        pass


class PolicyFitter(Rebuilder[dict]):
    """``specops policy fit --register``: the ``policy`` kind through ``specops.trainer.rebuild.Rebuilder``.

    1. **consume** every logged ``auto`` decision (read outside any consumer group);
    2. **build** the priors (:func:`fit_priors`);
    3. **gate**: the operator's ``--promote`` (priors are counts of what served: there is no
       held-out score to compare them on);
    4. **register** ``policy`` (``priors.json``) and 5. **promote** it when asked;
    6. nothing to **commit**: no consumer group moved.
    """

    kind = "policy"

    def __init__(self, records: Iterable, registry, *, max_trials: float = 1000.0, promote: bool = False) -> None:
        super().__init__(None, registry, None, reader=_ReadAll(records))
        self.max_trials, self.promote = max_trials, promote
        self.priors: dict = {}
        self.report: dict[str, ClusterReport] = {}
        self.used = 0

    def consume(self) -> int:
        self.priors, self.report, self.used = fit_priors(self.reader.records, max_trials=self.max_trials)
        return self.used

    def start(self, consumed: int) -> dict:
        return {}

    def due(self) -> list[str]:
        return [""] if self.registry is not None and self.used else []

    def build(self, key: str) -> Candidate:
        return Candidate(self.priors)

    def gate(self, key: str, c: Candidate) -> tuple[bool, str]:
        return self.promote, f"fitted from {self.used} auto requests"

    def register(self, key: str, c: Candidate) -> ArtifactVersion:
        with tempfile.TemporaryDirectory(prefix="specops-policy-") as d:
            (Path(d) / "priors.json").write_text(json.dumps(c.artifact))
            return self.artifacts.register(
                "", Path(d), meta={"requests": self.used}, metrics={"requests": float(self.used)}
            )

    def promote_reason(self, c: Candidate) -> str:
        return c.reason

    def record(self, key: str, c: Candidate, result: dict) -> None:
        result["version"] = c.version.version
        if c.outcome == "promoted":
            result["promoted"] = True

"""Fit the ``auto`` policy's priors from its logged decisions, and report how it did.

Serving logs, with every finished ``auto`` request, what the policy chose
(``GenerationRecord.policy``: steps, drafted and accepted per method, and the request's
acceptance counts per key: ``draft``, ``dresd``, ``llma.<source>@m<N>`` for a copy from
a source at match length N and more). This module sums them per cluster, key and temperature bucket into a priors
artifact (``serving.engine.auto.AutoPolicy.load_priors`` reads it; ``specops policy fit``
registers it as the ``policy`` kind), and into a report: per cluster, the share of steps
each method got and its acceptance.

Costs are not fitted here: they belong to a replica's hardware and are measured by each
replica at load (``AutoPolicy.calibrate``) and while it serves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from specops.serving.engine.auto import key_chain

PRIORS_FORMAT = "specops-auto-priors/1"


@dataclass
class ClusterReport:
    requests: int = 0
    steps: dict[str, int] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        total = sum(self.steps.values()) or 1
        return {"requests": self.requests, "steps": dict(sorted(self.steps.items())),
                "step_share": {m: round(n / total, 4) for m, n in sorted(self.steps.items())},
                "acceptance": {m: round(self.accepted.get(m, 0) / d, 4) for m, d in sorted(self.drafted.items()) if d}}  # fmt: skip


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
        rows.append({"cluster": cluster, "key": key, "temperature": temp, "accepted": round(acc * scale, 3),
                     "rejected": round(rej * scale, 3)})  # fmt: skip
    return {"format": PRIORS_FORMAT, "counts": rows, "requests": used}, report, used

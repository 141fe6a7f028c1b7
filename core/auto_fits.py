"""What the ``auto`` policy (``specops.core.auto_policy``) measures and keeps: its cost fits
(:class:`CostFit`), its acceptance counts (:class:`Counts`), and its priors artifact's format
and checks, shared with the trainer's policy fit (``specops.trainer.policy_fit`` writes it; every
number is checked before any is used)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from specops.core.errors import echo

TEMP_BUCKETS = ("greedy", "low", "high")
"""Temperature buckets of the acceptance counts (``specops.core.auto_policy.temp_bucket``)."""

PRIORS_FORMAT = "specops-auto-priors/1"
MAX_PRIOR_COUNT = 1e12
"""Largest acceptance count a priors artifact may hold (they are scaled to :data:`PRIOR_TRIALS`)."""
MAX_PRIOR_MS = 1e7
"""Largest cost coefficient (ms) a priors artifact may hold."""


def check_priors(
    priors: object,
) -> tuple[
    dict[tuple[str, str, str], tuple[float, float]], dict[int, tuple[float, float]], dict[str, tuple[float, float]]
]:
    """A priors artifact's counts ``{(cluster, key, temperature): (accepted, rejected)}``, verify fits
    ``{load edge: (a_ms, b_ms)}`` and propose fits ``{method: (a_ms, b_ms)}``, every number checked
    (finite, in range: a NaN would stall the policy's Beta draws); ``ValueError`` naming the field
    (``counts[3].accepted``) otherwise."""

    def bad(where: str, what: str, got: object) -> ValueError:
        return ValueError(f"auto-policy priors: {where} must be {what}, got {echo(got)}")

    def number(obj: dict, name: str, where: str, hi: float) -> float:
        v = obj.get(name) if isinstance(obj, dict) else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= hi):
            raise bad(f"{where}.{name}", f"a finite number in [0, {hi:g}]", v)
        return float(v)

    def table(name: str) -> dict:
        v = priors.get(name, {})
        if not isinstance(v, dict):
            raise bad(name, "an object", v)
        return v

    if not isinstance(priors, dict) or priors.get("format") != PRIORS_FORMAT:
        fmt = priors.get("format") if isinstance(priors, dict) else type(priors).__name__
        raise ValueError(f"not an auto-policy priors file (format {echo(fmt)})")
    rows = priors.get("counts", [])
    if not isinstance(rows, list):
        raise bad("counts", "a list", rows)
    counts = {}
    for i, row in enumerate(rows):
        where = f"counts[{i}]"
        if not isinstance(row, dict):
            raise bad(where, "an object", row)
        for name in ("cluster", "key"):
            if not isinstance(row.get(name), str) or not row[name]:
                raise bad(f"{where}.{name}", "a non-empty string", row.get(name))
        if row.get("temperature") not in TEMP_BUCKETS:
            raise bad(f"{where}.temperature", f"one of {', '.join(TEMP_BUCKETS)}", row.get("temperature"))
        counts[(row["cluster"], row["key"], row["temperature"])] = (
            number(row, "accepted", where, MAX_PRIOR_COUNT),
            number(row, "rejected", where, MAX_PRIOR_COUNT),
        )
    verify = {}
    for edge, fit in table("verify").items():
        if not (isinstance(edge, str) and edge.isdigit() and 1 <= int(edge) <= 1_000_000):
            raise bad("verify", "keyed by requests in flight (1, 2, 4, ...)", edge)
        verify[int(edge)] = (
            number(fit, "a_ms", f"verify.{edge}", MAX_PRIOR_MS),
            number(fit, "b_ms", f"verify.{edge}", MAX_PRIOR_MS),
        )
    propose = {
        str(m): (number(fit, "a_ms", f"propose.{m}", MAX_PRIOR_MS), number(fit, "b_ms", f"propose.{m}", MAX_PRIOR_MS))
        for m, fit in table("propose").items()
    }
    return counts, verify, propose


COST_DECAY = 0.99
"""Per-observation decay of the cost fits (about 100 steps of memory)."""

COST_PRIOR_WEIGHT = 3.0
"""Weight of the calibration prior in each cost fit (pseudo-observations at 1 and 9 tokens)."""


class CostFit:
    """Milliseconds of a call as ``a + b * n`` (``n``: tokens), a decayed weighted least-squares
    fit with the calibration as pseudo-observations (so two points fix it before any traffic)."""

    def __init__(self, a: float, b: float, *, decay: float = COST_DECAY, prior_weight: float = COST_PRIOR_WEIGHT):
        self.a0, self.b0, self.decay, self.w0 = float(a), float(b), decay, prior_weight
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.n_obs = 0
        self.a, self.b = self.a0, self.b0

    def observe(self, n: float, ms: float) -> None:
        if not (math.isfinite(ms) and ms >= 0):
            return
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + n, d * self.sy + ms
        self.sxx, self.sxy = d * self.sxx + n * n, d * self.sxy + n * ms
        self.n_obs += 1
        self._solve()

    def _solve(self) -> None:
        # the prior as pseudo-points at n = 1 and n = 9 on the calibrated line
        w = self.w0
        p = [(1.0, self.a0 + self.b0), (9.0, self.a0 + 9 * self.b0)]
        sw = self.sw + 2 * w
        sx = self.sx + w * sum(x for x, _ in p)
        sy = self.sy + w * sum(y for _, y in p)
        sxx = self.sxx + w * sum(x * x for x, _ in p)
        sxy = self.sxy + w * sum(x * y for x, y in p)
        den = sw * sxx - sx * sx
        if den <= 1e-12:
            return
        b = (sw * sxy - sx * sy) / den
        b = max(b, 0.0)  # more tokens never cost less
        self.b, self.a = b, max((sy - b * sx) / sw, 1e-3)

    def predict(self, n: float) -> float:
        return self.a + self.b * n

    def to_dict(self) -> dict:
        return {"a_ms": round(self.a, 4), "b_ms": round(self.b, 4), "observations": self.n_obs}


@dataclass
class Counts:
    """Decayed Bernoulli counts of drafted positions: accepted, and first rejections."""

    accepted: float = 0.0
    rejected: float = 0.0
    updated: float = field(default_factory=time.time)
    """Wall time of the latest ``add`` (the weight fades with :data:`HALF_LIFE_S` after it)."""

    def add(self, accepted: float, rejected: float, decay: float = 1.0) -> None:
        self.accepted = decay * self.accepted + accepted
        self.rejected = decay * self.rejected + rejected
        self.updated = time.time()

    @property
    def trials(self) -> float:
        return self.accepted + self.rejected

    @property
    def mean(self) -> float:
        return (self.accepted + 1.0) / (self.trials + 2.0)

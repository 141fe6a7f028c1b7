"""What the ``auto`` policy (``specops.core.auto_policy``) measures and keeps: its cost fits
(:class:`CostFit`), its acceptance counts (:class:`Counts`), and its priors artifact's format
and checks, shared with the trainer's policy fit (``specops.trainer.policy_fit`` writes it; every
number is checked before any is used)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specops.core.errors import echo

TEMP_BUCKETS = ("greedy", "low", "high")
"""Temperature buckets of the acceptance counts (``temp_bucket``)."""

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


LOAD_BUCKETS = (1, 2, 4, 8, 16)
"""Requests in flight are bucketed (1, 2, 3-4, 5-8, 9-16, 17+) for the verify-cost fits."""

MATCH_BUCKETS = (1, 2, 4, 8, 16)
"""A copy's match lengths are bucketed (1, 2-3, 4-7, 8-15, 16+) for its acceptance counts."""


def temp_bucket(temperature: float) -> str:
    """``greedy``, ``low`` (T <= 0.7) or ``high``: acceptance falls with temperature."""
    return "greedy" if temperature <= 0 else ("low" if temperature <= 0.7 else "high")


def _bucket(x: int, edges: tuple[int, ...]) -> int:
    for i, e in enumerate(edges[1:]):
        if x < e:
            return i
    return len(edges) - 1


def load_bucket(n: int) -> int:
    return _bucket(max(1, n), LOAD_BUCKETS)


def copy_key(method: str, source: str, match: int) -> str:
    """The acceptance key of a copy by ``method`` from ``source`` at match length ``match``:
    ``copy_key("llma", "request", 9) == "llma.request@m8"``."""
    return f"{method}.{source}@m{MATCH_BUCKETS[_bucket(match, MATCH_BUCKETS)]}"


def copy_keys(method: str, source: str, match: int, n: int) -> list[str]:
    """The acceptance key of each of a copy's ``n`` tokens: once its first ``i`` are accepted the
    context matches the source over ``match + i`` tokens, so token ``i`` is a trial at that match
    length (``copy_keys("llma", "request", 1, 3) == ["llma.request@m1", "llma.request@m2",
    "llma.request@m2"]``)."""
    return [copy_key(method, source, match + i) for i in range(n)]


def chain_tokens(alphas: list[float], k: int) -> float:
    """Tokens one step emits with a chain of ``k`` drafts whose ``i``-th is accepted with
    ``alphas[i]`` once those before it were: ``1 + a0 + a0 a1 + ...`` (:func:`expected_tokens`
    when every ``a`` is the same)."""
    e = p = 1.0
    for a in alphas[:k]:
        p *= min(max(a, 0.0), 1.0)
        e += p
    return e


def chain_evidence(keys: list[str], accepted: int, rejected: bool) -> dict[str, list[float]]:
    """One chain's outcome per key (``keys``: each drafted position's, :func:`copy_keys`): the
    accepted positions are successes of their keys, the first rejected one a failure of its own."""
    out: dict[str, list[float]] = {}
    for key in keys[:accepted]:
        out.setdefault(key, [0.0, 0.0])[0] += 1.0
    if rejected and accepted < len(keys):
        out.setdefault(keys[accepted], [0.0, 0.0])[1] += 1.0
    return out


def key_chain(key: str) -> list[str]:
    """``llma.context@m8`` -> ``[llma.context@m8, llma.context, llma]``: the key, then its parents."""
    out = [key]
    if "@" in key:
        out.append(key.split("@")[0])
    if "." in out[-1]:
        out.append(out[-1].split(".")[0])
    return out


def add_evidence(counts: dict, cluster: str, temp: str, evidence: Mapping[str, Sequence[float]], decay: float) -> None:
    """One step's evidence, ``key -> (accepted, rejected)``, for each key and its parents (the
    fallbacks of keys not seen yet); each decays once, however many of the step's keys share it."""
    total: dict[str, list[float]] = {}
    for key, (accepted, rejected) in evidence.items():
        for k in key_chain(key):
            t = total.setdefault(k, [0.0, 0.0])
            t[0], t[1] = t[0] + accepted, t[1] + rejected
    for k, (accepted, rejected) in total.items():
        counts.setdefault((cluster, k, temp), Counts()).add(accepted, rejected, decay)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step emits with a chain of ``k`` drafts at per-token acceptance ``alpha``."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


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


REALIZED_DECAY = 0.98
"""Per-step decay of a method's realized-speed ratio at one load (about 50 steps of memory)."""

REALIZED_PRIOR_STEPS = 8.0
"""Pseudo-steps at ratio 1 in each realized-speed ratio: the model is trusted until the
steps measured at that load outweigh it."""

REALIZED_CLIP = 4.0
"""One step's ratio is clipped to [1/4, 4] (a preempted thread must not decide the next 50 steps)."""


ESTIMATORS = ("geometric", "sum", "mean")
"""The realized-speed check's estimators (:class:`SpeedCheck`)."""


class SpeedCheck:
    """How fast a method's steps really were at one load against what the policy's model said,
    as a factor shrunk towards 1 by :data:`REALIZED_PRIOR_STEPS`. Three estimators of it, over
    decayed per-step ratios ``realized / modelled`` tokens per second, each clipped to
    [1/:data:`REALIZED_CLIP`, :data:`REALIZED_CLIP`]:

    - ``geometric`` (the default until 2026-12-03): their geometric mean. It reads below 1 for a
      method whose steps vary (a copy emits 1 or 5 tokens where 3 are expected: 0.75), which
      holds a copy back.
    - ``sum``: the ratio of sums, the tokens emitted over the tokens the model's speed promised
      in the time the steps took. Unbiased, but weighted by time: at load 8 a few long waits in
      the batcher decided it (issue 60's A/B, docs/auto.md).
    - ``mean`` (the default): their arithmetic mean, each step one vote. No spread penalty (1/3
      and 5/3 average to 1), and a long wait is one step's low ratio, not a weight of its length.
      Its A/B against ``geometric`` (``benchmarks/out/adaptive_estimator.json``) ran 0.988 /
      1.044 / 1.034 of the time at concurrency 1 / 4 / 8.

    The model (acceptance counts, cost fits) misses what it does not name: a draft's forwards
    contending with the other requests' threads, the batch waiting for its slowest row, a chain
    whose acceptance is not geometric. The check learns, per load level, how far the model is
    off for each method, and the policy scales that method's estimate by :attr:`factor`: so it
    learns which method pays at each load."""

    def __init__(
        self,
        *,
        decay: float = REALIZED_DECAY,
        prior_steps: float = REALIZED_PRIOR_STEPS,
        half_life_s: float = 600.0,
        estimator: str = "mean",
    ):
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, not {estimator!r}")
        self.decay, self.prior_steps, self.half_life_s = decay, prior_steps, half_life_s
        self.estimator = estimator
        self.weight = self.num = self.den = self.log_sum = self.ratio_sum = 0.0
        self.n_obs = 0
        self.updated = time.time()

    def _fade(self, now: float) -> float:
        """Evidence loses half its weight per ``half_life_s`` without news: a method the check
        turned off at a load is tried again there once its verdict has faded."""
        return 0.5 ** (max(0.0, now - self.updated) / self.half_life_s)

    def observe(self, ratio: float, promised: float = 1.0) -> None:
        """One step: its ``ratio`` of realized to modelled speed, and ``promised``, the tokens the
        model's speed gives in the time the step took (its weight in the ``sum`` estimator)."""
        if not (math.isfinite(ratio) and ratio > 0 and math.isfinite(promised) and promised > 0):
            return
        now = time.time()
        d = self.decay * self._fade(now)
        r = min(max(ratio, 1.0 / REALIZED_CLIP), REALIZED_CLIP)
        self.weight = d * self.weight + 1.0
        self.num, self.den = d * self.num + r * promised, d * self.den + promised
        self.log_sum = d * self.log_sum + math.log(r)
        self.ratio_sum = d * self.ratio_sum + r
        self.n_obs, self.updated = self.n_obs + 1, now

    @property
    def factor(self) -> float:
        if self.den <= 0:
            return 1.0
        w = self.weight * self._fade(time.time())  # shrunk towards 1 in log space, as steps accrue
        if self.estimator == "geometric":
            log_factor = self.log_sum / self.weight
        elif self.estimator == "mean":
            log_factor = math.log(max(self.ratio_sum / self.weight, 1e-9))
        else:
            log_factor = math.log(max(self.num / self.den, 1e-9))
        return math.exp(log_factor * w / (w + self.prior_steps))

    def to_dict(self) -> dict:
        return {"factor": round(self.factor, 4), "observations": self.n_obs}


class CoRunCheck:
    """What a method running in one request costs the *other* requests in flight, per load level.

    A step's own check (:class:`SpeedCheck`) sees only that step: a draft model's step, timed on
    its own, delivers about what the model promised. What it misses is the wait it causes: the
    draft's forwards run on the batcher's thread and hold the pass its batch would have run (or
    the batch goes without it and pays a pass of its own), so the *other* rows' steps take
    longer. Every step's measured speed over its model is credited to each drafting method the
    other in-flight sessions were running when it was chosen (``with``) and to each one they
    were not (``without``); a method's :meth:`factor` at a load is the ratio of the two sides'
    :class:`SpeedCheck` factors, and the policy scales the tokens the others emit during a step of that
    method by it. Target-only beside a step is the reference (the pass costs the model fits
    describe it), so ``methods`` leaves it out and its factor is 1. Both sides start at 1
    (:data:`REALIZED_PRIOR_STEPS` pseudo-steps) and fade like the own check, so a method turned
    off at a load by what it cost the others is tried again there."""

    def __init__(self, estimator: str = "mean") -> None:
        self.estimator = estimator
        self.with_: dict[tuple[str, int], SpeedCheck] = {}
        self.without: dict[tuple[str, int], SpeedCheck] = {}

    def observe(self, bucket: int, present: tuple[str, ...], methods, ratio: float, promised: float = 1.0) -> None:
        """One step at ``bucket`` whose co-running sessions ran ``present``; ``methods``: every
        option the policy knows (each gets one side)."""
        for m in methods:
            side = self.with_ if m in present else self.without
            side.setdefault((m, bucket), SpeedCheck(estimator=self.estimator)).observe(ratio, promised)

    def observe_step(
        self, own: dict, method: str, bucket: int, co: tuple[str, ...], methods, ratio, rows, promised: float = 1.0
    ) -> None:
        """One step's measured speed over its model (``ratio``; ``promised``: the tokens the model
        gives in the step's time): its own method's check in ``own`` sees it without what the
        co-running methods cost it, and (with other rows in the pass) this check sees it whole:
        its with/without split is the comparison."""
        check = own.setdefault((method, bucket), SpeedCheck(estimator=self.estimator))
        check.observe(ratio / math.prod(self.factor(m, bucket) for m in co), promised)
        if rows > 1:
            self.observe(bucket, co, methods, ratio, promised)

    def factor(self, method: str, bucket: int) -> float:
        w = self.with_.get((method, bucket))
        if w is None:
            return 1.0
        wo = self.without.get((method, bucket))
        ratio = w.factor / (wo.factor if wo is not None else 1.0)
        return min(max(ratio, 1.0 / REALIZED_CLIP), REALIZED_CLIP)

    def to_dict(self) -> dict:
        return {
            f"{m}@{LOAD_BUCKETS[b]}": {
                "factor": round(self.factor(m, b), 4),
                "with": self.with_[(m, b)].n_obs,
                "without": self.without[(m, b)].n_obs if (m, b) in self.without else 0,
            }
            for (m, b) in sorted(self.with_)
        }

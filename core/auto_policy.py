"""The ``auto`` policy: which drafting method and k to run each step, from measured speed.

Shared by serving (``specops.serving.proposers.auto`` asks it every step) and the trainer's
policy fit (``specops.trainer.policy_fit`` writes its priors): the acceptance estimates, the
cost fits, the decision, and the priors format (:data:`PRIORS_FORMAT`, :func:`check_priors`,
:func:`key_chain`). Pure Python; it names no method but ``target`` (no draft, always an
option): the candidates, their keys and cost priors come from serving's method catalogue.

Every step, the policy estimates each option's **tokens per second** and runs the fastest:

    speed(m, k) = (E_m(k) + (B - 1) * e) / (P_m(k) + V_B(n_m(k)))

- ``E_m(k) = 1 + a + a^2 + ... + a^k``: expected tokens one step emits when method ``m``
  drafts a chain of ``k`` (accepted drafts + the bonus), with ``a`` the per-token acceptance
  (OSD Eq. 2's numerator). ``a`` is a draw from a Beta posterior (Thompson sampling): the
  cluster's decayed counts for ``m``'s key at the request's temperature bucket (capped at
  :data:`PRIOR_TRIALS` trials, so the request's own evidence soon outweighs them) plus the
  request's own counts. A key may be specific (``llma.context@m8``: a copy from the context at
  match length 8-15); a key with no record borrows from its parents (:func:`key_chain`).
- ``P_m(k)``: the measured cost of the proposer call (``a + b * k`` ms, fitted online per
  method); ``V_B(n)``: the measured cost of a target pass verifying ``n`` tokens at ``B``
  requests in flight (``a_B + b_B * n`` ms, one decayed least-squares fit per load bucket).
  OSD's ``c`` is ``P(1) / V(1)``; here both are measured, and verifying is not free under load.
- ``(B - 1) * e``: the tokens the other in-flight requests emit per step (``e`` is the
  replica's running mean). With ``B`` requests sharing a pass, a longer draft slows all of
  them; the additive term makes extra draft tokens pay only when they raise the whole
  batch's throughput. At ``B = 1`` it is Eq. 2 with measured costs. Under load it lowers ``k``
  and turns speculation off once no draft pays (vLLM's disable-by-queue, from measured costs).
- ``target`` (no draft) is always an option: ``(1 + (B - 1) e) / V_B(1)``.
- Measured, per load level: each option's speed is scaled by its steps' realized speed over the
  model (``SpeedCheck``), and ``(B - 1) e`` by what the method costs the others' steps when it
  runs beside them (``CoRunCheck``: a draft's forwards hold the pass its batch would run).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from specops.core.auto_fits import (
    COST_DECAY,
    COST_PRIOR_WEIGHT,
    LOAD_BUCKETS,
    MATCH_BUCKETS,
    MAX_PRIOR_COUNT,
    MAX_PRIOR_MS,
    PRIORS_FORMAT,
    TEMP_BUCKETS,
    CoRunCheck,
    CostFit,
    Counts,
    SpeedCheck,
    add_evidence,
    chain_evidence,
    chain_tokens,
    check_priors,
    copy_key,
    expected_tokens,
    key_chain,
    load_bucket,
    temp_bucket,
)

__all__ = [
    "COST_DECAY",
    "LOAD_BUCKETS",
    "MATCH_BUCKETS",
    "COST_PRIOR_WEIGHT",
    "MAX_PRIOR_COUNT",
    "MAX_PRIOR_MS",
    "PRIORS_FORMAT",
    "TEMP_BUCKETS",
    "AutoPolicy",
    "Choice",
    "CostFit",
    "Counts",
    "SpeedCheck",
    "check_priors",
    "copy_key",
    "expected_tokens",
    "key_chain",
    "load_bucket",
    "temp_bucket",
]

TARGET = "target"
"""Target-only decoding: the option that drafts nothing, always available."""

PRIOR_TRIALS = 24.0
"""Most trials of a cluster's acceptance counts a request starts from (its own evidence adds)."""

DECAY = 0.995
"""Per-step decay of the cluster's acceptance counts (about 200 steps of memory): traffic
and drafts change, and a method that was bad once is retried as its counts fade."""

DEFAULT_PROPOSE_MS = (2.0, 4.0)
"""Cost prior (ms: ``a + b * k``) of a method's call when nothing better is known: a draft
model's, a forward per token (a method must then earn its place by measurement)."""

HALF_LIFE_S = 600.0
"""Per this many seconds without news a cluster's counts for a method lose half their weight:
it is explored again."""

CATCHUP_HORIZON = 4.0
"""Steps over which a draft's catch-up prefill (one forward of the ``gap`` tokens it missed while
other options ran) is priced; choices are remade every step, and a request's last steps take less."""


@dataclass
class Choice:
    """One step's decision."""

    method: str
    k: int
    speed: float
    """Estimated tokens per second that decided it."""
    key: str = ""
    """The acceptance counts it used (``llma.request@m4``: a copy from the request's references at
    match length 4-7)."""
    keys: tuple[str, ...] = ()
    """A copy's per-position keys (each drafted token's match length: ``copy_keys``); empty: one
    key, ``key``, for every position."""
    n_verify: int = 1
    """Tokens this request's pass verifies (1 + the drafts)."""
    expected: float = 1.0
    """Tokens the step is expected to emit (``E(k)`` at the drawn acceptance)."""
    n_others: float = 0.0
    """Tokens the other in-flight requests put in the same pass (their latest choices)."""
    widest_other: float = 0.0
    """The longest of them (a padded batch is that wide for every row)."""
    rows: int = 1
    """Requests sharing the pass (padded batches)."""
    catchup_ms: float = 0.0
    """The catch-up prefill priced into this choice (before spreading over the horizon)."""
    alternatives: dict[str, float] = field(default_factory=dict)
    """Each option's estimated tokens per second (its best k)."""
    others_emitted: float = 0.0
    """Tokens the other in-flight requests are expected to emit in the same step."""
    modelled: float = 0.0
    """The model's tokens per second for this option and k at the posterior's mean acceptance
    (not the Thompson draw, whose winners are biased up), before the realized-speed factor:
    what :meth:`AutoPolicy.record` holds the step's measured speed against."""
    bucket: int = 0
    """The load bucket the choice was made at (its realized-speed check's)."""
    co: tuple[str, ...] = ()
    """The methods the other in-flight ``auto`` sessions were running (the co-running check's)."""


class AutoPolicy:
    """Per replica: each cluster's acceptance counts and the replica's measured costs.

    Thread-safe (one lock, held for microseconds per step). ``load`` returns the requests in
    flight (the batcher's, in serving); by default the policy counts its own sessions.
    """

    def __init__(
        self,
        *,
        max_k: int = 8,
        draft_max_k: int = 8,
        verify_ms: tuple[float, float] = (20.0, 1.0),
        propose_ms: Mapping[str, tuple[float, float]] | None = None,
        candidates: tuple[str, ...] | None = None,
        seed: int | None = None,
        load: Callable[[], int] | None = None,
        decay: float = DECAY,
        prior_trials: float = PRIOR_TRIALS,
        explore: bool = True,
        padded_batches: bool = False,
        realized_check: bool = True,
        copy_shadows: bool = True,
        copy_chain: bool = False,
        realized_estimator: str = "mean",
    ) -> None:
        """``propose_ms``: method -> the calibration prior of its call's cost (ms: ``a + b * k``);
        a method may also :meth:`join` later. ``candidates``: the methods ``auto`` may run
        besides ``target`` (None: every method serving's catalogue lets join ``auto``).
        ``realized_check``: scale each option's estimate by its measured steps at the load
        (:attr:`realized`); off only where a test pins the costs. ``copy_shadows``: count the copies
        a step declined against the tokens then emitted (``specops.serving.proposers.auto_shadow``).
        ``copy_chain``: price a copy's token ``i`` at the match length it would then have (``keys``).
        ``realized_estimator``: the realized-speed check's estimator (:class:`SpeedCheck`):
        ``mean`` (default from 2026-12-03: its A/B against ``geometric`` ran 0.988 / 1.044 / 1.034
        of its time at concurrency 1 / 4 / 8), ``geometric`` or ``sum``. The copy chain and
        ``sum`` were slower under load in their A/B (docs/auto.md, Numbers)."""
        self.copy_shadows, self.copy_chain = copy_shadows, copy_chain
        self.max_k, self.draft_max_k = int(max_k), int(draft_max_k)  # any option's longest draft; a draft model's
        self.padded_batches = padded_batches
        """Passes are right-padded (serving's ``TargetBatcher``): a pass costs rows x its widest row.
        False: a pass's cost follows the tokens of all its rows."""
        self.candidates = None if candidates is None else tuple(candidates)
        self.decay, self.prior_trials, self.explore = decay, prior_trials, explore
        self._verify_prior = verify_ms
        self.verify: dict[int, CostFit] = {}
        self.propose: dict[str, CostFit] = {m: CostFit(a, b) for m, (a, b) in (propose_ms or {}).items()}
        """Proposer cost fits at one request in flight (ms: ``a + b * k``), per method."""
        self.kinds: dict[str, str] = {}
        """Method -> its cost kind (:meth:`join`), which a calibration may start over."""
        self.catchup: dict[str, CostFit] = {}
        """Per method that keeps a cache of the request (a draft model): the cost of feeding the
        ``gap`` tokens it missed while other options ran (ms: ``a + b * gap``), measured."""
        self._catchup_by_kind: dict[str, tuple[float, float]] = {}
        self._loaded: dict[str, tuple[int, tuple[float, float]]] = {}
        self._by_kind: dict[str, tuple[int, tuple[float, float]]] = {}
        """Cost priors of methods not joined yet, loaded per method, measured per kind (the newer wins)."""
        self._seq = 0
        self.propose_loaded: dict[tuple[str, int], CostFit] = {}
        """The same at higher loads (a draft's forwards share the cores with the other requests)."""
        self.counts: dict[tuple[str, str, str], Counts] = {}
        self.emitted_per_step = self.verified_per_step = 1.0
        """Running means over the replica's steps (for in-flight requests ``auto`` does not drive)."""
        self.active: dict[int, tuple[float, float]] = {}
        """In-flight ``auto`` sessions -> (tokens verified, tokens expected) of their latest choice."""
        self.running: dict[int, str] = {}
        """In-flight ``auto`` sessions -> the method of their latest choice."""
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self._load = load
        self.in_flight = 0
        self.decisions: dict[tuple[str, str], int] = {}
        """(cluster, method) -> steps chosen (the ``/metrics`` counter reads it)."""
        self.last: dict[str, Choice] = {}
        """cluster -> the latest decision (``/v1/policy``)."""
        self.realized_check = realized_check
        self.realized: dict[tuple[str, int], SpeedCheck] = {}
        """(method, load bucket) -> how its measured steps compare with the model at that load
        (:class:`~specops.core.auto_fits.SpeedCheck`); each option's estimate is scaled by it."""
        self.corun = CoRunCheck(estimator=realized_estimator)
        """What each method costs the other requests' steps at each load: the others' tokens in an
        option's estimate are scaled by it (:class:`~specops.core.auto_fits.CoRunCheck`)."""

    # ------------------------------------------------------------------ calibration and priors
    def join(self, method: str, prior_ms: tuple[float, float], *, kind: str = "") -> None:
        """``method`` is an option from now on. Its call's cost fit starts from the newer of a
        loaded prior of ``method`` (:meth:`load_priors`) and a calibration of its ``kind``
        (:meth:`calibrated`; e.g. every method that drafts with the draft model), else from
        ``prior_ms``. A method that already has a fit keeps it."""
        with self.lock:
            self.kinds[method] = kind
            if method not in self.propose:
                waiting = [w for w in (self._loaded.pop(method, None), self._by_kind.get(kind)) if w is not None]
                self.propose[method] = CostFit(*(max(waiting)[1] if waiting else prior_ms))

    def calibrated(
        self,
        verify_ms: tuple[float, float],
        kinds: Mapping[str, tuple[float, float]],
        catchup: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        """Start the cost fits over from measured costs (serving measures them at load): the
        verify fits from ``verify_ms``, the call of every method of a kind in ``kinds``
        (joined already, or joining later) from that kind's cost, and the catch-up prefill of
        every method of a kind in ``catchup`` (ms: ``a + b * gap``)."""
        with self.lock:
            for kind, (a, b) in (catchup or {}).items():
                self._catchup_by_kind[kind] = (a, b)
                for method in [m for m, k in self.kinds.items() if k == kind]:
                    self.catchup[method] = CostFit(a, b)
            self._verify_prior = verify_ms
            self.verify.clear()
            for kind, (a, b) in kinds.items():
                self._by_kind[kind] = (self._next(), (a, b))
                for method in [m for m, k in self.kinds.items() if k == kind]:
                    self.propose[method] = CostFit(a, b)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def priors(self) -> dict:
        """The acceptance counts and cost fits as a JSON-able artifact (``load_priors`` reads it)."""
        with self.lock:
            return {
                "format": PRIORS_FORMAT,
                "counts": [
                    {
                        "cluster": c,
                        "key": k,
                        "temperature": t,
                        "accepted": round(v.accepted, 3),
                        "rejected": round(v.rejected, 3),
                    }
                    for (c, k, t), v in sorted(self.counts.items())
                ],
                "verify": {str(LOAD_BUCKETS[b]): f.to_dict() for b, f in sorted(self.verify.items())},
                "propose": {m: f.to_dict() for m, f in self.propose.items()},
            }

    def load_priors(self, priors: dict) -> None:
        """Start from a priors artifact (``priors()``, or ``specops policy fit``'s output).

        The whole artifact is checked first (:func:`check_priors`): a bad one raises
        ``ValueError`` naming the field and changes nothing."""
        counts, verify, propose = check_priors(priors)
        with self.lock:
            for (cluster, key, temp), (accepted, rejected) in counts.items():
                c = Counts(accepted, rejected)
                scale = min(1.0, self.prior_trials / c.trials) if c.trials else 1.0
                self.counts[(cluster, key, temp)] = Counts(c.accepted * scale, c.rejected * scale)
            for edge, (a, b) in verify.items():
                bucket = load_bucket(edge)
                self.verify[bucket] = CostFit(a, b)
                if bucket == 0:
                    self._verify_prior = (a, b)
            for m, (a, b) in propose.items():
                if m in self.propose:
                    self.propose[m] = CostFit(a, b)
                else:  # a method that has not joined yet: its fit starts here when it does
                    self._loaded[m] = (self._next(), (a, b))

    def reseed(self, cluster: str, methods: tuple[str, ...] | list[str], alpha: float | None = None) -> None:
        """Another model now drafts for ``methods`` in ``cluster`` (a hot-swap): what the counts
        knew of them was the old model's. Their counts (every key under them, every temperature)
        are dropped, so the policy explores the new model again rather than keep avoiding it on
        the old one's record; with ``alpha`` (its per-token acceptance measured on the cluster's
        recent greedy traffic, e.g. the promotion gate's ``served`` score), the greedy counts
        start there, at ``prior_trials`` trials, and live steps take over from the first request."""
        with self.lock:
            for c, key, temp in list(self.counts):
                if c == cluster and key_chain(key)[-1] in methods:
                    del self.counts[(c, key, temp)]
            if alpha is not None and math.isfinite(alpha) and 0.0 <= alpha <= 1.0:
                for method in methods:
                    t = self.prior_trials
                    self.counts[(cluster, method, "greedy")] = Counts(alpha * t, (1.0 - alpha) * t)

    # ------------------------------------------------------------------ load
    def load(self) -> int:
        if self._load is not None:
            try:
                return max(1, int(self._load()))
            except Exception:  # a load probe must never fail a request
                return max(1, self.in_flight)
        return max(1, self.in_flight)

    def _verify_fit(self, bucket: int) -> CostFit:
        fit = self.verify.get(bucket)
        if fit is None:
            # an unseen load starts from the nearest lower bucket's fit (or the calibration)
            lower = [b for b in self.verify if b < bucket]
            base = self.verify[max(lower)] if lower else None
            fit = self.verify[bucket] = CostFit(base.a, base.b) if base else CostFit(*self._verify_prior)
        return fit

    def _propose_fit(self, method: str, bucket: int) -> CostFit:
        if method not in self.propose:  # an option that never joined: priced as a draft model until measured
            self.propose[method] = CostFit(*self._loaded.pop(method, (0, DEFAULT_PROPOSE_MS))[1])
        if bucket == 0:
            return self.propose[method]
        fit = self.propose_loaded.get((method, bucket))
        if fit is None:
            lower = [b for (m, b) in self.propose_loaded if m == method and b < bucket]
            base = self.propose_loaded[(method, max(lower))] if lower else self.propose[method]
            fit = self.propose_loaded[(method, bucket)] = CostFit(base.a, base.b)
        return fit

    # ------------------------------------------------------------------ the decision
    def posterior(self, cluster: str, key: str, temp: str, own: Counts | None) -> tuple[float, float]:
        """Beta parameters: the cluster's counts plus the request's. The cluster's part holds at
        most ``prior_trials`` trials, filled from the most specific key first (``llma.context@m8``),
        then its parents (``llma.context``, ``llma``) for what the specific one lacks."""
        a = r = 0.0
        room = self.prior_trials
        now = time.time()
        for k in key_chain(key):
            c = self.counts.get((cluster, k, temp))
            if c is None or not c.trials or room <= 1e-9:
                continue
            fade = 0.5 ** (max(0.0, now - c.updated) / HALF_LIFE_S)
            take = min(room, c.trials * fade)
            a, r = a + c.accepted / c.trials * take, r + c.rejected / c.trials * take
            room -= take
        if own is not None:
            a, r = a + own.accepted, r + own.rejected
        return a + 1.0, r + 1.0

    def _alpha(self, cluster: str, key: str, temp: str, own: Counts | None) -> tuple[float, float]:
        """(the acceptance the decision uses: a Thompson draw, or the mean without exploration;
        the posterior's mean), from one posterior."""
        a, b = self.posterior(cluster, key, temp, own)
        if not (math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0):
            # betavariate loops forever on NaN: evidence that is not finite counts as none
            # (the uniform prior's mean); load_priors refuses it, this guards the rest
            return 0.5, 0.5
        mean = a / (a + b)
        return (self.rng.betavariate(a, b) if self.explore else mean), mean

    def _others(self, session: int | None, load: int) -> tuple[float, float, float]:
        """(tokens the other in-flight requests verify per pass, the longest of them, tokens they
        emit per step): their latest choices for ``auto`` sessions, the replica's running means
        for the rest."""
        mine = [v for sid, v in self.active.items() if sid != session]
        unknown = max(0, load - 1 - len(mine))
        widest = max([n for n, _ in mine] + ([self.verified_per_step] if unknown else []), default=0.0)
        return (
            sum(n for n, _ in mine) + unknown * self.verified_per_step,
            widest,
            sum(e for _, e in mine) + unknown * self.emitted_per_step,
        )

    def pass_tokens(self, n_mine: float, n_others: float, widest_other: float, rows: int) -> float:
        """The cost regressor of a pass: its tokens, or with padded batches rows x widest row."""
        if self.padded_batches and rows > 1:
            return rows * max(n_mine, widest_other)
        return n_others + n_mine

    def _catchup_fit(self, method: str) -> CostFit:
        fit = self.catchup.get(method)
        if fit is None:  # its kind's calibration, else one call of the method plus a tenth per token
            kind = self._catchup_by_kind.get(self.kinds.get(method, ""))
            p = self.propose.get(method) or CostFit(*DEFAULT_PROPOSE_MS)
            fit = self.catchup[method] = CostFit(*(kind or (p.a + p.b, 0.1 * p.b)))
        return fit

    def _pass_shape(self, session: int | None, load: int, seen) -> tuple[float, float, float, int]:
        """(the others' tokens in this request's next pass, the widest of them, the tokens they
        emit per step, rows). With padded batches and the request's previous pass as the batcher
        ran it (``seen``: ``rows``, ``others``, ``widest_other``), that pass; otherwise inferred
        from the other sessions' latest choices (:meth:`_others`) at ``load`` rows."""
        n_o, wide, others = self._others(session, load)
        if self.padded_batches and seen is not None and getattr(seen, "rows", 0) >= 1:
            rows = int(seen.rows)
            per_other = others / max(load - 1, 1) if load > 1 else self.emitted_per_step
            return float(seen.others), float(seen.widest_other), per_other * (rows - 1), rows
        return n_o, wide, others, load

    def choose(
        self,
        cluster: str,
        temp: str,
        *,
        available: dict[str, dict],
        own: dict[str, Counts],
        k_cap: int,
        session: int | None = None,
        seen=None,
        remaining: int | None = None,
    ) -> Choice:
        """The fastest option this step. ``available``: method -> ``{"key": counts key, "max_k":
        longest draft it can give, "rows": rows per step, "catchup": tokens its cache must feed
        first}``; ``own``: the request's counts per key; ``session``: the asking session (its own
        previous choice is not one of the others'); ``seen``: the request's previous target pass
        as it ran (``specops.serving.engine.types.TargetPass``), which prices this one; ``remaining``:
        tokens the request may still emit (a catch-up is spread over at most the steps left)."""
        with self.lock:
            load = self.load()
            n_o, wide, others, rows_b = self._pass_shape(session, load, seen)
            bucket = load_bucket(rows_b)
            vfit = self._verify_fit(bucket)
            x1 = self.pass_tokens(1, n_o, wide, rows_b)
            co = tuple(sorted({m for sid, m in self.running.items() if sid != session}))
            shared = {"n_others": n_o, "widest_other": wide, "rows": rows_b, "others_emitted": others, "bucket": bucket}
            shared["co"] = co
            raw = (1.0 + others) / max(vfit.predict(x1), 1e-6) * 1000.0  # target beside others: the reference
            best = Choice(TARGET, 0, raw * self._factor(TARGET, bucket), n_verify=1, modelled=raw, **shared)
            alts = {TARGET: round(best.speed, 2)}
            for method, info in available.items():
                key, keys = info["key"], list(info.get("keys") or [info["key"]])
                drawn = {kk: self._alpha(cluster, kk, temp, own.get(kk)) for kk in dict.fromkeys(keys)}
                alphas, means = [drawn[kk][0] for kk in keys], [drawn[kk][1] for kk in keys]
                if len(keys) == 1:  # one key for every position: OSD's geometric chain
                    alphas, means = alphas * k_cap, means * k_cap
                factor, co_factor = self._factor(method, bucket), self._co(method, bucket)
                pfit = self._propose_fit(method, load_bucket(load))
                rows = max(1, int(info.get("rows", 1)))
                sunk = info.get("sunk", False)  # a copy lookup already ran this step: its cost is paid
                gap = int(info.get("catchup", 0) or 0)
                catchup = self._catchup_fit(method).predict(gap) if gap > 0 else 0.0
                m_best: Choice | None = None
                e = reach = 1.0
                for k in range(1, min(int(info["max_k"]), k_cap) + 1):
                    n = 1 + rows * k
                    reach *= min(max(alphas[k - 1], 0.0), 1.0)  # the chain's tokens, one more per k
                    e += reach
                    steps = CATCHUP_HORIZON if remaining is None else min(CATCHUP_HORIZON, max(1.0, remaining / e))
                    ms = (0.0 if sunk else pfit.predict(k)) + vfit.predict(self.pass_tokens(n, n_o, wide, rows_b))
                    ms += catchup / steps
                    speed = (e + others * co_factor) / max(ms, 1e-6) * 1000.0 * factor
                    if m_best is None or speed > m_best.speed:
                        modelled = (chain_tokens(means, k) + others) / max(ms, 1e-6) * 1000.0
                        m_best = Choice(
                            method,
                            k,
                            speed,
                            key=key,
                            keys=tuple(keys[:k]) if len(keys) > 1 else (),
                            n_verify=n,
                            expected=e,
                            catchup_ms=catchup,
                            modelled=modelled,
                            **shared,
                        )
                if m_best is not None:
                    alts[method] = round(m_best.speed, 2)
                    if m_best.speed > best.speed:
                        best = m_best
            best.alternatives = alts
            if session is not None:
                self.active[session] = (float(best.n_verify), best.expected)
                self.running[session] = best.method
            self.last[cluster] = best
            return best

    def _factor(self, method: str, bucket: int) -> float:
        check = self.realized.get((method, bucket))
        return 1.0 if check is None else check.factor

    def _co(self, method: str, bucket: int) -> float:
        return self.corun.factor(method, bucket) if self.realized_check else 1.0

    def decided(self, cluster: str, choice: Choice) -> None:
        """Count the step's final choice (after any in-step fallback) for ``/v1/policy`` and the metrics."""
        with self.lock:
            self.decisions[(cluster, choice.method)] = self.decisions.get((cluster, choice.method), 0) + 1

    def record(
        self,
        cluster: str,
        temp: str,
        choice: Choice,
        *,
        accepted: int,
        drafted: int,
        emitted: int,
        n_verified: int,
        verify_ms: float | None,
        propose_ms: float | None,
        target_pass=None,
        catchup: int = 0,
        step_ms: float | None = None,
    ) -> None:
        """One step's outcome: the acceptance counts of what was tried and the costs measured.

        ``target_pass``: the pass as the batcher ran it (``rows``, ``width``, ``mine``,
        ``others``): the verify cost is fitted on its real shape, not on the one the choice
        assumed. ``catchup``: tokens the method's cache fed before drafting (``propose_ms`` then
        holds that prefill too: the part over the call's fitted cost goes to its catch-up fit).
        ``step_ms``: the step's wall time, proposing to verdict: its tokens per second against the
        choice's ``modelled`` feed the method's realized-speed check at the choice's load."""
        with self.lock:
            load = self.load()
            if verify_ms is not None:
                if target_pass is not None and self.padded_batches:
                    rows = int(target_pass.rows)
                    x = self.pass_tokens(
                        target_pass.mine, target_pass.others, target_pass.widest_other, rows
                    )  # rows x width, as it ran
                elif target_pass is not None:
                    rows, x = load, self.pass_tokens(target_pass.mine, choice.n_others, choice.widest_other, load)
                else:  # the pass verified our tokens and the others' (their latest choices)
                    rows, x = (
                        choice.rows,
                        self.pass_tokens(n_verified, choice.n_others, choice.widest_other, choice.rows),
                    )
                self._verify_fit(load_bucket(rows)).observe(x, verify_ms)
            if propose_ms is not None and choice.method in self.propose:
                pfit = self._propose_fit(choice.method, load_bucket(load))
                if catchup > 0:
                    extra = max(0.0, propose_ms - pfit.predict(max(choice.k, 1)))
                    self._catchup_fit(choice.method).observe(catchup, extra)
                else:
                    pfit.observe(max(choice.k, 1), propose_ms)
            if self.realized_check and step_ms is not None and step_ms > 0 and choice.modelled > 0:
                promised = choice.modelled * step_ms / 1000.0  # the model's tokens in the step's time
                ratio = (emitted + choice.others_emitted) / promised
                methods = tuple(self.propose)  # target-only beside it is the reference (factor 1)
                self.corun.observe_step(
                    self.realized, choice.method, choice.bucket, choice.co, methods, ratio, choice.rows, promised
                )
            self.emitted_per_step = 0.98 * self.emitted_per_step + 0.02 * emitted
            self.verified_per_step = 0.98 * self.verified_per_step + 0.02 * n_verified
            if drafted > 0:  # a copy's positions each under its match length (``keys``), else one key
                keys = list(choice.keys) or [choice.key] * drafted
                add_evidence(self.counts, cluster, temp, chain_evidence(keys, accepted, accepted < drafted), self.decay)

    # ------------------------------------------------------------------ observability
    def snapshot(self, cluster: str | None = None, *, timeout_s: float = -1) -> dict:
        """The policy's state (``/v1/policy``): :func:`specops.core.auto_view.snapshot`."""
        from specops.core.auto_view import snapshot

        return snapshot(self, cluster, timeout_s=timeout_s)

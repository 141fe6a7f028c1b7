"""OS³, RaLMSpec's optimal speculation stride scheduler (§4 and App. A.2 of the paper).

Between two verifications a loop makes ``s`` speculation steps (each: a retrieval from the
request's local cache, then generation). With ``γ`` the chance that one speculated retrieval
equals the knowledge base's, ``a`` the latency of a speculation step and ``b`` that of a
verification, the expected number of retrievals verified per unit time is

- synchronous:  ``(1 - γ^s) / ((1 - γ)(s·a + b))``
- asynchronous: ``(1 - γ^s) / ((1 - γ)[γ^s((s-1)a + max(a, b)) + (1 - γ^s)(s·a + b)])``

and OS³ picks the ``s`` that maximises it. ``γ`` is the maximum-likelihood estimate over
the last ``w = 5`` verifications, ``ΣM / (ΣM + Σ1[M < s])`` (``M`` the speculations a
verification confirmed), capped at ``γmax = 0.6``. ``a`` and ``b`` are measured live: ``a``
is the mean of the recent speculation steps; ``b`` is a line ``b0 + b1·s`` fitted to the
recent verifications' (batch size, latency), since an approximate dense retriever's batched
latency grows with the batch (App. A.1) while exact and sparse ones stay flat; with one
batch size seen so far it is their mean. The stride starts at 1 (the paper's warm-up).

**Turning speculation off (our addition).** The paper's objective leaves out what a
mismatch costs afterwards: the mismatched interval is generated again with the true
passage (one more step of ``a``). When retrieval is cheap next to generation (``b ≪ a``, as
on a CPU with a fast exact index) every stride then loses to plain RaLMSeq, and the paper's
OS³, which only ranks strides, speculates anyway (0.70x RaLMSeq measured). So the
scheduler also compares the best stride's rate *with* that rework,
``(1-γ^s)/(1-γ) / (latency(s) + (1-γ^s)·a)``, against RaLMSeq's ``1/(a + b(1))``, and
returns stride 0 (retrieve from the KB, do not speculate) when RaLMSeq is faster. Here ``γ``
is the uncapped estimate: the cap guards the choice of stride against over-optimism, and
would turn speculation off wherever ``b < 0.67·a``. While off, the loop still looks the
query up in its cache and scores the guess against the KB's answer ("shadow" speculation,
no generation), so ``γ`` stays current and speculation comes back when it pays. The same
shadow rounds replace the paper's warm-up at s = 1: a request starts unspeculated and
speculates once the measured γ, a and b say it pays, so learning them costs no rework
(a wrong warm-up guess cost up to two intervals of 16: 0.83-0.85x measured).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


def objective(s: int, gamma: float, a: float, b: float, *, asynchronous: bool) -> float:
    """Expected verified retrievals per second at stride ``s`` (the paper's two forms)."""
    assert s >= 1 and 0.0 <= gamma < 1.0 and a >= 0.0 and b >= 0.0, (s, gamma, a, b)
    verified = (1.0 - gamma**s) / (1.0 - gamma)
    if asynchronous:
        hit = gamma**s
        latency = hit * ((s - 1) * a + max(a, b)) + (1.0 - hit) * (s * a + b)
    else:
        latency = s * a + b
    return verified / max(latency, 1e-12)


def rate_with_rework(s: int, gamma: float, a: float, b: float, *, asynchronous: bool) -> float:
    """:func:`objective` with the regeneration a mismatch costs (``a`` with probability ``1-γ^s``)."""
    verified = (1.0 - gamma**s) / (1.0 - gamma)
    return verified / max(verified / objective(s, gamma, a, b, asynchronous=asynchronous) + (1.0 - gamma**s) * a, 1e-12)


def speculation_pays(
    gamma: float, a: float, bs: list[float], *, asynchronous: bool, margin: float = 0.0, rework: bool = True
) -> bool:
    """Whether some stride's rate with rework beats RaLMSeq's ``1 / (a + b(1))`` by more than ``margin``.
    ``rework=False`` ranks by :func:`objective` alone: a loop whose mismatch emits the true token
    where it rolls back (kNN-LM, §5.3) spends nothing after a mismatch beyond the stride's own steps."""
    sequential = 1.0 / max(a + bs[0], 1e-12)
    rate = rate_with_rework if rework else objective
    return max(rate(s, gamma, a, bs[s - 1], asynchronous=asynchronous) for s in range(1, len(bs) + 1)) > sequential * (
        1.0 + margin
    )


def best_stride(gamma: float, a: float, b: float | list[float], *, asynchronous: bool, s_max: int = 16) -> int:
    """The stride in 1..s_max maximising :func:`objective` (the smallest among equals).

    ``b`` is one latency for every stride, or a list of ``s_max`` latencies (``b[s-1]`` for a
    batch of ``s`` queries)."""
    bs = [float(b)] * s_max if np.isscalar(b) else [float(x) for x in b]
    assert len(bs) >= s_max, (len(bs), s_max)
    scores = [objective(s, gamma, a, bs[s - 1], asynchronous=asynchronous) for s in range(1, s_max + 1)]
    return 1 + int(np.argmax(scores))


@dataclass
class OS3Config:
    window: int = 5
    """Verifications ``γ`` is estimated over (the paper's w)."""
    gamma_max: float = 0.6
    """Cap on the estimate (the paper's γmax): no over-optimism, no division by zero."""
    s_max: int = 16
    """Largest stride considered."""
    initial: int = 1
    """Stride before anything is measured when ``allow_off`` is False (the paper starts at 1);
    with ``allow_off`` the first rounds are unspeculated and measure instead."""
    timing_window: int = 16
    """Recent speculation steps and verifications ``a`` and ``b`` are estimated over."""
    allow_off: bool = True
    """Return stride 0 (no speculation this round) when RaLMSeq would be faster."""
    gamma_off_max: float = 0.99
    """Cap on the uncapped estimate the off decision uses (keeps ``1-γ`` above zero)."""
    off_window: int = 20
    """Verifications the off decision's γ is estimated over (Laplace-smoothed): whether to
    speculate at all needs a steadier estimate than the stride. Over the stride's 5, a true γ
    of 0.85 reads 1.0 four times in ten, speculation flaps on, and each miss costs a rework."""
    pay_margin: float = 0.05
    """Speculate only when the model predicts at least this much over RaLMSeq: what it leaves
    out (handing verification to a worker thread that contends for the interpreter lock,
    scoring the cache, rollback bookkeeping) costs a few percent, so a predicted break-even
    is a measured loss."""
    rework: bool = True
    """Whether a mismatch costs a step of rework (RaLMSpec's interval is generated again; kNN-LM's
    loop emits the true token where it rolls back, so it does not): see :func:`speculation_pays`."""


PAPER_OS3 = OS3Config(allow_off=False)
"""The paper's OS³: γ capped at 0.6, always speculates."""
RALM_OS3 = OS3Config(gamma_max=0.9)
"""Iterative RaLM's default: γ capped at 0.9, not the paper's 0.6 (a departure, as for
kNN-LM). With the local cache's prefetch the cache's guess equals the KB's 85-95 % of the time
here, and the cap decides which stride the estimate asks for. By the paper's own objective
(:func:`objective`) at a true γ of 0.9, the stride the 0.6 cap picks verifies 4-19 % fewer
retrievals per second than the best one wherever ``0.5a ≤ b ≤ 2a`` synchronously (8 % at
``b = a``, 19 % at ``b = 2a``; stride 1-2 where 3-6 is best), and 4-16 % fewer asynchronously
at ``1.5a ≤ b ≤ 2a``; the 0.9 cap's stride
is within 2.5 % of the best for a true γ of 0.85 or 0.9 there. (It is not that 0.6 never
batches: synchronous OS³ at 0.6 takes stride 2 from ``b ≈ 0.67a``; asynchronous keeps stride 1
up to ``b ≈ 1.67a``.) ``tests/serving/ralm/test_os3_caps.py`` computes these. The off rule
still uses the uncapped estimate, and a mismatch still rolls back; the cap only sets the
stride."""


class StrideScheduler:
    """Live estimates of ``γ``, ``a``, ``b`` and the stride they call for.

    ``fixed`` > 0 turns the scheduler off: :meth:`stride` is always ``fixed`` (the paper's
    s = 3 without OS³), while the estimates are still kept for reporting."""

    def __init__(self, cfg: OS3Config | None = None, *, asynchronous: bool = False, fixed: int = 0) -> None:
        self.cfg = cfg or OS3Config()
        self.asynchronous = asynchronous
        self.fixed = fixed
        self._verifications: deque[tuple[int, int]] = deque(maxlen=self.cfg.window)  # (stride, matched)
        self._history: deque[tuple[int, int]] = deque(maxlen=max(self.cfg.window, self.cfg.off_window))
        self._spec_s: deque[float] = deque(maxlen=self.cfg.timing_window)
        self._verify: deque[tuple[int, float]] = deque(maxlen=self.cfg.timing_window)  # (batch, seconds)
        self.chosen: list[int] = []
        """Every stride handed out, in order (the response reports them)."""

    # ------------------------------------------------------------------ observations
    def observe_speculation(self, seconds: float) -> None:
        """One speculation step (cache retrieval + generation) took ``seconds``."""
        self._spec_s.append(float(seconds))

    def observe_generation(self, seconds: float) -> None:
        """An unspeculated interval's generation took ``seconds`` (a speculation step's cost
        less a cache lookup: what ``a`` is while speculation is off)."""
        self._spec_s.append(float(seconds))

    def observe_verification(self, stride: int, matched: int, seconds: float) -> None:
        """A verification of ``stride`` speculations confirmed ``matched`` of them (the
        leading run) and its batched retrieval took ``seconds``."""
        assert 0 <= matched <= stride, (matched, stride)
        self._verifications.append((int(stride), int(matched)))
        self._history.append((int(stride), int(matched)))
        self._verify.append((int(stride), float(seconds)))

    # ------------------------------------------------------------------ estimates
    @property
    def gamma(self) -> float:
        if not self._verifications:
            return 0.0
        matched = sum(m for _, m in self._verifications)
        misses = sum(1 for s, m in self._verifications if m < s)
        if matched + misses == 0:
            return 0.0
        return min(self.cfg.gamma_max, matched / (matched + misses))

    @property
    def gamma_uncapped(self) -> float:
        """The off decision's estimate: over the last ``off_window`` verifications, Laplace-smoothed
        (``(ΣM + 1) / (ΣM + misses + 2)``), without the γmax cap."""
        matched = sum(m for _, m in self._history)
        misses = sum(1 for s, m in self._history if m < s)
        return min(self.cfg.gamma_off_max, (matched + 1) / (matched + misses + 2)) if matched + misses else 0.0

    @property
    def a(self) -> float:
        return float(np.mean(self._spec_s)) if self._spec_s else 0.0

    def b(self, s: int) -> float:
        """Estimated latency of a verification batch of ``s`` queries."""
        intercept, slope = self._b_line()
        return max(0.0, intercept + slope * s)

    def _b_line(self) -> tuple[float, float]:
        """(intercept, slope) of the line through the recent verifications (slope ≥ 0)."""
        if not self._verify:
            return 0.0, 0.0
        xs = np.array([n for n, _ in self._verify], dtype=np.float64)
        ys = np.array([t for _, t in self._verify], dtype=np.float64)
        if np.ptp(xs) == 0:
            return float(ys.mean()), 0.0
        slope = max(0.0, float(np.polyfit(xs, ys, 1)[0]))  # a batch never gets cheaper with more queries
        return float(ys.mean() - slope * xs.mean()), slope

    def _bs(self) -> list[float]:
        """``b(1..s_max)`` from one fit (the stride and off decisions run every round)."""
        intercept, slope = self._b_line()
        return [max(0.0, intercept + slope * n) for n in range(1, self.cfg.s_max + 1)]

    def stride(self, remaining: int | None = None) -> int:
        """The stride for the next round (at most ``remaining`` speculation steps); 0 means do
        not speculate this round (``allow_off``: RaLMSeq is faster with the costs measured)."""
        if self.fixed:
            s = self.fixed
        elif not self._verifications or not self._spec_s:
            s = 0 if self.cfg.allow_off else self.cfg.initial  # off: measure γ, a, b unspeculated first
        else:
            bs = self._bs()
            s = best_stride(self.gamma, self.a, bs, asynchronous=self.asynchronous, s_max=self.cfg.s_max)
            if self.cfg.allow_off and not self._pays(self.gamma_uncapped, bs):
                s = 0
        if remaining is not None and s:
            s = max(1, min(s, remaining))
        self.chosen.append(s)
        return s

    def _pays(self, gamma: float, bs: list[float]) -> bool:
        return speculation_pays(
            gamma, self.a, bs, asynchronous=self.asynchronous, margin=self.cfg.pay_margin, rework=self.cfg.rework
        )

    def could_pay(self) -> bool:
        """Whether speculating could beat RaLMSeq at the best γ the off rule admits
        (``gamma_off_max``) with the ``a`` and ``b`` measured so far: when even that loses,
        a search is too cheap next to a step for any guess to pay, and a loop may stop
        scoring guesses (and keeping the cache that makes them) until the costs change.
        True until ``a`` and ``b`` have been measured."""
        if self.fixed or not self.cfg.allow_off or not self._spec_s or not self._verify:
            return True
        return self._pays(self.cfg.gamma_off_max, self._bs())

    def observe_retrieval(self, batch: int, seconds: float) -> None:
        """A knowledge-base search of ``batch`` queries that verified nothing took ``seconds``
        (an unspeculated round with no guess scored): ``b`` only."""
        self._verify.append((int(batch), float(seconds)))

    def snapshot(self) -> dict:
        return {
            "gamma": round(self.gamma, 4),
            "a_s": round(self.a, 6),
            "b1_s": round(self.b(1), 6),
            "strides": list(self.chosen),
            "off_rounds": self.chosen.count(0),
        }

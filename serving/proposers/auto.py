"""``speculation.method = "auto"``: one request's proposer, running per step the option the
policy (:class:`specops.core.auto_policy.AutoPolicy`) estimates fastest.

The candidates are the catalogue's methods with ``joins_auto`` (``specops.serving.proposers.catalogue``),
each built by its own ``build`` when the request and the replica have what it needs, plus
``target`` (no draft), always. How ``auto`` runs a candidate follows from its spec, never from
its name:

- a method that **copies** (``copies_references``: LLMA, from references, past sessions and the
  context) is asked first every step (it costs microseconds); where it copied from and how long
  the match was (its proposer's ``last_source`` and ``last_match``) pick its acceptance counts
  (:func:`specops.core.auto_fits.copy_key`), so the policy copies while a long match holds and
  drafts with a model otherwise; a copy that another option ran instead of is followed over the
  tokens then emitted, which say what it would have been accepted (``auto_shadow``), so its
  estimate learns from the steps it lost too;
- any other method is asked only when chosen, and one that drafts nothing falls back to the
  next best option in the same step; a method that needs a **draft model** drafts at most
  ``policy.draft_max_k`` tokens; one keyed on the **target's hidden state** is an option only
  once a verdict has brought one.

Each candidate's call-cost prior follows from its role (:data:`KIND_PRIORS`); the policy then
measures it, and :func:`calibrate` measures the draft model's step at load.

Lossless by construction: the policy only chooses what to *propose*; every step is verified
by the same verifier as a fixed method, so greedy output equals target-only decoding and
sampling keeps the target's distribution (tested).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from specops.core.auto_fits import add_evidence, chain_evidence, copy_keys
from specops.core.auto_policy import TARGET, AutoPolicy, Choice, Counts, copy_key, temp_bucket
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals, Verdict
from specops.serving.proposers.auto_shadow import CopyShadows


class MethodSpec(Protocol):
    """What ``auto`` reads of a candidate's ``specops.serving.proposers.catalogue.MethodSpec`` (the
    catalogue builds this proposer, so this module does not import it back)."""

    needs: frozenset[str]
    copies_references: bool


IN_SYNC = 2
"""A draft cache this many committed tokens behind is in step (the last step's bonus and its
last accepted token); further behind, its next call first feeds the gap: a catch-up prefill."""

MODEL = "draft_model"
"""The cost kind of methods that draft with the draft model (a calibration measures its step)."""

KIND_PRIORS = {MODEL: (2.0, 4.0), "copy": (0.05, 0.0), "search": (1.0, 0.0)}
"""Cost prior (ms: ``a + b * k``) of a call per kind: a model forward per token; an index
lookup (microseconds); a datastore search or anything else (about a millisecond, whatever k)."""


@dataclass(frozen=True)
class Role:
    """How ``auto`` runs one candidate, from its catalogue spec."""

    copies: bool
    """Asked first every step; its acceptance keyed by source and match length (``copies_references``)."""
    model: bool
    """Drafts with the draft model: at most ``policy.draft_max_k`` tokens (needs ``draft_model``)."""
    hidden: bool
    """Keyed on the target's hidden state: an option once a verdict brought one (needs ``target_hidden``)."""

    @classmethod
    def of(cls, spec: MethodSpec) -> Role:
        return cls(
            copies=spec.copies_references, model="draft_model" in spec.needs, hidden="target_hidden" in spec.needs
        )

    @property
    def kind(self) -> str:
        """Its call's cost kind (:data:`KIND_PRIORS`)."""
        return MODEL if self.model else ("copy" if self.copies else "search")


def calibrate(policy: AutoPolicy, pair, context_ids: list[int] | None = None, reps: int = 5) -> dict:
    """Measure the target's verify cost at 1 and 9 tokens and the draft's one-token step
    (``specops.core.cost.step_ms``), as the policy's cost priors (the draft's for every candidate that
    drafts with the draft model). About a second on CPU.

    Each is the fastest of ``reps``: a replica calibrates while it starts, often beside other
    processes starting (a benchmark's vLLM servers made a 1-token pass take 1.4 s instead of
    35 ms, and ``auto`` then priced speculation out at one request). The live fits take the
    real load in from there."""
    from specops.core.cost import step_ms

    ctx = context_ids or list(range(1, 65))
    out = {
        "verify_ms_1": step_ms(pair.target, ctx, 1, reps=reps, warmup=2, best=True),
        "verify_ms_9": step_ms(pair.target, ctx, 9, reps=reps, warmup=2, best=True),
    }
    if pair.draft is not None:
        out["draft_ms_1"] = step_ms(pair.draft, ctx, 1, reps=reps, warmup=2, best=True)
        # a catch-up feeds `gap` tokens in one forward that keeps the last row of logits only (the
        # draft proposer's): measured so, since with a chat model's vocabulary the head's rows
        # dominate a small draft's forward and 17 of them priced every catch-up several times over
        out["draft_prefill_ms_17"] = step_ms(pair.draft, ctx, 17, reps=reps, warmup=2, best=True, keep=1)
    policy.calibrated(*calibration(out))
    return out


def calibration(measured: Mapping[str, float]) -> tuple[tuple[float, float], dict, dict]:
    """The arguments of ``AutoPolicy.calibrated`` from :func:`calibrate`'s measurements (so a
    second policy can start from the same ones): the verify line through 1 and 9 tokens; a draft
    call's cost per kind (little fixed cost, one forward per token); the draft's catch-up, its
    17-token prefill over a one-token call, per token."""
    v1, v9 = measured["verify_ms_1"], measured["verify_ms_9"]
    b = max((v9 - v1) / 8.0, 0.0)
    kinds, catchup = {}, {}
    if "draft_ms_1" in measured:
        d1, d17 = measured["draft_ms_1"], measured["draft_prefill_ms_17"]
        kinds[MODEL] = (d1 * 0.1, d1 * 0.9)
        catchup[MODEL] = (max(d1 * 0.1, 1e-3), max((d17 - d1) / 16.0, 0.0))
    return (max(v1 - b, 1e-3), b), kinds, catchup


class AutoProposer(Proposer):
    """One request under ``auto``: asks the policy each step and runs the chosen sub-proposer.

    Every sub-proposer sees every step (``observe``, ``rollback``): the draft model's cache
    catches up with the tokens it did not draft on its next call, DReSD keeps the latest
    hidden state, LLMA's context index grows. Which one drafted is this class's business only.
    """

    name = "auto"

    def __init__(
        self,
        policy: AutoPolicy,
        subs: Mapping[str, Proposer],
        specs: Mapping[str, MethodSpec],
        *,
        cluster: str = "default",
    ) -> None:
        """``subs``: method name -> its proposer; ``specs``: method name -> its catalogue entry
        (which says how ``auto`` runs it: :class:`Role`)."""
        self.policy, self.subs, self.cluster = policy, dict(subs), cluster
        self.roles = {m: Role.of(specs[m]) for m in self.subs}
        for m, role in self.roles.items():
            policy.join(m, KIND_PRIORS[role.kind], kind=role.kind)
        self.own: dict[str, Counts] = {}
        self.steps: dict[str, int] = {}
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        """Steps per method that rejected a drafted token (OSD's per-token α, ``specops_rejected_steps_total``)."""
        self.k_sum: dict[str, int] = {}
        self.last: Choice | None = None
        self._pending: tuple[Choice, float, float | None, str, int, float] | None = None
        self._seen = None
        """The previous step's target pass as the batcher ran it (its rows and width price the next)."""
        self._started = False
        self._temp = "greedy"
        self._observed = False
        self._hidden = False
        """A verdict brought the target's hidden state since the last start or rollback."""
        self.shadows = CopyShadows() if policy.copy_shadows else None
        """The copies this request declined, followed over the tokens it then emitted."""

    @property
    def needs_hidden(self) -> bool:
        """A candidate keys on the target's hidden state: the verifier must return it every step."""
        return any(r.hidden for r in self.roles.values())

    @property
    def num_forwards(self) -> int:  # type: ignore[override]
        return sum(p.num_forwards for p in self.subs.values())

    def start(self, state: DecodeState) -> None:
        for p in self.subs.values():
            p.start(state)
        self._temp = temp_bucket(state.params.temperature)
        self._observed = False
        self._seen = None
        self._hidden = False
        if self.shadows is not None:
            self.shadows.clear()
        if not self._started:
            self._started = True
            with self.policy.lock:
                self.policy.in_flight += 1

    def _options(self, state: DecodeState, k: int) -> tuple[dict[str, dict], dict[str, Proposals]]:
        """This step's options for the policy (method -> its counts key, longest draft, rows per
        step), the copies first (their lookups run now: ``sunk``), and the copies made."""
        available: dict[str, dict] = {}
        copies: dict[str, Proposals] = {}
        for m, sub in self.subs.items():
            if not self.roles[m].copies:
                continue
            t0 = time.perf_counter()
            copy = copies[m] = sub.propose(state, k)
            copy_ms = (time.perf_counter() - t0) * 1000.0
            if copy.k > 0:
                source, match = getattr(sub, "last_source", "") or "context", getattr(sub, "last_match", 1) or 1
                key = copy_key(m, source, match)
                available[m] = {"key": key, "max_k": copy.k, "rows": 1, "sunk": True}
                if self.policy.copy_chain:  # each token at the match length it would then have
                    available[m]["keys"] = copy_keys(m, source, match, copy.k)
            with self.policy.lock:
                self.policy.propose[m].observe(1, copy_ms)
        for m, sub in self.subs.items():
            role = self.roles[m]
            if role.copies or (role.hidden and not self._hidden):
                continue
            max_k = min(k, self.policy.draft_max_k) if role.model else k
            available[m] = {"key": m, "max_k": max_k, "rows": getattr(sub, "n_drafts", 1)}
            lm = getattr(sub, "lm", None)
            if role.model and lm is not None:  # a draft that sat out steps must first feed them
                gap = len(state.token_ids) - lm.num_cached
                available[m]["catchup"] = gap if gap > IN_SYNC else 0
        return available, copies

    def propose(self, state: DecodeState, k: int) -> Proposals:
        if k <= 0:
            self._pending = None
            return Proposals.empty()
        t_step = time.perf_counter()  # the step's wall time runs from here to the verdict
        available, copies = self._options(state, k)
        cap = min(k, self.policy.max_k)
        while True:
            choice = self.policy.choose(
                self.cluster,
                self._temp,
                available=available,
                own=self.own,
                k_cap=cap,
                session=id(self),
                seen=self._seen,
                remaining=state.params.max_new_tokens - state.num_generated,
            )
            sub = self.subs.get(choice.method)
            lm = getattr(sub, "lm", None)
            # a draft that sat out steps first catches up on their tokens: a prefill, priced apart
            gap = 0 if lm is None else len(state.token_ids) - lm.num_cached
            catchup = gap if gap > IN_SYNC else 0
            t0 = time.perf_counter()
            if choice.method == TARGET:
                props = Proposals.empty()
            elif choice.method in copies:
                rows = [r[: choice.k] for r in copies[choice.method].rows()]
                props = Proposals.from_rows(rows[:1])
            else:
                props = self.subs[choice.method].propose(state, choice.k)
            propose_ms = (time.perf_counter() - t0) * 1000.0
            if props.k > 0 or choice.method == TARGET:
                break
            available.pop(choice.method)  # nothing retrieved: the next best option, this same step
        self.policy.decided(self.cluster, choice)
        self.last = choice
        if self.shadows is not None:  # the copies on offer that did not run: what would they have got?
            for m, copy in copies.items():
                if m != choice.method and m in available and copy.k > 0:
                    tokens = list(copy.rows()[0][:cap])
                    keys = available[m].get("keys") or [available[m]["key"]] * len(tokens)
                    self.shadows.open(list(keys[: len(tokens)]), tokens)
        timed = choice.method != TARGET and not self.roles[choice.method].copies
        self._pending = (choice, time.perf_counter(), propose_ms if timed else None, choice.key, catchup, t_step)
        return props

    def observe(self, state: DecodeState, verdict: Verdict) -> None:
        self._account(verdict)
        if self.shadows is not None and self.shadows.pending:
            self._shadow_evidence(verdict.emitted)
        self._hidden = verdict.target_hidden is not None
        for p in self.subs.values():
            p.observe(state, verdict)

    def observe_final(self, state: DecodeState, verdict: Verdict) -> None:
        self._account(verdict)

    def _account(self, verdict: Verdict) -> None:
        if self._pending is None:  # the session ran the step without asking (no room for a draft)
            self.steps[TARGET] = self.steps.get(TARGET, 0) + 1
            return
        choice, t_end, propose_ms, key, catchup, t_step = self._pending
        self._pending = None
        now = time.perf_counter()
        verify_ms = (now - t_end) * 1000.0
        acc, drafted = len(verdict.accepted), verdict.num_drafted
        m = choice.method
        self.steps[m] = self.steps.get(m, 0) + 1
        if drafted:
            self.drafted[m] = self.drafted.get(m, 0) + drafted
            self.accepted[m] = self.accepted.get(m, 0) + acc
            self.rejected[m] = self.rejected.get(m, 0) + (acc < drafted)
            self.k_sum[m] = self.k_sum.get(m, 0) + drafted
            keys = list(choice.keys) or [key] * drafted  # a copy's positions under their own keys
            for k, (a, r) in chain_evidence(keys, acc, acc < drafted).items():
                self.own.setdefault(k, Counts()).add(a, r)
        n_verified = 1 + (verdict.num_nodes or drafted)
        first = not self._observed  # the first pass is the prompt's prefill: not a verify step's cost
        self._observed = True
        self.policy.record(
            self.cluster,
            self._temp,
            choice,
            accepted=acc,
            drafted=drafted,
            emitted=len(verdict.emitted),
            n_verified=n_verified,
            verify_ms=None if first else verify_ms,
            propose_ms=propose_ms,
            target_pass=verdict.target_pass,
            catchup=catchup,
            step_ms=None if first else (now - t_step) * 1000.0,
        )
        self._seen = verdict.target_pass

    def _shadow_evidence(self, emitted: list[int]) -> None:
        """The followed copies against this step's tokens: their keys' counts, the cluster's (each
        copy's first news decays them, as a real step does) and the request's own."""
        news = self.shadows.advance(emitted)  # type: ignore[union-attr]
        with self.policy.lock:
            for opened in (True, False):
                step: dict[str, list[float]] = {}
                for e in news:
                    if e.opened == opened:
                        t = step.setdefault(e.key, [0.0, 0.0])
                        t[0], t[1] = t[0] + e.accepted, t[1] + e.rejected
                if step:
                    decay = self.policy.decay if opened else 1.0
                    add_evidence(self.policy.counts, self.cluster, self._temp, step, decay)
        for e in news:
            if e.accepted or e.rejected:
                self.own.setdefault(e.key, Counts()).add(e.accepted, e.rejected)

    def rollback(self, state: DecodeState, position: int) -> None:
        self._pending = None
        if self.shadows is not None:
            self.shadows.clear()
        self._hidden = False  # the hidden state described a withdrawn position
        for p in self.subs.values():
            p.rollback(state, position)

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in (TARGET, *self.subs):
            if self.steps.get(m):
                out[f"steps_{m}"] = self.steps[m]
                out[f"drafted_{m}"] = self.drafted.get(m, 0)
                out[f"accepted_{m}"] = self.accepted.get(m, 0)
        return out

    def summary(self) -> dict:
        """The response's ``speculation.auto`` block: steps, drafted and accepted per method, and
        the latest decision with the estimates that decided it."""
        per = {
            m: {
                "steps": n,
                "drafted": self.drafted.get(m, 0),
                "accepted": self.accepted.get(m, 0),
                "rejected_steps": self.rejected.get(m, 0),
                "mean_k": round(self.k_sum.get(m, 0) / n, 2),
            }
            for m, n in self.steps.items()
        }
        last = self.last
        return {
            "methods": per,
            "chosen": max(self.steps, key=self.steps.get) if self.steps else TARGET,
            "temperature": self._temp,
            "counts": {key: [round(c.accepted, 3), round(c.rejected, 3)] for key, c in sorted(self.own.items())},
            "shadows": self.shadows.summary() if self.shadows is not None else None,
            "last": {
                "method": last.method,
                "k": last.k,
                "tokens_per_s": round(last.speed, 2),
                "estimates": last.alternatives,
            }
            if last
            else None,
        }

    def finish(self) -> None:
        for p in self.subs.values():
            p.finish()
        if self._started:
            self._started = False
            with self.policy.lock:
                self.policy.in_flight -= 1
                self.policy.active.pop(id(self), None)
                self.policy.running.pop(id(self), None)


_DEFAULT: AutoPolicy | None = None
_DEFAULT_LOCK = threading.Lock()


def default_policy() -> AutoPolicy:
    """The process's policy for engines built without one (serving passes its replica's own)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = AutoPolicy()
        return _DEFAULT

"""``auto`` on vLLM: per request, the vLLM server (the method) expected to decode it fastest.

Our engine's ``auto`` (``core.auto_policy``) chooses a method and k *every step*, because it
drafts in-process. A vLLM server fixes its speculation when it starts, so through
``--engine vllm`` the choice is made once per request, among the servers the front door runs
(``serving.vllm.fleet``: target-only, n-gram, the cluster's draft). Per-step switching stays a
feature of our engine (docs/vllm.md).

The estimate is the same decomposition as the in-engine policy's, from what each finished
request measured (its per-token α, computed by ``serving.vllm.replay``, and its decode time):

    speed(m) = E(α_m, k) / step_ms_m(load)

- ``α_m``: from a Beta posterior over the decayed accepted and rejected counts of method
  ``m`` in the request's cluster, temperature bucket and *kind* (``refs``: the request
  carries text to copy from — references, retrieved passages — or ``plain``), so a copying
  method is judged on the requests it can copy in. Target-only has ``E = 1``. A draw
  (Thompson sampling) while the option has served fewer than :data:`SETTLED_TRIALS` requests
  of that (cluster, kind), the posterior mean after: a stray draw sends one request to a
  slower server, and under concurrent load that request also shares the cores with every
  other one (measured with draws throughout: at concurrency 4 ``auto`` sent 71 of 72 requests
  to the copy server and one to target-only, and made 0.845× the copy server's tokens/s;
  ``benchmarks/out/vllm_path_thompson.json``).
- ``step_ms_m(load, shared)``: the decayed mean of the measured milliseconds per decode step
  of ``m``'s server, per load bucket (requests in flight through the front door, on every
  server) and per whether *another* server was decoding when the request started. An unseen
  load bucket starts from the nearest lower one; a server never measured beside another is
  priced at its cost alone times ``1 + busy servers`` (each takes its share of the cores).

Servers share the machine's cores: on a CPU, two servers decoding at once each run at a
fraction of their speed and neither batches the other's requests, while one server batches
all of them (vLLM's continuous batching). So the choice looks past the next request:

1. ``best``: the method fastest *alone* at this load (steady state, every request on it).
2. No other server is busy: ``best``.
3. A busy server within :data:`MIGRATE_GAIN` of ``best`` alone: join it (no sharing for a
   near-tie).
4. **Migrate**: the requests decoding on the busy servers would choose ``best`` too (each
   judged by its own cluster, temperature and kind, at the mean α): the traffic moves to
   ``best``, and the two servers share the cores only until the busy one drains. ``best``.
5. **Split**: those requests are better where they are (another kind of traffic): the servers
   would share the cores as long as both kinds arrive, so each option is priced *while
   sharing* (measured), the busy server at its cost alone, and the fastest wins.

An earlier rule priced every request as in step 5. Under concurrent load it locked onto
whichever server happened to be busy first, however slow: every later request saw the other
servers at their (slow) shared cost and joined it (``auto`` ran at 0.20× the best single
server at concurrency 4 on the real pair, ``benchmarks/out/vllm_path_split_rule.json``).

Each option is tried :data:`MIN_TRIALS` times per (cluster, kind) before the estimates
decide (at a load bucket it has not run at, its cost is its cost at the nearest lower one:
optimistic, so it is tried there too), and counts fade with :data:`HALF_LIFE_S`: the mean of
a method avoided for a while drifts back towards the prior's 0.5, so a low-α method is retried
(the draft may have been promoted meanwhile: :meth:`RequestPolicy.reseed` also starts its
trials over).
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field

from specops.core.auto_fits import Counts
from specops.core.auto_policy import TARGET, expected_tokens, load_bucket, temp_bucket

MIN_TRIALS = 2
"""Requests each option serves per (cluster, kind) before the estimates decide."""

SETTLED_TRIALS = 8
"""Requests an option serves per (cluster, kind) before its α is the posterior mean, not a draw."""

PRIOR_TRIALS = 24.0
"""Most trials of the cluster's counts a choice draws from (fresh evidence soon outweighs old)."""

DECAY = 0.98
"""Per-request decay of the counts and of the step-cost means (about 50 requests of memory)."""

HALF_LIFE_S = 600.0
"""Counts lose half their weight per this many seconds without news."""

MIGRATE_GAIN = 1.15
"""How much faster alone another server must be than a busy one before traffic moves to it."""

Group = tuple[str, float, str]
"""A request in flight: (cluster, temperature, kind)."""


def shares(method: str, busy: dict[str, int]) -> bool:
    """Whether ``method``'s server would decode beside another server (one that is busy now)."""
    return any(n > 0 for m, n in busy.items() if m != method)


def request_kind(*, copyable: bool) -> str:
    """``refs`` when the request brings text a copying drafter can copy from, else ``plain``."""
    return "refs" if copyable else "plain"


@dataclass
class _Cost:
    """A decayed mean of milliseconds per decode step."""

    ms: float = 0.0
    weight: float = 0.0

    def add(self, ms: float, decay: float) -> None:
        self.ms = (decay * self.weight * self.ms + ms) / (decay * self.weight + 1.0)
        self.weight = decay * self.weight + 1.0


@dataclass
class ServerChoice:
    """One request's decision."""

    method: str
    speed: float
    """Estimated tokens per second that decided it (0 while exploring)."""
    kind: str
    load: int
    explored: bool = False
    """Chosen to try an option that had too few requests yet."""
    alternatives: dict[str, float] = field(default_factory=dict)
    reason: str = "alone"
    """``explore``, ``alone`` (no other server busy), ``join`` (a busy server within
    :data:`MIGRATE_GAIN`), ``migrate`` or ``split`` (the module's steps 2-5)."""

    def to_dict(self) -> dict:
        return {
            "chose": self.method,
            "kind": self.kind,
            "load": self.load,
            "explored": self.explored,
            "reason": self.reason,
            "estimates_tok_s": self.alternatives,
        }


class RequestPolicy:
    """Per front door: acceptance counts per (cluster, method, temperature, kind), step costs per
    (method, load bucket). Thread-safe."""

    def __init__(
        self, methods: tuple[str, ...], *, k: int | dict[str, int], seed: int | None = None, explore: bool = True
    ) -> None:
        if not methods:
            raise ValueError("auto on vLLM needs at least one server method")
        self.methods = tuple(methods)
        self.ks = {m: int(k[m]) for m in self.methods} if isinstance(k, dict) else {m: int(k) for m in self.methods}
        """Tokens each method's server drafts per step at most."""
        self.explore = explore
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, str, str, str], Counts] = {}
        self.costs: dict[tuple[str, int, bool], _Cost] = {}
        self.tries: dict[tuple[str, str, str], int] = {}
        self.decisions: dict[tuple[str, str], int] = {}
        """(cluster, method) -> requests chosen (``/v1/policy``)."""
        self.last: dict[str, ServerChoice] = {}

    # ------------------------------------------------------------------ estimates
    def _alpha(self, cluster: str, method: str, temp: str, kind: str, *, draw: bool = True) -> float:
        """A Thompson draw of ``method``'s α (``draw=False`` or no exploration: the posterior mean)."""
        c = self.counts.get((cluster, method, temp, kind))
        a = r = 0.0
        if c is not None and c.trials > 0:
            fade = 0.5 ** (max(0.0, time.time() - c.updated) / HALF_LIFE_S)
            take = min(PRIOR_TRIALS, c.trials * fade)
            a, r = c.accepted / c.trials * take, c.rejected / c.trials * take
        a, r = a + 1.0, r + 1.0
        return self.rng.betavariate(a, r) if self.explore and draw else a / (a + r)

    def _speed(self, method: str, ms: float | None, cluster: str, temp: str, kind: str, *, draw: bool = True):
        """Tokens per second of ``method`` at ``ms`` per step (None: not measured)."""
        if ms is None:
            return None
        e = (
            1.0
            if method == TARGET
            else expected_tokens(self._alpha(cluster, method, temp, kind, draw=draw), self.ks[method])
        )
        return e / max(ms, 1e-6) * 1000.0

    def _prefers(self, group: Group, bucket: int) -> str | None:
        """The method a request in flight would choose alone at ``bucket`` (posterior means)."""
        cluster, temperature, kind = group
        temp = temp_bucket(temperature)
        speeds = {m: self._speed(m, self._step_ms(m, bucket, 0), cluster, temp, kind, draw=False) for m in self.methods}
        speeds = {m: v for m, v in speeds.items() if v is not None}
        return max(speeds, key=speeds.get) if speeds else None

    def _measured(self, method: str, bucket: int, shared: bool) -> float | None:
        for b in range(bucket, -1, -1):
            c = self.costs.get((method, b, shared))
            if c is not None and c.weight > 0:
                return c.ms
        return None

    def _step_ms(self, method: str, bucket: int, others: int) -> float | None:
        """Milliseconds per step of ``method``'s server at ``bucket`` beside ``others`` busy servers:
        measured, else (never measured beside another) its cost alone times ``1 + others``, each
        busy server taking its share of the cores (a CPU's case; a GPU's measurements correct it)."""
        shared = others > 0
        ms = self._measured(method, bucket, shared)
        if ms is not None:
            return ms
        if shared:
            alone = self._measured(method, bucket, False)
            return None if alone is None else alone * (1 + others)
        return self._measured(method, bucket, True)

    def choose(
        self,
        cluster: str,
        *,
        temperature: float,
        kind: str,
        load: int,
        allowed=None,
        busy: dict[str, int] | None = None,
        in_flight: dict[str, list[Group]] | None = None,
    ) -> ServerChoice:
        """The server for one request (``allowed``: the methods it may use, default all; ``busy``:
        method -> requests its server is decoding now, this one not counted; ``in_flight``: method ->
        those requests' (cluster, temperature, kind), which tell a migration from a split; without
        it a busy server's requests are taken to stay, a split)."""
        busy = {m: n for m, n in (busy or {}).items() if n > 0}
        options = [m for m in self.methods if allowed is None or m in allowed]
        if not options:
            raise ValueError("no server method is allowed for this request")
        temp, bucket = temp_bucket(temperature), load_bucket(load)
        with self.lock:
            untried = [m for m in options if self.tries.get((cluster, kind, m), 0) < MIN_TRIALS]
            alone: dict[str, float] = {}
            for m in options:
                draw = self.tries.get((cluster, kind, m), 0) < SETTLED_TRIALS
                v = self._speed(m, self._step_ms(m, bucket, 0), cluster, temp, kind, draw=draw)
                if v is not None:
                    alone[m] = round(v, 2)
            alts, reason = alone, "alone"
            if untried and self.explore:
                m = min(untried, key=lambda x: (self.tries.get((cluster, kind, x), 0), options.index(x)))
                choice = ServerChoice(m, alts.get(m, 0.0), kind, load, explored=True, alternatives=alts)
                choice.reason = "explore"
            else:
                m = max(alone, key=alone.get) if alone else options[0]
                others = {b for b in busy if b != m}
                joinable = [b for b in others if b in alone]
                join = max(joinable, key=alone.get) if joinable else None
                if not others or m not in alone:
                    pass
                elif join is not None and alone[m] < MIGRATE_GAIN * alone[join]:
                    m, reason = join, "join"
                elif in_flight is not None and all(
                    self._prefers(g, bucket) in (m, None) for b in others for g in in_flight.get(b, ())
                ):
                    reason = "migrate"
                else:
                    reason, alts = "split", {}
                    for x in options:
                        n_others = sum(1 for b in busy if b != x)
                        draw = self.tries.get((cluster, kind, x), 0) < SETTLED_TRIALS
                        v = self._speed(x, self._step_ms(x, bucket, n_others), cluster, temp, kind, draw=draw)
                        if v is not None:
                            alts[x] = round(v, 2)
                    m = max(alts, key=alts.get) if alts else m
                choice = ServerChoice(m, alts.get(m, 0.0), kind, load, alternatives=alts, reason=reason)
            key = (cluster, kind, choice.method)
            self.tries[key] = self.tries.get(key, 0) + 1
            self.decisions[(cluster, choice.method)] = self.decisions.get((cluster, choice.method), 0) + 1
            self.last[cluster] = choice
            return choice

    # ------------------------------------------------------------------ evidence
    def record(
        self,
        cluster: str,
        method: str,
        *,
        temperature: float,
        kind: str,
        load: int,
        accepted: int,
        rejected_steps: int,
        steps: int,
        decode_s: float,
        shared: bool = False,
    ) -> None:
        """A finished request on ``method``'s server: its drafted-position counts and its decode
        time over ``steps`` steps (the first, which holds the prefill, excluded by the caller);
        ``shared``: another server was decoding when it started."""
        if steps <= 0 or not math.isfinite(decode_s) or decode_s < 0:
            return
        temp, bucket = temp_bucket(temperature), load_bucket(load)
        with self.lock:
            if method != TARGET and accepted + rejected_steps > 0:
                c = self.counts.setdefault((cluster, method, temp, kind), Counts())
                c.add(accepted, rejected_steps, DECAY)
            self.costs.setdefault((method, bucket, bool(shared)), _Cost()).add(decode_s * 1000.0 / steps, DECAY)

    def reseed(self, cluster: str, method: str) -> None:
        """Another model now serves ``method`` in ``cluster`` (a promoted draft): its counts were the
        old model's, and it is explored again."""
        with self.lock:
            for key in [key for key in self.counts if key[0] == cluster and key[1] == method]:
                del self.counts[key]
            for key in [key for key in self.tries if key[0] == cluster and key[2] == method]:
                del self.tries[key]

    def summary(self) -> dict:
        """For ``/v1/policy``: decisions, the latest choice per cluster, α means and step costs."""
        with self.lock:
            return {
                "level": "request",
                "methods": list(self.methods),
                "decisions": [
                    {"cluster": c, "method": m, "requests": n} for (c, m), n in sorted(self.decisions.items())
                ],
                "last": {c: ch.to_dict() for c, ch in self.last.items()},
                "alpha": [
                    {"cluster": c, "method": m, "temperature": t, "kind": k, "mean": round(v.mean, 4)}
                    for (c, m, t, k), v in sorted(self.counts.items())
                ],
                "step_ms": [
                    {"method": m, "load_bucket": b, "shared": sh, "ms": round(v.ms, 3)}
                    for (m, b, sh), v in sorted(self.costs.items())
                ],
            }

"""``auto`` on vLLM: per request, the vLLM server (the method) expected to serve the traffic fastest.

Our engine's ``auto`` (``specops.core.auto_policy``) chooses a method and k *every step*, because it
drafts in-process. A vLLM server fixes its speculation when it starts, so through
``--engine vllm`` the choice is made once per request, among the servers the front door runs
(``specops.serving.vllm.fleet``: target-only, n-gram, the cluster's draft). Per-step switching stays a
feature of our engine (docs/vllm.md).

The estimate is the same decomposition as the in-engine policy's, from what each finished
request measured (its per-token α, computed by ``specops.serving.vllm.replay``, and its decode time):

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
  load bucket starts from the nearest lower one (scaled, below); a server never measured beside another is
  priced at its cost alone times ``1 + busy servers`` (each takes its share of the cores).

Servers share the machine's cores: on a CPU, two servers decoding at once each run at a
fraction of their speed and neither batches the other's requests, while one server batches
all of them (vLLM's continuous batching). So under concurrent traffic the choice is made for
the traffic, not for the request:

1. **Alone** (no other server busy, and the recent load, a decayed mean of the requests in
   flight at each arrival, under :data:`CONCURRENT_LOAD`: one request at a time): the method
   fastest for this request, ``speed(m)`` above.
2. **Home** (concurrent traffic): the traffic *mix* (a decayed count of the requests per
   cluster, temperature and kind, about 50 requests of memory) has a home server, the one
   that serves the whole mix in the least time alone (posterior means). The home changes only
   when another server would serve the mix :data:`HOME_GAIN` faster, so a near-tie does not
   send the traffic back and forth. A request goes home.
3. **Split**: unless the mix is served :data:`SPLIT_GAIN` faster with the groups another
   server decodes faster alone moved there (this request's group among them), the two servers
   sharing the cores. Work on a server progresses at its cost *while sharing* (measured;
   never measured: its cost alone times two) while the other is busy too, and at its cost
   alone after. On a CPU, where sharing costs about what the two servers cost one after the
   other, a split pays only when the moved groups are much faster on the other server; on a
   GPU with room, sharing costs little and each group goes where it is fastest.

Two earlier rules decided per request. One priced every option as it would run beside the
servers busy at that moment: under concurrent load it locked onto whichever server happened
to be busy first, however slow, since every other server looked slow while sharing (``auto``
ran at 0.20× the best single server at concurrency 4 on the real pair,
``benchmarks/out/vllm_path_split_rule.json``). The next moved the traffic to the fastest
server when the requests decoding at that moment would prefer it too: on a mix it fired on a
momentary snapshot (a copy server holding only chat requests sent the next chat request to
target-only while references kept arriving for the copy server), and the servers shared the
cores (0.84×, ``benchmarks/out/vllm_path_migrate_rule.json``).

Each option is tried :data:`MIN_TRIALS` times per (cluster, kind) before the estimates
decide. At a load bucket a server has not run at, its cost is its cost at the nearest lower
one times how much the servers measured at both slow down between them (a server the traffic
has left is not priced at a lighter load's cost, which would call it back). Counts fade with :data:`HALF_LIFE_S`: the mean of
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

HOME_GAIN = 1.15
"""How much faster another server must serve the traffic mix alone before it becomes home: a
move makes the two servers share the cores while the old home drains."""

CLIP = 3.0
CLIP_AFTER = 3.0
"""A step cost above ``CLIP`` times the mean is taken as ``CLIP`` times the mean once the mean
has ``CLIP_AFTER`` requests of weight (in a warm-up on the real pair the first concurrent
requests each waited many seconds, probably on vLLM compiling new batch shapes)."""

SPLIT_GAIN = 1.15
"""How much faster the mix must be served split across home and another server (sharing the
cores) before the groups that server decodes faster leave home."""

LOAD_DECAY = 0.5
"""Per-request decay of the recent load (two or three requests of memory: a front door turns back to
per-request choices soon after concurrent traffic ends)."""

CONCURRENT_LOAD = 1.5
"""Recent load (requests in flight at arrival, this one included) from which traffic is concurrent."""

Group = tuple[str, str, str]
"""A traffic group: (cluster, temperature bucket, kind)."""


def request_kind(*, copyable: bool) -> str:
    """``refs`` when the request brings text a copying drafter can copy from, else ``plain``."""
    return "refs" if copyable else "plain"


@dataclass(frozen=True)
class Mark:
    """Where a :class:`LoadMeter` stood when a request arrived."""

    t: float
    area: float
    busy_area: dict[str, float]


class LoadMeter:
    """The requests in flight through a front door and each server's busy requests, with their
    time integrals, so a finished request's cost is filed under the load it *decoded* at (its
    mean over the request's life) and as shared when another server was busy for most of it.
    Filed by the load at arrival, the first requests of a burst land in the lightest bucket
    with the cost of a full batch, and an idle server then looks slower than it is. Thread-safe."""

    SHARED_FRACTION = 0.5
    """Fraction of a request's time another server must be busy for it to count as shared."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.t = clock()
        self.in_flight = 0
        self.busy: dict[str, int] = {}
        self.area = 0.0
        self.busy_area: dict[str, float] = {}

    def _advance(self) -> None:
        now = self.clock()
        dt = max(0.0, now - self.t)
        self.area += self.in_flight * dt
        for m, n in self.busy.items():
            if n > 0:
                self.busy_area[m] = self.busy_area.get(m, 0.0) + dt
        self.t = now

    def arrive(self) -> tuple[Mark, int, dict[str, int]]:
        """A request arrives: its mark, the load with it, and each server's busy requests."""
        with self.lock:
            self._advance()
            self.in_flight += 1
            return Mark(self.t, self.area, dict(self.busy_area)), self.in_flight, dict(self.busy)

    def start(self, method: str) -> None:
        """The request is sent to ``method``'s server."""
        with self.lock:
            self._advance()
            self.busy[method] = self.busy.get(method, 0) + 1

    def leave(self, method: str | None) -> None:
        """The request is done (``method``: the server :meth:`start` sent it to, None if never sent)."""
        with self.lock:
            self._advance()
            self.in_flight = max(0, self.in_flight - 1)
            if method is not None and self.busy.get(method, 0) > 0:
                self.busy[method] -= 1

    def since(self, mark: Mark, method: str) -> tuple[int, bool]:
        """A request's mean load since ``mark`` (rounded, at least 1) and whether another server
        than ``method``'s was busy for :data:`SHARED_FRACTION` of that time."""
        with self.lock:
            self._advance()
            dt = self.t - mark.t
            if dt <= 0:
                return max(1, self.in_flight), False
            load = (self.area - mark.area) / dt
            other = max((a - mark.busy_area.get(m, 0.0) for m, a in self.busy_area.items() if m != method), default=0.0)
            return max(1, round(load)), other / dt >= self.SHARED_FRACTION


@dataclass
class _Cost:
    """A decayed mean of milliseconds per decode step."""

    ms: float = 0.0
    weight: float = 0.0

    def add(self, ms: float, decay: float) -> None:
        if self.weight >= CLIP_AFTER:  # one request's stall (a compile, a swap) moves the mean by a bounded step
            ms = min(ms, CLIP * self.ms)
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
    """``explore``, ``alone`` (one request at a time: the fastest for it), ``home`` (concurrent
    traffic: the mix's server) or ``split`` (the module's steps 1-3)."""

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
        self.mix: dict[Group, float] = {}
        """(cluster, temperature bucket, kind) -> decayed requests: the traffic ``auto`` routes."""
        self.recent_load = 1.0
        self.home: str | None = None
        """The server the concurrent traffic lives on (module docstring, step 2)."""

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

    def _measured(self, method: str, bucket: int, shared: bool) -> float | None:
        """The decayed mean at ``bucket``; else at the nearest lower bucket, scaled by how much a
        step of the servers measured at both costs more at ``bucket`` (a server the traffic has
        not used at this load is not priced at a lighter load's cost)."""
        for b in range(bucket, -1, -1):
            c = self.costs.get((method, b, shared))
            if c is None or c.weight <= 0:
                continue
            if b == bucket:
                return c.ms
            ratios = [
                self.costs[(m, bucket, shared)].ms / self.costs[(m, b, shared)].ms
                for m in self.methods
                if m != method
                and self.costs.get((m, bucket, shared), _Cost()).weight > 0
                and self.costs.get((m, b, shared), _Cost()).weight > 0
                and self.costs[(m, b, shared)].ms > 0
            ]
            return c.ms * max(1.0, sum(ratios) / len(ratios)) if ratios else c.ms
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

    def _server_time(self, method: str, groups: list[Group], bucket: int, others: int) -> float | None:
        """Seconds per token-weighted request of ``groups`` (the mix's weights) on ``method``'s server."""
        ms = self._step_ms(method, bucket, others)
        total = 0.0
        for g in groups:
            v = self._speed(method, ms, *g, draw=False)
            if v is None or v <= 0:
                return None
            total += self.mix[g] / v
        return total

    def _mix_time(self, home: str, to: str | None = None, moved: frozenset = frozenset(), bucket: int = 0):
        """Time to serve the mix on ``home`` alone, or with the groups ``moved`` on server ``to``:
        both servers progress at their cost while sharing until the one with less work is done,
        the other alone after (module docstring, step 3)."""
        if to is None or not moved:
            return self._server_time(home, list(self.mix), bucket, 0)
        rest, away = [g for g in self.mix if g not in moved], [g for g in self.mix if g in moved]
        a, b = self._server_time(home, rest, bucket, 1), self._server_time(to, away, bucket, 1)
        a0, b0 = self._server_time(home, rest, bucket, 0), self._server_time(to, away, bucket, 0)
        if a is None or b is None or a0 is None or b0 is None:
            return None
        if a <= b:  # home is done first; the other server finishes alone
            return a + (1.0 - a / b) * b0 if b > 0 else a
        return b + (1.0 - b / a) * a0

    def _faster_alone(self, x: str, home: str, bucket: int) -> frozenset:
        """The mix's groups that server ``x`` decodes faster than ``home`` alone (a split's candidates)."""
        ms_x, ms_h = self._step_ms(x, bucket, 0), self._step_ms(home, bucket, 0)
        out = []
        for g in self.mix:
            vx, vh = self._speed(x, ms_x, *g, draw=False), self._speed(home, ms_h, *g, draw=False)
            if vx is not None and vh is not None and vx > vh:
                out.append(g)
        return frozenset(out)

    def _home(self, bucket: int) -> str | None:
        """The server that serves the mix fastest alone, kept unless another is :data:`HOME_GAIN`
        faster."""
        times = {m: self._mix_time(m, bucket=bucket) for m in self.methods}
        times = {m: t for m, t in times.items() if t is not None and t > 0}
        if not times:
            return None
        best = min(times, key=times.get)
        if self.home not in times or times[self.home] > HOME_GAIN * times[best]:
            self.home = best
        return self.home

    def choose(
        self,
        cluster: str,
        *,
        temperature: float,
        kind: str,
        load: int,
        allowed=None,
        busy: dict[str, int] | None = None,
    ) -> ServerChoice:
        """The server for one request (``allowed``: the methods it may use, default all; ``busy``:
        method -> requests its server is decoding now, this one not counted)."""
        busy = {m: n for m, n in (busy or {}).items() if n > 0}
        options = [m for m in self.methods if allowed is None or m in allowed]
        if not options:
            raise ValueError("no server method is allowed for this request")
        temp, bucket = temp_bucket(temperature), load_bucket(load)
        group: Group = (cluster, temp, kind)
        with self.lock:
            for g in list(self.mix):
                self.mix[g] *= DECAY
                if self.mix[g] < 0.01:
                    del self.mix[g]
            self.mix[group] = self.mix.get(group, 0.0) + 1.0
            self.recent_load = LOAD_DECAY * self.recent_load + (1.0 - LOAD_DECAY) * max(1, load)
            concurrent = self.recent_load >= CONCURRENT_LOAD or bool(busy)
            untried = [m for m in options if self.tries.get((cluster, kind, m), 0) < MIN_TRIALS]
            alone: dict[str, float] = {}
            for m in options:
                draw = self.tries.get((cluster, kind, m), 0) < SETTLED_TRIALS
                v = self._speed(m, self._step_ms(m, bucket, 0), cluster, temp, kind, draw=draw)
                if v is not None:
                    alone[m] = round(v, 2)
            steady = load_bucket(round(self.recent_load))  # the traffic's load, not this arrival's
            home = self._home(steady) if concurrent else None
            if untried and self.explore:
                m = min(untried, key=lambda x: (self.tries.get((cluster, kind, x), 0), options.index(x)))
                choice = ServerChoice(m, alone.get(m, 0.0), kind, load, explored=True, alternatives=alone)
                choice.reason = "explore"
            elif home is None:
                m = max(alone, key=alone.get) if alone else options[0]
                choice = ServerChoice(m, alone.get(m, 0.0), kind, load, alternatives=alone)
            elif home not in options:  # this request cannot go home: the fastest beside it
                alts = {}
                for x in options:
                    v = self._speed(x, self._step_ms(x, bucket, 1), cluster, temp, kind, draw=False)
                    if v is not None:
                        alts[x] = round(v, 2)
                m = max(alts, key=alts.get) if alts else options[0]
                choice = ServerChoice(m, alts.get(m, 0.0), kind, load, alternatives=alts, reason="split")
            else:
                weight = sum(self.mix.values())
                times, moves = {home: self._mix_time(home, bucket=steady)}, {}
                for x in options:
                    moves[x] = self._faster_alone(x, home, steady) if x != home else frozenset()
                    if moves[x]:
                        times[x] = self._mix_time(home, x, moves[x], steady)
                alts = {x: round(weight / t, 2) for x, t in times.items() if t}
                m, reason = home, "home"
                split = min((x for x in alts if x != home), key=lambda x: times[x], default=None)
                if (
                    split is not None
                    and group in moves[split]
                    and times[home] is not None
                    and times[home] > SPLIT_GAIN * times[split]
                ):
                    m, reason = split, "split"
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
                "home": self.home,
                "recent_load": round(self.recent_load, 2),
                "mix": [
                    {"cluster": c, "temperature": t, "kind": k, "weight": round(w, 2)}
                    for (c, t, k), w in sorted(self.mix.items())
                ],
                "alpha": [
                    {"cluster": c, "method": m, "temperature": t, "kind": k, "mean": round(v.mean, 4)}
                    for (c, m, t, k), v in sorted(self.counts.items())
                ],
                "step_ms": [
                    {"method": m, "load_bucket": b, "shared": sh, "ms": round(v.ms, 3)}
                    for (m, b, sh), v in sorted(self.costs.items())
                ],
            }

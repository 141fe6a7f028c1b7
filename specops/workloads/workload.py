"""The demo's traffic: a seeded schedule of distinct prompts with a distribution shift, replayed over HTTP.

Two workloads (``specops demo --workload``):

- ``chat`` (the default): **production-shaped traffic** for the Instruct target —
  ``/v1/chat/completions`` requests (a system message, a user message, the chat template)
  in three narrow domains the bootstrap corpus does not contain
  (``specops.workloads.chat_workload``: ``sql`` text-to-SQL, ``math`` word problems, ``api``
  questions about functions of pinned scientific-Python packages). Phase 1 is
  sql/math-heavy (45/45/10 % sql/math/api), phase 2 shifts to api-heavy (15/15/70 %): a
  cluster the draft has barely served becomes most of the traffic (OSD §5.2's shifting
  query distribution), while sql and math keep a trickle. Per domain,
  :func:`~specops.workloads.chat_workload.chat_workload` makes three disjoint parts: ``unseen`` (the
  closing comparison's never-served prompts), ``router`` (the first router is fitted on
  these, rendered as the server renders them) and ``served`` (the traffic).
- ``corpus``: the earlier workload — raw continuations (``/v1/completions``) of held-out
  bootstrap corpus files in the domains ``code`` and ``prose``, code-heavy then shifting to
  prose-heavy (80/20, then 20/80); the router is fitted on the bootstrap's training text.

By default every request is a **distinct** prompt, never served before (no two have the
same token ids), so a rising α is learning, not memory. With ``recurring`` N, prompts are
drawn with replacement from a pool of N per domain, as recurring queries of a real service
would be: a draft can then learn the exact answers it will be asked for again. Requests
carry no ``cluster``: the router assigns it, and the routed cluster is what the report
groups by (the true domain is kept to measure routing).

:class:`Replayer` sends the schedule through the official ``openai`` client from a few
client threads and calls ``on_outcome`` for every finished request.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from specops.demo.report.data import RequestRow
from specops.workloads.prompts import Prompt

T = TypeVar("T")

WORKLOADS = ("chat", "corpus")


@dataclass(frozen=True)
class Phase:
    name: str
    share: dict[str, float]
    """Probability of each domain in this phase."""
    fraction: float
    """Fraction of all requests in this phase."""


CORPUS_PHASES = (
    Phase("code-heavy", {"code": 0.8, "prose": 0.2}, 0.5),
    Phase("shift: prose-heavy", {"code": 0.2, "prose": 0.8}, 0.5),
)
PHASES = CORPUS_PHASES  # the corpus workload's phases (the name it always had)
CHAT_PHASES = (
    Phase("sql+math-heavy", {"sql": 0.45, "math": 0.45, "api": 0.1}, 0.5),
    Phase("shift: api-heavy", {"sql": 0.15, "math": 0.15, "api": 0.7}, 0.5),
)


def describe(phases: Sequence[Phase]) -> str:
    """``"sql+math-heavy (sql 45%, math 45%, api 10%) then shift: api-heavy (...)"``: the report's phases line."""
    return " then ".join(f"{p.name} (" + ", ".join(f"{d} {s:.0%}" for d, s in p.share.items()) + ")" for p in phases)


@dataclass(frozen=True)
class Planned:
    """One request of the schedule: a completion of ``text``, or, when ``messages`` is
    set, a chat (``text`` is then the user message)."""

    index: int
    phase: str
    domain: str
    text: str
    messages: tuple[tuple[str, str], ...] = ()
    """(role, content) pairs of a chat request; empty for a completion."""
    token_ids: tuple[int, ...] = ()
    """The prompt as the server tokenizes it (a chat: rendered with the chat template)."""

    @property
    def chat(self) -> bool:
        return bool(self.messages)

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass
class Workload:
    """A built workload: what :func:`specops.demo.run.run_demo` replays, compares and routes with."""

    name: str
    """``chat`` or ``corpus``."""
    schedule: list[Planned]
    unseen: dict[str, list[Prompt]]
    """Per domain, prompts the schedule never serves (the closing comparison's)."""
    phases: tuple[Phase, ...]
    router_texts: dict[str, list[str]] = field(default_factory=dict)
    """Per domain, the texts the first router is fitted on (chat: the ``router`` part, rendered as
    the server renders it, disjoint from served and unseen prompts). Empty for ``corpus``: its router
    is fitted on the bootstrap's training text (``specops.trainer.router_fit.bootstrap_router``)."""


def _draw(
    phases: Sequence[Phase], pools: dict[str, list[T]], num_requests: int, rng: random.Random, recurring: bool
) -> list[tuple[str, str, T]]:
    """``(phase, domain, item)`` per request: the phase's domain mix drawn with ``rng``; each
    domain's pool taken in order (each item once) or, with ``recurring``, with replacement."""
    nxt = {d: 0 for d in pools}
    out: list[tuple[str, str, T]] = []
    for i, phase in enumerate(phases):
        n = num_requests - len(out) if i == len(phases) - 1 else round(num_requests * phase.fraction)
        names, weights = zip(*sorted(phase.share.items()))
        for _ in range(n):
            d = rng.choices(names, weights)[0]
            if recurring:
                item = rng.choice(pools[d])
            else:
                if nxt[d] >= len(pools[d]):
                    raise ValueError(
                        f"only {len(pools[d])} distinct prompts of domain {d!r}: "
                        "lower the request count or use a recurring workload"
                    )
                item, nxt[d] = pools[d][nxt[d]], nxt[d] + 1
            out.append((phase.name, d, item))
    return out


def build_schedule(
    model_dir: Path,
    tokenizer,
    *,
    num_requests: int,
    prompt_tokens: int,
    seed: int = 0,
    recurring: int = 0,
    phases: tuple[Phase, ...] = CORPUS_PHASES,
    extra: int = 0,
) -> tuple[list[Planned], dict[str, list[Prompt]]]:
    """The ``corpus`` workload: ``num_requests`` completions of held-out corpus text over
    ``phases``, and ``extra`` more distinct prompts per domain that the schedule never uses
    (the closing comparison's never-served prompts).

    Distinct prompts by default; with ``recurring`` > 0, drawn with replacement from a
    pool of that many prompts per domain."""
    from specops.workloads.prompts import distinct_prompts

    domains = sorted({d for p in phases for d in p.share})
    want = recurring if recurring else num_requests  # at most every request from one domain
    pools: dict[str, list[Prompt]] = {}
    unseen: dict[str, list[Prompt]] = {}
    for d in domains:
        prompts = distinct_prompts(model_dir, tokenizer, d, want + extra, num_tokens=prompt_tokens, seed=seed + 1)
        if len(prompts) <= extra:
            raise ValueError(f"not enough held-out prompts of domain {d!r} in {model_dir}")
        unseen[d], pools[d] = prompts[:extra], prompts[extra:]
    drawn = _draw(phases, pools, num_requests, random.Random(seed), bool(recurring))
    schedule = [Planned(i, phase, d, p.text, token_ids=tuple(p.token_ids)) for i, (phase, d, p) in enumerate(drawn)]
    return schedule, unseen


def build_chat_schedule(
    tokenizer,
    *,
    num_requests: int,
    seed: int = 0,
    recurring: int = 0,
    phases: tuple[Phase, ...] = CHAT_PHASES,
    extra: int = 0,
    router: int = 0,
) -> Workload:
    """The ``chat`` workload: ``num_requests`` chat requests over ``phases``, each a distinct
    prompt of its domain's ``served`` part (or, with ``recurring`` N, drawn with replacement
    from its first N); ``extra`` never-served prompts per domain (``unseen``) and ``router``
    router texts per domain, all three parts disjoint (``specops.workloads.chat_workload``).

    The parts are made in the order unseen, router, served, so the never-served prompts stay
    the same whatever the request count."""
    from specops.core.models import render_chat
    from specops.workloads.chat_workload import chat_workload, messages_of

    domains = tuple(sorted({d for p in phases for d in p.share}))
    want = recurring if recurring else num_requests  # at most every request from one domain
    parts = chat_workload(tokenizer, {"unseen": extra, "router": router, "served": want}, domains=domains, seed=seed)
    pools = {d: parts[d]["served"] for d in domains}
    drawn = _draw(phases, pools, num_requests, random.Random(seed), bool(recurring))
    schedule = [
        Planned(
            i,
            phase,
            d,
            p.text,
            messages=tuple((m["role"], m["content"]) for m in messages_of(p)),
            token_ids=tuple(p.token_ids),
        )
        for i, (phase, d, p) in enumerate(drawn)
    ]
    return Workload(
        name="chat",
        schedule=schedule,
        unseen={d: parts[d]["unseen"] for d in domains},
        phases=phases,
        router_texts={d: [render_chat(tokenizer, messages_of(p)) for p in parts[d]["router"]] for d in domains},
    )


def build_workload(
    name: str,
    model_dir: Path,
    tokenizer,
    *,
    num_requests: int,
    prompt_tokens: int = 64,
    seed: int = 0,
    recurring: int = 0,
    extra: int = 0,
    router: int = 0,
) -> Workload:
    """The workload ``name`` (:data:`WORKLOADS`): ``chat`` (``prompt_tokens`` unused) or
    ``corpus`` (``router`` unused: its router comes from the bootstrap's training text)."""
    if name == "chat":
        return build_chat_schedule(
            tokenizer, num_requests=num_requests, seed=seed, recurring=recurring, extra=extra, router=router
        )
    if name == "corpus":
        schedule, unseen = build_schedule(
            model_dir,
            tokenizer,
            num_requests=num_requests,
            prompt_tokens=prompt_tokens,
            seed=seed,
            recurring=recurring,
            extra=extra,
        )
        return Workload(name="corpus", schedule=schedule, unseen=unseen, phases=CORPUS_PHASES)
    raise ValueError(f"unknown workload {name!r}; one of {WORKLOADS}")


@dataclass
class Outcome:
    planned: Planned
    row: RequestRow
    error: str = ""


def rejected_steps(spec: dict) -> int | None:
    """The response's count of verification steps that ended in a rejection (what the OSD
    per-token α needs), or None when the server does not report it."""
    for key in ("rejected_steps", "num_rejected_steps"):
        v = spec.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def auto_fields(spec: dict) -> dict:
    """What a response's ``speculation`` block says of the method that decoded it: the method,
    its decode seconds, and under ``auto`` (its ``auto`` block) the verification steps in all and
    the draft model's own (steps, accepted tokens, rejected steps): the share of ``auto``'s steps
    on the draft, and the draft's per-token α where it ran. Fields the block lacks are left out."""
    out: dict = {"method": str(spec.get("method") or "")}
    decode_s = spec.get("decode_s")
    if isinstance(decode_s, (int, float)) and not isinstance(decode_s, bool) and decode_s > 0:
        out["decode_s"] = float(decode_s)
    methods = (spec.get("auto") or {}).get("methods") if isinstance(spec.get("auto"), dict) else None
    if isinstance(methods, dict):
        ints = lambda m, k: int(v) if isinstance(v := (methods.get(m) or {}).get(k, 0), int) else 0  # noqa: E731
        out["steps"] = sum(ints(m, "steps") for m in methods)
        out["draft_steps"] = ints("draft", "steps")
        out["draft_accepted"] = ints("draft", "accepted")
        out["draft_rejected_steps"] = ints("draft", "rejected_steps")
    return out


class Replayer:
    """Replays a schedule through the OpenAI API with ``clients`` threads, in schedule order:
    chat requests with ``client.chat.completions.create``, completions with
    ``client.completions.create``; both read the response's ``speculation`` block. ``method``:
    the speculation method every request names (``{"speculation": {"method": ...}}``); None
    (the default) names none, so the server decodes with its default, ``auto``, as a client
    that knows nothing of speculation gets."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        clients: int,
        max_tokens: int,
        api_key: str = "specops-demo",
        timeout_s: float = 300.0,
        method: str | None = None,
    ) -> None:
        import openai

        self.method = method or None

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.model = model
        self.clients = clients
        self.max_tokens = max_tokens
        self.t0 = 0.0

    def request(self, p: Planned):
        extra_body = {"speculation": {"method": self.method}} if self.method else None
        if p.chat:
            return self.client.chat.completions.create(
                model=self.model,
                messages=p.as_messages(),
                max_tokens=self.max_tokens,
                temperature=0,
                extra_body=extra_body,
            )
        return self.client.completions.create(
            model=self.model, prompt=p.text, max_tokens=self.max_tokens, temperature=0, extra_body=extra_body
        )

    def one(self, p: Planned) -> Outcome:
        import openai

        start = time.monotonic()
        try:
            r = self.request(p)
            spec = (r.model_extra or {})["speculation"]
            end = time.monotonic()
            row = RequestRow(
                t=end - self.t0,
                cluster=spec["cluster"],
                phase=p.phase,
                drafted=spec["drafted"],
                accepted=spec["accepted"],
                draft_version=str(spec["draft_version"] or ""),  # none: auto never ran the draft
                latency_s=end - start,
                num_generated=r.usage.completion_tokens,
                rejected_steps=rejected_steps(spec),
                domain=p.domain,
                **auto_fields(spec),
            )
            return Outcome(p, row)
        except (openai.OpenAIError, KeyError, TypeError) as exc:
            end = time.monotonic()
            row = RequestRow(
                t=end - self.t0,
                cluster="",
                phase=p.phase,
                drafted=0,
                accepted=0,
                draft_version="",
                latency_s=end - start,
                num_generated=0,
                ok=False,
                domain=p.domain,
            )
            return Outcome(p, row, error=f"{type(exc).__name__}: {exc}"[:300])

    def run(
        self, schedule: list[Planned], on_outcome: Callable[[Outcome], None], stop: threading.Event | None = None
    ) -> list[Outcome]:
        self.t0 = time.monotonic()
        lock = threading.Lock()
        todo = iter(schedule)
        out: list[Outcome] = []

        def worker() -> None:
            while stop is None or not stop.is_set():
                with lock:
                    p = next(todo, None)
                if p is None:
                    return
                o = self.one(p)
                with lock:
                    out.append(o)
                on_outcome(o)

        threads = [threading.Thread(target=worker, name=f"client-{i}", daemon=True) for i in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sorted(out, key=lambda o: o.planned.index)

"""The demo's traffic: held-out prompts of two domains, a distribution shift, replayed over HTTP.

The schedule is seeded and fixed before the run: phase 1 is code-heavy, phase 2 shifts to
prose-heavy (OSD §5.2's shifting query distribution). By default every request is a
**distinct** held-out prompt, never served before (``specops.prompts.distinct_prompts``), so
a rising α is learning, not memory. With ``recurring``, prompts are drawn with replacement
from a pool per domain, as recurring queries of a real service would be: a draft can then
learn the exact continuations it will be asked for again. Requests carry no ``cluster``:
the router assigns it, and the routed cluster is what the report groups by (the true
domain is kept to measure routing).

:class:`Replayer` sends the schedule through the official ``openai`` client from a few
client threads and calls ``on_row`` for every finished request.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specops.report import RequestRow


@dataclass(frozen=True)
class Phase:
    name: str
    share: dict[str, float]
    """Probability of each domain in this phase."""
    fraction: float
    """Fraction of all requests in this phase."""


PHASES = (
    Phase("code-heavy", {"code": 0.8, "prose": 0.2}, 0.5),
    Phase("shift: prose-heavy", {"code": 0.2, "prose": 0.8}, 0.5),
)


@dataclass(frozen=True)
class Planned:
    index: int
    phase: str
    domain: str
    text: str


def build_schedule(model_dir: Path, tokenizer, *, num_requests: int, prompt_tokens: int, seed: int = 0,
                   recurring: int = 0, phases: tuple[Phase, ...] = PHASES,
                   extra: int = 0) -> tuple[list[Planned], dict[str, list[str]]]:  # fmt: skip
    """``num_requests`` requests over ``phases``, and ``extra`` more distinct prompts per domain
    that the schedule never uses (the closing comparison's never-served prompts).

    Distinct prompts by default; with ``recurring`` > 0, drawn with replacement from a
    pool of that many prompts per domain."""
    from specops.prompts import distinct_prompts

    domains = sorted({d for p in phases for d in p.share})
    want = recurring if recurring else num_requests  # at most every request from one domain
    pools: dict[str, list[str]] = {}
    unseen: dict[str, list[str]] = {}
    for d in domains:
        texts = [p.text for p in distinct_prompts(model_dir, tokenizer, d, want + extra, num_tokens=prompt_tokens,
                                                  seed=seed + 1)]  # fmt: skip
        if len(texts) <= extra:
            raise ValueError(f"not enough held-out prompts of domain {d!r} in {model_dir}")
        unseen[d], pools[d] = texts[:extra], texts[extra:]
    rng = random.Random(seed)
    nxt = {d: 0 for d in domains}
    out: list[Planned] = []
    for i, phase in enumerate(phases):
        n = num_requests - len(out) if i == len(phases) - 1 else round(num_requests * phase.fraction)
        names, weights = zip(*sorted(phase.share.items()))
        for _ in range(n):
            d = rng.choices(names, weights)[0]
            if recurring:
                text = rng.choice(pools[d])
            else:
                if nxt[d] >= len(pools[d]):
                    raise ValueError(f"only {len(pools[d])} distinct held-out prompts of domain {d!r}: "
                                     "lower the request count or use a recurring workload")  # fmt: skip
                text, nxt[d] = pools[d][nxt[d]], nxt[d] + 1
            out.append(Planned(len(out), phase.name, d, text))
    return out, unseen


@dataclass
class Outcome:
    planned: Planned
    row: RequestRow
    error: str = ""


class Replayer:
    """Replays a schedule through the OpenAI API with ``clients`` threads, in schedule order."""

    def __init__(self, base_url: str, model: str, *, clients: int, max_tokens: int, api_key: str = "specops-demo",
                 timeout_s: float = 300.0) -> None:  # fmt: skip
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.model = model
        self.clients = clients
        self.max_tokens = max_tokens
        self.t0 = 0.0

    def one(self, p: Planned) -> Outcome:
        import openai

        start = time.monotonic()
        try:
            r = self.client.completions.create(model=self.model, prompt=p.text, max_tokens=self.max_tokens,
                                               temperature=0, extra_body={"speculation": {"method": "draft"}})  # fmt: skip
            spec = (r.model_extra or {})["speculation"]
            end = time.monotonic()
            row = RequestRow(t=end - self.t0, cluster=spec["cluster"], phase=p.phase, drafted=spec["drafted"],
                             accepted=spec["accepted"], draft_version=str(spec["draft_version"]),
                             latency_s=end - start, num_generated=r.usage.completion_tokens)  # fmt: skip
            return Outcome(p, row)
        except (openai.OpenAIError, KeyError) as exc:
            end = time.monotonic()
            row = RequestRow(t=end - self.t0, cluster="", phase=p.phase, drafted=0, accepted=0, draft_version="",
                             latency_s=end - start, num_generated=0, ok=False)  # fmt: skip
            return Outcome(p, row, error=f"{type(exc).__name__}: {exc}"[:300])

    def run(self, schedule: list[Planned], on_outcome: Callable[[Outcome], None],
            stop: threading.Event | None = None) -> list[Outcome]:  # fmt: skip
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

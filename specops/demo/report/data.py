"""The closed-loop demo's record (``run.json``) and its numbers (``summary.json``).

``specops demo`` records what happened (one :class:`RequestRow` per request, the promotions and
rollbacks, the speed measurements, the registry versions) in a :class:`DemoRun`;
:mod:`specops.demo.report.page` renders it.

Two acceptance numbers, both pooled over a set of successful requests (never the mean of
per-request ratios):

- **α**, the OSD paper's per-token acceptance rate (§3; ``specops.serving.engine.types.token_alpha``):
  ``Σ accepted / (Σ accepted + Σ rejected steps)``, a rejected step being a verification step
  that ended in a rejection. It estimates the probability that a draft token is accepted given
  that the ones before it in its step were. It needs each response's ``rejected_steps``
  (``speculation`` block); rows without it (an older server) give ``null``.
- **acceptance**: ``Σ accepted / Σ drafted``. Smaller than α for k > 1, as it also counts the
  tokens drafted after a rejection, which were never tried.

In ``summary.json`` each cluster gets

- ``alpha_first_100`` / ``alpha_last_100``: α over its first / last 100 successful requests by finish
  time. With fewer than 200 requests the two windows overlap (``alpha_window`` says how many
  requests each holds), so ``alpha_first_half`` / ``alpha_last_half`` (first ``n // 2`` requests,
  the rest) are given too; they never overlap.
- ``alpha_by_phase``: α over the cluster's requests in each workload phase.
- ``acceptance_first_100``, ``acceptance_last_100``, ``acceptance_first_half``,
  ``acceptance_last_half``, ``acceptance_by_phase``: accepted / drafted over the same requests.
- ``promotions`` (kind ``promote``), ``rollbacks``, ``draft_versions`` (served, in order of first use).
- ``speedup_vs_target`` / ``speedup_vs_static``: online-draft tokens/s over target-only / static-draft
  tokens/s; ``null`` when either side was not measured.
- The default method (where ``auto`` decoded the traffic or was measured): ``auto_draft_share_*``
  (its share of verification steps on the draft model), ``auto_draft_alpha_*`` (the per-token α
  of those steps) and ``auto_served_tokens_per_s_*`` (generated tokens per decode second, as the
  server timed them) over the served traffic's first and last half; ``auto_speedup_vs_target_before``
  / ``auto_speedup_vs_target``: its tokens/s over target-only's on the never-served prompts,
  before any traffic (the static draft, the policy with no history) and after it (the final
  champion, the policy as the traffic left it), with its draft share and α there
  (``auto_draft_share_before`` ...).

An α or acceptance with no tried (drafted) tokens is ``null``: ``summary.json`` and ``run.json`` are
strict JSON (no NaN).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WINDOW = 100  # requests in the first / last α window of summary.json


@dataclass(frozen=True)
class RequestRow:
    """One request replayed through the HTTP API."""

    t: float  # seconds since the workload started, when the request finished
    cluster: str  # the cluster that served it (router's or explicit)
    phase: str  # workload phase name, e.g. "code-heavy", "shift: prose-heavy"
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    draft_version: str  # registry version used ("base" = the bootstrap draft before any promotion)
    latency_s: float
    num_generated: int
    ok: bool = True  # False = the request failed (error response / exception)
    rejected_steps: int | None = None  # verification steps that ended in a rejection (None: not reported)
    domain: str = ""  # the workload's true domain of the prompt ("" when unknown)
    method: str = ""  # the method that decoded it (the response's speculation.method; "" when not reported)
    decode_s: float | None = None  # the server's decode seconds (speculation.decode_s)
    steps: int | None = None  # auto: verification steps in all (None: a fixed method)
    draft_steps: int | None = None  # auto: steps the draft model proposed
    draft_accepted: int | None = None  # auto: tokens accepted on those steps
    draft_rejected_steps: int | None = None  # auto: those steps that ended in a rejection

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per decode second, as the server measured it; nan when not reported."""
        return self.num_generated / self.decode_s if self.decode_s else math.nan

    @property
    def alpha(self) -> float:
        """The OSD per-token α, accepted / (accepted + rejected steps); nan when nothing was
        tried or the rejected steps are unknown."""
        if self.rejected_steps is None or not self.accepted + self.rejected_steps:
            return math.nan
        return self.accepted / (self.accepted + self.rejected_steps)

    @property
    def acceptance(self) -> float:
        """accepted / drafted; nan when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else math.nan


@dataclass(frozen=True)
class Promotion:
    """A champion change of one cluster's draft."""

    t: float  # seconds since start
    cluster: str
    version: str
    kind: str = "promote"  # or "rollback"
    reason: str = ""


@dataclass(frozen=True)
class SpeedRow:
    """Decoding speed of one method on one cluster's eval prompts."""

    cluster: str
    method: str  # "target-only", "static draft", "online draft"
    draft_version: str  # "" for target-only, "base" for static, e.g. "7" for online
    tokens_per_s: float  # median over the eval prompts
    acceptance: float  # accepted / drafted over the eval prompts (nan for target-only)
    num_prompts: int
    identical: bool  # greedy outputs identical to target-only (losslessness check)
    alpha: float = math.nan  # OSD per-token α over the eval prompts (nan for target-only, or not measured)
    draft_share: float = math.nan  # auto: its share of verification steps on the draft model (nan: a fixed method)
    draft_alpha: float = math.nan  # auto: the per-token α of its draft-model steps (nan: none, or a fixed method)


@dataclass
class DemoRun:
    """Everything the demo recorded; ``run.json`` is this, as JSON."""

    started_at: str  # ISO time
    duration_s: float
    config: dict  # demo settings shown in the report
    requests: list[RequestRow]
    promotions: list[Promotion]
    speed: list[SpeedRow]
    registry_versions: list[dict]  # one dict per version; whatever keys exist are rendered
    mlflow_ui_url: str | None
    api_url: str | None
    notes: list[str] = field(default_factory=list)  # free-form lines shown at the top (e.g. warnings)
    speed_before: list[SpeedRow] = field(default_factory=list)  # target-only and auto before any traffic


# ---------------------------------------------------------------------------------------------- numbers


ALPHA_DEFINITION = (
    "α = Σ accepted / (Σ accepted + Σ rejected steps), the OSD paper's per-token acceptance rate "
    "(a rejected step: a verification step that ended in a rejection); acceptance = Σ accepted / "
    "Σ drafted"
)


def token_alpha(rows: list[RequestRow]) -> float | None:
    """The OSD per-token α of ``rows``: Σ accepted / (Σ accepted + Σ rejected steps). None when
    they tried no draft token, or when a row has no ``rejected_steps`` (an older server)."""
    if any(r.rejected_steps is None for r in rows):
        return None
    tried = sum(r.accepted + r.rejected_steps for r in rows)
    return sum(r.accepted for r in rows) / tried if tried else None


def acceptance(rows: list[RequestRow]) -> float | None:
    """Σ accepted / Σ drafted of ``rows``; None when they drafted nothing."""
    drafted = sum(r.drafted for r in rows)
    return sum(r.accepted for r in rows) / drafted if drafted else None


def draft_share(rows: list[RequestRow]) -> float | None:
    """``auto``'s share of verification steps on the draft model over ``rows`` (pooled); None
    when none of them was decoded by ``auto``."""
    rows = [r for r in rows if r.steps is not None]
    steps = sum(r.steps for r in rows)
    return sum(r.draft_steps or 0 for r in rows) / steps if steps else None


def draft_alpha(rows: list[RequestRow]) -> float | None:
    """The per-token α of ``auto``'s draft-model steps over ``rows`` (pooled); None when it ran none."""
    acc = sum(r.draft_accepted or 0 for r in rows if r.steps is not None)
    tried = acc + sum(r.draft_rejected_steps or 0 for r in rows if r.steps is not None)
    return acc / tried if tried else None


def served_speed(rows: list[RequestRow]) -> float | None:
    """Generated tokens per decode second over ``rows`` (pooled, as the server timed them); None
    when none reported its decode time."""
    rows = [r for r in rows if r.decode_s]
    return sum(r.num_generated for r in rows) / sum(r.decode_s for r in rows) if rows else None


def has_alpha(run: DemoRun) -> bool:
    """Every successful request reported its rejected steps (so α can be computed)."""
    ok = [r for r in run.requests if r.ok]
    return bool(ok) and all(r.rejected_steps is not None for r in ok)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def clusters_of(run: DemoRun) -> list[str]:
    """Cluster names seen anywhere in the run, sorted (a failed request with no cluster names none)."""
    names = {r.cluster for r in run.requests} | {p.cluster for p in run.promotions} | {s.cluster for s in run.speed}
    return sorted(n for n in names if n)


def served(run: DemoRun, cluster: str) -> list[RequestRow]:
    """The cluster's successful requests, by finish time."""
    return sorted((r for r in run.requests if r.ok and r.cluster == cluster), key=lambda r: r.t)


def phase_spans(run: DemoRun) -> list[tuple[str, float, float]]:
    """``(phase, start_s, end_s)`` of the workload, in order. Requests are ordered by start time
    (finish minus latency), so a request still in flight when the phase changes does not split it; each span
    runs to the start of the next."""
    rows = sorted(run.requests, key=lambda r: r.t - r.latency_s)
    spans: list[list[Any]] = []
    for r in rows:
        if not spans or spans[-1][0] != r.phase:
            spans.append([r.phase, 0.0 if not spans else max(0.0, r.t - r.latency_s), None])
    end = max([run.duration_s] + [r.t for r in rows]) if rows else run.duration_s
    for cur, nxt in zip(spans, spans[1:] + [[None, end, None]]):
        cur[2] = max(cur[1], nxt[1])
    return [(p, s, e) for p, s, e in spans]


def speeds_of(run: DemoRun, cluster: str) -> dict[str, SpeedRow]:
    """The cluster's speed rows by method."""
    return {s.method: s for s in run.speed if s.cluster == cluster}  # the last row of a method wins


def speed_ratio(num: SpeedRow | None, den: SpeedRow | None) -> float | None:
    """tokens/s of ``num`` over ``den``; None when either is missing or the ratio is not finite."""
    if num is None or den is None or not den.tokens_per_s or not math.isfinite(num.tokens_per_s / den.tokens_per_s):
        return None
    return num.tokens_per_s / den.tokens_per_s


def auto_summary(run: DemoRun, cluster: str, rows: list[RequestRow]) -> dict:
    """The default method's numbers of one cluster ({} when ``auto`` decoded none of its requests
    and was not measured): on the served traffic, its share of steps on the draft model, the
    draft's α on them and its tokens/s, first half vs last half; on the never-served prompts,
    its speed-up over target-only before any traffic (the static draft) and after (the final
    champion), each against target-only measured beside it."""
    half = len(rows) // 2
    sp = speeds_of(run, cluster)
    pre = {s.method: s for s in run.speed_before if s.cluster == cluster}
    if not any(r.steps is not None for r in rows) and "auto" not in sp:
        return {}
    after, before = sp.get("auto"), pre.get("auto")
    return {
        "auto_draft_share_first_half": _r(draft_share(rows[:half])),
        "auto_draft_share_last_half": _r(draft_share(rows[half:])),
        "auto_draft_alpha_first_half": _r(draft_alpha(rows[:half])),
        "auto_draft_alpha_last_half": _r(draft_alpha(rows[half:])),
        "auto_served_tokens_per_s_first_half": _r(served_speed(rows[:half]), 2),
        "auto_served_tokens_per_s_last_half": _r(served_speed(rows[half:]), 2),
        "auto_speedup_vs_target_before": _r(speed_ratio(before, pre.get("target-only")), 3),
        "auto_speedup_vs_target": _r(speed_ratio(after, sp.get("target-only")), 3),
        "auto_draft_share_before": _r(before.draft_share) if before else None,
        "auto_draft_share_after": _r(after.draft_share) if after else None,
        "auto_draft_alpha_before": _r(before.draft_alpha) if before else None,
        "auto_draft_alpha_after": _r(after.draft_alpha) if after else None,
    }


def summarize(run: DemoRun) -> dict:
    """The content of ``summary.json`` (see the module docstring for what each number means)."""
    clusters = {}
    for name in clusters_of(run):
        rows = served(run, name)
        half = len(rows) // 2
        versions = list(dict.fromkeys(r.draft_version for r in rows if r.draft_version))
        kinds = Counter(p.kind for p in run.promotions if p.cluster == name)
        sp = speeds_of(run, name)
        first, last = token_alpha(rows[:WINDOW]), token_alpha(rows[-WINDOW:])
        phases = list(dict.fromkeys(r.phase for r in rows))
        clusters[name] = {
            "requests": len(rows),
            "failed_requests": sum(1 for r in run.requests if r.cluster == name and not r.ok),
            "alpha_window": min(WINDOW, len(rows)),
            "alpha_first_100": _r(first),
            "alpha_last_100": _r(last),
            "alpha_delta": _r(last - first) if first is not None and last is not None else None,
            "alpha_first_half": _r(token_alpha(rows[:half])),
            "alpha_last_half": _r(token_alpha(rows[half:])),
            "alpha_by_phase": {p: _r(token_alpha([r for r in rows if r.phase == p])) for p in phases},
            "acceptance_first_100": _r(acceptance(rows[:WINDOW])),
            "acceptance_last_100": _r(acceptance(rows[-WINDOW:])),
            "acceptance_first_half": _r(acceptance(rows[:half])),
            "acceptance_last_half": _r(acceptance(rows[half:])),
            "acceptance_by_phase": {p: _r(acceptance([r for r in rows if r.phase == p])) for p in phases},
            "promotions": kinds["promote"],
            "rollbacks": kinds["rollback"],
            "draft_versions": versions,
            "speedup_vs_target": _r(speed_ratio(sp.get("online draft"), sp.get("target-only")), 3),
            "speedup_vs_static": _r(speed_ratio(sp.get("online draft"), sp.get("static draft")), 3),
            **auto_summary(run, name, rows),
        }
    return {
        "clusters": clusters,
        "alpha_definition": ALPHA_DEFINITION,
        "failed_requests": sum(1 for r in run.requests if not r.ok),
        "requests": len(run.requests),
        "duration_s": _r(run.duration_s, 2),
        "started_at": run.started_at,
    }


# ---------------------------------------------------------------------------------------------- JSON


def strict_json(obj: Any) -> Any:
    """``obj`` with every non-finite float as None, so it dumps as strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def dump_json(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` as indented strict JSON."""
    path.write_text(json.dumps(strict_json(obj), indent=2, allow_nan=False, default=str) + "\n")


def _build(cls: type, d: dict) -> Any:
    """A dataclass from its dict: unknown keys ignored, None back to nan in float fields."""
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            v = d[f.name]
            kw[f.name] = math.nan if v is None and f.type == "float" else v
    return cls(**kw)


def load_run(path: Path) -> DemoRun:
    """Read a ``run.json`` written by :func:`specops.demo.report.page.write_report`."""
    d = json.loads(Path(path).read_text())
    d["requests"] = [_build(RequestRow, r) for r in d.get("requests", [])]
    d["promotions"] = [_build(Promotion, p) for p in d.get("promotions", [])]
    d["speed"] = [_build(SpeedRow, s) for s in d.get("speed", [])]
    d["speed_before"] = [_build(SpeedRow, s) for s in d.get("speed_before", [])]
    return _build(DemoRun, d)


def version_label(version: str) -> str:
    """``v7`` for a numbered registry version, else the name itself (``base``)."""
    return f"v{version}" if version.isdigit() else version

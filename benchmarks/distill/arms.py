"""The OSD benchmark's gate arms and domain switch: the gate's windows judged side by side on the
same candidates, the audit of every promotion, and the shift run's segments and recovery."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch

from benchmarks.distill.constants import RECOVERY_MARGIN, SHIFT_AT, SHIFT_MARGIN, SHIFT_WINDOW, WINDOW
from benchmarks.distill.served import Outcome, Served, pooled, serve
from specops.serving.engine.types import token_alpha
from specops.trainer.promote import PromoteConfig, fresh_window, gate_window, judge


def arm_config(pcfg: PromoteConfig, spec: str) -> PromoteConfig:
    """A gate arm's configuration from ``W`` (held-out window W, the default fresh evidence) or
    ``W:F`` (window W, F fresh requests; F = 0 is the held-out-only gate)."""
    window, _, fresh = str(spec).partition(":")
    return replace(pcfg, window=int(window), fresh=int(fresh) if fresh else pcfg.fresh)


class WindowArm:
    """One more gated arm of :func:`learning_run`: its own champion per cluster, gated with its
    own window (and fresh evidence) on the same candidates, serving (measured on) the same requests.
    Row keys start ``w{spec}_`` with ``:`` written ``f`` (``w16f0_accepted``)."""

    def __init__(self, cfg: PromoteConfig, clusters: list[str], base: torch.nn.Module, spec: str) -> None:
        self.cfg = cfg
        self.spec = str(spec)
        self.prefix = f"w{arm_key(spec)}_"
        self.model = {c: copy.deepcopy(base) for c in clusters}
        self.version = {c: 0 for c in clusters}
        self.fresh_cache: dict[str, dict] = {c: {} for c in clusters}
        self.gates: list[dict] = []

    def serve_row(self, c: str, s: Served, primary: Outcome, args) -> dict:
        out = serve(self.model[c], s, args.k, args.max_new_tokens)
        p = self.prefix
        return {f"{p}accepted": out.accepted, f"{p}rejected": len(out.rejected), f"{p}version": self.version[c]}

    def judge(self, c: str, st, held: list, vocab, request: int) -> None:
        result = judge(
            str(st.version),
            str(self.version[c]),
            st.published,
            self.model[c],
            gate_window([h.record for h in held], self.cfg),
            fresh_window(st.fresh, self.cfg, self.version[c]),
            self.cfg,
            vocab,
            fresh_cache=self.fresh_cache[c],
        )
        self.gates.append({"request": request, "cluster": c, "candidate": st.version, "promoted": result.promoted})
        if result.promoted:
            self.model[c].load_state_dict(st.published.state_dict())
            self.version[c] = st.version
            self.fresh_cache[c] = {}

    def summary(self) -> dict:
        return {
            "window": self.cfg.window,
            "fresh": self.cfg.fresh,
            "gates": len(self.gates),
            "promotions": sum(g["promoted"] for g in self.gates),
            "promoted_at": [g["request"] for g in self.gates if g["promoted"]],
        }


def arm_label(key: str) -> str:
    """``16f32`` (or ``16:32``, or a plain window ``16``) in words."""
    window, _, fresh = str(key).replace("f", ":").partition(":")
    held = "all held-out (256)" if window == "0" else f"window {window}"
    if not fresh:
        return f"gated, {held}"
    return f"gated, {held}, " + ("no fresh" if fresh == "0" else f"{fresh} fresh")


def arm_key(spec) -> str:
    """``W:F`` as it appears in row keys and JSON (``WfF``); a plain ``W`` stays ``W``."""
    return str(spec).replace(":", "f")


def audit_promotion(
    old: torch.nn.Module,
    new: torch.nn.Module,
    future: list[Served],
    args,
    *,
    request: int,
    cluster: str,
    old_version: int,
    new_version: int,
) -> dict:
    """The promoted version and the one it replaces, both serving the cluster's next requests
    (paired): the per-token α difference and its 95 % interval (requests are the units)."""
    a = [serve(new, s, args.k, args.max_new_tokens) for s in future]
    b = [serve(old, s, args.k, args.max_new_tokens) for s in future]
    if not future:
        return {
            "request": request,
            "cluster": cluster,
            "from": old_version,
            "to": new_version,
            "requests": 0,
            "delta_alpha": 0.0,
            "ci95": float("inf"),
            "worse_beyond_noise": False,
        }
    na = token_alpha(sum(o.accepted for o in a), sum(len(o.rejected) for o in a))
    nb = token_alpha(sum(o.accepted for o in b), sum(len(o.rejected) for o in b))
    # paired, per request: the difference of the two ratio estimators, linearised
    ta = sum(o.accepted + len(o.rejected) for o in a) or 1
    tb = sum(o.accepted + len(o.rejected) for o in b) or 1
    d = [
        (x.accepted - na * (x.accepted + len(x.rejected))) / ta
        - (y.accepted - nb * (y.accepted + len(y.rejected))) / tb
        for x, y in zip(a, b)
    ]
    half = 1.96 * math.sqrt(sum(v * v for v in d) * len(d) / max(1, len(d) - 1)) if len(d) > 1 else float("inf")
    delta = na - nb
    return {
        "request": request,
        "cluster": cluster,
        "from": old_version,
        "to": new_version,
        "requests": len(d),
        "delta_alpha": delta,
        "ci95": half,
        "worse_beyond_noise": bool(d) and delta + half < 0,
    }


# ---------------------------------------------------------------- 6. metrics
def moving(rows: list[dict], prefix: str = "", window: int = WINDOW) -> list[float]:
    """Pooled per-token α over the trailing ``window`` rows."""
    a, r = f"{prefix}accepted", f"{prefix}rejected"
    out, sa, sr = [], 0, 0
    for i, row in enumerate(rows):
        sa, sr = sa + row[a], sr + row[r]
        if i >= window:
            sa, sr = sa - rows[i - window][a], sr - rows[i - window][r]
        out.append(token_alpha(sa, sr))
    return out


def recovery(
    rows: list[dict],
    start: int,
    end: int,
    reference: float,
    *,
    margin: float = RECOVERY_MARGIN,
    min_seen: int = 20,
    window: int = WINDOW,
    prefix: str = "",
) -> int | None:
    """Requests after the switch at ``start`` until the pooled α of the trailing ``window``
    requests since the switch is back within ``margin`` of ``reference``; None if never before ``end``."""
    a, r = f"{prefix}accepted", f"{prefix}rejected"
    for n in range(start + min_seen, end + 1):
        seg = rows[max(start, n - window) : n]
        if token_alpha(sum(x[a] for x in seg), sum(x[r] for x in seg)) >= reference - margin:
            return n - start
    return None


def segment_alpha(rows: list[dict], start: int, n: int, prefix: str = "", window: int = SHIFT_WINDOW) -> float:
    """Pooled per-token α of the ``window`` requests ending ``n`` requests after ``start`` (all after it)."""
    a, r = f"{prefix}accepted", f"{prefix}rejected"
    seg = rows[max(start, start + n - window) : start + n]
    return token_alpha(sum(x[a] for x in seg), sum(x[r] for x in seg))


def shift_segments(rows: list[dict], domains: list[str], n: int, arms: dict[str, str]) -> list[dict]:
    """Per segment after the first: each arm's α after ``SHIFT_AT`` requests of the new domain,
    the reference it should reach and how many requests each arm took to come within
    ``SHIFT_MARGIN`` of it (None: not in the segment).

    The reference of a domain served before is the gated arm's pooled α over the last ``WINDOW``
    requests it served of it (its own level before the switch); of a domain never served before,
    the ungated arm's over the segment's last ``WINDOW`` requests (the level the trainer reaches
    on it, which no gate slows). ``arms`` maps a name to its row prefix."""
    out = []
    tail = min(WINDOW, n)
    points = [k for k in SHIFT_AT if k <= n] or [n]
    for j in range(1, len(domains)):
        start, end = j * n, (j + 1) * n
        prev = [i for i in range(j) if domains[i] == domains[j]]
        if prev:
            last = prev[-1]
            ref = pooled(rows[(last + 1) * n - tail : (last + 1) * n])
            ref_from = f"gated, last {tail} requests of segment {last + 1}"
        else:
            seg = rows[end - tail : end]
            ref = token_alpha(sum(r["u_accepted"] for r in seg), sum(r["u_rejected"] for r in seg))
            ref_from = f"ungated, last {tail} requests of this segment"
        seg_out = {"segment": j + 1, "domain": domains[j], "start": start, "reference": ref, "reference_from": ref_from}
        for name, prefix in arms.items():
            at = {str(k): segment_alpha(rows, start, k, prefix) for k in points}
            adapt = None
            for k in range(min(20, n), n + 1):
                if segment_alpha(rows, start, k, prefix) >= ref - SHIFT_MARGIN:
                    adapt = k
                    break
            seg_out[name] = {"alpha_at": at, "adapt_requests": adapt}
        k150 = 150 if n >= 150 else n  # the bar's point (a quick run's segment end)
        seg_out["gated_minus_ungated_150"] = segment_alpha(rows, start, k150) - segment_alpha(rows, start, k150, "u_")
        out.append(seg_out)
    return out


def shift_markdown(sh: dict) -> str:
    """The shift run's table: per segment and arm, α after 50/150/300 requests and requests to adapt."""
    segs = sh.get("segments") or []
    if not segs:
        return ""
    arms = [a for a in segs[0] if isinstance(segs[0][a], dict) and "alpha_at" in segs[0][a]]
    ats = list(segs[0][arms[0]]["alpha_at"])
    default = arm_label(f"{sh.get('window', '?')}:{sh.get('fresh', 0)}").removeprefix("gated, ")
    label = {"gated": f"gated (default: {default})", "ungated": "ungated"}
    lines = [
        f"Domain switch {' → '.join(sh['domains'])}, {sh['boundaries'][0]} requests per segment, one draft; per-token α "
        f"of the {SHIFT_WINDOW} requests served before each point; adapted: requests until that α is within "
        f"{SHIFT_MARGIN} of the reference.",
        "",
        "| segment | arm | " + " | ".join(f"α after {k}" for k in ats) + " | reference | adapted after | promotions |",
        "|---|---|" + "---:|" * (len(ats) + 3),
    ]
    promos = {"gated": sh.get("promotions"), "ungated": "every update"}
    promos.update({f"w{k}": w["promotions"] for k, w in (sh.get("windows") or {}).items()})
    for seg in segs:
        for a in arms:
            name = label.get(a, arm_label(a[1:]))
            ad = seg[a]["adapt_requests"]
            lines.append(
                f"| {seg['segment']}: {seg['domain']} | {name} | "
                + " | ".join(f"{seg[a]['alpha_at'][k]:.3f}" for k in ats)
                + f" | {seg['reference']:.3f} | {'not reached' if ad is None else ad} | {promos.get(a, '')} |"
            )
    return "\n".join(lines)

"""One point of ``benchmarks/ralm.py``'s retrieval-cost curve: RaLMSeq against RaLMSpec
(synchronous, asynchronous, and the paper's OS³ that always speculates) on one knowledge base,
retriever, backend and number of concurrent clients.

**Arms are interleaved.** The questions run in waves of ``clients`` (one question per
client, all at once); within a wave every arm runs in turn, the order rotating from wave to
wave, so a slow minute of the machine hits every arm alike. A wave's wall time per arm is
what a client sees; with one client it is the question's latency.

**The honest bound.** Speculation can only remove the time RaLMSeq spends in KB searches,
transport and queueing included (``r_save``): RaLMSpec still encodes every query (``r_encode``),
looks it up in its cache and generates every token. So no RaLMSpec arm can beat
``1 / (1 - r_save)``, and ``r_save`` comes from the RaLMSeq arm, never from the arm it bounds.

**γ** is measured, not assumed: the share of the cache's guesses that equal the KB's answer
over every guess the paper's OS³ arm (which always speculates) had checked.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

from specops.core.passage import indexed_text
from specops.serving.engine.types import SamplingParams
from specops.serving.ralm.loop import RalmConfig, RalmGenerator
from specops.serving.ralm.os3 import PAPER_OS3

SEQ, SYNC, PSA, PAPER = "RaLMSeq", "RaLMSpec sync", "RaLMSpec async", "RaLMSpec paper OS3"
AUTO = "RaLMSpec"
P256, FIXED, REGEN = "RaLMSpec prefetch 256", "RaLMSpec stride 3", "RaLMSpec regenerate"
ARMS = {
    SEQ: RalmConfig(mode="ralmseq"),
    AUTO: RalmConfig(),
    SYNC: RalmConfig(asynchronous=False),
    PSA: RalmConfig(asynchronous=True),
    PAPER: RalmConfig(asynchronous=True, speculation_off=False),
}
ABLATIONS = {
    P256: RalmConfig(prefetch=256),
    FIXED: RalmConfig(speculation_stride=3),
    REGEN: RalmConfig(reverify=False),
}
"""What each refinement is worth, each arm serving's default (``RaLMSpec``) with one thing changed
(RaLMSpec §5's ablations): the paper's other prefetch size (256 where serving takes 20), the
scheduler off (the paper's fixed stride 3), and a mismatch regenerating its interval instead of
re-verifying from the mismatch. Asynchronous verification off is the ``sync`` arm."""
ARM_OS3 = {PAPER: PAPER_OS3}
"""``RaLMSpec`` is serving's default: prefetch 20, OS³ (γ capped at 0.9, speculation off when it
cannot pay), re-verification from a mismatch, and verification asynchronous while its request
decodes alone, synchronous while others decode beside it (the count of the wave's requests still
running, read every round, as serving reads its batcher's) and always synchronous over embedded
Milvus Lite (from 2026-12-03; the curve's in-memory points are unaffected). ``sync`` and ``async`` fix that
choice; ``paper OS3`` is ``async`` with the paper's scheduler (γ capped at 0.6, always
speculates)."""
SPEC_ARMS = (AUTO, SYNC, PSA, PAPER)
HEADLINE = AUTO
"""The arm the summary's speed-ups and fractions of the bound are of (before serving chose the
verification mode itself, ``async``: :func:`headline` reads older JSONs so)."""


def headline(arms: dict) -> str:
    return HEADLINE if HEADLINE in arms else PSA


ABLATE_AT = ("memory-exact", "all")
"""Where ``--ablations`` runs: the in-memory exact points (the curve's first three, where only the
retrieval cost varies and the three ablations each cost a full arm) or every point."""


def ablated(point: Point, ablations: bool, at: str = "all") -> bool:
    """Whether ``point`` runs the ablation arms."""
    return ablations and (at == "all" or (point.backend == "memory" and point.retriever == "exact"))


def arm_names(ablations: bool) -> dict[str, RalmConfig]:
    return {**ARMS, **(ABLATIONS if ablations else {})}


@dataclass(frozen=True)
class Point:
    """Where on the curve: ``backend`` is ``memory`` (the KB in this process), ``milvus-lite``
    (Milvus Lite embedded in this process) or ``milvus-server`` (``milvus-lite server`` in its
    own process, over loopback gRPC)."""

    backend: str
    retriever: str
    passages: int
    clients: int = 1
    embedder: str = "hash"

    @property
    def label(self) -> str:
        c = f" x{self.clients} clients" if self.clients > 1 else ""
        return f"{self.backend}/{self.retriever} {self.passages:,} ({self.embedder}){c}"


def parse_point(spec: str) -> Point:
    """``BACKEND/RETRIEVER/PASSAGES[xCLIENTS][/minilm]``, e.g. ``memory/exact/1000000`` or
    ``milvus-server/exact/100000x8``."""
    parts = spec.strip().split("/")
    if len(parts) not in (3, 4) or parts[0] not in ("memory", "milvus-lite", "milvus-server"):
        raise SystemExit(f"--points: {spec!r} is not BACKEND/RETRIEVER/PASSAGES[xCLIENTS][/minilm]")
    size, _, clients = parts[2].lower().partition("x")
    embedder = parts[3] if len(parts) == 4 else "hash"
    if embedder not in ("hash", "minilm") or not size.isdigit() or (clients and not clients.isdigit()):
        raise SystemExit(f"--points: {spec!r}: PASSAGES and CLIENTS are integers, the embedder hash or minilm")
    return Point(parts[0], parts[1], int(size), int(clients or 1), embedder)


def record(res) -> dict:
    st, t = res.stats, res.stats.time_s
    return {
        "total_s": t["total"],
        "generate_s": t["generate"],
        "retrieval_s": st.retrieval_s,
        "kb_search_s": t["kb_search"],
        "kb_wait_s": t["kb_wait"],
        "embed_s": t["embed"],
        "cache_s": t["cache"],
        "async_overlap_s": t["async_overlap"],
        "intervals": st.intervals,
        "kb_calls": st.kb_calls,
        "kb_queries": st.kb_queries,
        "mismatches": st.mismatches,
        "rolled_back": st.rolled_back_tokens,
        "strides": list(st.strides),
        "unspeculated": st.unspeculated,
        "guesses_checked": st.guesses_checked,
        "guesses_correct": st.guesses_correct,
        "tokens": len(res.token_ids),
    }


def _pinned(cores: set[int] | None):
    """A thread initializer that moves the calling thread onto ``cores`` (Linux)."""

    def pin() -> None:
        if cores:
            os.sched_setaffinity(threading.get_native_id(), cores)

    return pin


def run_point(point: Point, kb, engine, tok, questions: list, args, resume=None, on_wave=None) -> list[dict]:
    """Every arm on every question in waves of ``point.clients``; returns one row per wave.
    RaLMSpec's verification workers run on ``args.kb_core_set`` (the retrieval side's cores).
    ``resume``: rows of this point's first waves, measured before (they are kept, not rerun);
    ``on_wave(rows)`` is called after every wave (the checkpoint)."""
    retriever = kb.retriever(point.retriever)
    texts = lambda ids: [indexed_text(p) for p in kb.passages(ids)]  # noqa: E731
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = [tok.encode(q.prompt, add_special_tokens=False) for q in questions]
    c = point.clients
    waves = [list(range(i, min(i + c, len(prompts)))) for i in range(0, len(prompts), c)]
    pools = [
        ThreadPoolExecutor(1, thread_name_prefix=f"ralm-verify-{i}", initializer=_pinned(args.kb_core_set))
        for i in range(c)
    ]
    clients = ThreadPoolExecutor(c, thread_name_prefix="ralm-client")
    configs = arm_names(ablated(point, getattr(args, "ablations", False), getattr(args, "ablate_at", "all")))
    running, lock = [0], threading.Lock()  # the wave's requests still decoding: serving's batcher count

    def one(arm: str, qi: int, slot: int):
        gen = RalmGenerator(
            engine,
            retriever,
            texts,
            tok,
            configs[arm],
            pool=pools[slot],
            os3=ARM_OS3.get(arm),
            concurrency=lambda: running[0],
        )
        try:
            return gen.generate(prompts[qi], params)
        finally:
            with lock:
                running[0] -= 1

    def wave(arm: str, qs: list[int]) -> tuple[float, list]:
        running[0] = len(qs)
        t0 = time.perf_counter()
        futures = [clients.submit(one, arm, qi, slot) for slot, qi in enumerate(qs)]
        results = [f.result() for f in futures]
        return time.perf_counter() - t0, results

    done = list(resume or [])
    try:
        for arm in configs:  # warm-up: the exact scorer's matrix, the KV path, the Milvus connection
            wave(arm, waves[0][:1])
        rows = done
        arms = list(configs)
        with tqdm(total=len(waves) * args.runs, initial=len(done) * args.runs, desc=point.label, unit="wave") as bar:
            for wi, qs in enumerate(waves):
                if wi < len(done):  # measured in an earlier session (--resume)
                    continue
                runs: dict[str, list] = {a: [] for a in arms}
                for run in range(args.runs):
                    shift = (wi + run) % len(arms)
                    for arm in arms[shift:] + arms[:shift]:  # rotate who goes first
                        runs[arm].append(wave(arm, qs))
                    bar.update(1)
                ref = {qi: r.token_ids for qi, r in zip(qs, runs[SEQ][0][1])}
                row = {"wave": wi, "questions": qs, "arms": {}}
                for arm, waves_run in runs.items():
                    wall, results = sorted(waves_run, key=lambda w: w[0])[len(waves_run) // 2]
                    row["arms"][arm] = {
                        "wall_s": wall,
                        "requests": [record(r) for r in results],
                        "identical": all(
                            r.token_ids == ref[qi] for _, rs in waves_run for qi, r in zip(qs, rs, strict=True)
                        ),
                    }
                rows.append(row)
                if on_wave is not None:
                    on_wave(rows)
        return rows
    finally:
        clients.shutdown()
        for p in pools:
            p.shutdown()


def _sum(rows: list[dict], arm: str, key: str) -> float:
    return sum(req[key] for r in rows for req in r["arms"][arm]["requests"])


def model_ceiling(rows: list[dict], bar: float = 0.8) -> dict:
    """What RaLMSpec's own model (``os3.objective``, the paper's two latency forms) allows at a
    point's measured costs, whatever the scheduler does: ``a`` = RaLMSeq's time per interval
    outside the KB search, ``b`` = its time per search, γ = the highest hit rate any speculating
    arm measured; the best stride (1..32) of the synchronous and of the asynchronous objective,
    with the search of a batch priced as one query, the cache free and no rework after a
    mismatch. So it is a ceiling: where it is under 0.8 of the bound, 0.8 cannot be reached at
    this γ on this machine. As a speed-up over RaLMSeq's ``a + b`` per interval and as a fraction
    of the bound ``1 / (1 - r_save)``; ``model_gamma_needed`` is the γ at which the ceiling would
    reach ``bar`` of the bound at these costs (None where even γ → 1 does not)."""
    from specops.serving.ralm.os3 import objective

    seq = [req for r in rows for req in r["arms"][SEQ]["requests"]]
    search = sum(q["kb_search_s"] for q in seq)
    a = (sum(q["total_s"] for q in seq) - search) / max(1, sum(q["intervals"] for q in seq))
    b = search / max(1, sum(q["kb_calls"] for q in seq))
    gammas = {}
    for arm in rows[0]["arms"]:
        reqs = [req for r in rows for req in r["arms"][arm]["requests"]]
        checked = sum(q["guesses_checked"] for q in reqs)
        if arm != SEQ and checked:
            gammas[arm] = sum(q["guesses_correct"] for q in reqs) / checked
    if a <= 0 or b <= 0 or not gammas:
        return {
            "model_a_s": a,
            "model_b_s": b,
            "model_gamma": None,
            "model_speedup": None,
            "model_fraction_of_bound": None,
        }

    def best(g: float) -> tuple[float, int, bool]:
        return max((objective(n, g, a, b, asynchronous=m), n, m) for n in range(1, 33) for m in (False, True))

    def fraction(g: float) -> float:
        return best(g)[0] * a

    g = min(max(gammas.values()), 0.999)
    rate, stride, asynchronous = best(g)
    speedup = rate * (a + b)
    needed = None
    if fraction(0.0) >= bar:
        needed = 0.0
    elif fraction(0.999) >= bar:
        lo, hi = 0.0, 0.999
        for _ in range(40):
            lo, hi = (lo, (lo + hi) / 2) if fraction((lo + hi) / 2) >= bar else ((lo + hi) / 2, hi)
        needed = hi
    return {
        "model_a_s": a,
        "model_b_s": b,
        "model_gamma": g,
        "model_gamma_arm": max(gammas, key=gammas.get),
        "model_stride": stride,
        "model_asynchronous": asynchronous,
        "model_speedup": speedup,
        "model_fraction_of_bound": speedup * a / (a + b),
        "model_gamma_needed": needed,
    }


def point_summary(point: Point, rows: list[dict]) -> dict:
    """r_save, r_encode and the bound from RaLMSeq; per arm the speed-up (RaLMSeq's summed wave
    wall time over the arm's), its fraction of the bound, and the loop's counts; γ measured."""
    seq_total = max(_sum(rows, SEQ, "total_s"), 1e-9)
    r_save = _sum(rows, SEQ, "kb_search_s") / seq_total
    r_encode = _sum(rows, SEQ, "embed_s") / seq_total
    bound = 1.0 / max(1.0 - r_save, 1e-9)
    seq_wall = sum(r["arms"][SEQ]["wall_s"] for r in rows)
    arms = {}
    for arm in rows[0]["arms"]:
        reqs = [req for r in rows for req in r["arms"][arm]["requests"]]
        wall = sum(r["arms"][arm]["wall_s"] for r in rows)
        strides = [s for req in reqs for s in req["strides"]]
        checked = sum(req["guesses_checked"] for req in reqs)
        mean = lambda key: statistics.fmean(req[key] for req in reqs)  # noqa: E731
        arms[arm] = {
            "wall_s": wall,
            "speedup": seq_wall / max(wall, 1e-9),
            "fraction_of_bound": (seq_wall / max(wall, 1e-9)) / bound,
            "median_request_s": statistics.median(req["total_s"] for req in reqs),
            "generate_s": mean("generate_s"),
            "retrieval_s": mean("retrieval_s"),
            "kb_search_s": mean("kb_search_s"),
            "embed_s": mean("embed_s"),
            "cache_s": mean("cache_s"),
            "kb_calls": mean("kb_calls"),
            "intervals": mean("intervals"),
            "mismatches": mean("mismatches"),
            "unspeculated": mean("unspeculated"),
            "mean_stride": statistics.fmean(strides) if strides else None,
            "async_overlap_s": mean("async_overlap_s"),
            "gamma": sum(req["guesses_correct"] for req in reqs) / checked if checked else None,
            "identical": all(r["arms"][arm]["identical"] for r in rows),
        }
    return {
        "retriever": point.retriever,
        "backend": point.backend,
        "passages": point.passages,
        "embedder": point.embedder,
        "clients": point.clients,
        "questions": sum(len(r["questions"]) for r in rows),
        "r_save": r_save,
        "r_encode": r_encode,
        "r_cache": _sum(rows, SEQ, "cache_s") / seq_total,
        "bound": bound,
        "speedup": arms[headline(arms)]["speedup"],
        "headline": headline(arms),
        "gamma": arms[PAPER]["gamma"],
        "kb_search_ms": 1000 * _sum(rows, SEQ, "kb_search_s") / max(1.0, _sum(rows, SEQ, "kb_calls")),
        "arms": arms,
        "outputs_identical": all(a["identical"] for a in arms.values()),
        **model_ceiling(rows),
    }

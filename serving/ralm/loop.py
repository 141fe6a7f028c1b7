"""Iterative retrieval-augmented generation: RaLMSeq and RaLMSpec (the RaLMSpec paper, §3–4).

**RaLMSeq** (the baseline, In-Context RaLM of Ram et al.): every ``interval`` (4) generated
tokens, retrieve the top-1 passage of the knowledge base for the last ``query_tokens`` (32)
tokens of prompt + output, put it before the prompt, and generate the next ``interval``
tokens.

**RaLMSpec** (Algorithm 1): the first retrieval is real and seeds a per-request *local
cache*; every later retrieval is first *speculated* from the cache (ranked with the KB's own
score, so a cached passage scores exactly as in the KB), and generation goes on with the
speculated passage. After ``s`` such speculation steps one *batched* KB retrieval verifies
``q_1..q_s``; at the first mismatch the output is rolled back to that step and regenerated
with the true passage (ours, ``reverify``: the withdrawn tokens are first verified again under
the true passage as one draft, in one target pass, so the prefix both passages give is kept
instead of regenerated; the paper regenerates the whole interval). Refinements (§4): *prefetch* (the top-``prefetch`` results of every
verification go into the cache, not just the first retrieval's), *OS³* (``s`` chosen live by
``specops.serving.ralm.os3``) and *asynchronous verification*: the batched KB retrieval runs in a
worker thread while the main thread makes the next speculation step (torch, FAISS and
numpy release the GIL), and the measured wall time shows the overlap.

**Same output.** Greedy RaLMSpec emits exactly RaLMSeq's tokens: the passage of every
interval is the KB's (verification), the query of an interval is encoded once, on its own,
and searched with a retriever whose rows do not depend on the batch
(``specops.serving.retrieval.retriever``), and both loops drive generation identically: one decode
session per run of intervals with the same passage (the KV cache is kept while the passage
stays, a passage change re-encodes passage + prompt + output), each interval capped at
``interval`` tokens. Rollback withdraws tentative tokens from the session that generated them
(its KV cache and proposer roll back with it, ``DecodeSession.rollback_to``) or drops the
sessions opened after the mismatch. Between retrievals, generation is speculative decoding
with the request's proposer (the cluster's draft by default): the two ideas compose.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from specops.serving.engine.proposer import Proposer
from specops.serving.engine.session import DecodeSession
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import ContextSpan, Proposals, SamplingParams
from specops.serving.ralm.os3 import RALM_OS3, OS3Config, StrideScheduler
from specops.serving.ralm.types import RalmConfig, RalmResult, RalmStats
from specops.serving.retrieval.retriever import Query, Retriever

log = logging.getLogger(__name__)

ASYNC_MAX_CONCURRENCY = 1
"""``RalmConfig.asynchronous = None`` verifies asynchronously while at most this many requests
decode on the engine (this one included), synchronously above."""


class _Stopped(Exception):
    """``on_final`` returned True: a stop sequence was seen in the final output."""


class LocalCache:
    """A request's speculation cache: passage ids, ranked per query with the KB's own score."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, ids) -> None:
        for pid in (int(i) for i in np.asarray(ids).ravel()):
            if pid < 0:
                continue
            self._ids.pop(pid, None)
            self._ids[pid] = None
            if len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def top1(self, retriever: Retriever, query: Query) -> int:
        """The cached passage the KB would rank first among the cached ones (ties: lower id)."""
        ids = np.fromiter(self._ids, dtype=np.int64, count=len(self._ids))
        scores = retriever.score([query], ids)[0]
        best = scores.max()
        return int(ids[scores == best].min())


class _Segment:
    """One decode session over ``passage + prompt + output[:start]``, kept while the passage stays."""

    def __init__(self, session: DecodeSession, passage: int, start: int, context_len: int) -> None:
        self.session, self.passage, self.start, self.context_len = session, passage, start, context_len
        self.alive = True

    @property
    def end(self) -> int:
        """Output position the session has generated up to."""
        return self.start + self.session.state.num_generated

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.session.abort()


@dataclass
class _Step:
    start: int
    """Output position where the interval starts."""
    query: Query
    passage: int
    segment: _Segment
    verified: bool
    seconds: float = 0.0
    finish_reason: str = ""


@dataclass(frozen=True)
class Drafting:
    """How the loop decodes between retrievals: a fresh proposer for each segment's session
    (None: target-only) and the tokens it drafts per step (the plan's ``k``)."""

    proposer: Callable[[], Proposer | None] = lambda: None
    k: int = 1


class RalmGenerator:
    """Runs one request's retrieval loop over a :class:`SpecEngine` and a knowledge base.

    ``passages(ids) -> list[str]`` gives passage texts; ``tokenizer`` encodes passages and
    decodes queries. ``drafting`` is the speculative decoding between retrievals (:class:`Drafting`;
    default: target-only)."""

    def __init__(
        self,
        engine: SpecEngine,
        retriever: Retriever,
        passages: Callable[[list[int]], list[str]],
        tokenizer,
        cfg: RalmConfig,
        *,
        drafting: Drafting | None = None,
        pool: ThreadPoolExecutor | None = None,
        os3: OS3Config | None = None,
        concurrency: Callable[[], int] | None = None,
    ) -> None:
        """``concurrency()``: requests decoding on this engine now, this one included (the
        batcher's count; None: 1), for ``RalmConfig.asynchronous = None``."""
        self.engine, self.retriever, self.passage_texts, self.tokenizer, self.cfg = (
            engine,
            retriever,
            passages,
            tokenizer,
            cfg,
        )
        self.drafting = drafting or Drafting()
        self.pool = pool
        self.os3 = os3
        self.concurrency = concurrency or (lambda: 1)
        self._passage_ids: dict[int, list[int]] = {}
        self._sep = list(tokenizer.encode("\n\n", add_special_tokens=False))

    # ------------------------------------------------------------------ pieces
    def _passage_tokens(self, pid: int) -> list[int]:
        if pid not in self._passage_ids:
            text = self.passage_texts([pid])[0]
            self._passage_ids[pid] = list(self.tokenizer.encode(text, add_special_tokens=False))[
                : self.cfg.max_passage_tokens
            ]
        return self._passage_ids[pid]

    def _encode_query(self, prompt: list[int], out: list[int], stats: RalmStats) -> Query:
        t0 = time.perf_counter()
        ids = (prompt + out)[-self.cfg.query_tokens :]
        q = self.retriever.encode([self.tokenizer.decode(ids)])[0]
        stats.time_s["embed"] += time.perf_counter() - t0
        return q

    def _search(self, queries: list[Query], k: int) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        ids, _ = self.retriever.search(queries, k)
        return ids, time.perf_counter() - t0

    def _open(self, passage: int, prompt: list[int], out: list[int], start: int, params: SamplingParams) -> _Segment:
        p_ids = self._passage_tokens(passage)
        head = p_ids + self._sep
        context = head + prompt + out[:start]
        spans = [ContextSpan("prompt", len(head), len(head) + len(prompt) + start)]
        if p_ids:
            spans.insert(0, ContextSpan("retrieved", 0, len(p_ids)))
        seed = None if params.seed is None else params.seed + start  # reproducible sampling per interval start
        seg_params = replace(params, max_new_tokens=params.max_new_tokens - start, seed=seed)
        drafting = self.drafting
        session = self.engine.session(
            context, seg_params, drafting.proposer(), drafting.k, spans=tuple(spans), hold_back=True
        )
        return _Segment(session, passage, start, len(context))

    def _interval(self, seg: _Segment, out: list[int], stats: RalmStats, redo: list[int] | None = None) -> str:
        """Generate up to ``interval`` tokens in ``seg`` onto ``out``; returns a finish reason or "".
        ``redo``: the tokens a mismatched speculation generated here, verified first as one draft
        (the target accepts the prefix the true passage also gives, in one pass)."""
        t0 = time.perf_counter()
        session, k = seg.session, self.drafting.k
        produced = 0
        if redo and not session.finished and self.cfg.interval > 1:
            outcome = session.step(Proposals.from_rows([redo[: self.cfg.interval - 1]]))
            out.extend(outcome.emitted)
            produced += len(outcome.emitted)
            stats.reverify_steps += 1
            stats.reverified_tokens += len(outcome.verdict.accepted) if outcome.verdict is not None else 0
        while produced < self.cfg.interval and not session.finished:
            session.k = min(k, self.cfg.interval - produced - 1)
            outcome = session.step()
            out.extend(outcome.emitted)
            produced += len(outcome.emitted)
        session.k = k
        stats.time_s["generate"] += time.perf_counter() - t0
        return session.finish_reason

    def _run_step(
        self,
        steps: list[_Step],
        passage: int,
        query: Query,
        verified: bool,
        prompt: list[int],
        out: list[int],
        params: SamplingParams,
        stats: RalmStats,
        redo: list[int] | None = None,
    ) -> _Step:
        """Generate one interval with ``passage``: continue the previous step's session when the
        passage is the same, else open a new one (``redo``: see :meth:`_interval`)."""
        t0 = time.perf_counter()
        start = len(out)
        prev = steps[-1] if steps else None
        if prev is not None and prev.passage == passage and prev.segment.alive and prev.segment.end >= start:
            seg = prev.segment
            if seg.end > start:  # it went on past here in a withdrawn branch: roll its KV cache back
                seg.session.rollback_to(seg.context_len + (start - seg.start))
        else:
            seg = self._open(passage, prompt, out, start, params)
        reason = self._interval(seg, out, stats, redo)
        step = _Step(start, query, passage, seg, verified, time.perf_counter() - t0, reason)
        steps.append(step)
        return step

    # ------------------------------------------------------------------ the loops
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_final: Callable[[list[int]], None] | None = None
    ) -> RalmResult:
        """Decode one request; ``on_final(tokens)`` receives output as it becomes final (verified);
        returning True ends the request there (finish reason ``stop``: a stop sequence was seen)."""
        cfg = self.cfg
        shared = self.retriever  # a KB service's retriever has a per-request view (specops.serving.retrieval.milvus.kb)
        self.retriever = shared.for_request() if hasattr(shared, "for_request") else shared
        stats = RalmStats(mode=cfg.mode, retriever=self.retriever.kind)
        prompt, out, steps = [int(t) for t in prompt_ids], [], []
        self._final = 0
        t0 = time.perf_counter()

        def final(tokens: list[int]) -> None:
            self._final += len(tokens)
            if on_final is not None and on_final(tokens) is True:
                raise _Stopped

        try:
            try:
                if cfg.mode == "ralmseq":
                    self._ralmseq(prompt, out, steps, params, stats, final)
                else:
                    self._ralmspec(prompt, out, steps, params, stats, final)
            except _Stopped:
                del out[self._final :]
                while steps and steps[-1].start >= len(out):
                    steps.pop().segment.close()
                result = self._result(out, steps, stats, t0)
                result.finish_reason = "stop"
                return result
            return self._result(out, steps, stats, t0)
        finally:
            self.retriever = shared
            for seg in {id(s.segment): s.segment for s in steps}.values():
                seg.close()

    def _ralmseq(self, prompt, out, steps, params, stats, on_final) -> None:
        while not steps or not steps[-1].finish_reason:
            q = self._encode_query(prompt, out, stats)
            ids, dt = self._search([q], 1)
            stats.kb_queries += 1
            stats.kb_calls += 1
            stats.time_s["kb_search"] += dt
            stats.time_s["kb_wait"] += dt
            n = len(out)
            self._run_step(steps, int(ids[0, 0]), q, True, prompt, out, params, stats)
            if len(out) > n:
                on_final(out[n:])

    def _speculate(self, cache: LocalCache, steps, prompt, out, params, stats) -> _Step:
        q = self._encode_query(prompt, out, stats)
        t0 = time.perf_counter()
        guess = cache.top1(self.retriever, q)
        stats.time_s["cache"] += time.perf_counter() - t0
        stats.speculations += 1
        return self._run_step(steps, guess, q, False, prompt, out, params, stats)

    def _unspeculated(self, cache: LocalCache, sched: StrideScheduler, steps, prompt, out, params, stats) -> None:
        """One interval with the KB's passage (speculation is off this round). The cache's
        guess is still scored against it, so OS³'s γ stays current."""
        q = self._encode_query(prompt, out, stats)
        t0 = time.perf_counter()
        guess = cache.top1(self.retriever, q)
        stats.time_s["cache"] += time.perf_counter() - t0
        ids, dt = self._search([q], self.cfg.prefetch)
        stats.kb_queries += 1
        stats.kb_calls += 1
        stats.unspeculated += 1
        stats.time_s["kb_search"] += dt
        stats.time_s["kb_wait"] += dt
        cache.add(ids)
        truth = int(ids[0, 0])
        stats.guesses_checked += 1
        stats.guesses_correct += int(guess == truth)
        sched.observe_verification(1, int(guess == truth), dt)
        step = self._run_step(steps, truth, q, True, prompt, out, params, stats)
        sched.observe_generation(step.seconds)

    def _ralmspec(self, prompt, out, steps, params, stats, on_final) -> None:
        cfg = self.cfg
        os3 = self.os3 or RALM_OS3
        if not cfg.speculation_off:
            os3 = replace(os3, allow_off=False)
        sched = StrideScheduler(os3, asynchronous=self._asynchronous(), fixed=cfg.speculation_stride)
        cache = LocalCache(cfg.cache_size)
        # 1. the first retrieval is real; its top-``prefetch`` seed the cache
        q = self._encode_query(prompt, out, stats)
        ids, dt = self._search([q], cfg.prefetch)
        stats.kb_queries += 1
        stats.kb_calls += 1
        stats.time_s["kb_search"] += dt
        stats.time_s["kb_wait"] += dt
        cache.add(ids)
        self._run_step(steps, int(ids[0, 0]), q, True, prompt, out, params, stats)
        n_final = 0

        def emit_final() -> None:
            nonlocal n_final
            end = len(out) if all(s.verified for s in steps) else next(s.start for s in steps if not s.verified)
            if end > n_final:
                chunk, n_final = out[n_final:end], end
                on_final(chunk)

        emit_final()
        pending: list[_Step] = []
        while True:
            done = bool(steps[-1].finish_reason)
            if done and not pending:
                break
            # 2. speculate up to the stride from the local cache (stride 0: OS³ found that
            # RaLMSeq is faster with the measured costs; retrieve and generate unspeculated)
            s = 0
            sched.asynchronous = self._asynchronous()
            if not done:
                remaining = max(1, math.ceil((params.max_new_tokens - len(out)) / cfg.interval))
                s = sched.stride(remaining)
                if s == 0 and not pending:
                    self._unspeculated(cache, sched, steps, prompt, out, params, stats)
                    emit_final()
                    continue
                while len(pending) < s and not steps[-1].finish_reason:
                    step = self._speculate(cache, steps, prompt, out, params, stats)
                    sched.observe_speculation(step.seconds)
                    pending.append(step)
            stats.strides.append(len(pending))
            # 3. verify them in one batched KB retrieval (asynchronously: during one more speculation step)
            queries = [p.query for p in pending]
            extra: _Step | None = None
            if sched.asynchronous and s > 0 and not steps[-1].finish_reason and self.pool is not None:
                stats.async_rounds += 1
                future = self.pool.submit(self._search, queries, cfg.prefetch)
                extra = self._speculate(cache, steps, prompt, out, params, stats)
                sched.observe_speculation(extra.seconds)
                t_wait = time.perf_counter()
                ids, dt = future.result()
                waited = time.perf_counter() - t_wait
                stats.time_s["async_overlap"] += max(0.0, dt - waited)
                stats.time_s["async_overlap_simulated"] += min(dt, extra.seconds)
            else:
                ids, dt = self._search(queries, cfg.prefetch)
                waited = dt
            stats.kb_queries += len(queries)
            stats.kb_calls += 1
            stats.verification_batches += 1
            stats.time_s["kb_search"] += dt
            stats.time_s["kb_wait"] += waited
            cache.add(ids)
            truth = [int(i) for i in ids[:, 0]]
            m = next((i for i, p in enumerate(pending) if p.passage != truth[i]), None)
            stats.guesses_checked += len(pending) if m is None else m + 1
            stats.guesses_correct += len(pending) if m is None else m
            sched.observe_verification(len(pending), len(pending) if m is None else m, dt)
            if m is None:  # 4a. every speculation held: final up to the extra step
                for p in pending:
                    p.verified = True
                pending = [extra] if extra is not None else []
            else:  # 4b. roll back to the first mismatch and regenerate it with the true passage
                stats.mismatches += 1
                for p in pending[:m]:
                    p.verified = True
                cut = pending[m].start
                stats.rolled_back_tokens += len(out) - cut
                keep = steps.index(pending[m])
                kept_segments = {id(s.segment) for s in steps[:keep]}
                for s in steps[keep:]:
                    if id(s.segment) not in kept_segments:
                        s.segment.close()
                del steps[keep:]
                redo = out[cut:] if cfg.reverify else None
                del out[cut:]
                self._run_step(steps, truth[m], pending[m].query, True, prompt, out, params, stats, redo)
                pending = []
            emit_final()
        stats.cache_passages = len(cache)
        stats.gamma = sched.gamma

    def _asynchronous(self) -> bool:
        """This round's verification mode: the config's, or (None) synchronous where the KB's
        search runs as Python in this process's threads (embedded Milvus Lite: a search overlapped
        with decoding contends for the interpreter lock, ``benchmarks/out/ralm.json``: 0.92x
        RaLMSeq async, 0.99x sync), else asynchronous only alone."""
        chosen = self.cfg.asynchronous
        if chosen is not None:
            return chosen
        if getattr(self.retriever, "search_holds_gil", False):
            return False
        return self.concurrency() <= ASYNC_MAX_CONCURRENCY

    def _result(self, out: list[int], steps: list[_Step], stats: RalmStats, t0: float) -> RalmResult:
        stats.intervals = len(steps)
        stats.time_s["total"] = time.perf_counter() - t0
        if stats.mode == "ralmspec":
            stats.strides = [s for s in stats.strides if s > 0]
        forwards = drafted = accepted = 0
        for seg in {id(s.segment): s.segment for s in steps}.values():
            st = seg.session.stats
            forwards += seg.session.target.num_forwards
            drafted += st.num_drafted
            accepted += st.num_accepted
        reason = steps[-1].finish_reason if steps else "length"
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return RalmResult(list(out), [s.passage for s in steps], stats, reason, forwards, drafted, accepted, text)

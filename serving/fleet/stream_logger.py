"""Serving-side logging of finished requests to the streams, off the request path.

1. When a request finishes, :meth:`StreamLogger.log` turns its result into one
   :class:`~specops.streams.records.MissRecord` (the target's distribution at every rejected
   position, collected by the verifier during decoding: no extra forward pass) and one
   :class:`~specops.streams.records.GenerationRecord`, and appends both to a bounded in-memory
   queue. This takes a top-k over ``[m, vocab]`` logits and never touches the stream,
   so a request never waits on it.
2. A background flusher thread takes up to ``batch_size`` records at a time, encodes
   them and publishes them, one ``publish`` per topic.
3. When the stream is down or slow the queue fills to ``queue_size`` and then sheds:
   with ``shed="oldest"`` (default: online distillation prefers fresh traffic) the
   oldest queued record is dropped to admit the new one; with ``shed="newest"`` the new
   record is refused. Every drop is counted (``stats.dropped`` and the Prometheus
   counter ``specops_stream_logger_dropped_total``). The flusher reconnects by itself
   with exponential backoff, retrying the batch it holds.

A record is *accepted* once the stream acknowledged it; what is still queued in memory
is lost if the serving process dies (the stream's guarantees start at the ack).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from prometheus_client import Counter, Gauge

from specops.serving.engine.sampling import LOGPROB_FLOOR
from specops.serving.engine.types import GenerationResult, SamplingParams
from specops.serving.served import RequestMeta  # defined below the modes and the fleet, named here too
from specops.streams import OutMessage, Producer, Stream, StreamConfig, Topics, codec, open_stream
from specops.streams.records import DIST_FULL, DIST_TOPK, ContextSpan, GenerationRecord, MissRecord, SamplingInfo

log = logging.getLogger(__name__)

DROPPED = Counter("specops_stream_logger_dropped_total", "Records the serving logger shed", ["reason"])
PUBLISHED = Counter("specops_stream_logger_published_total", "Records the serving logger published", ["topic"])
PUBLISH_ERRORS = Counter("specops_stream_logger_publish_errors_total", "Failed publish attempts of the serving logger")
QUEUE_DEPTH = Gauge("specops_stream_logger_queue_depth", "Records waiting in the serving logger's queue")

SHED_POLICIES = ("oldest", "newest")


@dataclass
class LoggerConfig:
    """How serving logs finished requests."""

    enabled: bool = True
    """Turn logging off entirely (nothing is built or queued)."""
    sample_every: int = 1
    """Log one request in N (1 = every request)."""
    queue_size: int = 2048
    """Bound on queued records (each logged request queues two)."""
    shed: str = "oldest"
    """When full: ``oldest`` drops the oldest queued record, ``newest`` refuses the new one."""
    batch_size: int = 128
    """Most records per publish."""
    topk: int = 64
    """Target log-probs kept per rejected position (the rest is the residual mass)."""
    full_distribution: bool = False
    """Log the whole target distribution instead of top-k (vocab floats per position)."""
    logprob_dtype: str = "float32"
    """``float32`` (exact) or ``float16`` (half the bytes)."""
    retry_initial_s: float = 0.2
    """First reconnect delay after a failed publish; doubles up to ``retry_max_s``."""
    retry_max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every}")
        if self.queue_size < 2:
            raise ValueError(f"queue_size must be >= 2, got {self.queue_size}")
        if self.shed not in SHED_POLICIES:
            raise ValueError(f"shed must be one of {SHED_POLICIES}, got {self.shed!r}")
        if self.batch_size < 1 or self.topk < 1:
            raise ValueError("batch_size and topk must be >= 1")
        if self.logprob_dtype not in ("float32", "float16"):
            raise ValueError(f"logprob_dtype must be float32 or float16, got {self.logprob_dtype!r}")
        if not (0 < self.retry_initial_s <= self.retry_max_s):
            raise ValueError("need 0 < retry_initial_s <= retry_max_s")


@dataclass
class LoggerStats:
    logged_requests: int = 0
    sampled_out: int = 0
    published: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Dropped records per reason: ``queue_full``, ``build_error``, ``encode_error``."""
    publish_errors: int = 0

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())


def method_artifacts(method: str) -> tuple[str, ...]:
    """The artifact kinds a method's requests use (the catalogue's, when it knows the method)."""
    from specops.serving.proposers.catalogue import CATALOGUE

    spec = CATALOGUE.get(method)
    return (spec.artifact,) if spec is not None and spec.artifact else ()


def build_records(
    prompt_ids: list[int],
    result: GenerationResult,
    params: SamplingParams,
    meta: RequestMeta,
    *,
    vocab_size: int,
    topk: int = 64,
    full_distribution: bool = False,
    logprob_dtype: str = "float32",
    engine: str = "",
) -> tuple[MissRecord, GenerationRecord]:
    """The two records of one finished request (validated on encode). ``engine`` (default:
    ``meta.engine``) names an external engine that served it: its result has no rejections."""
    dtype = np.dtype(logprob_dtype)
    rej = result.rejections
    m = len(rej)
    tokens = np.asarray([*prompt_ids, *result.token_ids], dtype=np.int32)
    positions = np.asarray([r.index for r in rej], dtype=np.int32)
    drafted = np.asarray([r.drafted_token for r in rej], dtype=np.int32)
    if m:
        logits = torch.stack([r.target_logits for r in rej]).float()  # [m, vocab]
        vocab_size = int(logits.shape[-1])
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = torch.zeros((0, vocab_size), dtype=torch.float32)  # not the default dtype: see load_model
    if full_distribution:
        kind, topk_ids, residual = DIST_FULL, None, None
        logprobs = logp.numpy().astype(dtype)
    else:
        kind = DIST_TOPK
        vals, ids = logp.topk(min(topk, vocab_size), dim=-1)  # sorted, most likely first
        # a token a grammar or min_tokens forbade is -inf: top-k records hold finite numbers, its floor
        vals = vals.clamp_min(LOGPROB_FLOOR)
        logprobs = vals.numpy().astype(dtype)
        topk_ids = ids.numpy().astype(np.int32)
        mass = np.exp(logprobs.astype(np.float64)).sum(axis=1)
        residual = np.clip(1.0 - mass, 0.0, 1.0).astype(np.float32)
    stats = result.stats
    sampling = SamplingInfo(params.temperature, params.top_p, params.max_new_tokens, params.seed)
    now = time.time()
    versions = dict(meta.artifact_versions)
    if meta.draft_version and "draft" in (method_artifacts(stats.method)):
        versions.setdefault("draft", meta.draft_version)
    spans = tuple(ContextSpan(s.kind, s.start, s.end) for s in result.context_spans)
    if spans == (ContextSpan("prompt", 0, len(prompt_ids)),):
        spans = ()  # the default: all prompt
    context = {"artifact_versions": versions, "context_spans": spans}
    miss = MissRecord(
        request_id=meta.request_id,
        cluster=meta.cluster,
        method=stats.method,
        draft_model=meta.draft_model,
        draft_version=meta.draft_version,
        sampling=sampling,
        token_ids=tokens,
        num_prompt_tokens=len(prompt_ids),
        vocab_size=vocab_size,
        positions=positions,
        drafted_tokens=drafted,
        dist_kind=kind,
        logprobs=logprobs,
        topk_ids=topk_ids,
        residual=residual,
        num_drafted=stats.num_drafted,
        num_accepted=stats.num_accepted,
        timestamp=now,
        engine=engine or meta.engine,
        **context,
    )
    gen = GenerationRecord(
        request_id=meta.request_id,
        cluster=meta.cluster,
        method=stats.method,
        draft_model=meta.draft_model,
        draft_version=meta.draft_version,
        prompt_ids=tokens[: len(prompt_ids)].copy(),
        output_ids=tokens[len(prompt_ids) :].copy(),
        vocab_size=vocab_size,
        finish_reason=stats.finish_reason,
        timestamp=now,
        policy=dict(stats.policy),
        **context,
    )
    return miss, gen


class StreamLogger:
    """Bounded, never-blocking hand-off of finished requests to the stream."""

    def __init__(
        self,
        stream: StreamConfig | str | Callable[[], Stream],
        cfg: LoggerConfig | None = None,
        *,
        vocab_size: int,
        topics: Topics | None = None,
    ) -> None:
        self.cfg = cfg or LoggerConfig()
        if callable(stream):
            self._open: Callable[[], Stream] = stream
            topics = topics or Topics()
        else:
            stream_cfg = StreamConfig.from_env(url=stream) if isinstance(stream, str) else stream
            self._open = lambda: open_stream(stream_cfg)
            topics = topics or stream_cfg.topics
        self.topics = topics
        self.vocab_size = vocab_size
        self.stats = LoggerStats()
        self._queue: deque[tuple[str, bytes, object]] = deque()
        self._cond = threading.Condition()
        self._counter = itertools.count()
        self._stop = False
        self._busy = False
        self._thread: threading.Thread | None = None
        if self.cfg.enabled:
            self._thread = threading.Thread(target=self._run, name="specops-stream-logger", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ request side
    def log(
        self, prompt_ids: list[int], result: GenerationResult, params: SamplingParams, meta: RequestMeta | None = None
    ) -> bool:
        """Queue the records of one finished request; returns whether it was queued
        (``meta`` names it; None: an unnamed request, as a bare engine's are).

        Never blocks on the stream and never raises: a failure to build the records is
        logged and counted as a drop.
        """
        if not self.cfg.enabled or self._stop:
            return False
        meta = meta if meta is not None else RequestMeta()
        if next(self._counter) % self.cfg.sample_every:
            self.stats.sampled_out += 1
            return False
        try:
            miss, gen = build_records(
                prompt_ids,
                result,
                params,
                meta,
                vocab_size=self.vocab_size,
                topk=self.cfg.topk,
                full_distribution=self.cfg.full_distribution,
                logprob_dtype=self.cfg.logprob_dtype,
                engine=meta.engine,
            )
        except Exception:  # noqa: BLE001 - logging must never fail a request
            log.exception("could not build stream records for request %s; dropped", meta.request_id)
            self._count_drop("build_error", 2)
            return False
        self._admit([(self.topics.misses, miss.key, miss), (self.topics.generations, gen.key, gen)])
        self.stats.logged_requests += 1
        return True

    def _admit(self, items: list) -> None:
        with self._cond:
            for item in items:
                if len(self._queue) >= self.cfg.queue_size:
                    if self.cfg.shed == "newest":
                        self._count_drop("queue_full", 1)
                        continue
                    self._queue.popleft()
                    self._count_drop("queue_full", 1)
                self._queue.append(item)
            QUEUE_DEPTH.set(len(self._queue))
            self._cond.notify()

    def _count_drop(self, reason: str, n: int) -> None:
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + n
        DROPPED.labels(reason).inc(n)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------ flusher
    def _take(self) -> list:
        with self._cond:
            while not self._queue and not self._stop:
                self._cond.wait(timeout=0.5)
            n = min(self.cfg.batch_size, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            self._busy = bool(batch)
            QUEUE_DEPTH.set(len(self._queue))
            return batch

    def _requeue(self, batch: list) -> None:
        """Put a failed batch back at the head, within the bound (overflow is shed)."""
        with self._cond:
            room = self.cfg.queue_size - len(self._queue)
            keep = batch[-room:] if room > 0 else []
            if self.cfg.shed == "newest":
                keep = batch[:room] if room > 0 else []
            if len(keep) < len(batch):
                self._count_drop("queue_full", len(batch) - len(keep))
            self._queue.extendleft(reversed(keep))
            self._busy = False
            QUEUE_DEPTH.set(len(self._queue))

    def _run(self) -> None:
        producer: Producer | None = None
        stream: Stream | None = None
        delay = self.cfg.retry_initial_s
        failures = 0
        while True:
            batch = self._take()
            if not batch:
                if self._stop:
                    break
                continue
            try:
                if producer is None:
                    stream = self._open()
                    producer = stream.producer()
                self._publish(producer, batch)
            except Exception as e:  # noqa: BLE001 - the flusher must survive anything
                failures += 1
                self.stats.publish_errors += 1
                PUBLISH_ERRORS.inc()
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "stream publish failed (%s: %s); retrying in %.1fs", type(e).__name__, e, delay)
                for closable in (producer, stream):
                    try:
                        if closable is not None:
                            closable.close()
                    except Exception:  # noqa: BLE001
                        pass
                producer, stream = None, None
                self._requeue(batch)
                if self._stop:
                    break
                with self._cond:
                    self._cond.wait(timeout=delay)
                delay = min(delay * 2, self.cfg.retry_max_s)
                continue
            if failures:
                log.warning(
                    "stream is back after %d failed attempt(s); %d record(s) dropped so far",
                    failures,
                    self.stats.num_dropped,
                )
            failures, delay = 0, self.cfg.retry_initial_s
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        for closable in (producer, stream):
            if closable is not None:
                closable.close()

    def _publish(self, producer: Producer, batch: list) -> None:
        """Publish ``batch`` topic by topic; on failure ``batch`` keeps only what is unpublished."""
        by_topic: dict[str, list[OutMessage]] = {}
        encoded = []
        for item in batch:
            topic, key, record = item
            try:
                value = codec.encode(record)
            except Exception:  # noqa: BLE001 - a bad record is a bug; count it, keep the rest
                log.exception("could not encode a %s; dropped", type(record).__name__)
                self._count_drop("encode_error", 1)
                continue
            encoded.append(item)
            by_topic.setdefault(topic, []).append(OutMessage(key=key, value=value))
        batch[:] = encoded
        for topic, messages in by_topic.items():
            producer.publish(topic, messages)
            self.stats.published += len(messages)
            PUBLISHED.labels(topic).inc(len(messages))
            # if a later topic fails, the retry must not publish this one twice
            batch[:] = [item for item in batch if item[0] != topic]

    # ------------------------------------------------------------ lifecycle
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued is published; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 0.05))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush for up to ``timeout_s``, then stop the flusher (what is left is dropped)."""
        if self._thread is None:
            return
        self.flush(timeout_s)
        with self._cond:
            self._stop = True
            left = len(self._queue)
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        self._thread = None
        if left:
            self._count_drop("shutdown", left)
            log.warning("stream logger closed with %d record(s) unpublished", left)

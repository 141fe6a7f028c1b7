"""Bounded admission: at most ``max_running`` requests decode, ``max_queue`` wait, the rest get 429.

A request is admitted in one of three ways:

- a worker is free: it runs now;
- every worker is busy but the queue has room: it waits, at most ``queue_timeout_s``
  (then 503), in arrival order;
- the queue is full too: :class:`~specops.core.errors.OverloadedError` at once (429 with a
  ``Retry-After``), so the server never hangs and its memory stays bounded by
  ``max_running + max_queue`` requests of bounded size.

The slot is released by whoever finishes the work (the decode thread), not by the HTTP
handler, so a client that disconnects cannot make the server run more than
``max_running`` decodes at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from specops.core.errors import OverloadedError, QueueTimeoutError

RUNNING = Gauge("specops_admission_running", "Requests decoding now")
WAITING = Gauge("specops_admission_queue_depth", "Requests waiting for a decode worker")
REJECTED = Counter("specops_admission_rejected_total", "Requests refused by admission", ["reason"])
WAIT_S = Histogram(
    "specops_admission_wait_seconds",
    "Time requests waited for a worker",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


@dataclass(frozen=True)
class AdmissionSnapshot:
    running: int
    waiting: int
    max_running: int
    max_queue: int

    @property
    def load(self) -> float:
        """Busy fraction of all admission places (1.0 = the next request gets 429)."""
        return (self.running + self.waiting) / (self.max_running + self.max_queue)


class Admission:
    """Async admission control for one event loop; ``release`` may be called from any thread."""

    def __init__(self, max_running: int, max_queue: int, queue_timeout_s: float) -> None:
        assert max_running >= 1 and max_queue >= 0 and queue_timeout_s > 0
        self.max_running = max_running
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._running = 0
        self._waiters: list[asyncio.Future] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def snapshot(self) -> AdmissionSnapshot:
        with self._lock:
            return AdmissionSnapshot(self._running, len(self._waiters), self.max_running, self.max_queue)

    async def acquire(self) -> None:
        """Take a worker slot, waiting in line if allowed; raise Overloaded / QueueTimeout otherwise."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        t0 = time.perf_counter()
        with self._lock:
            if self._running < self.max_running and not self._waiters:
                self._running += 1
                RUNNING.set(self._running)
                WAIT_S.observe(0.0)
                return
            if len(self._waiters) >= self.max_queue:
                REJECTED.labels("queue_full").inc()
                raise OverloadedError(
                    f"server is at capacity ({self._running} requests decoding, {len(self._waiters)} waiting, "
                    f"queue limit {self.max_queue}); retry after a short wait"
                )
            fut = loop.create_future()
            self._waiters.append(fut)
            WAITING.set(len(self._waiters))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with self._lock:
                if fut.done() and not fut.cancelled():
                    granted = True  # the slot arrived just as we gave up: hand it on
                else:
                    granted = False
                    fut.cancel()
                    if fut in self._waiters:
                        self._waiters.remove(fut)
                    WAITING.set(len(self._waiters))
            if granted:
                self.release()
            if isinstance(exc, asyncio.CancelledError):
                raise
            REJECTED.labels("queue_timeout").inc()
            raise QueueTimeoutError(
                f"waited {self.queue_timeout_s:g}s for a decode worker; the server is overloaded, retry later"
            ) from None
        WAIT_S.observe(time.perf_counter() - t0)

    def release(self) -> None:
        """Give the slot back: to the first waiter in line, or to the pool. Thread-safe."""
        with self._lock:
            while self._waiters:
                fut = self._waiters.pop(0)
                if not fut.done():
                    WAITING.set(len(self._waiters))
                    fut.get_loop().call_soon_threadsafe(self._grant, fut)
                    return  # the slot passes to the waiter: running count unchanged
            self._running -= 1
            assert self._running >= 0
            RUNNING.set(self._running)
            WAITING.set(0)

    def _grant(self, fut: asyncio.Future) -> None:
        """On the waiter's loop: hand it the slot, or pass the slot on if it gave up meanwhile."""
        if fut.done():
            self.release()
        else:
            fut.set_result(None)

"""Request latency as clients see it, in vLLM's metric names (with our prefix), and the access log.

Every completion request that reaches a decode worker is timed from its arrival (the first
byte of its request, as :class:`specops.serving.http.api.Gate` saw it) by one :class:`RequestTimer`:

- ``specops_time_to_first_token_seconds``: arrival to the first generated tokens, sent in a
  chunk (streams) or emitted by the decode's first step (non-streamed requests, whose client
  gets them with the whole response);
- ``specops_inter_token_latency_seconds``: the gap between successive streamed chunks of
  tokens, or between successive decode steps of a non-streamed request (one speculative step
  emits several tokens at once: this is the gap a client waits, not time per token);
- ``specops_e2e_request_latency_seconds``: arrival to the last token, of requests that finished.

Labels are the cluster (``specops.core.clusters.cluster_label``: bounded) and the decoding method.
The time a request waits for a worker is ``specops_admission_wait_seconds``
(``specops.serving.http.admission``); requests running and waiting are ``specops_admission_running``
and ``specops_admission_queue_depth``.

:func:`log_access` writes one line per HTTP request at INFO on the ``specops.access`` logger
(probes and metric scrapes at DEBUG; ``specops --no-access-log`` turns it off): method, path, status, seconds, request id, tenant
(its id, never its key), response bytes and client address, as ``extra`` fields too, so
``--log-format json`` gives each its own key.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Histogram

from specops.core.clusters import cluster_label
from specops.core.errors import clip

ACCESS = logging.getLogger("specops.access")

TTFT = Histogram(
    "specops_time_to_first_token_seconds",
    "Request arrival to its first generated tokens (sent in a stream, or emitted by the first decode step)",
    ["cluster", "method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80),
)
ITL = Histogram(
    "specops_inter_token_latency_seconds",
    "Gap between successive streamed chunks of tokens (decode steps of non-streamed requests)",
    ["cluster", "method"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5),
)
E2E = Histogram(
    "specops_e2e_request_latency_seconds",
    "Request arrival to its last token, of finished requests",
    ["cluster", "method"],
    buckets=(0.1, 0.3, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 240, 480, 960),
)


class RequestTimer:
    """The latency histograms of one request. ``tokens`` is called from one thread at a time: the
    decode worker (non-streamed requests) or the event loop (streams), never both."""

    def __init__(self, arrived: float, cluster: str, method: str) -> None:
        self.arrived = arrived
        """``time.perf_counter()`` when the request arrived."""
        self.labels = (cluster_label(cluster), method)
        self.last: float | None = None
        """When tokens last reached the client (or were emitted); None before the first."""

    def tokens(self) -> None:
        """Tokens went out now: the first ones' time to first token, or the gap since the last."""
        now = time.perf_counter()
        if self.last is None:
            TTFT.labels(*self.labels).observe(now - self.arrived)
        else:
            ITL.labels(*self.labels).observe(now - self.last)
        self.last = now

    def finished(self) -> None:
        """The request finished now (its response, or its stream's last chunk, is out)."""
        if self.last is None:  # no step reported its tokens: they reach the client now
            self.tokens()
        E2E.labels(*self.labels).observe(time.perf_counter() - self.arrived)


def log_access(
    method: str,
    path: str,
    status: int,
    seconds: float,
    *,
    request_id: str | None,
    tenant: str | None,
    num_bytes: int,
    client: str | None,
    level: int = logging.INFO,
) -> None:
    """One access-log line of one HTTP request (no key, no body)."""
    if not ACCESS.isEnabledFor(level):
        return
    path = clip(path.encode("unicode_escape").decode("ascii"))  # a decoded %0A is no new log line
    fields = {
        "http_method": method,
        "path": path,
        "status": status,
        "duration_s": round(seconds, 6),
        "request_id": request_id or "-",
        "tenant": tenant or "-",
        "bytes": num_bytes,
        "client": client or "-",
    }
    ACCESS.log(
        level,
        '%s "%s %s" %d %.3fs %dB request_id=%s tenant=%s',
        fields["client"],
        method,
        path,
        status,
        seconds,
        num_bytes,
        fields["request_id"],
        fields["tenant"],
        extra=fields,
    )

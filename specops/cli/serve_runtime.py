"""``specops serve``: one serving replica, the OpenAI-compatible API on uvicorn.

Several replicas share one stream and one registry: start each with its own ``--port``
(and ``--replica`` name when they share a host name and port numbering is not enough).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from specops.paths import data_dir, streams_url
from specops.serving.http.config import ServeConfig

log = logging.getLogger(__name__)

NONE = ("none", "off", "")
CLOSE = (b"connection", b"close")


def build_state(cfg: ServeConfig, *, root: Path | None = None):
    """The replica's components from its config (nothing loads until the app starts)."""
    from specops.serving.http.server import ServingState
    from specops.streams import StreamConfig

    root = Path(root) if root is not None else data_dir()
    target, draft = cfg.paths(root)
    stream = streams_url() if cfg.fleet.stream == "default" else cfg.fleet.stream
    stream_cfg = None if stream.lower() in NONE else StreamConfig.from_env(url=stream)

    def registry():
        if cfg.fleet.registry.lower() in NONE:
            return None
        from specops.cli.artifact import open_registry

        return open_registry(cfg.fleet.registry, None)  # serving follows; it never publishes alias moves itself

    cache = Path(cfg.fleet.cache_dir) if cfg.fleet.cache_dir else root / "serve" / cfg.replica_name
    return ServingState(
        cfg, target_dir=target, draft_dir=draft, cache_dir=cache, registry_factory=registry, stream_cfg=stream_cfg
    )


class DrainingUvicorn(uvicorn.Server):
    """uvicorn that drains before it stops listening.

    uvicorn alone closes its listening socket the moment a stop is asked for, so a load balancer
    sees refused connections, never the 503s. Here the first SIGTERM or SIGINT (or :meth:`Server.stop`)
    calls ``drain`` (``/readyz`` 503, new requests 503 with ``Retry-After``, ``/healthz`` still 200) and
    adds ``Connection: close`` to every response that starts from then on, so kept-alive clients
    reconnect elsewhere; the socket stays open. Once the requests that were in flight are done (streams
    and requests waiting for a worker included), or ``timeout_s`` has passed, uvicorn's own shutdown
    runs with what is left of ``timeout_s``: it stops listening, closes idle connections, cancels what
    still runs and then the app's shutdown stops what still decodes. A second SIGINT exits at once."""

    def __init__(self, config: uvicorn.Config, *, drain: Callable[[], None], timeout_s: float) -> None:
        super().__init__(config)
        self.drain, self.timeout_s = drain, timeout_s
        self.drain_deadline: float | None = None
        """``time.monotonic()`` when the drain stops waiting; None until a stop is asked for."""
        self.in_flight: set | None = None
        """The request tasks the drain waits for (taken on its first tick, in the event loop)."""

    def begin_drain(self) -> None:
        """Stop admitting but keep listening (from a signal handler, or another thread)."""
        if self.drain_deadline is not None:
            return
        self.drain()
        self.config.encoded_headers = [*self.config.encoded_headers, CLOSE]  # every later response
        self.server_state.default_headers = [*self.server_state.default_headers, CLOSE]
        self.drain_deadline = time.monotonic() + self.timeout_s

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is None:
            self.begin_drain()
        elif sig == signal.SIGINT:
            self.should_exit = self.force_exit = True  # a second Ctrl-C: at once

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.in_flight is None:  # what runs now; a request that starts later gets a quick 503
                self.in_flight = set(self.server_state.tasks)
            if CLOSE not in self.server_state.default_headers:  # a signal amid uvicorn's once-a-second reset
                self.server_state.default_headers = [*self.server_state.default_headers, CLOSE]
            self.in_flight = {task for task in self.in_flight if not task.done()}
            left = self.drain_deadline - time.monotonic()
            if not self.in_flight or left <= 0:
                if not self.in_flight:
                    log.info("drained: the requests in flight are done; the port closes")
                else:
                    log.warning(
                        "the drain's shutdown_timeout_s=%gs ran out with %d request(s) in flight",
                        self.timeout_s,
                        len(self.in_flight),
                    )
                self.config.timeout_graceful_shutdown = max(left, 0.0)
                self.should_exit = True
        return await super().on_tick(counter)


class Server:
    """uvicorn in a background thread (the demo and tests), or in the foreground (``specops serve``)."""

    def __init__(self, cfg: ServeConfig, *, root: Path | None = None, state=None) -> None:
        from specops.serving.http.api import create_app
        from specops.serving.http.read_timeouts import guarded_h11

        self.cfg = cfg
        self.state = state or build_state(cfg, root=root)
        self.app = create_app(self.state)
        # h11 with a header and unread-body timer; the API itself bounds the body it reads
        # (serving/http/read_timeouts.py). Shutdown: the drain (DrainingUvicorn) keeps listening until
        # the requests in flight are done, then uvicorn stops listening and ServingState.close runs.
        self.uv = DrainingUvicorn(
            uvicorn.Config(
                self.app,
                host=cfg.api.host,
                port=cfg.api.port,
                log_level="warning",
                log_config=None,  # uvicorn's loggers go to ours (dates, --log-format json)
                access_log=False,  # ours is specops.serving.http.latency's (logger specops.access)
                timeout_graceful_shutdown=cfg.admission.shutdown_timeout_s,
                timeout_keep_alive=cfg.api.keep_alive_timeout_s,
                http=guarded_h11(cfg.api.header_timeout_s, cfg.api.body_timeout_s),
                lifespan="on",
            ),
            drain=self.state.drain,
            timeout_s=cfg.admission.shutdown_timeout_s,
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        for server in getattr(self.uv, "servers", []) or []:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.cfg.api.port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.api.host in ("0.0.0.0", "") else self.cfg.api.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Server:
        """Start listening in a background thread (models keep loading after this returns)."""
        self._thread = threading.Thread(target=self.uv.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not start on {self.cfg.api.host}:{self.cfg.api.port}")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until the models are loaded; raise at once if loading failed, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.state.ready.wait(0.1):
            if self.state.load_error or time.monotonic() > deadline:
                raise RuntimeError(f"serving did not become ready: {self.state.load_error or self.state.loading_step}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """The same drain as a signal's (the port answers until the requests in flight are done), then
        wait up to ``timeout_s`` for the server thread."""
        self.uv.begin_drain()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        """Foreground: until SIGINT/SIGTERM; the port keeps answering (``/readyz`` 503, new requests 503)
        while in-flight requests finish (for up to ``shutdown_timeout_s``; a second SIGINT exits at once),
        then it stops listening, the stream is flushed, and it returns.

        While uvicorn runs, its handler is :meth:`DrainingUvicorn.handle_exit`, which does not raise the
        signal again afterwards. Ours covers the moments before and after: a signal before uvicorn
        listens stops it at once, and a stopped replica exits 0 instead of dying of the signal."""
        log.info(
            "serving the OpenAI API on http://%s:%d/v1 (health: /healthz, ready: /readyz, metrics: /metrics)",
            self.cfg.api.host,
            self.cfg.api.port,
        )

        def stop(sig: int, frame) -> None:
            self.state.drain()
            self.uv.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.uv.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        log.info("stopped; the stream is flushed")

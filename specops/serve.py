"""``specops serve``: one serving replica, the OpenAI-compatible API on uvicorn.

Several replicas share one stream and one registry: start each with its own ``--port``
(and ``--replica`` name when they share a host name and port numbering is not enough).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from specops.paths import data_dir, streams_url
from specops.serving.http.config import ServeConfig

log = logging.getLogger(__name__)

NONE = ("none", "off", "")


def build_state(cfg: ServeConfig, *, root: Path | None = None):
    """The replica's components from its config (nothing loads until the app starts)."""
    from specops.serving.http.server import ServingState
    from specops.streams import StreamConfig

    root = Path(root) if root is not None else data_dir()
    target, draft = cfg.paths(root)
    stream = streams_url() if cfg.stream == "default" else cfg.stream
    stream_cfg = None if stream.lower() in NONE else StreamConfig.from_env(url=stream)

    def registry():
        if cfg.registry.lower() in NONE:
            return None
        from specops.artifact_cli import open_registry

        return open_registry(cfg.registry, None)  # serving follows; it never publishes alias moves itself

    cache = Path(cfg.cache_dir) if cfg.cache_dir else root / "serve" / cfg.replica_name
    return ServingState(
        cfg, target_dir=target, draft_dir=draft, cache_dir=cache, registry_factory=registry, stream_cfg=stream_cfg
    )


class Server:
    """uvicorn in a background thread (the demo and tests), or in the foreground (``specops serve``)."""

    def __init__(self, cfg: ServeConfig, *, root: Path | None = None, state=None) -> None:
        import uvicorn

        from specops.serving.http.api import create_app
        from specops.serving.http.read_timeouts import guarded_h11

        self.cfg = cfg
        self.state = state or build_state(cfg, root=root)
        self.app = create_app(self.state)
        drain = self.state.drain

        class Uvicorn(uvicorn.Server):
            """uvicorn that starts the replica's drain the moment a stop is asked for (the signal,
            or :meth:`Server.stop`), before it closes its sockets: /readyz turns 503 at once."""

            def handle_exit(self, sig, frame) -> None:
                drain()
                super().handle_exit(sig, frame)

        # h11 with a header and unread-body timer; the API itself bounds the body it reads
        # (serving/http/read_timeouts.py). Shutdown: stop listening, let in-flight requests (streams
        # included) finish for up to shutdown_timeout_s, then stop what is left (ServingState.close).
        self.uv = Uvicorn(
            uvicorn.Config(
                self.app,
                host=cfg.host,
                port=cfg.port,
                log_level="warning",
                log_config=None,  # uvicorn's loggers go to ours (dates, --log-format json)
                access_log=False,  # ours is serving.http.latency's (logger specops.access)
                timeout_graceful_shutdown=cfg.shutdown_timeout_s,
                timeout_keep_alive=cfg.keep_alive_timeout_s,
                http=guarded_h11(cfg.header_timeout_s, cfg.body_timeout_s),
                lifespan="on",
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        for server in getattr(self.uv, "servers", []) or []:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.cfg.port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "") else self.cfg.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Server:
        """Start listening in a background thread (models keep loading after this returns)."""
        import time

        self._thread = threading.Thread(target=self.uv.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not start on {self.cfg.host}:{self.cfg.port}")
            time.sleep(0.02)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until the models are loaded; raise at once if loading failed, or after ``timeout_s``."""
        import time

        deadline = time.monotonic() + timeout_s
        while not self.state.ready.wait(0.1):
            if self.state.load_error or time.monotonic() > deadline:
                raise RuntimeError(f"serving did not become ready: {self.state.load_error or self.state.loading_step}")

    def stop(self, timeout_s: float = 60.0) -> None:
        self.state.drain()
        self.uv.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        """Foreground: until SIGINT/SIGTERM; in-flight requests finish (for up to ``shutdown_timeout_s``;
        a second SIGINT exits at once), the stream is flushed, and it returns.

        uvicorn handles the signal and, once shut down, raises it again for the handler it found
        installed. That handler is ours: it asks for the same graceful stop (a signal before uvicorn
        listens) and otherwise does nothing, so a stopped replica exits 0 instead of dying of the signal."""
        log.info(
            "serving the OpenAI API on http://%s:%d/v1 (health: /healthz, ready: /readyz, metrics: /metrics)",
            self.cfg.host,
            self.cfg.port,
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

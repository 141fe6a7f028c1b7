"""The vLLM servers behind one front door, and the hot-swap that moves a cluster to a new draft.

**One vLLM server per method, and per draft version in use** (not one per cluster): vLLM
fixes a server's speculation when it starts. The methods that draft with nothing per cluster
(target-only, n-gram, copy) get one server each, started at start-up and shared by every
cluster. The draft model gets one server per draft *version in use*: clusters serving
different drafts need different servers, while the clusters still on the bootstrap draft (or
on the same champion) share one. A fleet of C clusters therefore runs at most C + 1 draft
servers, usually far fewer, besides the shared ones.

**Hot-swap is a rolling replacement** behind the front door (:class:`VLLMDraftFollower`):

1. the follower fetches and validates the promoted draft as it does for our own engine
   (checksums, tokenizer, weights, a smoke forward);
2. it starts a new vLLM server with that draft and waits until it answers, while the old
   server goes on serving every request;
3. it swaps the cluster's slot: requests that start from now on go to the new server;
4. a server no slot uses any more is retired on a background thread: it stops getting
   requests, finishes the ones it has (``drain_s`` at most) and exits.

No request is refused or cut: one that started on the old server finishes there. vLLM's
worker-extension weight reload (``collective_rpc``) could swap in place without a second
server; it needs vLLM's dev-mode endpoints and a reload of the drafter inside the speculative
worker, which this build does not expose as a stable API, so the rolling replacement is
what runs (docs/architecture.md).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import urllib3

from specops.serving.fleet.hotswap import BASE, LIST, DraftFollower, DraftHandle
from specops.serving.vllm.metrics import SpecCounters, scrape
from specops.serving.vllm.process import ServerSpec, VLLMServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Counts:
    """Drafted and accepted tokens of an interval (what ``DraftFollower.record`` reads)."""

    num_drafted: int
    num_accepted: int


class VLLMServers:
    """The vLLM servers of one front door, keyed by the draft directory they serve."""

    def __init__(
        self,
        template: ServerSpec,
        *,
        methods: tuple[str, ...] | None = None,
        python: Path,
        log_dir: Path,
        start_timeout_s: float = 900.0,
        drain_s: float = 600.0,
    ) -> None:
        self.template = template
        self.methods = tuple(methods or (template.speculation,))
        """The speculations served (``process.SPECULATION``): one server each, the draft's per version."""
        self.python = Path(python)
        self.log_dir = Path(log_dir)
        self.start_timeout_s = start_timeout_s
        self.drain_s = drain_s
        self._servers: dict[str, VLLMServer] = {}
        self._lock = threading.Lock()
        self._retiring: list[threading.Thread] = []
        self.history: list[dict] = []
        """Every server started: name, draft, ready_s (seconds from start to answering)."""

    @property
    def per_draft(self) -> bool:
        return "draft" in self.methods

    @staticmethod
    def key(draft: Path | None, speculation: str = "draft") -> str:
        if speculation == "draft":
            return "draft:" + str(Path(draft).resolve()) if draft is not None else "draft:"
        return speculation

    def get(self, draft: Path | None, name: str, speculation: str = "draft") -> VLLMServer:
        """The server of ``speculation`` (of ``draft``, for the draft model), started and ready;
        started now when there is none."""
        if speculation not in self.methods:
            raise ValueError(f"speculation {speculation!r} is not served here (vllm_speculation: {self.methods})")
        key = self.key(draft, speculation)
        with self._lock:
            server = self._servers.get(key)
        if server is not None and server.alive():
            return server
        spec = replace(
            self.template, speculation=speculation, draft=Path(draft) if speculation == "draft" and draft else None
        )
        server = VLLMServer(spec, python=self.python, log_dir=self.log_dir, name=name).start()
        try:
            ready_s = server.wait_ready(self.start_timeout_s)
        except BaseException:
            server.stop()
            raise
        with self._lock:
            self._servers[key] = server
        self.history.append(
            {"name": name, "speculation": speculation, "draft": str(draft or ""), "ready_s": round(ready_s, 2)}
        )
        return server

    def shared(self) -> dict[str, VLLMServer]:
        """Speculation -> its shared server (those started)."""
        with self._lock:
            return {k: s for k, s in self._servers.items() if not k.startswith("draft:")}

    def revive_dead(self) -> list[VLLMServer]:
        """Restart, each on a thread of its own, every server in use whose process exited (a
        request to it meanwhile is a 503 with Retry-After). Returns the servers being restarted."""
        dead = [s for s in self.servers() if not s.alive() and not s.restarting and not s.retired]
        for server in dead:
            server.restarting = True

            def restart(server=server) -> None:
                try:
                    server.restart(self.start_timeout_s)
                except Exception:  # logged; the next check tries again
                    log.exception("vLLM server %s did not come back", server.name)
                finally:
                    server.restarting = False

            threading.Thread(target=restart, name=f"vllm-restart-{server.name}", daemon=True).start()
        return dead

    def servers(self) -> list[VLLMServer]:
        with self._lock:
            return list(self._servers.values())

    def retire_unused(self, in_use: set[int]) -> list[VLLMServer]:
        """Retire (drain, then stop, on a thread each) every draft server whose id is not in ``in_use``."""
        with self._lock:
            gone = {k: s for k, s in self._servers.items() if k.startswith("draft:") and id(s) not in in_use}
            for k in gone:
                del self._servers[k]
        for server in gone.values():
            t = threading.Thread(target=server.retire, args=(self.drain_s,), name=f"vllm-retire-{server.name}")
            t.daemon = True
            t.start()
            self._retiring.append(t)
            log.info("retiring vLLM server %s (%d requests still on it)", server.name, server.inflight)
        return list(gone.values())

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every server (in-flight requests were drained by the front door's own shutdown)."""
        for server in self.servers():
            server.stop(timeout_s)
        with self._lock:
            self._servers.clear()
        for t in self._retiring:
            t.join(timeout_s)


class VLLMDraftFollower(DraftFollower):
    """:class:`~serving.fleet.hotswap.DraftFollower` whose versions are served by vLLM servers:
    a new champion gets its server started and ready before the slot swaps to it."""

    def __init__(self, *args, servers: VLLMServers, base_draft_dir: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.servers = servers
        self.base_draft_dir = Path(base_draft_dir)
        self._http = urllib3.PoolManager(num_pools=8, maxsize=2)
        self._last: dict[int, SpecCounters] = {}
        """The last /metrics reading of each server (by id)."""
        self.counts_per_request = True
        """Live acceptance comes from each request's replayed counts (``serving.vllm.node``), as with our
        engine; False: from each champion server's counters per ``poll_s`` interval."""

    def start_base(self) -> VLLMServer | None:
        """The bootstrap draft's server, which every cluster serves until it has a champion (None
        when no server runs the draft model)."""
        self.base_backend = self.servers.get(self.base_draft_dir, "base") if self.servers.per_draft else None
        return self.base_backend

    def load(self, key: str, version):
        model = self._load(version)  # fetched, checksums, tokenizer, weights and a smoke forward checked
        path = self.cache_dir / version.cluster / f"v{version.version}"
        server = self.servers.get(path, f"{key}-v{version.version}") if self.servers.per_draft else None  # ready first
        return model, server

    def handle(self, item: str) -> bool:
        if item == LIST:  # every poll_s: dead servers restarted; their counters feed live acceptance
            for server in self.servers.revive_dead():
                log.error("vLLM server %s exited (code %s); restarting it", server.name, server.proc.returncode)
            self.read_live()
        return super().handle(item)

    def read_live(self) -> None:
        """The drafted and accepted tokens of each champion's server since the last reading, counted
        on its version (``DraftFollower.record``: live acceptance to the registry, auto-rollback).
        A server several clusters share (the base draft's) is not attributed: no cluster's own."""
        users: dict[int, list[DraftHandle]] = {}
        for slot in list(self.slots.values()):
            h = slot.current()
            users.setdefault(id(h.backend), []).append(h)
        for server in self.servers.servers():
            try:
                now = scrape(self._http, server.url)
            except (OSError, urllib3.exceptions.HTTPError) as exc:
                log.debug("vLLM server %s metrics not read: %s", server.name, exc)
                continue
            before = self._last.get(id(server))
            self._last[id(server)] = now
            handles = users.get(id(server), [])
            if before is None or len(handles) != 1 or handles[0].version == BASE or self.counts_per_request:
                continue
            delta = now - before
            if delta.requests > 0:
                counts = _Counts(int(delta.draft_tokens), int(delta.accepted))
                self.record(handles[0], counts, requests=int(delta.requests))

    def new_handle(self, key: str, version, obj) -> DraftHandle:
        model, server = obj  # what load() returned: the validated draft and its ready vLLM server
        return replace(super().new_handle(key, version, model), backend=server)

    def install(self, key: str, version, obj, load_s: float) -> None:
        super().install(key, version, obj, load_s)
        self._retire_unused()

    def _retire_unused(self) -> None:
        in_use = {id(slot.current().backend) for slot in self.slots.values()}
        in_use.add(id(self.base_backend))
        self.servers.retire_unused(in_use)

    def serving(self) -> dict[str, dict]:
        """Per cluster: the version served and its server (for ``/v1/clusters`` and tests)."""
        out = {}
        for cluster, slot in self.slots.items():
            h = slot.current()
            server = h.backend
            out[cluster] = {
                "version": h.version,
                "server": getattr(server, "url", None),
                "base": h.version == BASE,
            }
        return out

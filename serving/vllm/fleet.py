"""The vLLM servers behind one front door, and the hot-swap that moves a cluster to a new draft.

**One vLLM server per method, and per draft version in use** (not one per cluster): vLLM
fixes a server's speculation when it starts. The methods that draft with nothing per cluster
(target-only, n-gram, copy) get one server each, started at start-up and shared by every
cluster. The draft model gets one server per draft *version in use*: clusters serving
different drafts need different servers, while the clusters still on the bootstrap draft (or
on the same champion) share one. A fleet of C clusters therefore runs at most C + 1 draft
servers, usually far fewer, besides the shared ones.

**A swap loads the new draft into a running server** (:class:`VLLMDraftFollower`):

1. the follower fetches and validates the promoted draft as it does for our own engine
   (checksums, tokenizer, weights, a smoke forward);
2. it picks the server: the cluster's own (a cluster that already has a champion reloads its
   server in place), else a *standby* (a draft server started ahead with the base draft,
   ``vllm_standby`` of them, for a cluster's first champion), else a new server (a cold start,
   as when no standby is ready or the new draft has another shape);
3. the draft's weights load into it in place (``VLLMServer.reload_draft``: vLLM's in-place
   reload through our worker extension, ``plugin/specops_vllm_reload.py``): requests on that
   server pause between two steps for the load and go on with the new draft;
4. it swaps the cluster's slot: requests that start from now on go to that server;
5. a server no slot uses any more is retired on a background thread (it finishes the requests
   it has, ``drain_s`` at most, and exits), and a standby taken is replaced in the background.

No request is refused or cut, and every output stays the target's whichever draft proposed its
tokens. A request in flight on a server that reloads finishes with tokens drafted by both
versions; its counts go to the version it started on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import urllib3

from specops.core.models import has_weights, load_shell
from specops.serving.fleet.hotswap import BASE, LIST, DraftFollower, DraftHandle
from specops.serving.vllm.metrics import SpecCounters, scrape
from specops.serving.vllm.process import ServerSpec, VLLMError, VLLMServer

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
        standby: int = 0,
        copy_k: int | None = None,
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
        self.copy_k = copy_k or template.k
        """Tokens the copy server drafts per step at most (its copies are longer than the draft model's)."""
        self.standby = standby if "draft" in self.methods else 0
        """Draft servers kept started ahead with the base draft, for a cluster's first champion."""
        self._standby: list[VLLMServer] = []
        self._standby_starting: list[VLLMServer] = []
        self._standby_seq = 0
        self._closed = False
        self.history: list[dict] = []
        """Every server started (name, speculation, draft, ready_s: seconds from start to answering) and
        every draft loaded into a running one (``how``: in place or standby, ``reload_s``)."""

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
            self.template,
            speculation=speculation,
            draft=Path(draft) if speculation == "draft" and draft else None,
            k=self.copy_k if speculation == "copy" else self.template.k,
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

    def fill_standby(self, base_draft: Path) -> None:
        """Start standby draft servers (the base draft, on a thread each) until ``standby`` are
        ready or starting. A start that fails is logged; the next call tries again."""
        with self._lock:
            want = 0 if self._closed else self.standby - len(self._standby) - len(self._standby_starting)
            news = []
            for _ in range(max(want, 0)):
                self._standby_seq += 1
                spec = replace(self.template, speculation="draft", draft=Path(base_draft))
                server = VLLMServer(spec, python=self.python, log_dir=self.log_dir, name=f"standby-{self._standby_seq}")
                self._standby_starting.append(server)
                news.append(server)
        for server in news:

            def start(server=server) -> None:
                try:
                    if self._closed:
                        raise VLLMError("closed before it started")
                    ready_s = server.start().wait_ready(self.start_timeout_s)
                except Exception:
                    server.stop()
                    if not self._closed:
                        log.exception("standby vLLM server %s did not start", server.name)
                    ready_s = None
                with self._lock:
                    self._standby_starting.remove(server)
                    keep = ready_s is not None and not self._closed
                    if keep:
                        self._standby.append(server)
                if ready_s is None:
                    return
                if not keep:  # closed meanwhile
                    server.stop()
                    return
                log.info("standby vLLM server %s ready in %.1fs (the base draft)", server.name, ready_s)
                self.history.append(
                    {
                        "name": server.name,
                        "speculation": "draft",
                        "draft": str(base_draft),
                        "ready_s": round(ready_s, 2),
                    }
                )

            threading.Thread(target=start, name=f"vllm-{server.name}", daemon=True).start()

    def take_standby(self) -> VLLMServer | None:
        """A ready standby draft server (now no longer a standby), or None."""
        with self._lock:
            while self._standby:
                server = self._standby.pop(0)
                if server.alive():
                    return server
                server.stop()
        return None

    def standbys(self) -> list[VLLMServer]:
        with self._lock:
            return list(self._standby)

    def reload(self, server: VLLMServer, draft: Path, name: str, how: str) -> VLLMServer:
        """Load ``draft`` into ``server`` in place (``VLLMServer.reload_draft``); the server is from
        now on the one of ``draft``. Raises :class:`VLLMError` when vLLM refused it."""
        took = server.reload_draft(draft, name)
        with self._lock:
            for k in [k for k, s in self._servers.items() if s is server]:
                del self._servers[k]
            self._servers[self.key(draft)] = server
        self.history.append(
            {
                "name": name,
                "speculation": "draft",
                "draft": str(draft),
                "how": how,
                "reload_s": round(took, 3),
                "vocab": server.last_reload.get("vocab"),
            }
        )
        return server

    def describe(self) -> dict:
        """The servers, the standbys and the last starts and reloads (``/v1/clusters``' ``vllm``)."""
        with self._lock:
            used, standby, starting = list(self._servers.values()), list(self._standby), len(self._standby_starting)
        return {
            "servers": [
                {
                    "name": s.name,
                    "speculation": s.spec.speculation,
                    "draft": str(s.spec.draft or ""),
                    "alive": s.alive(),
                    "restarts": s.restarts,
                }
                for s in used
            ],
            "standby": {"wanted": self.standby, "ready": [s.name for s in standby], "starting": starting},
            "history": self.history[-20:],
        }

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
        """Every server started and kept: those in use, then the standbys."""
        with self._lock:
            return list(self._servers.values()) + list(self._standby)

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
        with self._lock:
            self._closed = True  # no standby starts or is kept after this
            starting = list(self._standby_starting)
        for server in self.servers() + starting:
            server.stop(timeout_s)
        with self._lock:
            self._servers.clear()
            self._standby.clear()
        for t in self._retiring:
            t.join(timeout_s)


class VLLMDraftFollower(DraftFollower):
    """:class:`~specops.serving.fleet.hotswap.DraftFollower` whose versions are served by vLLM servers:
    a new champion gets its server started and ready before the slot swaps to it."""

    def __init__(self, *args, servers: VLLMServers, base_draft_dir: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.servers = servers
        self.base_draft_dir = Path(base_draft_dir)
        self._http = urllib3.PoolManager(num_pools=8, maxsize=2)
        self._last: dict[int, SpecCounters] = {}
        """The last /metrics reading of each server (by id)."""
        self.counts_per_request = True
        """Live acceptance comes from each request's replayed counts (``specops.serving.vllm.node``), as with our
        engine; False: from each champion server's counters per ``poll_s`` interval."""

    def start_base(self) -> VLLMServer | None:
        """The bootstrap draft's server, which every cluster serves until it has a champion (None
        when no server runs the draft model)."""
        self.base_backend = self.servers.get(self.base_draft_dir, "base") if self.servers.per_draft else None
        return self.base_backend

    def start_standby(self) -> None:
        """Start the standby draft servers (``vllm_standby``) in the background."""
        self.servers.fill_standby(self.base_draft_dir)

    def load(self, key: str, version):
        model = self._load(version)  # fetched, checksums, tokenizer, weights and a smoke forward checked
        path = self.cache_dir / version.cluster / f"v{version.version}"
        if not has_weights(self.base_draft):  # vLLM holds the weights: the front door keeps the config only
            del model
            model = load_shell(path)
        server = self._server_for(key, path, f"{key}-v{version.version}") if self.servers.per_draft else None
        return model, server  # the server already drafts with the new version

    def _server_for(self, key: str, path: Path, name: str) -> VLLMServer:
        """A server drafting with ``path``, ready: the cluster's own reloaded in place, else a standby
        reloaded, else a new one (module docstring, step 2)."""
        slot = self.slots.get(key)
        own = slot.current().backend if slot is not None else None
        users = sum(1 for s in list(self.slots.values()) if s.current().backend is own)
        if own is not None and own is not self.base_backend and users == 1 and own.alive() and not own.restarting:
            try:
                return self.servers.reload(own, path, name, "in place")
            except VLLMError as exc:  # refused before anything loaded (another shape): a server of its own
                log.warning("cluster %s: %s; starting a new server instead", key, exc)
        standby = self.servers.take_standby()
        try:
            if standby is not None:
                try:
                    return self.servers.reload(standby, path, name, "standby")
                except VLLMError as exc:
                    standby.stop()
                    log.warning("cluster %s: %s; starting a new server instead", key, exc)
            log.info("cluster %s: no standby vLLM server ready; starting one for %s (a cold start)", key, name)
            return self.servers.get(path, name)
        finally:
            self.servers.fill_standby(self.base_draft_dir)  # the one taken is replaced in the background

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

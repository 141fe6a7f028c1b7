"""The soak's load and driver (``benchmarks/faults.py`` is the command): client threads sending
greedy requests, and the driver that kills and restarts one component per slot."""

from __future__ import annotations

import logging
import random
import signal
import threading
import time

import requests
from tqdm import tqdm

from benchmarks.soak.checks import check_isolation
from benchmarks.soak.stack import (
    CLUSTER,
    DOWN_S,
    LOAD_TENANTS,
    TENANTS,
    Attempt,
    Stack,
    Window,
    make_prompt,
    read_registry,
    read_stream,
    scrape,
)

log = logging.getLogger("bench.faults")


class Load:
    """``clients`` threads sending distinct greedy completion requests back to back."""

    def __init__(self, stack: Stack, t0: float, vocab: int, args) -> None:
        self.stack, self.t0, self.vocab, self.args = stack, t0, vocab, args
        self.attempts: list[Attempt] = []  # list.append is atomic: the clients share it
        self.in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), name=f"client-{i}", daemon=True)
            for i in range(args.clients)
        ]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _client(self, i: int) -> None:
        seq, failures = 0, 0
        url = self.stack.server_url + "/v1/completions"
        while not self._stop.is_set():
            rid = f"fault-c{i}-{seq:06d}"
            body = {
                "model": "specops",
                "prompt": make_prompt(self.args.seed, i, seq, self.vocab),
                "max_tokens": self.args.max_tokens,
                "temperature": 0,
                "cluster": CLUSTER,
                "speculation": {"method": "draft"},
            }
            a = Attempt(rid, i, seq, self.stack.epoch, self.now())
            with self._lock:
                self.in_flight.add(rid)
            key = list(TENANTS.values())[i % LOAD_TENANTS]  # the clients take turns between alice and bob
            try:  # a new connection per request: no pooled connection outlives a killed server
                r = requests.post(
                    url,
                    json=body,
                    headers={"X-Request-Id": rid, "Authorization": f"Bearer {key}"},
                    timeout=(5, self.args.request_timeout_s),
                )
                a.status = r.status_code
                if r.status_code == 200:
                    out = r.json()
                    a.text, a.draft_version = out["choices"][0]["text"], out["speculation"]["draft_version"] or ""
                else:
                    a.error = r.text[:200]
            except requests.RequestException as exc:
                a.error = f"{type(exc).__name__}: {str(exc)[:160]}"
            a.end = self.now()
            with self._lock:
                self.in_flight.discard(rid)
            self.attempts.append(a)
            seq += 1
            failures = 0 if a.status == 200 else failures + 1
            if failures:  # the server is down or restarting: back off (0.25 s doubling to 2 s)
                self._stop.wait(min(2.0, 0.25 * 2 ** (failures - 1)))

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.args.request_timeout_s + 10)


# ---------------------------------------------------------------- the run
class Driver:
    """Runs the load for ``duration_s`` and kills one component per slot, at a random point in it."""

    def __init__(self, stack: Stack, args) -> None:
        self.stack, self.args = stack, args
        self.rng = random.Random(args.seed)
        self.windows: list[Window] = []
        self.scrapes: dict[int, dict] = {}
        """Per server epoch: its last successful /metrics scrape."""
        self.load: Load | None = None
        self.bar: tqdm | None = None
        self.errors: list[BaseException] = []
        """Failed restarts (raised in the main thread)."""
        self.restarts: list[threading.Thread] = []
        self._stop = threading.Event()

    def plan(self) -> list[tuple[str, float, float]]:
        """(component, when, down for) per kill: the components in seeded shuffled turns, one kill per slot."""
        order: list[str] = []
        while len(order) < self.args.kills:
            turn = list(self.args.components)
            self.rng.shuffle(turn)
            order += turn
        slot = self.args.duration_s / max(1, self.args.kills)
        return [
            (c, (i + self.rng.uniform(0.2, 0.8)) * slot, self.rng.uniform(*DOWN_S[c]))
            for i, c in enumerate(order[: self.args.kills])
        ]

    def tick(self) -> None:
        if self.errors:
            raise self.errors[0]
        if self.bar is None or self.load is None:
            return
        second = min(int(self.load.now()), self.bar.total)
        if second > self.bar.n:
            done = list(self.load.attempts)
            self.bar.set_postfix(
                answered=sum(a.status == 200 for a in done),
                failed=sum(a.status != 200 for a in done),
                kills=len(self.windows),
                refresh=False,
            )
            self.bar.update(second - self.bar.n)

    def wait(self, cond, timeout_s: float, what: str) -> None:
        """Tick until ``cond()``; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.stack.logs()}")
            self.tick()
            time.sleep(0.2)

    def wait_until(self, t: float) -> None:
        self.wait(lambda: self.load.now() >= t, t - self.load.now() + 60, f"{t:.0f} s into the load")

    def wait_back(self, name: str) -> float:
        """Block until ``name`` is back (no ticking: restart threads call this too); returns the load time."""
        deadline = time.monotonic() + self.args.ready_timeout_s
        while not self.stack.is_back(name):
            if time.monotonic() > deadline or self._stop.is_set():
                raise TimeoutError(f"{name} not back after {self.args.ready_timeout_s:.0f} s\n{self.stack.logs()}")
            time.sleep(0.2)
        return self.load.now() if self.load is not None else 0.0

    def _monitor(self) -> None:
        """Scrape the server's logger counters every second (per epoch: the last scrape is kept)."""
        while not self._stop.wait(1.0):
            epoch = self.stack.epoch
            got = scrape(self.stack.server_url)
            if got is not None and epoch == self.stack.epoch:
                self.scrapes[epoch] = got

    def kill(self, name: str, down_s: float) -> Window:
        """SIGKILL ``name`` now; a thread restarts it after ``down_s`` and closes the window once it is back."""
        stack, load = self.stack, self.load
        proc = stack.procs[name]
        w = Window(name, 0.0, down_s, pid=proc.proc.pid, epoch=stack.epoch)
        if name == "server":
            got = scrape(stack.server_url)  # the last look at what this server has accepted
            if got is not None:
                self.scrapes[stack.epoch] = got
            w.published = dict(self.scrapes.get(stack.epoch, {}).get("published", {}))
            w.in_flight = len(load.in_flight)
        w.killed_at = load.now()
        proc.kill()
        if name == "server":
            stack.epoch += 1
        self.windows.append(w)
        log.info(
            "kill %d/%d at %.1f s: SIGKILL %s (pid %d)%s; restarting in %.1f s",
            len(self.windows),
            self.args.kills,
            w.killed_at,
            name,
            w.pid,
            f", {w.in_flight} request(s) in flight, accepted before the kill: {w.published}"
            if name == "server"
            else "",
            down_s,
        )

        def restart() -> None:
            try:
                if self._stop.wait(max(0.0, w.killed_at + down_s - load.now())):
                    return
                stack.spawn(name)
                w.back_at = self.wait_back(name)
                log.info(
                    "%s back at %.1f s (%s), %.1f s after the kill",
                    name,
                    w.back_at,
                    {"server": "/readyz 200", "mlflow": "/health 200", "trainer": "started up"}[name],
                    w.back_at - w.killed_at,
                )
            except BaseException as exc:  # noqa: BLE001 - the main thread raises it
                self.errors.append(exc)

        thread = threading.Thread(target=restart, name=f"restart-{name}", daemon=True)
        thread.start()
        self.restarts.append(thread)
        return w

    def run(self) -> dict:
        stack, args = self.stack, self.args
        t_setup = time.monotonic()
        for name in ("mlflow", "server", "trainer"):  # all at once: the server and trainer retry the registry
            stack.spawn(name)
        for name in ("mlflow", "server"):
            self.wait_back(name)
        setup_s = time.monotonic() - t_setup
        log.info(
            "stack up in %.1f s: MLflow %s, server %s, stream %s",
            setup_s,
            stack.mlflow_url,
            stack.server_url,
            stack.stream_url,
        )
        self.load = Load(stack, time.monotonic(), args.vocab, args).start()
        monitor = threading.Thread(target=self._monitor, name="monitor", daemon=True)
        monitor.start()
        self.bar = tqdm(total=int(args.duration_s), desc="soak", unit="s", mininterval=1.0, dynamic_ncols=True)
        try:
            for name, at, down_s in self.plan():
                prev = next((w for w in reversed(self.windows) if w.component == name), None)
                if prev is not None:  # a component is killed again only once it is back
                    self.wait(lambda: prev.back_at is not None, args.ready_timeout_s + 60, f"{name} to come back")
                    at = max(at, prev.back_at + args.min_gap_s)
                self.wait_until(at)
                self.kill(name, down_s)
            self.wait(
                lambda: all(w.back_at is not None for w in self.windows),
                args.ready_timeout_s + 60,
                "every killed component to come back",
            )
            self.wait_until(max([args.duration_s] + [w.back_at + args.tail_s for w in self.windows]))
        finally:
            self.load.stop()
            self._stop.set()
            for thread in self.restarts:  # none spawns a process after this
                thread.join(10)
            if not self.errors:
                self.tick()
            self.bar.close()
        load_s = self.load.now()
        try:  # on the last server, before it stops
            isolation = check_isolation(stack, self.args)
        except (requests.RequestException, KeyError, ValueError) as exc:
            log.error("the isolation checks failed to run: %s", exc)
            isolation = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        final = scrape(stack.server_url)
        if final is not None:
            self.scrapes[stack.epoch] = final
        log.info("load stopped at %.1f s; stopping the server (SIGTERM: it flushes the stream and exits)", load_s)
        server_rc = stack.procs["server"].stop(signal.SIGTERM, 60)
        trainer_rc = stack.procs["trainer"].stop(signal.SIGINT, 120)
        log.info("server exited %s, trainer exited %s", server_rc, trainer_rc)
        versions = read_registry(stack.mlflow_url)
        stack.procs["mlflow"].stop(signal.SIGTERM, 30)
        return {
            "attempts": self.load.attempts,
            "windows": self.windows,
            "scrapes": self.scrapes,
            "final_epoch": stack.epoch,
            "server_rc": server_rc,
            "trainer_rc": trainer_rc,
            "versions": versions,
            "records": read_stream(stack.stream_url),
            "setup_s": setup_s,
            "load_s": load_s,
            "isolation": isolation,
        }

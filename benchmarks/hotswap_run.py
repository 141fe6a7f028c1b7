"""The hot-swap benchmark's run (``benchmarks/hotswap.py`` is the command, its docstring defines the
measures): prompts, the perturbed draft B, the client load, and the timeline of promotions and swaps."""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specops.core.models import ModelPair, load_model
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import DecodePlan

log = logging.getLogger("bench.hotswap")

CLUSTER = "code"
REPLICA = "bench"


# ---------------------------------------------------------------- setup
def load_prompts(model_dir: Path, pair: ModelPair, n: int, num_tokens: int) -> tuple[list[list[int]], str]:
    """Held-out code prompts of the bootstrap; random token prompts when it has none (a bare model dir)."""
    try:
        from specops.workloads.prompts import heldout_prompts

        prompts = [p.token_ids for p in heldout_prompts(model_dir, pair.tokenizer, CLUSTER, n, num_tokens=num_tokens)]
    except (OSError, ValueError, KeyError) as exc:
        log.warning("no held-out prompts in %s (%s); using random token prompts", model_dir, exc)
        prompts = []
    if len(prompts) >= n:
        return prompts[:n], "held-out code"
    heldout = len(prompts)
    if heldout:
        log.warning("only %d held-out prompts; topping up with random token prompts", heldout)
    rng = random.Random(0)
    while len(prompts) < n:
        prompts.append([rng.randrange(1, pair.vocab_size) for _ in range(num_tokens)])
    return prompts, "held-out code + random token" if heldout else "random token"


def perturbed_draft(draft_dir: Path, dest: Path, scale: float, seed: int = 0) -> Path:
    """A second draft version: ``draft_dir`` with Gaussian noise (``scale`` × each tensor's std)
    on every weight, saved as safetensors next to the same tokenizer files."""
    shutil.copytree(draft_dir, dest)
    model = load_model(dest)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.float().std().clamp_min(1e-3))
    model.save_pretrained(dest, safe_serialization=True)
    return dest


@dataclass
class Request:
    client: int
    prompt: int
    start: float
    """Wall time the client called generate."""
    end: float
    latency_s: float
    version: str = ""
    started_at: float = 0.0
    """Wall time the request took its draft handle (ServedResult.started_at)."""
    identical: bool = True
    drafted: int = 0
    accepted: int = 0
    error: str = ""


class Load:
    """``concurrency`` client threads sending the prompts back to back through the node."""

    def __init__(
        self, node, prompts: list[list[int]], refs: list[list[int]], params: SamplingParams, concurrency: int
    ) -> None:
        self.node, self.prompts, self.refs, self.params = node, prompts, refs, params
        self.requests: list[Request] = []  # list.append is atomic: the clients share it
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), name=f"client-{i}", daemon=True)
            for i in range(concurrency)
        ]

    def _client(self, i: int) -> None:
        n = i * 7  # clients start on different prompts
        while not self._stop.is_set():
            j = n % len(self.prompts)
            n += 1
            start, t0 = time.time(), time.perf_counter()
            try:
                served = self.node.generate(DecodePlan.plain(self.prompts[j], self.params, cluster=CLUSTER))
            except Exception as exc:  # noqa: BLE001 - the benchmark counts every failure
                self.requests.append(Request(i, j, start, time.time(), time.perf_counter() - t0, error=repr(exc)))
                continue
            st = served.result.stats
            self.requests.append(
                Request(
                    i,
                    j,
                    start,
                    time.time(),
                    time.perf_counter() - t0,
                    served.draft_version,
                    served.started_at,
                    served.result.token_ids == self.refs[j],
                    st.num_drafted,
                    st.num_accepted,
                )
            )

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout_s)

    def first_on(self, version: str, since: float) -> Request | None:
        """The earliest-finishing request that took ``version`` at or after ``since``."""
        done = [r for r in list(self.requests) if r.version == version and r.started_at >= since]
        return min(done, key=lambda r: r.end, default=None)


def wait_for(cond, timeout_s: float, what: str, step_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(step_s)


# ---------------------------------------------------------------- the run
def run_swaps(pair: ModelPair, prompts: list[list[int]], refs: list[list[int]], args, tmp: Path) -> dict:
    from specops.registry import RegistryConfig, RegistryStore
    from specops.serving.fleet.events import EventPublisher, EventWatcher
    from specops.serving.fleet.hotswap import DraftFollower, HotSwapConfig
    from specops.serving.fleet.node import ServingNode
    from specops.streams import StreamConfig

    model_dir = Path(args.model_dir)
    draft_b = perturbed_draft(model_dir / "draft", tmp / "draft-b", args.perturb)
    stream = StreamConfig(url=f"local://{tmp}/log", fsync=False, num_partitions=2)
    publisher = EventPublisher(stream) if args.events else None
    db = tmp / "registry" / "mlflow.db"
    db.parent.mkdir(parents=True)
    log.info("creating the MLflow store and registering two draft versions")
    t0 = time.perf_counter()
    reg = RegistryStore(RegistryConfig(uri=f"sqlite:///{db}"), on_change=publisher)
    a = reg.artifact("draft").register(CLUSTER, model_dir / "draft", tokenizer_sha256=pair.tokenizer_sha256).version
    b = reg.artifact("draft").register(CLUSTER, draft_b, tokenizer_sha256=pair.tokenizer_sha256).version
    setup_s = time.perf_counter() - t0
    log.info("registry ready in %.1fs: A = version %s (bootstrap draft), B = version %s (perturbed)", setup_s, a, b)

    cfg = HotSwapConfig(poll_s=args.poll_s, auto_rollback=False)
    follower = DraftFollower(
        reg,
        pair.draft,
        target_vocab=pair.vocab_size,
        target_tokenizer_sha256=pair.tokenizer_sha256,
        cache_dir=tmp / "cache",
        cfg=cfg,
    ).start()
    events_at: list[float] = []

    def on_event(event) -> None:
        events_at.append(time.time())
        follower.on_event(event)

    watcher = EventWatcher(stream, REPLICA, on_event).start() if args.events else None
    node = ServingNode(pair, follower)
    slot = follower.slot(CLUSTER)  # the cluster exists (on the base draft) before the first promotion
    follower.wait_idle()
    load = Load(node, prompts, refs, SamplingParams(max_new_tokens=args.max_new_tokens), args.concurrency)
    swaps: list[dict] = []
    steady: list[tuple[float, float]] = []
    timeout = args.timeout_s + args.poll_s  # without events a swap may wait a whole poll interval
    try:
        time.sleep(1.0 if args.events else 0.0)  # the watcher's consumer group joins
        load.start()

        def swap_to(version: str) -> dict:
            t_call = time.time()
            reg.artifact("draft").promote(CLUSTER, version, reason="hotswap benchmark")
            t_prom = time.time()
            t_slot = wait_for(
                lambda: next((t for t, v in reversed(slot.history) if v == version and t >= t_call), None),
                timeout,
                f"the slot swap to version {version}",
            )
            first = wait_for(lambda: load.first_on(version, t_slot), timeout, f"a request served on version {version}")
            ev = next((t for t in events_at if t >= t_call), None)
            rec = next((s for s in reversed(follower.swaps) if s["to"] == version and s["at"] >= t_call), {})
            return {
                "to": version,
                "promote_call_s": t_prom - t_call,
                "promoted_at": t_prom,
                "slot_swap_at": t_slot,
                "first_served_at": first.end,
                "window": (t_prom, first.end + args.tail_s),
                "slot_swap_latency_s": t_slot - t_prom,
                "swap_latency_s": first.end - t_prom,
                "event_latency_s": None if ev is None else ev - t_prom,
                "load_s": rec.get("load_s"),
            }

        log.info("warm-up: promote A (version %s) and let the load settle", a)
        warm = swap_to(a)
        wait_for(lambda: time.time() >= warm["window"][1], timeout, "the warm-up tail")
        if args.events and not events_at:
            log.warning("no ModelEvent arrived for the warm-up promotion: the swap came from polling")
        order = [b if i % 2 == 0 else a for i in range(args.swaps)]
        for version in tqdm(order, desc="swaps", unit="swap"):
            t_steady = time.time()
            time.sleep(args.steady_s)
            steady.append((t_steady, time.time()))
            sw = swap_to(version)
            sw["from"] = a if version == b else b
            swaps.append(sw)
            time.sleep(max(0.0, sw["window"][1] - time.time()))
        t_steady = time.time()
        time.sleep(args.steady_s)
        steady.append((t_steady, time.time()))
        measured_from = steady[0][0]
    finally:
        load.stop()
        if watcher is not None:
            watcher.stop()
        follower.stop()
        if publisher is not None:
            publisher.close()
    return {
        "swaps": swaps,
        "steady_windows": steady,
        "measured_from": measured_from,
        "requests": load.requests,
        "versions": {"A": a, "B": b},
        "registry_setup_s": setup_s,
        "events_received": len(events_at),
        "warmup": warm,
    }

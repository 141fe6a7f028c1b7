"""Per-cluster replay buffers of logged requests (OSD Algorithm 1, the buffer Q).

Each cluster's draft learns from its own buffer. What a buffer keeps between updates
is its eviction policy:

- ``clear`` (the paper's choice, §4.2.1): keep everything since the last update, then
  release it all once the update is done.
- ``recent``: keep the most recent ``capacity`` requests; nothing is released after an
  update, so a request can feed several updates.
- ``reservoir``: a uniform sample of ``capacity`` requests out of every request seen
  (Vitter's algorithm R, seeded), also kept across updates.

``num_new`` counts requests added since the last update: the trainer updates a
cluster's draft every ``I`` of them (the paper's update interval).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

POLICIES = ("clear", "recent", "reservoir")


@dataclass(frozen=True)
class ReplayConfig:
    """Eviction policy of every cluster's buffer."""

    policy: str = "clear"
    """``clear`` (release after each update, OSD's default), ``recent`` or ``reservoir``."""
    capacity: int = 256
    """Most requests kept (``recent``, ``reservoir``); ``clear`` also refuses to grow past it."""
    seed: int = 0
    """Seed of the reservoir's sampling."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"replay policy must be one of {POLICIES}, got {self.policy!r}")
        if self.capacity < 1:
            raise ValueError(f"replay capacity must be >= 1, got {self.capacity}")


class ReplayBuffer(Generic[T]):
    """One cluster's buffer. Not thread-safe: the trainer's loop owns it."""

    def __init__(self, cfg: ReplayConfig, cluster: str = "") -> None:
        self.cfg = cfg
        self.cluster = cluster
        self._items: deque[T] | list[T] = deque(maxlen=cfg.capacity) if cfg.policy == "recent" else []
        self._rng = random.Random(f"{cfg.seed}:{cluster}")
        self.num_seen = 0
        """Requests ever added."""
        self.num_new = 0
        """Requests added since the last update."""
        self.num_evicted = 0

    def add(self, item: T) -> None:
        self.num_seen += 1
        self.num_new += 1
        cap = self.cfg.capacity
        if self.cfg.policy == "recent":
            if len(self._items) == cap:
                self.num_evicted += 1
            self._items.append(item)
        elif self.cfg.policy == "reservoir":
            if len(self._items) < cap:
                self._items.append(item)
            else:
                j = self._rng.randrange(self.num_seen)
                self.num_evicted += 1
                if j < cap:
                    self._items[j] = item  # type: ignore[index]
        else:  # clear: keep all until the update, but never grow without bound
            if len(self._items) == cap:
                self._items.pop(0)  # type: ignore[union-attr]
                self.num_evicted += 1
            self._items.append(item)

    def items(self) -> list[T]:
        """What an update trains on now."""
        return list(self._items)

    def updated(self) -> None:
        """Call after an update used ``items()``: applies the policy's release rule."""
        self.num_new = 0
        if self.cfg.policy == "clear":
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items))


class ReplayBuffers(Generic[T]):
    """One buffer per cluster, created on first use."""

    def __init__(self, cfg: ReplayConfig) -> None:
        self.cfg = cfg
        self._buffers: dict[str, ReplayBuffer[T]] = {}

    def __getitem__(self, cluster: str) -> ReplayBuffer[T]:
        if cluster not in self._buffers:
            self._buffers[cluster] = ReplayBuffer(self.cfg, cluster)
        return self._buffers[cluster]

    def due(self, interval: int) -> list[str]:
        """Clusters with at least ``interval`` new requests since their last update."""
        return sorted(c for c, b in self._buffers.items() if b.num_new >= interval)

    def clusters(self) -> list[str]:
        return sorted(self._buffers)

    def drop(self, cluster: str) -> None:
        """Forget the cluster's buffer (the trainer persisted it before unloading the cluster)."""
        self._buffers.pop(cluster, None)

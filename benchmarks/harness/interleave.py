"""Arms interleaved so that drift in the machine falls on all of them alike: the order of the arms
rotated per item, and several streams mixed into one seeded arrival order."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(order: Sequence[T], i: int) -> list[T]:
    """``order`` rotated left by ``i`` (who goes first changes with each prompt, repeat or round)."""
    items = list(order)
    if not items:
        return items
    s = i % len(items)
    return items[s:] + items[:s]


def mix_streams(streams: dict[str, list[T]], seed: int) -> list[T]:
    """The streams mixed into one arrival order (seeded; each draw picks a stream with probability
    proportional to what it has left), each stream's own order kept."""
    rng = random.Random(f"arrivals:{seed}")
    left = {d: list(v) for d, v in streams.items()}
    out = []
    while any(left.values()):
        d = rng.choices([d for d in left if left[d]], [len(left[d]) for d in left if left[d]])[0]
        out.append(left[d].pop(0))
    return out

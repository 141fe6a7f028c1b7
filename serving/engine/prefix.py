"""A request's choices (``n``, ``best_of``) share the prompt's prefill.

Every choice of a request decodes the same context; only the seed differs. Without sharing,
each prefills the whole prompt: ``n`` times the prefill's compute, which on a CPU is most of
a short answer's cost. With a :class:`SharedPrefix`, choice 0 (the *lead*) decodes exactly as a
request alone does, prefilling in its first step, and then hands a copy of its target's keys
and values for the context but its last token to the other choices (the *followers*). A
follower waits for that copy instead of prefilling, loads it into its own cache, and feeds the
context's last token with its first drafts as every request does.

The copy is the lead's own prefill, so every choice attends over the same keys and values
(choice 0 is bit for bit the request decoded alone; a follower's first pass scores its last
context token in a shorter pass, which may round differently in the last bit, as a prefix
cache does in vLLM). It is correct whatever the method: what a follower loads is what it
would have computed, and it checks the context token by token before loading.

A follower that finds another context (it never should), or whose lead failed before it
prefilled, prefills on its own: sharing only ever saves work. The keys and values stay within
the request: one tenant, one set of choices; nothing is kept once the request ends.
"""

from __future__ import annotations

import threading

import torch
from prometheus_client import Counter

from specops.serving.engine.kv import CachedLM

SHARED_TOKENS = Counter(
    "specops_prefill_shared_tokens_total",
    "Prompt tokens a request's choice (n, best_of) loaded from its first choice's prefill instead of computing them",
)

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer: keys and values ``[kv_heads, length, head_dim]`` of positions ``0 .. length-1``."""


class SharedPrefix:
    """One request's prefill, offered by its lead choice and taken by the others."""

    def __init__(self, *, wait_s: float = 600.0) -> None:
        self.wait_s = wait_s
        """How long a follower waits for the lead's prefill (the request's own timeout bounds it sooner)."""
        self._ready = threading.Event()
        self._ids: tuple[int, ...] | None = None
        self._kv: KV | None = None
        self.num_taken = 0
        """Followers that loaded the prefill (the tests read it; the metric counts the tokens)."""

    def handle(self, lead: bool) -> PrefixShare:
        """What choice ``lead``-or-not of the request carries into its session."""
        return PrefixShare(self, lead)

    def offer(self, ids: list[int], lm: CachedLM) -> None:
        """The lead's target holds ``ids`` at positions ``0 ..``: copy them for the followers."""
        if not self._ready.is_set():
            self._kv = lm.prefix(len(ids))
            self._ids = tuple(ids)
            self._ready.set()

    def withdraw(self) -> None:
        """The lead ended without a prefill to offer: followers stop waiting and prefill on their own."""
        self._ready.set()

    def take(self, ids: list[int], lm: CachedLM) -> int:
        """Load the lead's prefill into ``lm`` (an empty cache) if it is of ``ids``; the tokens it saved."""
        self._ready.wait(self.wait_s)
        kv = self._kv
        if kv is None or self._ids != tuple(ids) or lm.num_cached:
            return 0
        lm.load_prefix(kv)
        self.num_taken += 1
        SHARED_TOKENS.inc(len(ids))
        return len(ids)


class PrefixShare:
    """A choice's part in a :class:`SharedPrefix`: the lead offers, a follower takes."""

    __slots__ = ("group", "lead")

    def __init__(self, group: SharedPrefix, lead: bool) -> None:
        self.group, self.lead = group, lead

    def __repr__(self) -> str:
        return f"PrefixShare({'lead' if self.lead else 'follower'})"

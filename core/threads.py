"""CPU threads for torch: one OpenMP team in a serving process, on the thread that runs the target.

torch on a CPU runs its parallel kernels (and MKL's) on OpenMP teams. With libgomp each
thread that starts a parallel region gets a **team of its own**, kept while the thread
lives. Once the process holds more team threads than it has cores, libgomp stops letting
idle team threads spin and puts them to sleep on a futex, so **every** parallel region, on
every thread, pays a wake-up: measured on 2 cores, a 1-row 1536x576 product took 0.034 ms
with one team and 0.15-0.17 ms once a second thread had started a team of two, and a
1-token forward of SmolLM2-135M 34 ms against 55 ms (about 250 parallel regions a forward).

A serving replica has many threads that touch torch: decode workers (sampling, acceptance,
a draft model's forwards), the API's helper threads (prompt rendering, the router's
embedder), the followers that load hot-swapped drafts. :func:`single_threaded` makes the
calling thread run its kernels on itself alone (its OpenMP team size and MKL's, for this
thread only: torch's process-wide setting, which new threads start from, is untouched), so
only the target's batcher thread keeps a team of ``--threads``.

``specops serve`` does this process-wide with :func:`reserve_for_compute`: torch's default
becomes one thread, which every thread starts from (decode workers, the API's helpers,
followers), and the threads that run the target (the loader, which also times the target's
linear routes, and the batcher) call :func:`compute_thread` to take the ``--threads`` team.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_setters: tuple | None = None


def _load_setters() -> tuple:
    """(omp_set_num_threads, mkl_set_num_threads_local or None), from the libraries torch loaded."""
    global _setters
    with _lock:
        if _setters is not None:
            return _setters
        omp = mkl = None
        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        for name in ("libgomp.so.1", "libiomp5.so", None):  # torch's own runtime first, then whatever is loaded
            try:
                omp = ctypes.CDLL(os.path.join(lib, name) if name else None).omp_set_num_threads
                break
            except (AttributeError, OSError):
                continue
        try:  # MKL linked into libtorch_cpu: its per-thread setting (Fortran binding: by reference)
            mkl = ctypes.CDLL(os.path.join(lib, "libtorch_cpu.so")).mkl_set_num_threads_local_
        except (AttributeError, OSError):
            mkl = None
        if omp is None:
            log.info("torch has no OpenMP runtime to set per thread; worker threads keep torch's thread count")
        _setters = (omp, mkl)
        return _setters


def set_thread_cpus(n: int) -> bool:
    """Run this thread's torch kernels (OpenMP and MKL) on ``n`` threads, this thread only.

    Call it at the start of a thread. True when it took effect."""
    if torch.get_num_threads() == n:  # also torch's per-thread initialisation, which would undo ours later
        return True
    omp, mkl = _load_setters()
    if omp is None:
        return False
    omp(ctypes.c_int(n))
    if mkl is not None:
        mkl(ctypes.byref(ctypes.c_int(n)))
    return torch.get_num_threads() == n


def single_threaded() -> bool:
    """Run this thread's torch kernels on this thread alone (no OpenMP team of its own)."""
    return set_thread_cpus(1)


_compute_threads: int | None = None


def reserve_for_compute(n: int) -> None:
    """From now on every thread starts single-threaded; threads that call :func:`compute_thread`
    get ``n``. Call it once, early, before the process starts its threads (``specops serve``)."""
    global _compute_threads
    _compute_threads = int(n)
    torch.set_num_threads(1)
    log.info("torch: 1 thread per thread, %d on the threads that run the target", n)


def compute_thread() -> None:
    """Give this thread the ``n`` threads :func:`reserve_for_compute` kept (no-op otherwise)."""
    if _compute_threads is not None and _compute_threads > 1:
        set_thread_cpus(_compute_threads)

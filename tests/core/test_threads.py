"""specops.core.threads: one OpenMP team per serving process, on the threads that run the target.

Each case runs in a fresh interpreter: torch's thread settings are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_single_threaded_applies_to_the_calling_thread_only():
    got = _run(
        """
        import threading, torch
        torch.set_num_threads(2)
        from specops.core.threads import single_threaded
        seen = {}
        def worker():
            seen["ok"] = single_threaded()
            seen["worker"] = torch.get_num_threads()
            torch.randn(300, 300) @ torch.randn(300, 300)  # a kernel runs there, on one thread
        t = threading.Thread(target=worker); t.start(); t.join()
        print(seen["ok"], seen["worker"], torch.get_num_threads())
        """
    )
    assert got == "True 1 2"


def test_reserve_for_compute_gives_the_team_only_to_compute_threads():
    got = _run(
        """
        import threading, torch
        from specops.core.threads import compute_thread, reserve_for_compute
        reserve_for_compute(2)
        seen = {}
        def plain():
            seen["plain"] = torch.get_num_threads()
        def compute():
            compute_thread()
            seen["compute"] = torch.get_num_threads()
        for f in (plain, compute):
            t = threading.Thread(target=f); t.start(); t.join()
        print(seen["plain"], seen["compute"], torch.get_num_threads())
        """
    )
    assert got == "1 2 1"

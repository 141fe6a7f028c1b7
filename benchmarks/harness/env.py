"""The environment record written next to every benchmark's numbers, and the target's name."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    """The CPU's model name (benchmarks say which CPU their numbers come from)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """Versions, machine and git state, recorded next to every benchmark's numbers."""
    import torch
    import transformers

    def git(*args: str) -> str | None:
        try:
            return (
                subprocess.run(
                    ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
                ).stdout.strip()
                or None
            )
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "load_avg_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def target_name(model_dir: Path) -> str:
    """The target's name in a bootstrap directory's manifest ("toy target" for older ones)."""
    try:
        from specops.trainer.bootstrap import load_manifest

        m = load_manifest(model_dir)
        return m.get("target", {}).get("name") or f"{m.get('kind', 'toy')} target"
    except (OSError, ValueError):
        pass
    try:  # a target directory without the bootstrap's manifest: its converter's record
        return json.loads((Path(model_dir) / "target" / "source.json").read_text())["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"

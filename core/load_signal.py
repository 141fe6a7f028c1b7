"""The serving load signal: the one format serving writes and the trainer's scheduler reads.

A JSON file ``{"load": 0.42, "time": <epoch seconds>}`` rewritten atomically about once a
second by each replica (``ServeConfig.load_signal``). The trainer skips a scheduled tick
while the load is above its threshold ("spare FLOPs"), and treats a missing, unreadable,
non-finite or stale file as unknown load. A leaf module: it imports nothing of ours, so the
trainer reads the format without importing serving's HTTP stack.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path


def write_load_signal(path: str | os.PathLike, load: float, now: float | None = None) -> None:
    """Write ``{"load": load, "time": now}`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps({"load": float(load), "time": time.time() if now is None else float(now)}))
    os.replace(tmp, path)


def read_load_file(path: str | os.PathLike, stale_s: float, now: float | None = None) -> tuple[float | None, str]:
    """The load in the signal file, or None when unknown, with the reason."""
    now = time.time() if now is None else now
    try:
        data = json.loads(Path(path).read_text())
        load, stamp = float(data["load"]), float(data["time"])
    except FileNotFoundError:
        return None, f"no load signal at {path}"
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return None, f"unreadable load signal {path}: {type(exc).__name__}: {exc}"
    if not (math.isfinite(load) and math.isfinite(stamp)):
        return None, f"non-finite load signal in {path}"
    age = now - stamp
    if abs(age) > stale_s:
        return None, f"stale load signal {path} ({age:.0f}s old, limit {stale_s:.0f}s)"
    return load, "ok"

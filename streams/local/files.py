"""Names, metadata files and directory fsync of the local log (see ``specops.streams.local.stream``).

Metadata, member and offset files are written to a temporary file in the same directory
and renamed over the old one (with ``fsync``, the file and then its directory are fsynced).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from specops.streams.errors import StreamConfigError

TP = tuple[str, int]
"""A topic partition."""
POLL_STEP_S = 0.02
"""How long readers sleep between looks at a partition with nothing new."""
_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise StreamConfigError(
            f"invalid {kind} name {name!r}: use 1-249 characters of A-Z a-z 0-9 . _ - (not . or ..)"
        )
    return name


def write_json_atomic(path: Path, obj: Any, fsync: bool) -> None:
    """Write ``obj`` to a temporary file next to ``path`` and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)


def read_json(path: Path) -> Any | None:
    """The parsed file, or None if it does not exist. Raises ValueError if unparsable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

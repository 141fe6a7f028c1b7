"""Where specops keeps its data (models, logs, registry) on this machine."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SPECOPS_DATA_DIR"
CACHE_DIR_ENV = "SPECOPS_CACHE_DIR"


def data_dir() -> Path:
    """``$SPECOPS_DATA_DIR`` if set, else ``./.specops``."""
    return Path(os.environ.get(DATA_DIR_ENV, ".specops")).expanduser()


def cache_dir() -> Path:
    """Where derived data that is only a speed-up lives (safe to delete): ``$SPECOPS_CACHE_DIR``
    if set, else ``$XDG_CACHE_HOME/specops``, else ``~/.cache/specops``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "specops"


def models_dir() -> Path:
    return data_dir() / "models"


def streams_url() -> str:
    """The default stream: ``$SPECOPS_STREAM_URL`` if set, else the embedded local log
    under the data directory."""
    return os.environ.get("SPECOPS_STREAM_URL") or f"local://{data_dir() / 'streams'}"

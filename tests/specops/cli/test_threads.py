"""``--threads``' default: ``$SPECOPS_THREADS`` when set, else every core (at most 8)."""

from __future__ import annotations

import os

import pytest

from specops.cli.common import THREADS_ENV, default_threads


def test_the_environment_sets_the_default(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "3")
    assert default_threads() == 3
    monkeypatch.delenv(THREADS_ENV)
    assert default_threads() == min(os.cpu_count() or 1, 8)


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_bad_value_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv(THREADS_ENV, bad)
    with pytest.raises(SystemExit, match="SPECOPS_THREADS.*positive integer"):
        default_threads()

from __future__ import annotations

import pytest

from trainer.bootstrap import run as bootstrap


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """A --tiny bootstrap (random models, seconds) for benchmark smoke runs."""
    out = tmp_path_factory.mktemp("bench") / "models"
    bootstrap(out, tiny=True)
    return out

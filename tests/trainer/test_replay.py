"""Replay buffers keep what their eviction policy says, per cluster."""

from __future__ import annotations

import pytest

from specops.trainer.replay import ReplayBuffer, ReplayBuffers, ReplayConfig


def test_clear_policy_releases_everything_after_an_update():
    buf = ReplayBuffer(ReplayConfig(policy="clear", capacity=100))
    for i in range(8):
        buf.add(i)
    assert buf.items() == list(range(8)) and buf.num_new == 8
    buf.updated()
    assert len(buf) == 0 and buf.num_new == 0 and buf.num_seen == 8


def test_clear_policy_is_still_bounded():
    buf = ReplayBuffer(ReplayConfig(policy="clear", capacity=3))
    for i in range(5):
        buf.add(i)
    assert buf.items() == [2, 3, 4] and buf.num_evicted == 2


def test_recent_keeps_the_newest_across_updates():
    buf = ReplayBuffer(ReplayConfig(policy="recent", capacity=4))
    for i in range(10):
        buf.add(i)
    buf.updated()
    assert buf.items() == [6, 7, 8, 9] and buf.num_new == 0 and buf.num_evicted == 6


def test_reservoir_is_a_uniform_sample_and_seeded():
    counts = [0] * 50
    for trial in range(400):
        buf = ReplayBuffer(ReplayConfig(policy="reservoir", capacity=10, seed=trial))
        for i in range(50):
            buf.add(i)
        assert len(buf) == 10 and len(set(buf.items())) == 10
        for x in buf.items():
            counts[x] += 1
    # each item is kept with probability 10/50 -> expected 80 of 400 trials
    assert min(counts) > 45 and max(counts) < 120
    a = ReplayBuffer(ReplayConfig(policy="reservoir", capacity=5, seed=1), "c")
    b = ReplayBuffer(ReplayConfig(policy="reservoir", capacity=5, seed=1), "c")
    for i in range(30):
        a.add(i)
        b.add(i)
    assert a.items() == b.items()


def test_buffers_per_cluster_and_due_clusters():
    bufs = ReplayBuffers(ReplayConfig())
    for i in range(9):
        bufs["code"].add(i)
    for i in range(3):
        bufs["prose"].add(i)
    assert bufs.due(8) == ["code"] and bufs.clusters() == ["code", "prose"]
    bufs["code"].updated()
    assert bufs.due(8) == []


def test_bad_config_says_what_to_change():
    with pytest.raises(ValueError, match="clear"):
        ReplayConfig(policy="lru")
    with pytest.raises(ValueError, match="capacity"):
        ReplayConfig(capacity=0)

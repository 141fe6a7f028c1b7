"""The online trainer bounds its clusters: at most ``max_loaded_clusters`` drafts in memory (the
least recently used idle one unloaded, reloaded from its checkpoint exactly), at most
``max_clusters`` created (records of further clusters dead-lettered), and says so in its metrics."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from specops.streams import codec, open_stream
from specops.streams.records import DeadLetter
from specops.trainer import checkpoint as ckpt
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.replay import ReplayConfig
from tests.trainer.logged import log_requests

N_CLUSTERS = 12
RECIPE = {
    "positions": "rejected",
    "interval": 2,
    "holdout_every": 5,
    "steps_per_update": 2,
    "replay": ReplayConfig(policy="clear", capacity=8),
}
"""Teacher sampling at the logged rejected positions: no target model, deterministic updates."""


@pytest.fixture(scope="module")
def many(close_pair, tmp_path_factory):
    """48 logged requests over 12 clusters, interleaved (request i in cluster c{i % 12})."""
    root = tmp_path_factory.mktemp("cluster-bounds")
    return log_requests(
        close_pair, root, 4 * N_CLUSTERS, seed=5, cluster_of=lambda i: f"c{i % N_CLUSTERS}", max_new_tokens=12
    )


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def _peak_loaded(trainer: OnlineTrainer) -> list[int]:
    """Record how many clusters are in memory whenever one is loaded."""
    peaks: list[int] = []
    new_state = trainer._new_state

    def counting(cluster, *args, **kwargs):
        st = new_state(cluster, *args, **kwargs)
        peaks.append(len(trainer.clusters) + 1)  # the one being loaded, with those already in
        return st

    trainer._new_state = counting  # type: ignore[method-assign]
    return peaks


def _opt_state(st) -> dict:
    return {
        (i, k): v.clone() if torch.is_tensor(v) else v
        for i, s in st.opt.state_dict()["state"].items()
        for k, v in s.items()
    }


def test_many_clusters_stay_within_the_bounds_and_the_rest_are_dead_lettered(many, tmp_path):
    cfg, draft_dir = many
    before = {
        m: _metric(m)
        for m in (
            "specops_trainer_cluster_unloads_total",
            "specops_trainer_cluster_reloads_total",
            "specops_trainer_cluster_refused_records_total",
        )
    }
    out = tmp_path / "trainer"
    trainer = OnlineTrainer(
        cfg,
        draft_dir,
        out,
        OnlineConfig(**RECIPE, group="bounded", max_loaded_clusters=3, max_clusters=8, poll_records=16),
    )
    peaks = _peak_loaded(trainer)
    try:
        consumed = trainer.run(max_idle_s=1.0)
        assert consumed == 4 * N_CLUSTERS
        assert peaks and max(peaks) <= 3 and len(trainer.clusters) <= 3
        # the first 8 clusters seen were created, the other 4 never: their 16 records are dead letters
        created = sorted(trainer.budget.known)
        refused = {f"c{i}" for i in range(N_CLUSTERS)} - set(created)
        assert len(created) == 8 and ckpt.clusters_in(out) == created
        counts = trainer.budget.counts
        assert counts["refused"] == 16
        assert counts["unloaded"] > 0 and counts["reloaded"] > 0
        assert _metric("specops_trainer_clusters_loaded") == len(trainer.clusters)
        assert _metric("specops_trainer_clusters") == 8
        for name, key in (
            ("specops_trainer_cluster_unloads_total", "unloaded"),
            ("specops_trainer_cluster_reloads_total", "reloaded"),
            ("specops_trainer_cluster_refused_records_total", "refused"),
        ):
            assert _metric(name) - before[name] == counts[key], name
        # every cluster trained on its records although most were unloaded in between
        for cluster in created:
            st = trainer.state(cluster)
            assert st.records_trained + len(trainer.buffers[cluster]) + len(st.holdout) == 4
        with open_stream(cfg) as stream:
            letters = [codec.decode(m.value) for m in stream.read(cfg.topics.deadletter)]
            committed, ends = stream.committed("bounded", cfg.topics.misses), stream.end_offsets(cfg.topics.misses)
        assert len(letters) == 16 and all(isinstance(d, DeadLetter) for d in letters)
        assert {codec.decode(d.value).cluster for d in letters} == refused
        assert all("MissRecord.cluster" in d.reason and "max_clusters (8)" in d.reason for d in letters)
        assert {p: committed.get(p, 0) for p in ends} == ends  # nothing lost: trained, buffered or dead-lettered
    finally:
        trainer.close()


def test_an_unloaded_cluster_reloads_with_identical_weights_and_optimiser_state(many, tmp_path):
    cfg, draft_dir = many
    trainer = OnlineTrainer(
        cfg, draft_dir, tmp_path / "trainer", OnlineConfig(**RECIPE, group="reload", max_loaded_clusters=2)
    )
    try:
        trainer.run(max_idle_s=1.0)
        cluster = next(c for c, st in trainer.clusters.items() if st.updates)
        st = trainer.clusters[cluster]
        weights = {k: v.clone() for k, v in st.model.state_dict().items()}
        opt, groups = _opt_state(st), st.opt.state_dict()["param_groups"]
        kept = (
            st.version,
            st.updates,
            st.records_trained,
            [h.source for h in st.holdout],
            [h.source for h in trainer.buffers[cluster].items()],
            trainer.buffers[cluster].num_new,
        )
        assert opt, "the cluster has optimiser state to keep"
        unloads = trainer.budget.counts["unloaded"]
        others = [f"c{i}" for i in range(N_CLUSTERS) if f"c{i}" != cluster and f"c{i}" not in trainer.clusters]
        trainer.state(others[0])
        trainer.state(others[1])  # two others loaded: the cluster is out of memory now
        assert cluster not in trainer.clusters and trainer.budget.counts["unloaded"] >= unloads + 1
        back = trainer.state(cluster)
        assert back is not st
        assert back.model.state_dict().keys() == weights.keys()
        for k, v in back.model.state_dict().items():
            assert torch.equal(v, weights[k]), k
        got = _opt_state(back)
        assert got.keys() == opt.keys()
        for key, value in opt.items():
            assert torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value, key
        assert back.opt.state_dict()["param_groups"] == groups
        assert (
            back.version,
            back.updates,
            back.records_trained,
            [h.source for h in back.holdout],
            [h.source for h in trainer.buffers[cluster].items()],
            trainer.buffers[cluster].num_new,
        ) == kept
    finally:
        trainer.close()


def test_a_bounded_trainer_trains_exactly_what_an_unbounded_one_does(many, tmp_path):
    cfg, draft_dir = many
    finals = []
    for name, loaded in (("unbounded", N_CLUSTERS), ("one-at-a-time", 1)):
        trainer = OnlineTrainer(
            cfg, draft_dir, tmp_path / name, OnlineConfig(**RECIPE, group=name, max_loaded_clusters=loaded)
        )
        try:
            trainer.run(max_idle_s=1.0)
            final = {}
            for c in sorted(trainer.budget.known):
                st = trainer.state(c)
                final[c] = (st.version, {k: v.clone() for k, v in st.model.state_dict().items()})
            finals.append(final)
            assert len(trainer.clusters) <= loaded
        finally:
            trainer.close()
    unbounded, bounded = finals
    assert unbounded.keys() == bounded.keys() and len(unbounded) == N_CLUSTERS
    assert any(version for version, _ in unbounded.values())
    for cluster, (version, weights) in unbounded.items():
        assert bounded[cluster][0] == version, cluster
        for k, v in weights.items():
            assert torch.equal(bounded[cluster][1][k], v), (cluster, k)


def test_the_bounds_are_checked_and_left_out_of_the_config_hash():
    with pytest.raises(ValueError, match="max_loaded_clusters"):
        OnlineConfig(max_loaded_clusters=0)
    with pytest.raises(ValueError, match="max_clusters"):
        OnlineConfig(max_clusters=0)
    assert OnlineConfig(max_loaded_clusters=2, max_clusters=5).digest() == OnlineConfig().digest()

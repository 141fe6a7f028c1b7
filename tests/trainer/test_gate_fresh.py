"""The gate's fresh evidence (issue 55): training requests scored by the learning draft just
before it trained on them (test-then-train), paired with the champion on the same requests.

With one request in ten held out, the held-out window alone needs a hundred requests of a new
domain before it can tell; the fresh requests are the other nine in ten. A draft scored on a
request it had already trained on would be flattered, so the trainer must score each request
before the update that trains on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from specops.core.models import ModelPair, load_model_dir
from specops.registry import RegistryConfig, RegistryStore
from specops.trainer.acceptance import Acceptance
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.promote import FRESH, Fresh, PromoteConfig, Promoter, fresh_window, gate_decision
from specops.trainer.replay import ReplayConfig
from tests.conftest import perturbed
from tests.trainer.logged import log_requests


@dataclasses.dataclass
class _Rec:
    timestamp: float
    request_id: str


def _fresh(n: int, versions, t0: float = 100.0) -> list[Fresh]:
    return [Fresh(_Rec(t0 + i, f"r{i}"), v, 5, 10) for i, v in zip(range(n), versions)]


def _acc(pairs) -> Acceptance:
    pairs = tuple(pairs)
    m, n = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    return Acceptance(0.0, 0.0, 0.0, 0, served=m / n if n else 0.0, served_positions=n, per_request=pairs)


def test_fresh_window_takes_the_newest_scored_by_a_learner_newer_than_the_champion():
    fresh = _fresh(10, [1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    cfg = PromoteConfig(fresh=4)
    assert [f.record.request_id for f in fresh_window(fresh, cfg, 0)] == ["r6", "r7", "r8", "r9"]
    # scored by the champion (3) itself, or by older drafts: a draft paired with itself or an ancestor
    assert [f.learner_version for f in fresh_window(fresh, PromoteConfig(fresh=32), 3)] == [4, 4, 5, 5]
    assert fresh_window(fresh, PromoteConfig(fresh=0), 0) == []
    assert fresh_window(fresh, PromoteConfig(metric="sampling"), 0) == []  # only the served metric pairs requests
    aged = fresh_window(fresh, PromoteConfig(window_s=2.5), 0, now=109.5)
    assert [f.record.request_id for f in aged] == ["r7", "r8", "r9"]


def test_fresh_is_validated_and_the_cli_default_is_the_gate_default():
    with pytest.raises(ValueError, match="fresh"):
        PromoteConfig(fresh=-1)
    from specops.cli.train import add_parser

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    assert p.parse_args(["train"]).gate_fresh == PromoteConfig().fresh == FRESH
    assert p.parse_args(["train", "--gate-fresh", "0"]).gate_fresh == 0


def test_fresh_evidence_promotes_what_the_held_out_window_alone_cannot_tell():
    cfg = PromoteConfig(min_positions=1)
    window_c, window_r = _acc([(6, 10), (5, 10)]), _acc([(5, 10), (6, 10)])  # two held-out requests: a tie
    fresh = [((8, 10), (4, 10))] * 10 + [((7, 10), (5, 10))] * 10  # the learner wins on 20 fresh requests
    alone = gate_decision("2", "1", window_c, window_r, cfg)
    assert not alone.promoted
    both = gate_decision("2", "1", window_c, window_r, cfg, fresh=fresh)
    assert both.promoted, both.reason
    assert both.extra["fresh_requests"] == 20
    assert both.candidate_score == pytest.approx((11 + 150) / 220) and both.num_positions == 220
    # with fresh evidence off (0) nothing is paired: the window decides alone
    assert gate_decision("2", "1", window_c, window_r, dataclasses.replace(cfg, fresh=0)).promoted is False


def test_a_candidate_worse_on_the_same_period_held_out_is_not_promoted_on_fresh_evidence():
    cfg = PromoteConfig(min_positions=1)
    window_c, window_r = _acc([(5, 10)] * 6), _acc([(5, 10)] * 6)
    fresh = [((8, 10), (4, 10))] * 20
    worse = (_acc([(2, 10), (1, 10), (2, 10), (3, 10)]), _acc([(8, 10), (9, 10), (8, 10), (9, 10)]))
    result = gate_decision("2", "1", window_c, window_r, cfg, fresh=fresh, guard=worse)
    assert not result.promoted and "same period" in result.reason
    assert result.extra["guard_requests"] == 4 and result.extra["guard_served_gain"] < 0
    level = (_acc([(5, 10)] * 4), _acc([(5, 10), (6, 10), (4, 10), (5, 10)]))
    assert gate_decision("2", "1", window_c, window_r, cfg, fresh=fresh, guard=level).promoted
    # margin -1 promotes every candidate with evidence: no guard either
    assert gate_decision("2", "1", window_c, window_r, dataclasses.replace(cfg, margin=-1.0), fresh=fresh, guard=worse)


@pytest.mark.slow
def test_the_trainer_scores_each_request_before_it_trains_on_it(tiny_models, sqlite_uri, tmp_path):
    pair = load_model_dir(tiny_models)
    weak = ModelPair(pair.target, perturbed(pair.target, 0.6, seed=4), pair.tokenizer, pair.tokenizer_sha256)
    cfg, draft_dir = log_requests(weak, tmp_path, 30, seed=5, cluster_of=lambda i: "c", greedy_only=True)
    ocfg = OnlineConfig(
        positions="rejected", replay=ReplayConfig(policy="recent", capacity=32), interval=6, holdout_every=4, lr=2e-3
    )
    out = tmp_path / "trainer"
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    promoter = Promoter(
        reg, draft_dir, out, PromoteConfig(min_positions=1, fresh=64), tokenizer_dir=tiny_models / "target"
    )
    trainer = OnlineTrainer(cfg, draft_dir, out, ocfg, promoter=promoter)
    assert trainer.fresh_keep == 64
    trainer.run(max_idle_s=1.0)
    trainer.close()
    st = trainer.clusters["c"]
    assert st.version >= 3 and len(st.fresh) >= 12
    history = [json.loads(line) for line in (out / "c" / "updates.jsonl").read_text().splitlines()]
    trained_by: dict[str, int] = {}
    for h in history:  # "recent" replay trains a request in several updates: the first one counts
        for rid in h["request_ids"]:
            trained_by.setdefault(rid, h["version"])
    held = {h.record.request_id for h in st.holdout}
    for f in st.fresh:
        rid = f.record.request_id
        assert rid not in held  # held-out requests are never trained on: they are the window's, not fresh
        # scored by the version just before the update that first trained on it
        assert f.learner_version == trained_by[rid] - 1, rid
        assert 0 <= f.agree <= f.positions == len(f.record.token_ids) - f.record.num_prompt_tokens
    gated = [r for r in trainer.gate_results if "fresh_requests" in r.extra]
    assert gated, [r.reason for r in trainer.gate_results]
    # after a promotion only requests scored by newer learners are paired: never more than were scored since
    for r in trainer.gate_results:
        assert r.extra.get("fresh_requests", 0) <= len(st.fresh)


def test_without_a_gate_the_trainer_scores_nothing(tiny_models, tmp_path):
    pair = load_model_dir(tiny_models)
    cfg, draft_dir = log_requests(pair, tmp_path, 8, seed=2, cluster_of=lambda i: "c", greedy_only=True)
    trainer = OnlineTrainer(cfg, draft_dir, tmp_path / "t", OnlineConfig(positions="rejected", interval=4))
    assert trainer.fresh_keep == 0
    trainer.run(max_idle_s=0.5)
    trainer.close()
    assert not trainer.clusters["c"].fresh and not trainer.clusters["c"].unscored

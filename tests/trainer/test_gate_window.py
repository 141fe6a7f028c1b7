"""The promotion gate judges candidates on the cluster's recent held-out traffic (issue 55).

After a drift, a draft that learned the new traffic must win on the newest held-out requests,
even when the older held-out requests, of the traffic the cluster left, favour the champion.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specops.core.models import ModelPair, load_model, load_model_dir
from specops.registry import CHAMPION, RegistryConfig, RegistryStore
from specops.streams import codec, open_stream
from specops.trainer.promote import WINDOW, PromoteConfig, Promoter, gate_window
from tests.conftest import perturbed
from tests.trainer.logged import log_requests


@dataclasses.dataclass
class _Rec:
    timestamp: float
    name: str


def test_gate_window_takes_the_newest_requests_in_order():
    held = [_Rec(100.0 + i, f"r{i}") for i in range(10)]  # oldest first, as the trainer keeps them
    assert [r.name for r in gate_window(held, PromoteConfig(window=3))] == ["r7", "r8", "r9"]
    assert gate_window(held, PromoteConfig(window=0)) == held
    assert gate_window(held, PromoteConfig(window=50)) == held
    # an age limit on top: only those logged in the last 4.5 s before now=109.5
    aged = gate_window(held, PromoteConfig(window=0, window_s=4.5), now=109.5)
    assert [r.name for r in aged] == ["r5", "r6", "r7", "r8", "r9"]
    assert [r.name for r in gate_window(held, PromoteConfig(window=2, window_s=4.5), now=109.5)] == ["r8", "r9"]
    assert gate_window(held, PromoteConfig(window_s=1.0), now=1000.0) == []


@pytest.mark.parametrize("bad", [{"window": -1}, {"window_s": -1.0}, {"window_s": float("nan")}])
def test_gate_window_is_validated(bad):
    with pytest.raises(ValueError, match="window"):
        PromoteConfig(**bad)


def test_cli_default_is_the_gate_default():
    from specops.cli.train import add_parser

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["train"])
    assert args.gate_window == PromoteConfig().window == WINDOW and args.gate_window_s == 0.0


def _records(pair: ModelPair, root, n: int, seed: int) -> list:
    """Greedy requests whose output is ``pair.target``'s: a draft equal to that model agrees everywhere."""
    cfg, _ = log_requests(pair, root, n, seed=seed, cluster_of=lambda i: "c", greedy_only=True, partitions=1)
    with open_stream(cfg) as s:
        return [codec.decode(m.value) for m in s.read(cfg.topics.misses, timeout_s=1.0)]


def test_a_draft_that_followed_the_drift_is_promoted_on_the_recent_window(tiny_models, sqlite_uri, tmp_path):
    pair = load_model_dir(tiny_models)
    old_model = perturbed(pair.target, 3.0, seed=4)  # the traffic the cluster left: greedy outputs of this model
    new_model = perturbed(pair.target, 3.0, seed=9)  # the traffic it gets now
    old = _records(ModelPair(old_model, old_model, pair.tokenizer, pair.tokenizer_sha256), tmp_path / "a", 24, 1)
    new = _records(ModelPair(new_model, new_model, pair.tokenizer, pair.tokenizer_sha256), tmp_path / "b", 8, 2)
    holdout = old + new  # oldest first
    champ_dir, cand_dir = tmp_path / "champion", tmp_path / "candidate"
    old_model.save_pretrained(champ_dir, safe_serialization=True)
    new_model.save_pretrained(cand_dir, safe_serialization=True)
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    drafts = reg.artifact("draft")

    def gate(window: int):
        promoter = Promoter(
            reg,
            champ_dir,
            tmp_path / f"out{window}",
            PromoteConfig(window=window, min_positions=1),
            tokenizer_dir=tiny_models / "target",
        )
        if drafts.by_alias("c", CHAMPION) is None:
            champion = drafts.register(
                "c", champ_dir, tokenizer_dir=tiny_models / "target", tokenizer_sha256=promoter.tokenizer_sha256
            )
            drafts.promote("c", champion.version)
        cand = drafts.register(
            "c", cand_dir, tokenizer_dir=tiny_models / "target", tokenizer_sha256=promoter.tokenizer_sha256
        )
        return promoter.gate("c", cand.version, load_model(cand_dir), gate_window(holdout, promoter.cfg))

    whole = gate(0)  # the whole held-out set: 24 requests of the old traffic outvote 8 of the new
    assert not whole.promoted and whole.champion_score > whole.candidate_score
    assert whole.extra["window_requests"] == 32
    recent = gate(8)  # the newest 8: the candidate that follows the new traffic wins, beyond noise
    assert recent.promoted, recent.reason
    assert recent.candidate_score == pytest.approx(1.0) and recent.extra["window_requests"] == 8

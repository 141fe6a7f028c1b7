"""Training at every output position (``OnlineConfig.positions = "all"``): the target's
distribution there comes from one teacher forward per request, equals the target's own,
and the online loop trains on every output position of every request."""

from __future__ import annotations

import copy

import pytest
import torch

from specops.streams import open_stream
from specops.streams.consumer import RecordConsumer
from specops.trainer.data import TargetTeacher, every_position_example, logs_every_position
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.replay import ReplayConfig
from tests.trainer.logged import log_requests


@pytest.fixture(scope="module")
def logged(close_pair, tmp_path_factory):
    return log_requests(
        close_pair,
        tmp_path_factory.mktemp("positions"),
        12,
        seed=9,
        cluster_of=lambda i: "c",
        partitions=1,
        lo=6,
        hi=14,
        max_new_tokens=16,
        greedy_only=True,
    )


def _records(cfg, n: int):
    with open_stream(cfg) as s:
        return [d.record for d in RecordConsumer(s, f"peek-{n}", [cfg.topics.misses]).poll(max_records=n, timeout_s=5)]


def test_teacher_gives_the_targets_distribution_at_every_output_position(close_pair, logged):
    cfg, _ = logged
    rec = _records(cfg, 1)[0]
    assert not logs_every_position(rec)  # serving logged only the rejected positions
    teacher = TargetTeacher(close_pair.target, topk=16)
    ex = every_position_example(rec, teacher(rec))
    p, n = rec.num_prompt_tokens, len(rec.token_ids)
    assert ex.positions.tolist() == list(range(p, n)) and ex.context.tolist() == rec.token_ids[: n - 1].tolist()
    with torch.no_grad():
        full = torch.log_softmax(close_pair.target(input_ids=ex.context.unsqueeze(0)).logits[0].float(), -1)[p - 1 :]
    vals, ids = full.topk(16, -1)
    torch.testing.assert_close(ex.target.logprobs, vals, atol=1e-4, rtol=1e-4)
    assert torch.equal(ex.target.topk_ids, ids)
    torch.testing.assert_close(ex.target.residual, (1 - vals.double().exp().sum(-1)).float(), atol=1e-4, rtol=1e-4)
    # the logged rows agree with the recomputed ones at the rejected positions
    for j, pos in enumerate(rec.positions.tolist()):
        assert int(rec.topk_ids[j, 0]) == int(ids[pos - p, 0])
    teacher(rec)
    assert teacher.forwards == 1  # the second request for the same record is served from the cache


def test_online_loop_trains_at_every_output_position(close_pair, logged, tmp_path):
    cfg, draft_dir = logged
    ocfg = OnlineConfig(
        interval=4, holdout_every=1000, positions="all", group="g-all", replay=ReplayConfig(policy="clear")
    )
    trainer = OnlineTrainer(cfg, draft_dir, tmp_path / "out", ocfg, target=close_pair.target)
    before = copy.deepcopy(trainer.state("c").model.state_dict())
    assert trainer.run(max_idle_s=1.0) == 12
    st = trainer.clusters["c"]
    trainer.close()
    outputs = sum(len(r.token_ids) - r.num_prompt_tokens for r in _records(cfg, 12))
    assert st.version == 3 and st.positions_trained == outputs  # every output position, not only the rejected
    assert any(not torch.equal(before[k], v) for k, v in st.model.state_dict().items())


def test_every_position_needs_a_target_or_a_teacher(logged, tmp_path):
    cfg, draft_dir = logged
    with pytest.raises(ValueError, match="every position"):
        OnlineTrainer(cfg, draft_dir, tmp_path / "out", OnlineConfig(positions="all"))
    with pytest.raises(ValueError, match="positions"):
        OnlineConfig(positions="some")


def test_specops_train_defaults_are_the_trainers():
    """The recipe `specops train` runs with no flags is OnlineConfig's (chosen by benchmarks/osd.py --grid)."""
    from specops.cli.main import build_parser

    args = build_parser().parse_args(["train"])
    cfg = OnlineConfig()
    assert (args.interval, args.loss, args.lr, args.steps, args.replay, args.capacity, args.positions) == (
        cfg.interval,
        cfg.loss,
        cfg.lr,
        cfg.steps_per_update,
        cfg.replay.policy,
        cfg.replay.capacity,
        cfg.positions,
    )


def test_cli_says_which_target_is_missing(logged, tmp_path, capsys):
    from specops.cli.main import main

    cfg, draft_dir = logged
    rc = main(
        [
            "--threads",
            "1",
            "train",
            "--registry",
            "none",
            "--stream",
            cfg.url,
            "--draft",
            str(draft_dir),
            "--out",
            str(tmp_path / "out"),
            "--idle-exit",
            "1",
        ]
    )
    assert rc == 2 and "--target DIR" in capsys.readouterr().err


def test_a_target_of_another_vocabulary_is_refused(logged, tmp_path, tiny_models):
    import json

    cfg, draft_dir = logged
    other = tmp_path / "other-draft"
    other.mkdir()
    conf = json.loads((draft_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**conf, "vocab_size": conf["vocab_size"] + 1}))
    with pytest.raises(ValueError, match="vocabulary"):
        OnlineTrainer(cfg, other, tmp_path / "out", OnlineConfig(), target=tiny_models / "target")

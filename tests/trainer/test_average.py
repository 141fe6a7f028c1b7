"""Weight averaging in the online trainer (``OnlineConfig.average_decay``): the published draft is
the moving average of the trained weights, evaluations score it, checkpoints hold it with the
trained weights beside it, and a restart resumes both exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specops.trainer import checkpoint as ckpt
from specops.trainer.acceptance import evaluate_records
from specops.trainer.online import OnlineConfig, OnlineTrainer
from specops.trainer.replay import ReplayConfig
from tests.tolerances import assert_f32_close
from tests.trainer.logged import log_requests

DECAY = 0.8
RECIPE = {
    "positions": "rejected",  # the logged positions: no target model, and examples independent of the draft
    "steps_per_update": 2,
    "interval": 4,
    "holdout_every": 3,
    "poll_records": 4,
    "replay": ReplayConfig(policy="clear", capacity=8),
}


@pytest.fixture(scope="module")
def logged(close_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("average")
    return log_requests(
        close_pair, root, 30, seed=5, cluster_of=lambda i: "c", partitions=1, greedy_only=True, max_new_tokens=12
    )


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the trainer trains: all but the token embeddings (and a head tied to them)."""
    frozen = model.get_input_embeddings().weight
    return {n: p.detach().clone() for n, p in model.named_parameters() if p is not frozen}


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in actual.items():
        assert_f32_close(value, expected[name])


def _loaded(path: Path) -> dict[str, torch.Tensor]:
    return _trainable(AutoModelForCausalLM.from_pretrained(path, use_safetensors=True))


def test_the_published_draft_is_the_moving_average_of_the_trained_weights(logged, tmp_path):
    """Two trainers on the same records, one averaging: the same trained weights after every
    pass, and the averaging one publishes ``d·avg + (1-d)·weights`` (from the base draft) in its
    checkpoints, its held-out evaluations and its history."""
    cfg, draft_dir = logged
    plain = OnlineTrainer(cfg, draft_dir, tmp_path / "plain", OnlineConfig(**RECIPE, group="plain"))
    avg = OnlineTrainer(cfg, draft_dir, tmp_path / "avg", OnlineConfig(**RECIPE, group="avg", average_decay=DECAY))
    try:
        expected, version, updates = _loaded(draft_dir), 0, 0
        while plain.step() and avg.step():
            st, sa = plain.state("c"), avg.state("c")
            if st.version != version:  # an update: the average takes a step toward the new weights
                version, updates = st.version, updates + 1
                weights = _trainable(st.model)
                expected = {n: DECAY * v + (1 - DECAY) * weights[n] for n, v in expected.items()}
            assert sa.version == st.version
            _assert_same(_trainable(sa.model), _trainable(st.model))  # averaging does not change training
            if updates:
                _assert_same(_trainable(sa.published), expected)
        assert updates >= 3
        sa = avg.state("c")
        latest = ckpt.latest_version(tmp_path / "avg", "c")
        _assert_same(_loaded(latest), _trainable(sa.published))  # what serving loads: the average
        _assert_same(ckpt.load_trained(latest), _trainable(sa.model))  # beside it: what trains on
        assert ckpt.load_trained(ckpt.latest_version(tmp_path / "plain", "c")) is None
        assert ckpt.load_state(latest)["config"]["average_decay"] == DECAY
        held = [h.record for h in sa.holdout]
        assert held
        published = AutoModelForCausalLM.from_pretrained(latest, use_safetensors=True)
        assert avg.evaluate("c").to_dict() == evaluate_records(published, held, vocab=avg.vocab).to_dict()
        assert avg.evaluate("c").to_dict() != evaluate_records(sa.model, held, vocab=avg.vocab).to_dict()
    finally:
        plain.close()
        avg.close()


def test_a_restart_resumes_the_average_and_the_trained_weights(logged, tmp_path):
    cfg, draft_dir = logged
    ocfg = OnlineConfig(**RECIPE, group="whole", average_decay=DECAY)
    whole = OnlineTrainer(cfg, draft_dir, tmp_path / "whole", ocfg)
    whole.run(max_idle_s=1.0)
    whole.close()
    out, ocfg = tmp_path / "halves", OnlineConfig(**RECIPE, group="halves", average_decay=DECAY)
    first = OnlineTrainer(cfg, draft_dir, out, ocfg)
    first.run(max_records=14)  # stops inside an update window: its records wait in the persisted buffer
    first.close()
    second = OnlineTrainer(cfg, draft_dir, out, ocfg)
    try:
        second.run(max_idle_s=1.0)
        a, b = whole.state("c"), second.state("c")
        assert a.version == b.version
        _assert_same(_trainable(b.published), _trainable(a.published))
        _assert_same(_trainable(b.model), _trainable(a.model))
    finally:
        second.close()


def test_averaging_turned_off_resumes_the_trained_weights_and_on_starts_from_the_published(logged, tmp_path):
    cfg, draft_dir = logged
    out = tmp_path / "out"
    on = OnlineTrainer(cfg, draft_dir, out, OnlineConfig(**RECIPE, group="on", average_decay=DECAY))
    on.run(max_idle_s=1.0)
    on.close()
    trained = _trainable(on.state("c").model)
    off = OnlineTrainer(cfg, draft_dir, out, OnlineConfig(**RECIPE, group="on"))
    try:
        st = off.state("c")
        assert st.average is None and st.published is st.model
        _assert_same(_trainable(st.model), trained)
    finally:
        off.close()
    plain_out = tmp_path / "plain"
    plain = OnlineTrainer(cfg, draft_dir, plain_out, OnlineConfig(**RECIPE, group="p"))
    plain.run(max_idle_s=1.0)
    plain.close()
    again = OnlineTrainer(cfg, draft_dir, plain_out, OnlineConfig(**RECIPE, group="p", average_decay=DECAY))
    try:
        st = again.state("c")
        _assert_same(_trainable(st.published), _trainable(st.model))
        _assert_same(_trainable(st.published), _loaded(ckpt.latest_version(plain_out, "c")))
    finally:
        again.close()


def test_a_corrupt_trained_weights_file_is_refused(logged, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg, draft_dir = logged
    out = tmp_path / "out"
    t = OnlineTrainer(cfg, draft_dir, out, OnlineConfig(**RECIPE, group="g", average_decay=DECAY))
    t.run(max_idle_s=1.0)
    t.close()
    file = ckpt.latest_version(out, "c") / ckpt.TRAINED_FILE
    tensors = load_file(str(file))
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="non-finite"):
        OnlineTrainer(cfg, draft_dir, out, OnlineConfig(**RECIPE, group="g", average_decay=DECAY))


def test_the_decay_is_checked():
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="average_decay"):
            OnlineConfig(average_decay=bad)
    with pytest.raises(ValueError, match="deepspeed"):
        OnlineConfig(average_decay=0.9, backend="deepspeed")
    assert OnlineConfig(average_decay=0.9).digest() != OnlineConfig().digest()

"""Weight averaging in the online trainer (``OnlineConfig.average_decay``): the published draft is
the moving average of the trained weights, evaluations score it, checkpoints hold it with the
trained weights beside it, and a restart resumes both exactly."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specops.trainer import checkpoint as ckpt
from specops.trainer.acceptance import evaluate_records
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.replay import ReplayConfig
from tests.tolerances import assert_f32_close
from tests.trainer.logged import log_requests

DECAY = 0.8
RECIPE = {
    "positions": "rejected",  # the logged positions: no target model, and examples independent of the draft
    "steps_per_update": 1,
    "interval": 3,
    "holdout_every": 4,
    "poll_records": 3,
    "replay": ReplayConfig(policy="clear", capacity=8),
}


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the trainer trains: all but the token embeddings (and a head tied to them)."""
    frozen = model.get_input_embeddings().weight
    return {n: p.detach().clone() for n, p in model.named_parameters() if p is not frozen}


def _loaded(path: Path) -> dict[str, torch.Tensor]:
    return _trainable(AutoModelForCausalLM.from_pretrained(path, use_safetensors=True))


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in actual.items():
        assert_f32_close(value, expected[name])


@pytest.fixture(scope="module")
def runs(close_pair, tmp_path_factory):
    """Two trainers fed the same records pass by pass, one averaging. Returns the stream, the base
    draft, both output directories, the number of updates and, after every pass, (the plain
    trainer's weights, the averaging one's trained weights, its published ones, the expected average)."""
    root = tmp_path_factory.mktemp("average")
    cfg, draft_dir = log_requests(
        close_pair, root, 20, seed=5, cluster_of=lambda i: "c", partitions=1, greedy_only=True, max_new_tokens=8
    )
    plain = OnlineTrainer(cfg, draft_dir, root / "plain", OnlineConfig(**RECIPE, group="plain", average_decay=0))
    avg = OnlineTrainer(cfg, draft_dir, root / "avg", OnlineConfig(**RECIPE, group="avg", average_decay=DECAY))
    passes, expected, version, updates = [], _loaded(draft_dir), 0, 0
    try:
        while plain.step() and avg.step():
            st, sa = plain.state("c"), avg.state("c")
            assert sa.version == st.version
            if st.version != version:  # an update: the average takes a step toward the new weights
                version, updates = st.version, updates + 1
                weights = _trainable(st.model)
                expected = {n: DECAY * v + (1 - DECAY) * weights[n] for n, v in expected.items()}
            passes.append((_trainable(st.model), _trainable(sa.model), _trainable(sa.published), expected))
    finally:
        plain.close()
        avg.close()
    return cfg, draft_dir, root / "plain", root / "avg", updates, passes


def test_the_published_draft_is_the_moving_average_of_the_trained_weights(runs, tmp_path):
    """The same trained weights after every pass with and without averaging; the averaging trainer
    publishes ``d·avg + (1-d)·weights`` (from the base draft) in its checkpoints and scores it in its
    held-out evaluations."""
    cfg, draft_dir, _, avg_out, updates, passes = runs
    assert updates >= 3
    for plain_weights, trained, published, expected in passes:
        _assert_same(trained, plain_weights)  # averaging does not change training
        _assert_same(published, expected)
    latest = ckpt.latest_version(avg_out, "c")
    _assert_same(_loaded(latest), passes[-1][2])  # what serving loads: the average
    _assert_same(ckpt.load_trained(latest), passes[-1][1])  # beside it: what trains on
    assert ckpt.load_state(latest)["config"]["average_decay"] == DECAY
    out = tmp_path / "avg"
    shutil.copytree(avg_out, out)
    again = OnlineTrainer(cfg, draft_dir, out, OnlineConfig(**RECIPE, group="avg", average_decay=DECAY))
    try:
        sa = again.state("c")
        held = [h.record for h in sa.holdout]
        assert held
        published = AutoModelForCausalLM.from_pretrained(latest, use_safetensors=True)
        assert again.evaluate("c").to_dict() == evaluate_records(published, held, vocab=again.vocab).to_dict()
        assert again.evaluate("c").to_dict() != evaluate_records(sa.model, held, vocab=again.vocab).to_dict()
    finally:
        again.close()


def test_a_restart_resumes_the_average_and_the_trained_weights(runs, tmp_path):
    cfg, draft_dir, _, avg_out, _, passes = runs
    ocfg = OnlineConfig(**RECIPE, group="halves", average_decay=DECAY)
    first = OnlineTrainer(cfg, draft_dir, tmp_path / "out", ocfg)
    first.run(max_records=10)  # stops inside an update window: its records wait in the persisted buffer
    first.close()
    second = OnlineTrainer(cfg, draft_dir, tmp_path / "out", ocfg)
    try:
        second.run(max_idle_s=1.0)
        st = second.state("c")
        assert st.version == ckpt.load_state(ckpt.latest_version(avg_out, "c"))["version"]
        _assert_same(_trainable(st.model), passes[-1][1])
        _assert_same(_trainable(st.published), passes[-1][2])
    finally:
        second.close()


def test_averaging_turned_off_resumes_the_trained_weights_and_on_starts_from_the_published(runs, tmp_path):
    cfg, draft_dir, plain_out, avg_out, _, passes = runs
    shutil.copytree(avg_out, tmp_path / "avg")
    off = OnlineTrainer(cfg, draft_dir, tmp_path / "avg", OnlineConfig(**RECIPE, group="avg", average_decay=0))
    try:
        st = off.state("c")
        assert st.average is None and st.published is st.model
        _assert_same(_trainable(st.model), passes[-1][1])
    finally:
        off.close()
    shutil.copytree(plain_out, tmp_path / "plain")
    on = OnlineTrainer(cfg, draft_dir, tmp_path / "plain", OnlineConfig(**RECIPE, group="plain", average_decay=DECAY))
    try:
        st = on.state("c")
        _assert_same(_trainable(st.published), passes[-1][0])
        _assert_same(_trainable(st.model), passes[-1][0])
    finally:
        on.close()


def test_a_corrupt_trained_weights_file_is_refused(runs, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg, draft_dir, _, avg_out, _, _ = runs
    shutil.copytree(avg_out, tmp_path / "avg")
    file = ckpt.latest_version(tmp_path / "avg", "c") / ckpt.TRAINED_FILE
    tensors = load_file(str(file))
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="non-finite"):
        OnlineTrainer(cfg, draft_dir, tmp_path / "avg", OnlineConfig(**RECIPE, group="avg", average_decay=DECAY))


def test_the_decay_is_checked():
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="average_decay"):
            OnlineConfig(average_decay=bad)
    assert OnlineConfig().average_decay == 0.95  # on by default
    assert OnlineConfig(average_decay=0.9).digest() != OnlineConfig().digest() != OnlineConfig(average_decay=0).digest()
    # off, the field is left out of the hash, as before it existed (checkpoints' config_hash tags stay comparable)
    off = OnlineConfig(average_decay=0)
    values = {k: v for k, v in asdict(off).items() if k not in ("max_loaded_clusters", "max_clusters")}
    del values["average_decay"]
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert off.digest() == digest

"""Multi-rank training: the trainer's DeepSpeed path on 2 ranks (2 processes, gloo, CPU)
gives the same updates as 1 rank, started with the very command the Helm chart runs.

The chart's trainer argv (``ci/trainer-multigpu-values.yaml``: ``deepspeed --num_gpus 2
--no_local_rank --module specops train --config /etc/specops/train.toml --backend deepspeed``)
runs here with two changes only: the config path points at this test's TOML and
``--master_port`` is a free port (tests run side by side). ``DS_ACCELERATOR=cpu``: no GPU.

The reference is the plain PyTorch update in the test's process (DeepSpeed in one process
makes the same update: ``tests/trainer/test_deepspeed.py``). The 2-rank job runs in two halves (8 records, then 8 more), so the second half resumes
its drafts and ZeRO-2 optimiser state from a checkpoint written by 2 ranks (gathered on
rank 0, scattered again): if the moments were lost or mis-sliced the later updates would
part from the 1-rank run's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specops.streams import StreamConfig
from specops.trainer import checkpoint as ckpt
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.replay import ReplayConfig
from tests.deploy import helm_support
from tests.registry.mlflow_server import free_port

pytestmark = pytest.mark.slow  # DeepSpeed launcher subprocesses

ROOT = Path(__file__).resolve().parents[2]
N_REQUESTS = 16
CLUSTERS = ("code", "prose")
CHART_CONFIG = "/etc/specops/train.toml"


@pytest.fixture(scope="module")
def chart_argv() -> list[str]:
    objects = helm_support.render(helm_support.CI_DIR / "trainer-multigpu-values.yaml")
    return helm_support.trainer_launch_argv(objects)


@pytest.fixture(scope="module")
def logged(close_pair, tmp_path_factory):
    from tests.trainer.logged import log_requests

    return log_requests(
        close_pair, tmp_path_factory.mktemp("multirank"), N_REQUESTS, seed=11, cluster_of=lambda i: CLUSTERS[i % 2]
    )


def _toml(path: Path, **values) -> Path:
    lines = [f"{k} = {json.dumps(v)}" for k, v in values.items()]  # strings, ints and bools: JSON spelling is TOML's
    path.write_text("[train]\n" + "\n".join(lines) + "\n")
    return path


def _run(argv: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "SPECOPS_STREAM_FSYNC": "0",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    run = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, f"{argv}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return run


@pytest.fixture(scope="module")
def runs(chart_argv, logged, tmp_path_factory):
    cfg, draft_dir = logged
    tmp = tmp_path_factory.mktemp("ranks")
    common = dict(
        stream=cfg.url,
        draft=str(draft_dir),
        interval=3,
        holdout_every=4,
        steps=3,
        registry="none",
        capacity=32,
        idle_exit=5,
        positions="rejected",
        replay="recent",
    )
    # one rank: the plain PyTorch update in this process (tests/trainer/test_deepspeed.py shows DeepSpeed
    # in one process makes the same update), with the options the TOML below gives the CLI
    trainer = OnlineTrainer(
        StreamConfig(url=cfg.url, fsync=False, num_partitions=2),
        draft_dir,
        tmp / "one",
        OnlineConfig(
            positions="rejected",
            group="one",
            interval=3,
            holdout_every=4,
            steps_per_update=3,
            replay=ReplayConfig(policy="recent", capacity=32),
        ),
    )
    assert trainer.run(max_records=N_REQUESTS, max_idle_s=5) == N_REQUESTS
    trainer.close()
    # two ranks, the chart's command, in two halves
    assert chart_argv[0] == "deepspeed" and CHART_CONFIG in chart_argv, chart_argv
    logs = []
    for half in (1, 2):
        two = _toml(tmp / f"two{half}.toml", out=str(tmp / "two"), group="two", max_records=N_REQUESTS // 2, **common)
        argv = [a if a != CHART_CONFIG else str(two) for a in chart_argv]
        argv[1:1] = ["--master_port", str(free_port())]
        run = _run(argv, tmp)
        logs.append(run.stdout + run.stderr)
    return tmp / "one", tmp / "two", logs, draft_dir


def _history(out: Path, cluster: str) -> list[dict]:
    return [json.loads(line) for line in (out / cluster / "updates.jsonl").read_text().splitlines()]


def test_chart_launches_two_ranks_and_both_compute(runs):
    _, _, logs, _ = runs
    for log in logs:
        assert "dist_world_size=2" in log and "rank 0 of 2: consuming" in log  # the launcher made a world of two
        steps = [int(n) for n in re.findall(r"rank 1 of 2: (\d+) optimiser steps", log)]
        assert steps and steps[0] > 0, log[-3000:]  # rank 1 took its share of every step


def test_two_ranks_make_the_one_rank_update(runs):
    one, two, logs, draft_dir = runs
    base = AutoModelForCausalLM.from_pretrained(draft_dir).state_dict()
    # the second half resumed drafts checkpointed by the first (and then updated them again)
    assert re.search(r"cluster \w+: resumed draft v1", logs[1]), logs[1][-3000:]
    assert sum(len(_history(one, c)) for c in CLUSTERS) >= 3
    for cluster in CLUSTERS:
        h1, h2 = _history(one, cluster), _history(two, cluster)
        assert h1 and [h["request_ids"] for h in h2] == [h["request_ids"] for h in h1], cluster
        for a, b in zip(h1, h2):
            # float32 sums in another order (two partial sums, then an all-reduce): same numbers to ~1e-6
            assert b["loss_first"] == pytest.approx(a["loss_first"], rel=1e-4)
            assert b["loss_last"] == pytest.approx(a["loss_last"], rel=1e-4)
            assert b["eval_after"]["sampling"] == pytest.approx(a["eval_after"]["sampling"], abs=1e-4)
        # the trained weights (the trainer's default publishes their moving average: it moves slower)
        t1, t2 = (load_file(str(ckpt.latest_version(out, cluster) / ckpt.TRAINED_FILE)) for out in (one, two))
        moved = max((t1[k] - base[k]).abs().max().item() for k in t1)
        gap = max((t2[k] - t1[k]).abs().max().item() for k in t1)
        assert moved > 1e-3 and gap < moved / 100, (cluster, moved, gap)
        # and the published average, which rank 0 keeps across the restart between the halves
        w1 = AutoModelForCausalLM.from_pretrained(ckpt.latest_version(one, cluster)).state_dict()
        w2 = AutoModelForCausalLM.from_pretrained(ckpt.latest_version(two, cluster)).state_dict()
        moved = max((w1[k] - base[k]).abs().max().item() for k in base)
        gap = max((w2[k] - w1[k]).abs().max().item() for k in base)
        assert moved > 1e-4 and gap < moved / 100, (cluster, moved, gap)


def test_two_rank_checkpoint_holds_the_whole_optimiser_state(runs):
    """ZeRO-2's moments, gathered from both ranks, are the one-rank AdamW moments laid end to end
    (the trainable parameters in order): the checkpoint holds the whole state, not rank 0's half."""
    one, two, _, _ = runs
    for cluster in CLUSTERS:
        o1 = load_file(str(ckpt.latest_version(one, cluster) / "optimizer.safetensors"))
        o2 = load_file(str(ckpt.latest_version(two, cluster) / "optimizer.safetensors"))
        params = sorted({int(k.split(".")[0]) for k in o1})
        assert int(o2["0.step"]) == int(o1[f"{params[0]}.step"]) > 0
        for name in ("exp_avg", "exp_avg_sq"):
            flat1 = torch.cat([o1[f"{i}.{name}"].flatten() for i in params])
            flat2 = o2[f"0.{name}"]
            assert flat2.shape == flat1.shape, (cluster, name, flat2.shape, flat1.shape)
            scale = flat1.abs().max().item()
            assert scale > 0 and (flat2 - flat1).abs().max().item() < scale / 100, (cluster, name)
        state = ckpt.load_state(ckpt.latest_version(two, cluster))
        assert state["config"]["backend"] == "deepspeed" and state["config"]["deepspeed_zero_stage"] == 2

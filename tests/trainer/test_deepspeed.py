"""backend="deepspeed": the online trainer's update through a DeepSpeed ZeRO-2 engine on
the CPU (gloo, one process) matches plain PyTorch, the moving average it publishes
(``average_decay``) matches the torch backend's, and its checkpoints stay safetensors +
JSON and resume (trained weights, average and optimiser state).

DeepSpeed leaves a process group, environment variables and its accelerator choice in the
process that uses it, so both backends run in one subprocess (this module, run as
``python -m tests.trainer.test_deepspeed SPEC``), torch first, which prints a JSON summary.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specops.trainer import checkpoint as ckpt
from specops.trainer.online.trainer import OnlineConfig
from tests.tolerances import F32_RTOL

pytestmark = pytest.mark.slow  # a DeepSpeed subprocess

ROOT = Path(__file__).resolve().parents[2]
N_REQUESTS = 16
CLUSTERS = ("code", "prose")
# averaging on: ZeRO-2 keeps the full weights on every rank, so the published average is the torch backend's
TRAIN = {"interval": 3, "holdout_every": 4, "steps_per_update": 3, "poll_timeout_s": 0.05, "average_decay": 0.5}


@pytest.fixture(scope="module")
def logged(close_pair, tmp_path_factory):
    """A local stream of N_REQUESTS logged requests over two clusters, and the draft's dir."""
    from tests.trainer.logged import log_requests

    return log_requests(
        close_pair, tmp_path_factory.mktemp("deepspeed"), N_REQUESTS, seed=5, cluster_of=lambda i: CLUSTERS[i % 2]
    )


@pytest.fixture(scope="module")
def both_runs(logged, tmp_path_factory):
    """Train on the same records with backend torch, then deepspeed (+ a resumed deepspeed trainer)."""
    cfg, draft_dir = logged
    out = tmp_path_factory.mktemp("trainers")
    spec = {"url": cfg.url, "draft": str(draft_dir), "out": str(out)}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECOPS_STREAM_FSYNC": "0"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.trainer.test_deepspeed", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), out, draft_dir


def test_deepspeed_update_matches_torch(both_runs):
    result, out, draft_dir = both_runs
    assert not result["deepspeed_imported_by_torch_run"]
    assert result["engine"] == {"zero_stage": 2, "optimizer": "DeepSpeedZeroOptimizer", "client": "AdamW"}
    torch_hist, ds_hist = result["history"]["torch"], result["history"]["deepspeed"]
    base = AutoModelForCausalLM.from_pretrained(draft_dir).state_dict()
    for cluster in CLUSTERS:
        th, dh = torch_hist[cluster], ds_hist[cluster]
        assert th and len(dh) == len(th), cluster
        assert [h["request_ids"] for h in dh] == [h["request_ids"] for h in th]
        # same weights and data: the first loss is the same computation (float32: compare at its precision);
        # later ones differ by float noise
        assert dh[0]["loss_first"] == pytest.approx(th[0]["loss_first"], rel=F32_RTOL)
        for d, t in zip(dh, th):
            assert d["loss_first"] == pytest.approx(t["loss_first"], rel=1e-4)
            assert d["loss_last"] == pytest.approx(t["loss_last"], rel=1e-4)
            assert d["eval_after"]["sampling"] == pytest.approx(t["eval_after"]["sampling"], abs=1e-4)
        assert dh[-1]["loss_last"] < dh[0]["loss_first"]
        w_torch = AutoModelForCausalLM.from_pretrained(ckpt.latest_version(out / "torch", cluster)).state_dict()
        w_ds = AutoModelForCausalLM.from_pretrained(ckpt.latest_version(out / "deepspeed", cluster)).state_dict()
        moved = max((w_ds[k] - base[k]).abs().max().item() for k in base)
        gap = max((w_ds[k] - w_torch[k]).abs().max().item() for k in base)
        assert moved > 1e-3 and gap < moved / 100, (cluster, moved, gap)
        # what was published is the average, not the trained weights the optimiser holds
        trained = load_file(str(ckpt.latest_version(out / "deepspeed", cluster) / ckpt.TRAINED_FILE))
        apart = max((trained[k] - w_ds[k]).abs().max().item() for k in trained)
        assert apart > gap * 10, (cluster, apart, gap)


def test_deepspeed_checkpoint_is_safetensors_json_and_resumes(both_runs):
    result, out, _ = both_runs
    root = out / "deepspeed"
    assert not [p for p in root.rglob("*") if p.suffix in (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")]
    for cluster in CLUSTERS:
        latest = ckpt.latest_version(root, cluster)
        files = {p.name for p in latest.iterdir()}
        assert {"model.safetensors", "optimizer.safetensors", "state.json", "config.json"} <= files
        assert all(name.endswith((".safetensors", ".json")) for name in files), files
        state = ckpt.load_state(latest)
        assert state["config"]["backend"] == "deepspeed" and state["config"]["deepspeed_zero_stage"] == 2
        model = AutoModelForCausalLM.from_pretrained(latest, use_safetensors=True)
        # the trained parameters: the token embeddings (and the head tied to them) stay frozen by default
        numel = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
        opt = load_file(str(latest / "optimizer.safetensors"))  # ZeRO-2, world size 1: one flat fp32 partition
        assert opt["0.exp_avg"].shape == opt["0.exp_avg_sq"].shape == (numel,), {k: v.shape for k, v in opt.items()}
        assert int(opt["0.step"]) == state["version"] * TRAIN["steps_per_update"]
        resumed = result["resumed"][cluster]
        assert resumed["version"] == state["version"] and resumed["weights_equal"] and resumed["average_equal"]
        assert resumed["opt_steps"] == [state["version"] * TRAIN["steps_per_update"]]
        assert resumed["exp_avg_equal"]
    assert result["resumed_consumed"] == 0 and not result["resumed_warnings"]


def test_deepspeed_resumes_a_torch_checkpoint_with_fresh_optimiser_state(both_runs):
    result, out, _ = both_runs
    cross = result["cross"]
    assert cross["warnings"] == len(CLUSTERS) and cross["opt_state"] == 0
    assert cross["versions"] == {c: ckpt.load_state(ckpt.latest_version(out / "torch", c))["version"] for c in CLUSTERS}


def test_backend_is_validated():
    with pytest.raises(ValueError, match="backend"):
        OnlineConfig(backend="jax")
    with pytest.raises(ValueError, match="zero_stage"):
        OnlineConfig(backend="deepspeed", deepspeed_zero_stage=3)


# ---------------------------------------------------------------- the subprocess
def _main(spec: dict) -> dict:
    from specops.streams import StreamConfig
    from specops.trainer.online.trainer import OnlineTrainer

    torch.set_num_threads(2)
    logging.basicConfig(level=logging.WARNING)
    stream = StreamConfig(url=spec["url"], fsync=False, num_partitions=2)
    out, result = Path(spec["out"]), {"history": {}}

    def trainer(ckpt_dir: str, group: str, backend: str) -> OnlineTrainer:
        ocfg = OnlineConfig(positions="rejected", group=group, backend=backend, **TRAIN)
        return OnlineTrainer(stream, Path(spec["draft"]), out / ckpt_dir, ocfg)

    def train(backend: str, group: str) -> OnlineTrainer:
        t = trainer(backend, group, backend)
        consumed = t.run(max_records=N_REQUESTS, max_idle_s=5)
        t.close()
        assert consumed == N_REQUESTS, consumed
        lines = {c: (out / backend / c / "updates.jsonl").read_text().splitlines() for c in CLUSTERS}
        result["history"][backend] = {c: [json.loads(line) for line in lines[c]] for c in CLUSTERS}
        return t

    train("torch", "plain")
    result["deepspeed_imported_by_torch_run"] = "deepspeed" in sys.modules
    first = train("deepspeed", "ds")
    engine = first.clusters[CLUSTERS[0]].engine
    result["engine"] = {
        "zero_stage": engine.zero_optimization_stage(),
        "optimizer": type(engine.optimizer).__name__,
        "client": type(engine.optimizer.optimizer).__name__,
    }

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("specops.trainer.online.trainer").addHandler(handler)

    second = trainer("deepspeed", "ds", "deepspeed")  # a restart: resumes weights, optimiser state, buffers
    result["resumed"] = {}
    for cluster in CLUSTERS:
        before, after = first.clusters[cluster], second.state(cluster)
        w_before, w_after = before.model.state_dict(), after.model.state_dict()
        sd_before, sd_after = before.opt.state_dict()["state"], after.opt.state_dict()["state"]
        result["resumed"][cluster] = {
            "version": after.version,
            "weights_equal": all(torch.equal(w_before[k], w_after[k]) for k in w_before),
            "average_equal": all(
                torch.equal(a, b)
                for a, b in zip(before.published.state_dict().values(), after.published.state_dict().values())
            )
            and before.published is not before.model,
            "opt_steps": [int(s["step"]) for s in sd_after.values()],
            "exp_avg_equal": all(torch.equal(sd_before[i]["exp_avg"], sd_after[i]["exp_avg"]) for i in sd_before),
        }
    result["resumed_consumed"] = second.step()
    second.close()
    result["resumed_warnings"] = list(warnings)

    warnings.clear()  # a plain PyTorch checkpoint resumed under ZeRO-2: weights yes, optimiser state no
    cross = trainer("torch", "plain", "deepspeed")
    result["cross"] = {
        "warnings": len(warnings),
        "opt_state": sum(len(cross.state(c).opt.state) for c in CLUSTERS),
        "versions": {c: cross.state(c).version for c in CLUSTERS},
    }
    cross.close()
    return result


if __name__ == "__main__":
    print(json.dumps(_main(json.loads(sys.argv[1]))))

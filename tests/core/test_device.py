"""Devices and precisions: flags validated with a clear error, the CPU default unchanged,
speculative decoding lossless in bfloat16, and the CUDA path (run where a GPU is)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specops.core.device import Placement
from specops.core.errors import ModelConfigError
from specops.core.models import ModelPair, load_model
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.http.config import ServeConfig
from specops.serving.plan import plain_generate
from tests.conftest import random_prompts

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")


def test_placements_are_validated_with_the_flag_to_change():
    assert Placement().torch_device == torch.device("cpu") and Placement().torch_dtype == torch.float32
    assert Placement("cpu", "bfloat16").torch_dtype == torch.bfloat16
    for device in ("gpu", "cuda:x", "CUDA", ""):
        with pytest.raises(ModelConfigError, match="--device .* is not a device"):
            Placement(device)
    with pytest.raises(ModelConfigError, match="--dtype 'fp8'"):
        Placement("cpu", "fp8")
    with pytest.raises(ModelConfigError, match="float16 needs a GPU"):
        Placement("cpu", "float16")
    if not torch.cuda.is_available():
        with pytest.raises(ModelConfigError, match="no CUDA GPU is visible"):
            Placement("cuda:0")


def test_serve_config_refuses_float16_on_a_cpu():
    assert ServeConfig().engine.device == "cpu" and ServeConfig().engine.dtype == "float32"
    with pytest.raises(ValueError, match="float16 needs a GPU"):
        ServeConfig(dtype="float16")
    with pytest.raises(ValueError, match="not a device"):
        ServeConfig(device="tpu")


def test_every_command_shows_device_and_dtype():
    for cmd in ("serve", "train", "bootstrap"):
        out = subprocess.run(
            [sys.executable, "-m", "specops.cli.main", cmd, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert "--device" in out and "--dtype" in out, cmd


def _cast(model, dtype):
    out = type(model)(model.config).eval()
    out.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in out.parameters():
            p.data = p.data.to(dtype)
    return out


def _first_divergence_is_a_rounding_tie(target, prompt, ref, out, ulps=4):
    """Where ``out`` first leaves ``ref``, were the two tokens' target logits within ``ulps`` units of
    the precision's rounding? In bfloat16 a verify pass over k+1 positions and a one-token step
    accumulate the same sums in a different order, so their logits differ by about an ulp and an
    exact tie can fall either way (vLLM documents the same for its speculative decoding)."""
    i = next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + ref[:i]], device=target.device)).logits[0, -1].float()
    tolerance = ulps * torch.finfo(target.dtype).eps * logits.abs().max().item()
    gap = abs(logits[ref[i]].item() - logits[out[i]].item())
    assert gap <= tolerance, f"diverged at {i}: {ref[i]} vs {out[i]}, logit gap {gap:.4f} > {tolerance:.4f}"
    return True


def test_speculation_is_lossless_in_bfloat16_on_a_cpu(close_pair):
    """Target and draft in bfloat16: every method equals target-only greedy at that precision, up to
    exact ties that bfloat16 rounding breaks differently in a verify pass (checked to be ties)."""
    pair = ModelPair(
        target=_cast(close_pair.target, torch.bfloat16), draft=_cast(close_pair.draft, torch.bfloat16), tokenizer=None
    )
    engine = SpecEngine(pair)
    for prompt in random_prompts(4, seed=41):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=20), method="target").token_ids
        for method in ("draft", "pld"):
            out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=20), method=method, k=3).token_ids
            assert len(out) == len(ref)
            assert out == ref or _first_divergence_is_a_rounding_tie(pair.target, prompt, ref, out), method


def test_the_tie_check_is_not_a_blank_cheque(close_pair):
    """Negative control: a divergence at a clear margin fails the bfloat16 tie check."""
    target = _cast(close_pair.target, torch.bfloat16)
    prompt = random_prompts(1, seed=41)[0]
    engine = SpecEngine(ModelPair(target=target, draft=target, tokenizer=None))
    ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=4), method="target").token_ids
    with torch.no_grad():
        worst = int(target(torch.tensor([prompt])).logits[0, -1].argmin())
    with pytest.raises(AssertionError, match="logit gap"):
        _first_divergence_is_a_rounding_tie(target, prompt, ref, [worst] + ref[1:])


@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculation_is_lossless_on_a_gpu(close_pair, dtype):
    pair = ModelPair(
        target=_cast(close_pair.target, dtype).to("cuda"),
        draft=_cast(close_pair.draft, dtype).to("cuda"),
        tokenizer=None,
    )
    engine = SpecEngine(pair)
    for prompt in random_prompts(6, seed=42):
        ref = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method="target").token_ids
        for method in ("draft", "pld"):
            out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), method=method, k=3).token_ids
            assert out == ref or _first_divergence_is_a_rounding_tie(pair.target, prompt, ref, out), method
        seeded = SamplingParams(max_new_tokens=16, temperature=0.8, seed=7)
        a = plain_generate(engine, prompt, seeded, method="draft").token_ids
        assert a == plain_generate(engine, prompt, seeded, method="draft").token_ids  # seeded sampling reproduces


@GPU
def test_load_model_places_weights_on_the_gpu(tiny_models):
    model = load_model(tiny_models / "draft", dtype="bfloat16", device="cuda")
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16

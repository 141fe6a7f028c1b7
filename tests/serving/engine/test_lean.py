"""The lean packed pass (``engine.lean``): the decoder written out with fused q/k/v and gate/up
products computes what Hugging Face's packed pass computes, writes the same KV slots, is
rebuilt when the weights change in place, and is left out where it does not apply."""

from __future__ import annotations

import copy

import pytest
import torch

from specops.core import cpu_linear
from specops.core.models import prepare_for_decoding
from specops.serving.engine import lean, ragged
from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.kv import CachedLM
from specops.serving.engine.slots import SlotPool
from tests.conftest import random_prompts, tiny_llama
from tests.tolerances import assert_f32_close

# Both sides are float32 passes through the network by different kernels (oneDNN's fused weights
# against torch's linear layers), each with its own rounding: compare at two such paths'
# tolerance, as test_batching does, not at a float32 result's against an exact reference (CI saw
# one logit of 970 differ by 2.1e-6 where F32_ATOL allows 1e-6).
PATHS = {"rtol": 1e-4, "atol": 1e-5}

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch has no oneDNN")


def _hf_pass(model, ids, rows, pool, kept):
    out = model(
        input_ids=ids[None],
        position_ids=rows.positions,
        attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool),
        past_key_values=ragged.PackedCache(pool, rows),
        use_cache=True,
        specops_rows=rows,
        logits_to_keep=kept,
        output_hidden_states=True,
    )
    return out.logits[0], out.hidden_states[-1][0, kept]


@pytest.mark.parametrize("prepared", [False, True])
def test_lean_pass_equals_the_hugging_face_packed_pass(prepared):
    """Decode rows, a prefill and a verification step side by side: the same logits and final
    hidden states at float32 precision, and the same keys and values in every request's slot."""
    model = tiny_llama(64, 3, seed=5).eval()
    if prepared:  # as serving loads it: cpu_linear's routes on every linear
        prepare_for_decoding(model)
    assert ragged.install(model)
    fused = lean.install(model)
    assert fused is not None
    pools = [SlotPool(model, slots=6, capacity=64) for _ in range(2)]
    torch.manual_seed(0)
    for layer in range(pools[0].num_layers):  # both pools hold the same earlier context
        for a, b in ((pools[0].keys, pools[1].keys), (pools[0].values, pools[1].values)):
            a[layer].normal_()
            b[layer].copy_(a[layer])
    slots, past, new = [0, 1, 2, 4, 5], [7, 3, 0, 11, 5], [1, 1, 9, 4, 1]
    rows = ragged.Rows.build(slots, past, new, "cpu")
    ids = torch.tensor(random_prompts(1, seed=3, lo=sum(new), hi=sum(new) + 1)[0])
    kept = torch.tensor([0, 1, 10, 11, 12, 13, 14, 15])  # the 1-token rows, the prefill's last, the 4 verified, ...
    with torch.inference_mode():
        want_logits, want_hidden = _hf_pass(model, ids, rows, pools[0], kept)
        hidden = fused.hidden_states(ids, rows, pools[1])[kept]
        logits = model.get_output_embeddings()(hidden)
    assert_f32_close(hidden, want_hidden, **PATHS)
    assert_f32_close(logits, want_logits, **PATHS)
    assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
    for layer in range(pools[0].num_layers):
        assert_f32_close(pools[1].keys[layer], pools[0].keys[layer], **PATHS)
        assert_f32_close(pools[1].values[layer], pools[0].values[layer], **PATHS)


def test_where_the_lean_pass_does_not_apply(monkeypatch):
    model = tiny_llama(32, 1, seed=2)
    assert lean.supported(model) is None
    assert "bfloat16" in lean.supported(copy.deepcopy(model).to(torch.bfloat16))
    monkeypatch.setenv(lean.ENV, "0")
    assert lean.install(model) is None
    monkeypatch.delenv(lean.ENV)
    monkeypatch.setenv(cpu_linear.ROUTE_ENV, "stock")  # no special route asked for: no prepacked weights either
    assert "SPECOPS_CPU_LINEAR=stock" in lean.supported(model)
    monkeypatch.delenv(cpu_linear.ROUTE_ENV)
    model.config.model_type = "gpt2"
    assert "architecture" in lean.supported(model)


def test_the_batcher_runs_the_lean_pass_and_rebuilds_it_after_weights_change(close_pair):
    """Batched steps go through the lean pass (equal to an unbatched forward); a weight changed in
    place (a hot swap copying a new version in) makes the next pass repack the fused weights."""
    target = copy.deepcopy(close_pair.target)
    batcher = TargetBatcher(target, max_batch=2, window_s=0.0)
    try:
        first = batcher._lean[id(target)]
        assert first is not None
        prompt = random_prompts(1, seed=4, lo=10, hi=11)[0]
        batcher.begin()
        got, _ = batcher.lm().forward(prompt)
        batcher.end()
        want, _ = CachedLM(target).forward(prompt)
        assert_f32_close(got, want, **PATHS)
        with torch.no_grad():
            target.model.layers[0].mlp.up_proj.weight.mul_(1.5)
        assert first.stale()
        batcher.begin()
        got, _ = batcher.lm().forward(prompt)
        batcher.end()
        want, _ = CachedLM(target).forward(prompt)
        assert_f32_close(got, want, **PATHS)
        assert batcher._lean[id(target)] is not first
    finally:
        batcher.close()

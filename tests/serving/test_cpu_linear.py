"""Few-row linear products as W @ xᵀ (serving/engine/cpu_linear.py): same values at float32 precision,
training untouched, and every plain nn.Linear of a loaded model switched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from serving.engine.cpu_linear import MAX_ROWS, SmallBatchLinear, use_small_batch_linear
from tests.conftest import tiny_llama
from tests.tolerances import assert_f32_close


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, MAX_ROWS, MAX_ROWS + 1, 40])
def test_values_equal_nn_linear(rows, bias):
    torch.manual_seed(rows)
    ref = nn.Linear(24, 56, bias=bias)
    fast = copy.deepcopy(ref)
    assert use_small_batch_linear(fast) == 1 and isinstance(fast, SmallBatchLinear)
    x = torch.randn(1, rows, 24)
    with torch.inference_mode():
        got, want = fast(x), ref(x)
    assert got.shape == want.shape == (1, rows, 56) and got.is_contiguous()
    assert_f32_close(got, want)
    got.view(rows, 56)  # callers reshape with view(): the output must be contiguous


def test_training_goes_through_nn_linear_unchanged():
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    fast = copy.deepcopy(ref)
    use_small_batch_linear(fast)
    x = torch.randn(4, 16)
    (ref(x) ** 2).sum().backward()
    (fast(x) ** 2).sum().backward()
    assert torch.equal(ref.weight.grad, fast.weight.grad)  # the same op: bit for bit


def test_a_model_is_switched_once_and_stays_loadable(tmp_path):
    model = tiny_llama(32, 2, seed=1)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert use_small_batch_linear(model) == n_linear > 0
    assert use_small_batch_linear(model) == 0  # idempotent
    state = copy.deepcopy(model).state_dict()
    assert state.keys() == tiny_llama(32, 2, seed=1).state_dict().keys()
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_stock_linear_switches_back_for_the_block_only():
    from serving.engine.cpu_linear import stock_linear

    model = tiny_llama(32, 2, seed=1)
    use_small_batch_linear(model)
    with stock_linear(model, None):
        assert not any(isinstance(m, SmallBatchLinear) for m in model.modules())
    assert use_small_batch_linear(model) == 0  # every module is SmallBatchLinear again

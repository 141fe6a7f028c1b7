"""Inference linear routes (core/cpu_linear.py: W @ xᵀ, oneDNN prepacked): same values at float32 precision,
training untouched, and every plain nn.Linear of a loaded model switched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from specops.core import cpu_linear
from specops.core.cpu_linear import MAX_ROWS, SmallBatchLinear, use_small_batch_linear
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
    from specops.core.cpu_linear import stock_linear

    model = tiny_llama(32, 2, seed=1)
    use_small_batch_linear(model)
    with stock_linear(model, None):
        assert not any(isinstance(m, SmallBatchLinear) for m in model.modules())
    assert use_small_batch_linear(model) == 0  # every module is SmallBatchLinear again


def test_routes_are_measured_per_shape_and_row_count(monkeypatch):
    """``auto`` takes W @ xᵀ only where it measured faster (by the margin), per weight shape;
    the row counts between two timed ones follow the next one up; values stay nn.Linear's."""
    model = nn.Sequential(nn.Linear(24, 56), nn.Linear(56, 24), nn.Linear(24, 56))
    ref = copy.deepcopy(model)
    monkeypatch.setattr(cpu_linear, "MIN_CALIBRATION_BYTES", 0)

    # a fake CPU: W @ xᵀ wins from 8 rows on the 56x24 shape, never on 24x56, ties at 1 row; oneDNN never wins
    def fake(route, modules, x):
        if route == "stock":
            return 1.0
        if route == "onednn":
            return 5.0
        rows, shape = x.shape[0], tuple(modules[0].weight.shape)
        return 0.95 if rows == 1 else 0.5 if (shape == (56, 24) and rows >= 8) else 2.0

    monkeypatch.setattr(cpu_linear, "_measure", fake)
    assert use_small_batch_linear(model, "auto") == 3
    assert model[0].wx_rows == model[2].wx_rows == frozenset(range(5, MAX_ROWS + 1))  # buckets 8 and 16
    assert model[1].wx_rows == frozenset()  # a 1-row near tie (0.95) stays on nn.Linear
    for rows in (1, 4, 8, 12):
        x = torch.randn(rows, 24)
        with torch.inference_mode():
            assert_f32_close(model(x), ref(x))


def test_forced_routes_and_small_models(monkeypatch):
    big_enough = nn.Linear(24, 56)
    assert use_small_batch_linear(big_enough, "stock") == 1 and big_enough.wx_rows == frozenset()
    forced = nn.Linear(24, 56)
    monkeypatch.setenv(cpu_linear.ROUTE_ENV, "wx")
    use_small_batch_linear(forced)
    assert forced.wx_rows == frozenset(range(1, MAX_ROWS + 1))
    monkeypatch.setenv(cpu_linear.ROUTE_ENV, "fastest")
    with pytest.raises(ValueError, match="SPECOPS_CPU_LINEAR"):
        use_small_batch_linear(nn.Linear(2, 2))
    monkeypatch.setenv(cpu_linear.ROUTE_ENV, "auto")
    monkeypatch.setattr(cpu_linear, "_measure", lambda *a: pytest.fail("a tiny model is not timed"))
    tiny = nn.Linear(24, 56)
    use_small_batch_linear(tiny)
    assert tiny.wx_rows == frozenset(range(1, MAX_ROWS + 1))  # below MIN_CALIBRATION_BYTES: W @ xᵀ as before


needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, MAX_ROWS, MAX_ROWS + 1, 100])
def test_prepacked_onednn_route_equals_nn_linear(rows, bias):
    """SPECOPS_CPU_LINEAR=onednn: every inference product on the prepacked weight, any row count."""
    torch.manual_seed(rows)
    ref = nn.Linear(24, 56, bias=bias)
    fast = copy.deepcopy(ref)
    use_small_batch_linear(fast, "onednn")
    assert fast.onednn_rows == frozenset(range(1, MAX_ROWS + 1)) and fast.onednn_long
    x = torch.randn(1, rows, 24)
    with torch.inference_mode():
        got, want = fast(x), ref(x)
    assert got.shape == want.shape == (1, rows, 56)
    assert_f32_close(got, want)
    (fast(x) ** 2).sum().backward()  # with autograd: nn.Linear's own op, gradients as ever
    assert fast.weight.grad is not None


@needs_onednn
def test_packed_weight_follows_the_module():
    """A deep copy packs its own weight (an opaque oneDNN tensor cannot be copied); a weight changed
    in place (load_state_dict, a hot-swapped copy) is packed again; a bfloat16 model takes nn.Linear."""
    torch.manual_seed(0)
    fast = nn.Linear(24, 56)
    use_small_batch_linear(fast, "onednn")
    x = torch.randn(5, 24)
    twin = copy.deepcopy(fast)
    with torch.inference_mode():
        assert_f32_close(twin(x), fast(x))
    fast.load_state_dict({"weight": torch.randn(56, 24), "bias": torch.zeros(56)})
    with torch.inference_mode():
        assert_f32_close(fast(x), x @ fast.weight.t())
        half = copy.deepcopy(fast).to(torch.bfloat16)
        assert half(x.bfloat16()).dtype == torch.bfloat16


@needs_onednn
def test_calibration_takes_onednn_where_it_wins(monkeypatch):
    """oneDNN is chosen per shape and row count where it beat the best other route by the margin,
    and for inputs longer than MAX_ROWS (timed at PREFILL_ROWS) only against nn.Linear."""
    model = nn.Sequential(nn.Linear(24, 56), nn.Linear(56, 24))
    ref = copy.deepcopy(model)
    monkeypatch.setattr(cpu_linear, "MIN_CALIBRATION_BYTES", 0)

    def fake(route, modules, x):
        rows, shape = x.shape[0], tuple(modules[0].weight.shape)
        if route == "onednn":  # wins on 56x24 from 4 rows on (and long inputs), never on 24x56
            return 0.3 if shape == (56, 24) and rows >= 4 else 3.0
        return 1.0 if route == "stock" else 0.8

    monkeypatch.setattr(cpu_linear, "_measure", fake)
    assert use_small_batch_linear(model, "auto") == 2
    assert model[0].onednn_rows == frozenset(range(3, MAX_ROWS + 1)) and model[0].onednn_long
    assert model[0].wx_rows == frozenset({1, 2})
    assert model[1].onednn_rows == frozenset() and not model[1].onednn_long
    for rows in (1, 4, 40):
        x = torch.randn(rows, 24)
        with torch.inference_mode():
            assert_f32_close(model(x), ref(x))

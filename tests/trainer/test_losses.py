"""Distillation losses (trainer/losses.py) against a naive float64 reference: values,
gradients, limits, numerical stability, non-finite handling, errors and masking."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import REGISTRY

from specops.trainer.losses import (
    LOSSES,
    RESIDUAL_FLOOR,
    TargetDist,
    checked_loss,
    distill_loss,
    forward_kl,
    jsd,
    reverse_kl,
)
from tests.tolerances import assert_f32_close

N, V, K = 6, 11, 4
MASK = torch.tensor([True, False, True, True, False, True])


# ----------------------------------------------------------------------------- reference


def _lse(x: torch.Tensor) -> torch.Tensor:
    m = x.max()
    return m + torch.log(torch.exp(x - m).sum())


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    return x - _lse(x)


def ref_div(log_p: torch.Tensor, log_q: torch.Tensor, kind: str, beta: float = 0.5) -> torch.Tensor:
    """One position, explicit probability vectors: Σ a·log(a/b) over a > 0, JSD via explicit m."""
    p, q = log_p.exp(), log_q.exp()
    sp, sq = p > 0, q > 0
    if kind == "fkl":
        return (p[sp] * (log_p[sp] - log_q[sp])).sum()
    if kind == "rkl":
        return (q[sq] * (log_q[sq] - log_p[sq])).sum()
    m = beta * p + (1 - beta) * q
    return beta * (p[sp] * (log_p[sp] - m[sp].log())).sum() + (1 - beta) * (q[sq] * (log_q[sq] - m[sq].log())).sum()


def _rows(mask, n):
    return range(n) if mask is None else [int(i) for i in mask.nonzero()]


def ref_full(z, target_lp, kind, *, beta=0.5, tau=1.0, mask=None):
    """Mean over selected rows of the divergence between softmax(target/τ) and softmax(z/τ)."""
    z, t = z.double(), target_lp.double()
    vals = [ref_div(_log_softmax(t[i] / tau), _log_softmax(z[i] / tau), kind, beta) for i in _rows(mask, len(z))]
    return torch.stack(vals).mean()


def _coarse_draft(z_row, ids_row, tau):
    log_q = _log_softmax(z_row.double() / tau)
    tail = torch.ones(len(z_row), dtype=torch.bool)
    tail[ids_row] = False
    return torch.cat([log_q[ids_row], _lse(log_q[tail]).reshape(1)])


def ref_topk_tau1(z, ids, lp, res, kind, *, beta=0.5, mask=None):
    """τ = 1: explicitly coarse-grained (k+1)-outcome distributions, floored residual renormalised."""
    vals = []
    for i in _rows(mask, len(z)):
        log_r = res[i].double().clamp_min(RESIDUAL_FLOOR).log().reshape(1)
        log_p = _log_softmax(torch.cat([lp[i].double(), log_r]))  # p / sum(p), kept in log space
        vals.append(ref_div(log_p, _coarse_draft(z[i], ids[i], 1.0), kind, beta))
    return torch.stack(vals).mean()


def ref_topk_uniform_tail(z, ids, lp, res, kind, *, beta=0.5, tau=1.0, mask=None):
    """A full target with the residual spread uniformly over the tail, tempered, then coarse-grained."""
    vals = []
    for i in _rows(mask, len(z)):
        v, k = z.shape[1], ids.shape[1]
        r = res[i].double().clamp_min(RESIDUAL_FLOOR)
        log_p_full = torch.full((v,), float(r) / (v - k), dtype=torch.float64).log()
        log_p_full[ids[i]] = lp[i].double()
        log_pt = _log_softmax(log_p_full / tau)
        tail = torch.ones(v, dtype=torch.bool)
        tail[ids[i]] = False
        log_p = torch.cat([log_pt[ids[i]], _lse(log_pt[tail]).reshape(1)])
        vals.append(ref_div(log_p, _coarse_draft(z[i], ids[i], tau), kind, beta))
    return torch.stack(vals).mean()


# ----------------------------------------------------------------------------- data


def _data(seed=0, n=N, v=V, k=K, scale=2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    target_lp = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * scale, -1).to(dtype)
    lp, ids = target_lp.double().topk(k, dim=-1)
    res = (1 - lp.exp().sum(-1)).clamp_min(0)
    return z, target_lp, ids, lp.to(dtype), res.to(dtype)


def _skipped(reason: str) -> float:
    return REGISTRY.get_sample_value("specops_trainer_skipped_steps_total", {"reason": reason}) or 0.0


# ----------------------------------------------------------------------------- 1. reference values


@pytest.mark.parametrize("tau", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_full_target_matches_reference(tau, beta):
    z, t, *_ = _data(seed=1)
    target = TargetDist.full(t)
    got = {
        "fkl": forward_kl(z, target, tau=tau, mask=MASK),
        "rkl": reverse_kl(z, target, tau=tau, mask=MASK),
        "jsd": jsd(z, target, beta=beta, tau=tau, mask=MASK),
    }
    for kind, value in got.items():
        assert value.dtype == torch.float32 and value.ndim == 0
        ref = ref_full(z, t, kind, beta=beta, tau=tau, mask=MASK)
        assert_f32_close(value, ref)
        assert float(ref) > 1e-3  # a generic pair: the comparison is not 0 == 0
        torch.testing.assert_close(distill_loss(z, target, kind, beta=beta, tau=tau, mask=MASK), value)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_topk_target_matches_coarse_grained_reference(beta):
    z, t, ids, lp, res = _data(seed=2)
    target = TargetDist.topk(ids, lp, res)
    for kind in LOSSES:
        got = distill_loss(z, target, kind, beta=beta, mask=MASK)
        assert_f32_close(got, ref_topk_tau1(z, ids, lp, res, kind, beta=beta, mask=MASK))
        # data-processing inequality: the coarse-grained divergence bounds the full one from below
        assert float(got) <= float(distill_loss(z, TargetDist.full(t), kind, beta=beta, mask=MASK)) + 1e-6


@pytest.mark.parametrize("tau", [0.7, 2.0])
def test_topk_tempered_is_uniform_tail_tempering(tau):
    z, _, ids, lp, res = _data(seed=3)
    target = TargetDist.topk(ids, lp, res)
    for kind in LOSSES:
        got = distill_loss(z, target, kind, beta=0.3, tau=tau, mask=MASK)
        ref = ref_topk_uniform_tail(z, ids, lp, res, kind, beta=0.3, tau=tau, mask=MASK)
        assert_f32_close(got, ref)
    # at τ = 1 the uniform-tail construction is the plain coarse-graining
    torch.testing.assert_close(
        ref_topk_uniform_tail(z, ids, lp, res, "jsd", beta=0.3), ref_topk_tau1(z, ids, lp, res, "jsd", beta=0.3)
    )


def test_zero_residual_is_floored_and_finite():
    z, _, ids, lp, _ = _data(seed=4)
    res = torch.zeros(N)  # rounding said "no mass outside the top k", the draft disagrees
    target = TargetDist.topk(ids, lp, res)
    for kind in LOSSES:
        got = distill_loss(z, target, kind)
        assert torch.isfinite(got)
        assert_f32_close(got, ref_topk_tau1(z, ids, lp, res, kind))


def test_low_precision_draft_computes_in_float32_and_float64_stays():
    z, t, *_ = _data(seed=5)
    target = TargetDist.full(t.half())
    for dtype in (torch.float16, torch.bfloat16):
        got = forward_kl(z.to(dtype), target)
        assert got.dtype == torch.float32
        assert_f32_close(got, ref_full(z.to(dtype), t.half(), "fkl"))
    assert forward_kl(z.double(), TargetDist.full(t.double())).dtype == torch.float64


# ----------------------------------------------------------------------------- 2. gradients


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("topk", [False, True])
def test_gradcheck(kind, topk):
    z, t, ids, lp, res = _data(seed=6, n=3, v=5, k=2, dtype=torch.float64)
    target = TargetDist.topk(ids, lp, res) if topk else TargetDist.full(t)
    z = z.requires_grad_()
    mask = torch.tensor([True, False, True])
    assert torch.autograd.gradcheck(lambda x: distill_loss(x, target, kind, beta=0.3, tau=0.7, mask=mask), (z,))


@pytest.mark.parametrize("kind", LOSSES)
def test_gradients_match_reference_autograd(kind):
    z, t, ids, lp, res = _data(seed=7, dtype=torch.float64)
    cases = [
        (TargetDist.full(t), lambda x: ref_full(x, t, kind, beta=0.3, tau=0.7, mask=MASK), 0.7),
        (TargetDist.topk(ids, lp, res), lambda x: ref_topk_tau1(x, ids, lp, res, kind, beta=0.3, mask=MASK), 1.0),
    ]
    for target, ref_fn, tau in cases:
        x1, x2 = z.clone().requires_grad_(), z.clone().requires_grad_()
        distill_loss(x1, target, kind, beta=0.3, tau=tau, mask=MASK).backward()
        ref_fn(x2).backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-7, atol=1e-10)
        assert x1.grad.abs().max() > 1e-3 and (x1.grad[~MASK] == 0).all()


# ----------------------------------------------------------------------------- 3. limits


def test_equal_distributions_give_zero():
    z, *_ = _data(seed=8)
    same = torch.log_softmax(z, -1)
    lp, ids = same.topk(K, -1)
    res = 1 - lp.double().exp().sum(-1).float()
    cases = [(TargetDist.full(same), 1.0), (TargetDist.full(same), 2.0), (TargetDist.topk(ids, lp, res), 1.0)]
    for target, tau in cases:  # (top-k at τ != 1 uses the uniform-tail approximation: not exactly q)
        for kind in LOSSES:
            assert abs(float(distill_loss(z, target, kind, tau=tau))) < 1e-5


def test_jsd_limits_are_forward_and_reverse_kl():
    z, t, *_ = _data(seed=9, dtype=torch.float64)
    target = TargetDist.full(t)
    fkl, rkl = float(forward_kl(z, target)), float(reverse_kl(z, target))
    small, large = 1e-4, 1 - 1e-4
    assert float(jsd(z, target, beta=small)) / small == pytest.approx(fkl, rel=2e-3)
    assert float(jsd(z, target, beta=large)) / (1 - large) == pytest.approx(rkl, rel=2e-3)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_is_not_a_weighted_sum_of_kls(beta):
    z, t, *_ = _data(seed=10)
    target = TargetDist.full(t)
    mixed = beta * forward_kl(z, target) + (1 - beta) * reverse_kl(z, target)
    assert abs(float(jsd(z, target, beta=beta)) - float(mixed)) > 0.1


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_topk_with_k_equal_vocab_and_zero_residual_is_the_full_loss(tau):
    z, t, *_ = _data(seed=11)
    lp, ids = t.topk(V, -1)
    full, topk = TargetDist.full(t), TargetDist.topk(ids, lp, torch.zeros(N))
    for kind in LOSSES:
        x1, x2 = z.clone().requires_grad_(), z.clone().requires_grad_()
        a, b = distill_loss(x1, topk, kind, tau=tau), distill_loss(x2, full, kind, tau=tau)
        assert_f32_close(a, b)  # two float32 code paths: top-k with k = V, and full
        a.backward(), b.backward()
        assert_f32_close(x1.grad, x2.grad)


# ----------------------------------------------------------------------------- 4. stability


def test_large_logits_are_stable():
    g = torch.Generator().manual_seed(12)
    z = (torch.rand(N, V, generator=g) * 2 - 1) * 1e4
    t = (torch.rand(N, V, generator=g) * 2 - 1) * 1e4
    z[0] = torch.tensor([1e4, 1e4 - 1, 1e4 - 2.5] + [-1e4] * (V - 3))  # near-ties at large scale
    t[0] = torch.tensor([1e4 - 2, 1e4, 1e4 - 0.5] + [-1e4] * (V - 3))
    t[1] = z[1]  # p = q at large scale
    target_lp = torch.log_softmax(t, -1)
    lp, ids = target_lp.topk(K, -1)
    res = (1 - lp.double().exp().sum(-1)).clamp_min(0).float()
    cases = [
        (TargetDist.full(target_lp), lambda x, kind: ref_full(x, target_lp, kind, beta=0.3, tau=0.7), 0.7),
        (TargetDist.topk(ids, lp, res), lambda x, kind: ref_topk_tau1(x, ids, lp, res, kind, beta=0.3), 1.0),
    ]
    for target, ref_fn, tau in cases:
        for kind in LOSSES:
            x32, x64 = z.clone().requires_grad_(), z.double().requires_grad_()
            got, ref = distill_loss(x32, target, kind, beta=0.3, tau=tau), ref_fn(x64, kind)
            got.backward(), ref.backward()
            assert torch.isfinite(got) and torch.isfinite(x32.grad).all()
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-3)
            torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
            assert x32.grad[0].abs().max() > 1e-3  # the near-tie row has a real gradient


# ----------------------------------------------------------------------------- 5. non-finite inputs


@pytest.mark.parametrize(
    "where, value, reason",
    [
        ("draft", float("nan"), "nonfinite_draft_logits"),
        ("draft", float("inf"), "nonfinite_draft_logits"),
        ("full", float("nan"), "nonfinite_target"),
        ("full", float("inf"), "nonfinite_target"),
        ("topk", float("nan"), "nonfinite_target"),
        ("topk", float("-inf"), "nonfinite_target"),
        ("residual", float("nan"), "nonfinite_target"),
    ],
)
def test_checked_loss_skips_nonfinite_inputs(caplog, where, value, reason):
    z, t, ids, lp, res = _data(seed=13)
    tensor = {"draft": z, "full": t, "topk": lp, "residual": res}[where]
    tensor.view(-1)[0] = value  # row 0 is selected by MASK
    if where == "full":
        tensor.view(-1)[2 * V + 1] = value  # and row 2
    target = TargetDist.full(t) if where in ("draft", "full") else TargetDist.topk(ids, lp, res)
    before = _skipped(reason)
    with caplog.at_level(logging.WARNING, logger="specops.trainer.losses"):
        loss, why = checked_loss(z, target, "jsd", mask=MASK)
    assert loss is None and why.startswith(reason)
    assert f"{2 if where == 'full' else 1} of 4 positions" in why
    assert _skipped(reason) == before + 1
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and reason in caplog.records[0].getMessage()


def test_neg_inf_in_full_target_is_probability_zero(caplog):
    z, t, *_ = _data(seed=14)
    t = t.clone()
    t[:, :3] = float("-inf")  # tokens the target can never emit
    t = torch.log_softmax(t, -1)
    target = TargetDist.full(t)
    for kind in ("fkl", "jsd"):
        x = z.clone().requires_grad_()
        loss, why = checked_loss(x, target, kind, beta=0.3, mask=MASK)
        assert why is None and torch.isfinite(loss)
        assert_f32_close(loss, ref_full(z, t, kind, beta=0.3, mask=MASK))
        loss.backward()
        assert torch.isfinite(x.grad).all()
    # reverse KL is genuinely infinite there (q > 0 where p = 0): refused as a non-finite loss
    before = _skipped("nonfinite_loss")
    with caplog.at_level(logging.WARNING, logger="specops.trainer.losses"):
        loss, why = checked_loss(z, target, "rkl", mask=MASK)
    assert loss is None and why.startswith("nonfinite_loss") and "4 of 4" in why
    assert _skipped("nonfinite_loss") == before + 1 and "nonfinite_loss" in caplog.text


def test_tokens_impossible_for_both_have_no_nan_gradients():
    # e.g. padded vocabulary columns masked to -inf on both sides: 0·log(0/0) = 0, gradient 0
    z, t, *_ = _data(seed=21, dtype=torch.float64)
    z[:, -2:], t[:, -2:] = float("-inf"), float("-inf")
    for kind in LOSSES:
        x, x_ref = z.clone().requires_grad_(), z[:, :-2].clone().requires_grad_()
        loss = distill_loss(x, TargetDist.full(t), kind, beta=0.3, tau=0.7, mask=MASK)
        ref = ref_full(x_ref, t[:, :-2], kind, beta=0.3, tau=0.7, mask=MASK)
        loss.backward(), ref.backward()
        torch.testing.assert_close(loss, ref)
        assert torch.isfinite(x.grad).all() and (x.grad[:, -2:] == 0).all()
        torch.testing.assert_close(x.grad[:, :-2], x_ref.grad)


def test_checked_loss_passes_finite_input_and_ignores_unselected_rows():
    z, t, *_ = _data(seed=15)
    t[1, 0] = float("nan")  # row 1 is masked out (padding)
    z[4, 0] = float("nan")
    before = [_skipped(r) for r in ("nonfinite_draft_logits", "nonfinite_target", "nonfinite_loss")]
    loss, why = checked_loss(z, TargetDist.full(t), "fkl", mask=MASK)
    assert why is None and torch.isfinite(loss)
    assert_f32_close(loss, ref_full(z, t, "fkl", mask=MASK))
    assert [_skipped(r) for r in ("nonfinite_draft_logits", "nonfinite_target", "nonfinite_loss")] == before


# ----------------------------------------------------------------------------- 6. errors


def test_invalid_arguments_raise():
    z, t, ids, lp, res = _data(seed=16)
    full = TargetDist.full(t)
    with pytest.raises(ValueError, match="unknown loss kind 'kl'.*fkl, rkl, jsd"):
        distill_loss(z, full, "kl")
    with pytest.raises(ValueError, match="unknown loss kind"):
        checked_loss(z, full, "mse")
    for beta in (0.0, 1.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"beta must be in \(0, 1\) exclusive"):
            jsd(z, full, beta=beta)
    for tau in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="tau must be a finite number > 0"):
            forward_kl(z, full, tau=tau)


def test_mismatched_shapes_raise():
    z, t, ids, lp, res = _data(seed=17)
    with pytest.raises(ValueError, match="draft_logits must be a 2-D"):
        forward_kl(z[None], TargetDist.full(t))
    with pytest.raises(ValueError, match="full target logprobs shape .* does not match draft_logits"):
        forward_kl(z, TargetDist.full(torch.cat([t, t[:, :1]], 1)))
    with pytest.raises(ValueError, match="top-k target has 5 positions, draft_logits has 6"):
        forward_kl(z, TargetDist.topk(ids[:5], lp[:5], res[:5]))
    with pytest.raises(ValueError, match="k=11 exceeds the vocabulary size V=10"):
        forward_kl(z[:, :10], TargetDist.topk(*t.topk(V, -1)[::-1], torch.zeros(N)))
    with pytest.raises(ValueError, match="topk_ids out of range"):
        forward_kl(z, TargetDist.topk(ids + V, lp, res))
    with pytest.raises(ValueError, match="residual must be a float tensor of shape"):
        TargetDist.topk(ids, lp, res[:3])
    with pytest.raises(ValueError, match="topk_ids shape .* does not match topk_logprobs"):
        TargetDist.topk(ids[:, :2], lp, res)
    with pytest.raises(ValueError, match="topk_ids must be a 2-D integer tensor"):
        TargetDist.topk(ids.float(), lp, res)
    with pytest.raises(ValueError, match="needs both topk_ids and residual"):
        TargetDist(lp, ids, None)
    with pytest.raises(ValueError, match="target logprobs must be a 2-D float tensor"):
        TargetDist.full(t[0])
    for bad_mask in (MASK[:4], MASK.long()):
        with pytest.raises(ValueError, match="mask must be a bool tensor of shape"):
            forward_kl(z, TargetDist.full(t), mask=bad_mask)


def test_target_dist_helpers():
    _, t, ids, lp, res = _data(seed=18)
    full, topk = TargetDist.full(t), TargetDist.topk(ids, lp, res)
    assert not full.is_topk and topk.is_topk
    moved = topk.to("cpu")
    assert moved.is_topk and torch.equal(moved.topk_ids, ids) and torch.equal(moved.residual, res)
    assert full.to(torch.device("cpu")).topk_ids is None


# ----------------------------------------------------------------------------- 7. masking


def test_masked_out_rows_do_not_matter():
    z, t, ids, lp, res = _data(seed=19)
    z2, t2, lp2, res2 = z.clone(), t.clone(), lp.clone(), res.clone()
    z2[1] = 50 * torch.randn(V)
    t2[4] = torch.log_softmax(torch.randn(V), -1)
    lp2[4], res2[1] = lp2[4] - 3, 0.5
    for kind in LOSSES:
        a = distill_loss(z, TargetDist.full(t), kind, mask=MASK)
        b = distill_loss(z2, TargetDist.full(t2), kind, mask=MASK)
        assert float(a) == float(b)
        a = distill_loss(z, TargetDist.topk(ids, lp, res), kind, mask=MASK)
        b = distill_loss(z2, TargetDist.topk(ids, lp2, res2), kind, mask=MASK)
        assert float(a) == float(b)
        # and the mask really selects: all rows differ from the masked mean
        assert float(distill_loss(z, TargetDist.full(t), kind)) != float(a)


@pytest.mark.parametrize("checked", [False, True])
def test_empty_mask_gives_connected_zero(checked):
    z, t, *_ = _data(seed=20)
    z[1, 0] = float("nan")  # masked out, must not poison the zero
    x = z.requires_grad_()
    none = torch.zeros(N, dtype=torch.bool)
    for kind in LOSSES:
        x.grad = None
        fn = (lambda *a, **kw: checked_loss(*a, **kw)[0]) if checked else distill_loss
        loss = fn(x, TargetDist.full(t), kind, mask=none)
        assert float(loss.detach()) == 0.0 and loss.requires_grad
        loss.backward()
        assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))


# ---------------------------------------------------------------- restricted to a draft vocabulary
def test_restricting_a_full_target_renormalises_its_columns():
    logp = torch.log_softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), dim=-1)
    ids = torch.tensor([1, 4, 5, 9])
    got = TargetDist.full(logp).restrict(ids)
    assert not got.is_topk and got.logprobs.shape == (3, 4)
    assert_f32_close(got.logprobs, torch.log_softmax(logp[:, ids], dim=-1))


def test_restricting_a_topk_target_keeps_its_ratios_and_spreads_the_residual():
    # row 0: top-3 ids 2, 7, 3 (3 is outside the subset); row 1: no top-k id in the subset
    ids = torch.tensor([[2, 7, 3], [3, 8, 6]])
    p = torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.2, 0.1]])
    target = TargetDist.topk(ids, p.log(), torch.tensor([0.2, 0.1]))
    subset = torch.tensor([0, 2, 5, 7])
    got = target.restrict(subset).logprobs.exp()
    assert got.shape == (2, 4)
    assert_f32_close(got.sum(-1), torch.ones(2))
    # row 0: 0.5 and 0.2 in place, the residual 0.2 spread over the 2 subset tokens outside the top k
    assert_f32_close(got[0], torch.tensor([0.1, 0.5, 0.1, 0.2]) / 0.9)
    assert_f32_close(got[1], torch.full((4,), 0.25))  # only residual mass: uniform over the subset


def test_a_restricted_target_trains_the_subset_logits():
    ids = torch.tensor([[2, 7, 3]])
    target = TargetDist.topk(ids, torch.tensor([[0.5, 0.3, 0.1]]).log(), torch.tensor([0.1])).restrict(
        torch.tensor([2, 7])
    )
    logits = torch.zeros(1, 2, requires_grad=True)
    loss = distill_loss(logits, target, "fkl")
    loss.backward()
    assert logits.grad[0, 0] < 0 < logits.grad[0, 1]  # toward token 2, the target's favourite


def test_a_record_with_a_reference_span_trains_on_the_whole_context():
    """The draft sees what the target saw: reference texts placed in the context are part of
    the prefix it learns to continue, and each example ends exactly at its miss position."""
    import dataclasses

    from specops.streams.records import ContextSpan
    from specops.trainer.data import teacher_example
    from tests.streams.records_factory import miss_record

    rec = miss_record()
    rec = dataclasses.replace(rec, context_spans=(ContextSpan("reference", 0, 12), ContextSpan("prompt", 12, 20)))
    rec.validate()
    ex = teacher_example(rec)
    last = int(rec.positions.max())
    assert ex.context.tolist() == rec.token_ids[:last].tolist()  # the reference tokens are in it
    assert ex.context[:12].tolist() == rec.token_ids[:12].tolist()
    assert ex.positions.tolist() == rec.positions.tolist()

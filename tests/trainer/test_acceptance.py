"""Offline expected acceptance: it matches the verifier's real acceptance rate, and it is
exact on known cases."""

from __future__ import annotations

import torch

from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.engine.verifier import decide
from specops.serving.fleet.stream_logger import LoggerConfig, RequestMeta, StreamLogger
from specops.serving.plan import plain_generate
from specops.streams import StreamConfig, codec, open_stream
from specops.trainer.acceptance import evaluate_records, position_acceptance
from specops.trainer.losses import TargetDist
from tests.conftest import random_prompts


def test_sampling_estimate_is_the_verifiers_acceptance_probability():
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(1, 12, generator=g) * 2
    draft_logits = torch.randn(1, 12, generator=g) * 2
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    est, _, _ = position_acceptance(draft_logits, TargetDist.full(target_logits.log_softmax(-1)))
    trials, accepted = 20000, 0
    for _ in range(trials):
        d = int(torch.multinomial(q[0], 1, generator=g))
        acc, _ = decide(torch.cat([p, p]), [d], q, greedy=False, generator=g)
        accepted += len(acc)
    rate = accepted / trials
    assert abs(rate - float(est[0])) < 0.015, (rate, float(est[0]))
    assert abs(float(est[0]) - float(torch.minimum(p, q).sum())) < 1e-6


def test_topk_bounds_bracket_the_full_value_and_agree_at_k_equals_v():
    g = torch.Generator().manual_seed(1)
    target = torch.randn(5, 40, generator=g).log_softmax(-1)
    draft = torch.randn(5, 40, generator=g) * 1.5
    full_low, full_high, full_greedy = position_acceptance(draft, TargetDist.full(target))
    assert torch.allclose(full_low, full_high)
    vals, ids = target.topk(8, dim=-1)
    residual = (1 - vals.exp().sum(-1)).clamp(min=0)
    low, high, greedy = position_acceptance(draft, TargetDist.topk(ids, vals, residual))
    assert torch.all(low <= full_low + 1e-6) and torch.all(full_low <= high + 1e-6)
    assert torch.equal(greedy, full_greedy)
    vals, ids = target.topk(40, dim=-1)
    low, high, _ = position_acceptance(draft, TargetDist.topk(ids, vals, torch.zeros(5)))
    assert torch.allclose(low, full_low, atol=1e-5) and torch.allclose(high, full_low, atol=1e-5)


def test_on_its_own_greedy_rejections_the_draft_agrees_nowhere_and_the_target_everywhere(close_pair, tmp_path):
    cfg = StreamConfig(url=f"local://{tmp_path}/log", fsync=False)
    logger = StreamLogger(cfg, LoggerConfig(topk=16), vocab_size=close_pair.vocab_size)
    engine = SpecEngine(close_pair, logger=logger)
    for i, prompt in enumerate(random_prompts(6, seed=3)):
        plain_generate(engine, prompt, SamplingParams(max_new_tokens=24), meta=RequestMeta(f"r{i}", "c"))
    logger.close()
    with open_stream(cfg) as s:
        records = [codec.decode(m.value) for m in s.read(cfg.topics.misses)]
    draft = evaluate_records(close_pair.draft, records)
    target = evaluate_records(close_pair.target, records)
    assert draft.num_positions == target.num_positions == sum(r.num_rejected for r in records) > 0
    assert draft.greedy == 0.0  # each position is where the draft's argmax was refused
    assert target.greedy == 1.0
    # the target against itself: the lower bound is the logged top-k mass, the upper bound 1
    topk_mass = sum(float((1 - r.residual).sum()) for r in records) / target.num_positions
    assert abs(target.sampling - topk_mass) < 1e-4 and target.sampling_upper > 0.999
    assert draft.sampling < target.sampling


def _served_records(pair, tmp_path, n=8, seed=3):
    cfg = StreamConfig(url=f"local://{tmp_path}/log", fsync=False)
    logger = StreamLogger(cfg, LoggerConfig(topk=16), vocab_size=pair.vocab_size)
    engine = SpecEngine(pair, logger=logger)
    results = [
        plain_generate(engine, p, SamplingParams(max_new_tokens=24), meta=RequestMeta(f"r{i}", "c"))
        for i, p in enumerate(random_prompts(n, seed=seed))
    ]
    logger.close()
    with open_stream(cfg) as s:
        return [codec.decode(m.value) for m in s.read(cfg.topics.misses)], results


def test_served_agreement_is_measured_at_every_output_position(close_pair, tmp_path):
    """On greedy records every output token is the target's argmax: the target agrees
    everywhere, and the serving draft agrees exactly where the engine accepted its drafts."""
    records, results = _served_records(close_pair, tmp_path)
    target = evaluate_records(close_pair.target, records)
    draft = evaluate_records(close_pair.draft, records)
    n_out = sum(len(r.token_ids) - r.num_prompt_tokens for r in records)
    assert target.served == 1.0 and target.served_positions == draft.served_positions == n_out
    assert len(draft.per_request) == len(records) and sum(n for _, n in draft.per_request) == n_out
    assert draft.greedy == 0.0 < draft.served < 1.0  # biased to 0 at rejected positions, not in truth
    # every accepted draft token was an agreement, so the served agreement is at least the acceptance
    accepted = sum(r.stats.num_accepted for r in results)
    assert draft.served * n_out >= accepted


def test_rejected_positions_favour_any_other_draft_and_served_does_not(close_pair, tiny_pair, tmp_path):
    """The gate's old comparison promoted drafts that served worse. Records served by the close
    draft: an unrelated random draft beats it at those rejected positions, yet agrees with the
    target far less often over the requests."""
    from specops.trainer.acceptance import paired_gain
    from specops.trainer.promote import PromoteConfig, gate_decision

    records, _ = _served_records(close_pair, tmp_path, n=12)
    serving, other = evaluate_records(close_pair.draft, records), evaluate_records(tiny_pair.draft, records)
    assert other.greedy > serving.greedy == 0.0  # the biased view
    assert other.served < serving.served  # the truth
    delta, stderr = paired_gain(other, serving)
    assert delta == other.served - serving.served and 0 < stderr < 1
    biased = gate_decision("2", "1", other, serving, PromoteConfig(metric="greedy", min_positions=1))
    fair = gate_decision("2", "1", other, serving, PromoteConfig(metric="served", min_positions=1))
    assert biased.promoted and not fair.promoted and fair.metric == "served"
    assert fair.extra["stderr"] == stderr and fair.extra["candidate_greedy"] == other.greedy


def test_paired_gain_needs_the_same_requests():
    import pytest

    from specops.trainer.acceptance import Acceptance, paired_gain

    a = Acceptance(0, 0, 0, 0, served=0.5, served_positions=20, per_request=((5, 10), (5, 10)))
    b = Acceptance(0, 0, 0, 0, served=0.4, served_positions=20, per_request=((4, 10), (4, 10)))
    assert paired_gain(a, b) == (0.1, 0.0)
    with pytest.raises(ValueError, match="same requests"):
        paired_gain(a, Acceptance(0, 0, 0, 0, served=0.4, served_positions=10, per_request=((4, 10),)))

"""Student and mixed sampling (OSD §4.1): the mixture is sampled correctly, the sampled
sequence is scored with the target's own distributions, and the online loop trains with it."""

from __future__ import annotations

import copy

import pytest
import torch
from scipy import stats

from specops.trainer.data import draft_logits, draft_logits_at, teacher_example
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.replay import ReplayConfig
from specops.trainer.sampling import mixture_sample, sampled_example
from tests.trainer.logged import log_requests


@pytest.mark.parametrize("mix", [0.0, 0.3, 1.0])
def test_mixture_sample_matches_the_mixture(mix):
    """Chi-square goodness of fit of 20k draws against mix·p + (1-mix)·q on an 8-token vocabulary."""
    g = torch.Generator().manual_seed(3)
    t_logits, d_logits = torch.randn(1, 8, generator=g) * 2, torch.randn(1, 8, generator=g) * 2
    n = 20_000
    draws = mixture_sample(t_logits.expand(n, 8), d_logits.expand(n, 8), mix, g)
    observed = torch.bincount(draws, minlength=8).numpy()
    expected = (
        mix * torch.softmax(t_logits[0].double(), -1) + (1 - mix) * torch.softmax(d_logits[0].double(), -1)
    ).numpy()
    assert stats.chisquare(observed, expected / expected.sum() * n).pvalue > 1e-3


def test_mixture_sample_rejects_bad_mix():
    with pytest.raises(ValueError, match="mix"):
        mixture_sample(torch.zeros(1, 4), torch.zeros(1, 4), 1.5)


@pytest.fixture(scope="module")
def logged(close_pair, tmp_path_factory):
    return log_requests(
        close_pair,
        tmp_path_factory.mktemp("sampling"),
        12,
        seed=5,
        cluster_of=lambda i: "c",
        partitions=1,
        lo=6,
        hi=14,
        max_new_tokens=16,
        greedy_only=True,
    )


def test_sampled_example_is_scored_by_the_target(close_pair, logged):
    """Every sampled position carries the target's full distribution given the sampled prefix."""
    cfg, _ = logged
    from specops.streams import open_stream
    from specops.streams.consumer import RecordConsumer

    with open_stream(cfg) as s:
        consumer = RecordConsumer(s, "peek", [cfg.topics.misses])
        rec = consumer.poll(max_records=1, timeout_s=5)[0].record
    target, draft = close_pair.target, copy.deepcopy(close_pair.draft)
    ex = sampled_example(target, draft, rec, mix=0.5, max_new_tokens=10, generator=torch.Generator().manual_seed(0))
    p = rec.num_prompt_tokens
    assert ex.num_positions == 10 and ex.positions.tolist() == list(range(p, p + 10))
    assert ex.context[:p].tolist() == rec.token_ids[:p].tolist() and len(ex.context) == p + 9
    with torch.no_grad():
        full = torch.log_softmax(target(input_ids=ex.context.unsqueeze(0)).logits[0].float(), -1)
    torch.testing.assert_close(ex.target.logprobs, full[p - 1 :], atol=1e-5, rtol=1e-5)
    assert draft_logits(draft, ex).shape == (10, close_pair.vocab_size)
    # the teacher example of a record is exactly the logged positions
    torch.testing.assert_close(draft_logits(draft, teacher_example(rec)), draft_logits_at(draft, rec))


def test_student_sampling_with_mix_zero_follows_the_draft(close_pair, logged):
    """mix=0 samples from the draft alone: a draft forced onto one token emits only that token."""
    cfg, _ = logged
    from specops.streams import open_stream
    from specops.streams.consumer import RecordConsumer

    with open_stream(cfg) as s:
        rec = RecordConsumer(s, "peek2", [cfg.topics.misses]).poll(max_records=1, timeout_s=5)[0].record
    draft = copy.deepcopy(close_pair.draft)
    head = torch.nn.Linear(draft.config.hidden_size, draft.config.vocab_size, bias=True)
    with torch.no_grad():  # logits = bias: token 7 dwarfs all others whatever the hidden state
        head.weight.zero_()
        head.bias.zero_()
        head.bias[7] = 1e4
    draft.lm_head = head
    ex = sampled_example(
        close_pair.target, draft, rec, mix=0.0, max_new_tokens=6, generator=torch.Generator().manual_seed(1)
    )
    assert ex.context[rec.num_prompt_tokens :].tolist() == [7] * 5


@pytest.mark.parametrize("sampling", ["student", "mixed"])
def test_online_loop_trains_with_sampled_sequences(close_pair, logged, tmp_path, sampling):
    cfg, draft_dir = logged
    ocfg = OnlineConfig(
        interval=4,
        holdout_every=1000,
        sampling=sampling,
        sample_max_new_tokens=8,
        group=f"g-{sampling}",
        replay=ReplayConfig(policy="clear"),
    )  # each request trained once: positions add up
    trainer = OnlineTrainer(cfg, draft_dir, tmp_path / "out", ocfg, target=close_pair.target)
    before = copy.deepcopy(trainer.state("c").model.state_dict())
    assert trainer.run(max_idle_s=1.0) == 12
    st = trainer.clusters["c"]
    trainer.close()
    assert st.version == 3 and st.skipped_steps == 0
    assert st.positions_trained == 12 * 8  # every sampled position of every request
    changed = any(not torch.equal(before[k], v) for k, v in st.model.state_dict().items())
    assert changed


def test_student_sampling_needs_a_target(logged, tmp_path):
    cfg, draft_dir = logged
    with pytest.raises(ValueError, match="target"):
        OnlineTrainer(cfg, draft_dir, tmp_path / "out", OnlineConfig(sampling="student"))

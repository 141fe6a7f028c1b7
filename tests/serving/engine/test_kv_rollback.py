"""KV-cache rollback: after a rejection at any position, cached decoding equals a full recompute."""

from __future__ import annotations

import pytest
import torch

from specops.serving.engine.kv import CachedLM
from specops.serving.engine.proposer import Proposer
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import DecodeState, Proposals, SamplingParams, Verdict
from specops.serving.plan import plain_generate
from specops.serving.proposers.draft_model import DraftModelProposer


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("keep", range(0, 12))
def test_rollback_to_every_position_matches_recompute(tiny_target, keep):
    ids = list(range(3, 15))  # 12 tokens
    lm = CachedLM(tiny_target)
    lm.forward(ids)
    lm.rollback(keep)
    assert lm.num_cached == keep == lm.cache.get_seq_length()
    new = [50, 51, 52]
    logits, _ = lm.forward(new)
    ref = full_logits(tiny_target, ids[:keep] + new)[keep:]
    assert torch.allclose(logits, ref, atol=1e-4), (logits - ref).abs().max()


class ScriptedProposer(Proposer):
    """Proposes the true greedy continuation with one wrong token at ``wrong_at``."""

    name = "scripted"

    def __init__(self, truth: list[int], prompt_len: int, wrong_at: int, vocab: int) -> None:
        self.truth, self.prompt_len, self.wrong_at, self.vocab = truth, prompt_len, wrong_at, vocab
        self.verdicts: list[Verdict] = []

    def propose(self, state: DecodeState, k: int) -> Proposals:
        start = state.num_generated
        drafts = list(self.truth[start : start + k])
        if self.wrong_at < len(drafts):
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % self.vocab
        return Proposals(tokens=torch.tensor([drafts], dtype=torch.long).reshape(1, len(drafts)))

    def observe(self, state: DecodeState, verdict: Verdict) -> None:
        self.verdicts.append(verdict)


@pytest.mark.parametrize("wrong_at", range(0, 6))
def test_rejection_at_every_draft_position(tiny_pair, wrong_at):
    engine = SpecEngine(tiny_pair, collect_rejections=True)
    prompt = [7, 8, 9, 10]
    truth = plain_generate(engine, prompt, SamplingParams(max_new_tokens=40), method="target").token_ids
    k = 6
    proposer = ScriptedProposer(truth, len(prompt), wrong_at, tiny_pair.vocab_size)
    out = plain_generate(engine, prompt, SamplingParams(max_new_tokens=40), k=k, proposer=proposer)
    assert out.token_ids == truth
    full_steps = [v for v in proposer.verdicts if v.num_drafted == k]
    assert full_steps and all(len(v.accepted) == wrong_at for v in full_steps)
    # Every rejection is logged with its absolute index and the target's logits there.
    for rej in out.rejections:
        pos = rej.index
        assert rej.emitted_token == (prompt + truth)[pos] != rej.drafted_token
        ref = full_logits(tiny_pair.target, (prompt + truth)[:pos])[-1]
        assert torch.allclose(rej.target_logits, ref, atol=1e-4)
    assert (
        len(out.rejections)
        == out.stats.num_rejected_steps
        == sum(len(v.accepted) < v.num_drafted for v in proposer.verdicts)
    )


def test_verifier_returns_target_hidden_state(tiny_pair):
    from specops.serving.engine.verifier import Verifier

    lm = CachedLM(tiny_pair.target)
    verifier = Verifier(lm, want_hidden=True)
    state = DecodeState(token_ids=[3, 4, 5], num_prompt_tokens=3, params=SamplingParams())
    verdict = verifier.verify(state, Proposals(tokens=torch.tensor([[99 % tiny_pair.vocab_size]])))
    assert verdict.target_hidden is not None
    assert verdict.target_hidden.shape == (tiny_pair.target.config.hidden_size,)
    # By value: the hidden state at the position that produced the bonus (the last accepted
    # token, or the last prompt token), which DReSD keys on; an off-by-one row fails here.
    with torch.inference_mode():
        out = tiny_pair.target(input_ids=torch.tensor([[3, 4, 5, *verdict.accepted]]), output_hidden_states=True)
    assert torch.allclose(verdict.target_hidden, out.hidden_states[-1][0, -1].float(), atol=1e-4)
    assert verdict.bonus == int(out.logits[0, -1].argmax())


class CheckedDraftProposer(DraftModelProposer):
    """Asserts each cached proposal equals a draft rollout recomputed from scratch."""

    checks = 0

    def propose(self, state: DecodeState, k: int) -> Proposals:
        out = super().propose(state, k)
        ids = list(state.token_ids)
        ref = []
        for _ in range(out.k):
            nxt = int(full_logits(self.model, ids)[-1].argmax())
            ref.append(nxt)
            ids.append(nxt)
        assert out.tokens[0].tolist() == ref
        assert self.lm.num_cached <= len(state.token_ids) + out.k
        CheckedDraftProposer.checks += 1
        return out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_cache_stays_exact_across_rejections(close_pair, k):
    engine = SpecEngine(close_pair)
    proposer = CheckedDraftProposer(close_pair.draft)
    before = CheckedDraftProposer.checks
    out = plain_generate(engine, [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=30), k=k, proposer=proposer)
    ref = plain_generate(engine, [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=30), method="target")
    assert out.token_ids == ref.token_ids
    assert 0 < out.stats.num_accepted < out.stats.num_drafted  # both acceptances and rejections happened
    assert CheckedDraftProposer.checks - before >= out.stats.num_verify_steps - 1  # the last step may draft 0

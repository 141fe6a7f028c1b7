"""Teacher-forward training: records an external engine (vLLM) served carry no target distribution
(``MissRecord.scored`` is False), so the trainer recomputes it with the target, in batched forwards
equal to the one-at-a-time ones; at the rejected positions they are where the current draft would
be rejected, which are the engine's logged rejections on greedy requests; and a trainer without a
target refuses such records, saying how to start it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.stream_logger import LoggerConfig, RequestMeta, StreamLogger, build_records
from specops.serving.plan import plain_generate
from specops.streams import StreamConfig, codec, open_stream
from specops.streams.consumer import RecordConsumer
from specops.trainer.data import TargetTeacher, draft_predictions, would_be_rejected
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer
from specops.trainer.replay import ReplayConfig
from tests.conftest import random_prompts

N = 12
MAX_NEW = 16


def _serve(pair, n: int, seed: int, *, greedy_only: bool = True):
    """(prompt, result, params) of ``n`` requests our engine served, every rejection collected."""
    engine = SpecEngine(pair, collect_rejections=True)
    out = []
    for i, prompt in enumerate(random_prompts(n, seed=seed, lo=6, hi=14)):
        temperature = 0.0 if greedy_only or i % 2 else 0.8
        params = SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW, seed=i)
        out.append((prompt, plain_generate(engine, prompt, params), params))
    return out


def _log(pair, served, root, *, engine: str) -> StreamConfig:
    """Log the served requests as ``engine`` would: ours with its rejections, an external one with none."""
    cfg = StreamConfig(url=f"local://{root}/log", fsync=False, num_partitions=1)
    logger = StreamLogger(cfg, LoggerConfig(topk=32), vocab_size=pair.vocab_size)
    for i, (prompt, result, params) in enumerate(served):
        if engine:
            result = dataclasses.replace(result, rejections=[])  # vLLM hands out no distributions
        logger.log(prompt, result, params, RequestMeta(f"r{i}", "c", engine=engine))
    logger.close()
    return cfg


def _records(cfg: StreamConfig, n: int):
    with open_stream(cfg) as s:
        return [d.record for d in RecordConsumer(s, f"peek-{n}", [cfg.topics.misses]).poll(max_records=n, timeout_s=5)]


@pytest.fixture(scope="module")
def served(close_pair):
    return _serve(close_pair, N, seed=21)


@pytest.fixture(scope="module")
def unscored(close_pair, served, tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher-forward")
    draft_dir = root / "draft"
    close_pair.draft.save_pretrained(draft_dir, safe_serialization=True)
    return _log(close_pair, served, root, engine="vllm"), draft_dir


def test_external_engine_records_carry_no_positions(close_pair, served, unscored):
    recs = _records(unscored[0], N)
    assert len(recs) == N and all(r.engine == "vllm" and not r.scored and r.num_rejected == 0 for r in recs)
    prompt, result, params = served[0]
    assert result.rejections, "our engine rejected something: the external one logs it not"
    miss, _ = build_records(
        prompt,
        dataclasses.replace(result, rejections=[]),
        params,
        RequestMeta("x", engine="vllm"),
        vocab_size=close_pair.vocab_size,
    )
    assert codec.decode(codec.encode(miss)).engine == "vllm"


def test_batched_teacher_equals_one_at_a_time(close_pair, unscored):
    recs = _records(unscored[0], N)
    assert len({len(r.token_ids) for r in recs}) > 2, "requests of several lengths"
    one = TargetTeacher(close_pair.target, topk=16)
    batched = TargetTeacher(close_pair.target, topk=16, batch_tokens=3 * max(len(r.token_ids) for r in recs))
    assert batched.prefetch(recs) == N and batched.forwards == N and 1 < batched.batches < N
    assert batched.prefetch(recs) == 0  # all cached
    for rec in recs:
        a, b = one(rec), batched(rec)
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=1e-5)
        # the same ids in the same order, except where two neighbours' log-probs tie to float32 noise
        # (a padded batch runs other kernel shapes; the k-th may swap with the next one outside the top-k)
        gaps = a.logprobs[:, :-1] - a.logprobs[:, 1:]
        tie = torch.zeros_like(a.topk_ids, dtype=torch.bool)
        tie[:, :-1] |= gaps < 1e-4
        tie[:, 1:] |= gaps < 1e-4
        tie[:, -1] = True
        assert bool(((b.topk_ids == a.topk_ids) | tie).all())
        assert float((b.topk_ids == a.topk_ids).float().mean()) > 0.9
        torch.testing.assert_close(b.residual, a.residual, atol=1e-5, rtol=1e-5)
    assert batched.forwards == N and one.forwards == N  # the batched teacher answered from its cache


@pytest.mark.parametrize("pair_name", ["close_pair", "served_pair"])
def test_would_be_rejected_positions_are_the_engines_rejections(pair_name, request, tmp_path):
    """On greedy requests the draft's argmax differs from the output exactly at the positions the
    engine rejected, plus the ones it did not draft there (after ``k`` accepted tokens, at the end):
    replaying the engine's step rule on the draft's predictions gives its rejections exactly."""
    from specops.core import draft_vocab
    from specops.serving.proposers.catalogue import DEFAULT_K

    pair = request.getfixturevalue(pair_name)
    vocab = draft_vocab.of(pair.draft)
    served = _serve(pair, 8, seed=33)
    cfg = _log(pair, served, tmp_path, engine="")
    recs = _records(cfg, 8)
    found = engine_total = 0
    for rec, (_, result, _) in zip(recs, served):
        logged = [r.index for r in result.rejections]
        assert rec.positions.tolist() == logged
        where = would_be_rejected(pair.draft, rec, vocab).tolist()
        assert set(logged) <= set(where)
        pred = draft_predictions(pair.draft, rec, vocab).tolist()
        output = rec.token_ids[rec.num_prompt_tokens :].tolist()
        assert _replay(pred, output, DEFAULT_K["draft"], MAX_NEW) == (rec.positions - rec.num_prompt_tokens).tolist()
        found += len(where)
        engine_total += len(logged)
    assert engine_total > 4 and found >= engine_total


def _replay(pred: list[int], output: list[int], k: int, max_new: int) -> list[int]:
    """The engine's greedy step rule (as ``benchmarks/osd.py``'s replay): rejected output indices."""
    n, j, rejected = len(output), 0, []
    while j < n:
        k_step = min(k, max_new - j - 1)
        a = 0
        while a < k_step and j + a < n and pred[j + a] == output[j + a]:
            a += 1
        if a < k_step and j + a < n:
            rejected.append(j + a)
        j += a + 1
    return rejected


@pytest.mark.parametrize("positions", ["all", "rejected"])
def test_unscored_records_train_in_both_recipes(close_pair, unscored, tmp_path, positions):
    cfg, draft_dir = unscored
    ocfg = OnlineConfig(
        interval=4, holdout_every=1000, positions=positions, group=f"tf-{positions}", replay=ReplayConfig("clear")
    )
    trainer = OnlineTrainer(cfg, draft_dir, tmp_path / "out", ocfg, target=close_pair.target)
    assert isinstance(trainer.teacher, TargetTeacher)
    before = copy.deepcopy(trainer.state("c").model.state_dict())
    base = copy.deepcopy(trainer.state("c").model)
    assert trainer.run(max_idle_s=1.0) == N
    st = trainer.clusters["c"]
    teacher = trainer.teacher
    trainer.close()
    recs = _records(cfg, N)
    outputs = sum(len(r.token_ids) - r.num_prompt_tokens for r in recs)
    assert st.version == 3 and any(not torch.equal(before[k], v) for k, v in st.model.state_dict().items())
    assert teacher.forwards == N and teacher.batches == 3  # one batched forward per update, none one at a time
    if positions == "all":
        assert st.positions_trained == outputs
    else:  # the first update's positions are the base draft's would-be rejections
        first = sum(len(would_be_rejected(base, r)) for r in recs[:4])
        history = [line for line in (tmp_path / "out" / "c" / "updates.jsonl").read_text().splitlines() if line]
        assert first > 0 and f'"positions": {first},' in history[0]
        assert 0 < st.positions_trained < outputs


def test_scored_records_train_as_before_with_a_target_given(close_pair, served, tmp_path):
    """A target given to a rejected-position trainer is loaded (for external-engine records) but
    changes nothing for our records: the same weights as without it."""
    cfg = _log(close_pair, served, tmp_path, engine="")
    draft_dir = tmp_path / "draft"
    close_pair.draft.save_pretrained(draft_dir, safe_serialization=True)
    ocfg = dict(interval=4, holdout_every=1000, positions="rejected", replay=ReplayConfig("clear"))
    models = []
    for name, target in (("without", None), ("with", close_pair.target)):
        trainer = OnlineTrainer(
            cfg, draft_dir, tmp_path / name, OnlineConfig(**ocfg, group=f"scored-{name}"), target=target
        )
        trainer.run(max_idle_s=1.0)
        models.append(trainer.clusters["c"].model.state_dict())
        assert (trainer.teacher is not None) == (target is not None) and trainer.clusters["c"].version == 3
        trainer.close()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_unscored_records_without_a_target_are_refused(unscored, tmp_path):
    from specops.streams.records import DeadLetter

    cfg, draft_dir = unscored
    ocfg = OnlineConfig(interval=4, holdout_every=1000, positions="rejected", group="no-target")
    trainer = OnlineTrainer(cfg, draft_dir, tmp_path / "out", ocfg)
    try:
        assert trainer.teacher is None and trainer.run(max_idle_s=1.0) == N
        assert "c" not in trainer.clusters or trainer.clusters["c"].version == 0
        with open_stream(cfg) as stream:
            letters = [codec.decode(m.value) for m in stream.read(cfg.topics.deadletter)]
        assert len(letters) == N and all(isinstance(d, DeadLetter) for d in letters)
        assert all("MissRecord.engine" in d.reason and "specops train --target" in d.reason for d in letters)
    finally:
        trainer.close()

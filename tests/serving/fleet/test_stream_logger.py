"""The serving-side logger: what the records hold, sampling, shedding, and that logging
never changes an output."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.stream_logger import LoggerConfig, RequestMeta, StreamLogger
from specops.serving.plan import plain_generate
from specops.streams import StreamConfig, codec, open_stream
from specops.streams.records import GenerationRecord, MissRecord
from tests.conftest import random_prompts


@pytest.fixture
def stream_cfg(tmp_path) -> StreamConfig:
    return StreamConfig(url=f"local://{tmp_path}/log", fsync=False, num_partitions=2)


def _records(cfg: StreamConfig, topic: str) -> list:
    with open_stream(cfg) as s:
        return [codec.decode(m.value) for m in s.read(topic)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_miss_records_hold_the_targets_distribution_at_each_rejection(close_pair, stream_cfg, temperature):
    logger = StreamLogger(stream_cfg, LoggerConfig(topk=8), vocab_size=close_pair.vocab_size)
    engine = SpecEngine(close_pair, logger=logger)
    results = {}
    for i, prompt in enumerate(random_prompts(6, seed=11)):
        params = SamplingParams(temperature=temperature, max_new_tokens=20, seed=i)
        results[f"r{i}"] = (
            prompt,
            plain_generate(engine, prompt, params, method="draft", meta=RequestMeta(f"r{i}", "code")),
        )
    assert logger.flush(20)
    logger.close()
    misses = _records(stream_cfg, stream_cfg.topics.misses)
    gens = {g.request_id: g for g in _records(stream_cfg, stream_cfg.topics.generations)}
    assert sorted(r.request_id for r in misses) == sorted(results)
    assert sum(r.num_rejected for r in misses) > 0, "the close pair should reject some drafts"
    for rec in misses:
        assert isinstance(rec, MissRecord)
        prompt, res = results[rec.request_id]
        assert rec.token_ids.tolist() == prompt + res.token_ids
        assert rec.num_prompt_tokens == len(prompt)
        assert (rec.num_drafted, rec.num_accepted) == (res.stats.num_drafted, res.stats.num_accepted)
        assert rec.num_rejected == res.stats.num_rejected_steps
        assert rec.sampling.temperature == temperature and rec.cluster == "code" and rec.method == "draft"
        # an independent full forward pass gives the target's distribution everywhere
        with torch.no_grad():
            logits = close_pair.target(torch.tensor([rec.token_ids.tolist()])).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        for i, pos in enumerate(rec.positions.tolist()):
            expect_lp, expect_ids = logp[pos - 1].topk(8)
            np.testing.assert_allclose(rec.logprobs[i], expect_lp.numpy(), atol=1e-4)
            assert set(rec.topk_ids[i].tolist()) == set(expect_ids.tolist())
            assert abs(rec.residual[i] - (1 - expect_lp.exp().sum().item())) < 1e-4
            assert rec.drafted_tokens[i] != rec.token_ids[pos]
        gen = gens[rec.request_id]
        assert isinstance(gen, GenerationRecord)
        assert gen.prompt_ids.tolist() == prompt and gen.output_ids.tolist() == res.token_ids


def test_logging_never_changes_greedy_output(close_pair, stream_cfg):
    prompts = random_prompts(6, seed=5)
    plain = SpecEngine(close_pair)
    logger = StreamLogger(stream_cfg, vocab_size=close_pair.vocab_size)
    logged = SpecEngine(close_pair, logger=logger)
    for p in prompts:
        params = SamplingParams(max_new_tokens=16)
        assert (
            plain_generate(logged, p, params).token_ids == plain_generate(plain, p, params, method="target").token_ids
        )
    logger.close()
    assert logger.stats.published == 2 * len(prompts)


def test_sampling_one_in_n_and_switching_off(close_pair, stream_cfg):
    logger = StreamLogger(stream_cfg, LoggerConfig(sample_every=3), vocab_size=close_pair.vocab_size)
    engine = SpecEngine(close_pair, logger=logger)
    for p in random_prompts(7, seed=2):
        plain_generate(engine, p, SamplingParams(max_new_tokens=4))
    logger.close()
    assert logger.stats.logged_requests == 3 and logger.stats.sampled_out == 4
    assert len(_records(stream_cfg, stream_cfg.topics.misses)) == 3

    off = StreamLogger(stream_cfg, LoggerConfig(enabled=False), vocab_size=close_pair.vocab_size)
    engine = SpecEngine(close_pair, logger=off)
    assert not engine.collect_rejections
    plain_generate(engine, [1, 2, 3], SamplingParams(max_new_tokens=4))
    off.close()
    assert off.stats.logged_requests == 0
    assert len(_records(stream_cfg, stream_cfg.topics.misses)) == 3


class GatedStream:
    """A real local stream whose publishes wait on a gate: a stream that is stuck."""

    def __init__(self, cfg: StreamConfig, gate: threading.Event) -> None:
        self.inner = open_stream(cfg)
        self.gate = gate

    def producer(self):
        inner, gate = self.inner.producer(), self.gate

        class Gated:
            def publish(self, topic, messages):
                gate.wait()
                return inner.publish(topic, messages)

            def close(self):
                inner.close()

        return Gated()

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("shed", ["oldest", "newest"])
def test_full_queue_sheds_by_policy_without_blocking(close_pair, stream_cfg, shed):
    gate = threading.Event()
    cfg = LoggerConfig(queue_size=4, batch_size=2, shed=shed)
    logger = StreamLogger(
        lambda: GatedStream(stream_cfg, gate), cfg, vocab_size=close_pair.vocab_size, topics=stream_cfg.topics
    )
    engine = SpecEngine(close_pair, logger=logger)
    params = SamplingParams(max_new_tokens=4)
    plain_generate(engine, [5, 6, 7], params, meta=RequestMeta("first"))
    assert _wait(lambda: logger.queue_depth == 0)  # the flusher holds "first", stuck at the gate
    for i in range(6):
        plain_generate(engine, [5, 6, 7 + i], params, meta=RequestMeta(f"q{i}"))  # must not block
    assert logger.stats.dropped["queue_full"] == 12 - 4
    gate.set()
    assert logger.flush(20)
    logger.close()
    ids = [r.request_id for r in _records(stream_cfg, stream_cfg.topics.misses)]
    kept = {"oldest": ["q4", "q5"], "newest": ["q0", "q1"]}[shed]
    assert sorted(ids) == sorted(["first", *kept])


def _wait(cond, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False

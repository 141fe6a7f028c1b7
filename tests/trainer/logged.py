"""Serve random prompts through the engine with stream logging: the trainer tests' input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specops.core.models import ModelPair
from specops.serving.engine.grammar import GrammarSpec
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.stream_logger import LoggerConfig, RequestMeta, StreamLogger
from specops.serving.plan import plain_generate
from specops.streams import StreamConfig
from tests.conftest import random_prompts


def log_requests(
    pair: ModelPair,
    root: Path,
    n: int,
    *,
    seed: int,
    cluster_of: Callable[[int], str],
    partitions: int = 2,
    lo: int = 8,
    hi: int = 20,
    max_new_tokens: int = 24,
    greedy_only: bool = False,
    url: str | None = None,
    grammar: GrammarSpec | None = None,
    vocab: int | None = None,
    **stream: object,
) -> tuple[StreamConfig, Path]:
    """Log ``n`` requests (request ``i`` in cluster ``cluster_of(i)``) to ``url`` (default ``local://root/log``).

    Odd requests are greedy, even ones sampled at T=0.8 (all greedy with ``greedy_only``).
    Extra keyword arguments are StreamConfig fields (group timings for Kafka, say).
    ``grammar``: every request decodes under it (JSON mode, say); ``vocab``: prompt ids below it
    (default: the tests' random-model vocabulary). The pair's draft is saved to ``root/draft``.
    Returns (stream config, draft dir).
    """
    draft_dir = root / "draft"
    pair.draft.save_pretrained(draft_dir, safe_serialization=True)
    cfg = StreamConfig(url=url or f"local://{root}/log", fsync=False, num_partitions=partitions, **stream)  # type: ignore[arg-type]
    logger = StreamLogger(cfg, LoggerConfig(topk=32), vocab_size=pair.vocab_size)
    engine = SpecEngine(pair, logger=logger)
    for i, prompt in enumerate(random_prompts(n, seed=seed, lo=lo, hi=hi, **({"vocab": vocab} if vocab else {}))):
        temperature = 0.0 if greedy_only or i % 2 else 0.8
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=i, grammar=grammar)
        plain_generate(engine, prompt, params, meta=RequestMeta(f"r{i}", cluster_of(i)))
    logger.close()
    return cfg, draft_dir

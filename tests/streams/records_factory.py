"""Builds valid records with realistic shapes for the stream tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from specops.streams.records import DIST_FULL, DIST_TOPK, GenerationRecord, MissRecord, ModelEvent, SamplingInfo


def miss_record(
    seed: int = 0,
    *,
    cluster: str = "code",
    vocab: int = 512,
    n: int = 60,
    m: int = 6,
    k: int = 16,
    kind: str = DIST_TOPK,
    dtype=np.float32,
    request_id: str | None = None,
) -> MissRecord:
    rng = np.random.default_rng(seed)
    num_prompt = 20
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    positions = np.sort(rng.choice(np.arange(num_prompt, n), m, replace=False)).astype(np.int32)
    drafted = ((tokens[positions] + 1 + rng.integers(0, vocab - 1, m)) % vocab).astype(np.int32)
    drafted = np.where(drafted == tokens[positions], (drafted + 1) % vocab, drafted).astype(np.int32)
    logits = rng.normal(size=(m, vocab)) * 3
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    if kind == DIST_FULL:
        logprobs, ids, residual = logp.astype(dtype), None, None
    else:
        ids = np.argsort(-logp, axis=1)[:, :k].astype(np.int32)
        logprobs = np.take_along_axis(logp, ids, axis=1).astype(dtype)
        residual = np.clip(1 - np.exp(logprobs.astype(np.float64)).sum(axis=1), 0, 1).astype(np.float32)
    return MissRecord(
        request_id=request_id or f"req-{seed}",
        cluster=cluster,
        method="draft",
        draft_model=f"draft-{cluster}",
        draft_version="3",
        sampling=SamplingInfo(0.7, 0.9, 40, seed),
        token_ids=tokens,
        num_prompt_tokens=num_prompt,
        vocab_size=vocab,
        positions=positions,
        drafted_tokens=drafted,
        dist_kind=kind,
        logprobs=logprobs,
        topk_ids=ids,
        residual=residual,
        num_drafted=3 * m + 4,
        num_accepted=2 * m + 4,
        timestamp=1_790_000_000.5,
    )


def generation_record(seed: int = 0, cluster: str = "code", vocab: int = 512) -> GenerationRecord:
    rng = np.random.default_rng(seed)
    return GenerationRecord(
        request_id=f"req-{seed}",
        cluster=cluster,
        method="draft",
        draft_model=f"draft-{cluster}",
        draft_version="3",
        prompt_ids=rng.integers(0, vocab, 12).astype(np.int32),
        output_ids=rng.integers(0, vocab, 30).astype(np.int32),
        vocab_size=vocab,
        finish_reason="length",
        timestamp=1_790_000_001.0,
    )


def model_event() -> ModelEvent:
    return ModelEvent(
        kind="promotion", model_name="draft-code", version="4", previous_version="3", reason="gate +0.031"
    )


def assert_same_record(a, b) -> None:
    """Field by field equality; arrays must match in dtype, shape and every byte."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f.name
        else:
            assert x == y, f.name

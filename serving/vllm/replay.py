"""Per-request speculation counts of a vLLM request: vLLM's own, else recomputed in the front door.

vLLM 0.32 reports them per request when started with ``--per-request-spec-decode-metrics
detailed`` (``specops.serving.vllm.process`` does): the final usage chunk of a streamed response
carries the tokens drafted and accepted at each verify step (:func:`from_vllm`). A stream the
front door closes early (a stop sequence matched, the client went away) gets no final chunk,
so for those the counts are recomputed from the request's prompt and returned token ids; vLLM's
proposers are deterministic given the context (``tests/serving/vllm`` checks the recomputation
against vLLM's own counts):

- **n-gram** (:func:`ngram_draft`): vLLM's prompt lookup, the longest trailing n-gram of
  the context (``prompt_lookup_max`` down to ``prompt_lookup_min``) that occurred earlier,
  ties to its earliest occurrence, the tokens after it (our implementation of the rule of
  ``vllm/v1/spec_decode/ngram_proposer.py``; ``tests/serving/vllm`` checks it against the
  server's own counters);
- **copy** (``plugin.specops_vllm_copy.propose_copy``): the very function vLLM runs;
- **draft model**: vLLM drafts greedily (``draft_sample_method = "greedy"``), a chain of k
  argmaxes. Until its first mismatch a chain's context is the output's own prefix, so one
  teacher-forced forward of the draft over prompt + output gives every proposal that can be
  accepted (:func:`draft_argmax`).

The verification: a drafted token is accepted exactly when the output token at its position
equals it (greedy: the target's argmax; sampling: vLLM's rejection sampler with one-hot
drafts resamples from ``max(0, p - q)``, which is zero at the drafted token). So the step
structure follows from the output alone (:func:`replay`): the prefill emits the first token,
then every step drafts from the context so far, accepts the matching prefix and emits one
more. A draft that runs past the request's end is compared as far as the output goes.

Under greedy decoding this is what vLLM did, exactly (up to the draft's float ties between
vLLM's kernels and torch's). The per-token α that follows (``engine.types.token_alpha``)
is the one our engine reports, so responses, metrics, the report and auto-rollback read the
same quantity on both engines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Replayed:
    """One request's speculation, step by step (after the prefill's token)."""

    drafted: int = 0
    """Tokens drafted and compared against the output."""
    accepted: int = 0
    rejected_steps: int = 0
    """Steps whose draft had a token the output did not."""
    steps: int = 0
    """Decode steps after the prefill (target passes − 1)."""


def from_vllm(metrics: dict | None) -> Replayed | None:
    """vLLM's own per-request counts (``metrics.speculative_decoding`` with
    ``--per-request-spec-decode-metrics detailed``): one entry per verify step of the tokens
    drafted and accepted; None when absent or malformed."""
    if not isinstance(metrics, dict):
        return None
    acc, drafted = metrics.get("per_step_accepted"), metrics.get("per_step_drafted")
    if not isinstance(acc, list) or not isinstance(drafted, list) or len(acc) != len(drafted):
        return None
    try:
        pairs = [(int(a), int(d)) for a, d in zip(acc, drafted)]
    except (TypeError, ValueError):
        return None
    if any(a < 0 or d < 0 or a > d for a, d in pairs):
        return None
    return Replayed(
        drafted=sum(d for _, d in pairs),
        accepted=sum(a for a, _ in pairs),
        rejected_steps=sum(1 for a, d in pairs if a < d),
        steps=len(pairs),
    )


def ngram_draft(context: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """vLLM's n-gram proposal for ``context``: for the longest ``n`` in ``[min_n, max_n]`` whose
    trailing n-gram occurs earlier (an occurrence that starts before the last token), the
    earliest such occurrence, and the ``k`` tokens after it (fewer at the context's end)."""
    total = int(context.size)
    if total < min_n or k <= 0:
        return context[:0]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = context[total - n :]
        # windows starting at s <= total - 1 - n: they end before the trailing n-gram's last token
        windows = np.lib.stride_tricks.sliding_window_view(context[: total - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return context[start : start + min(k, total - start)]
    return context[:0]


def draft_argmax(model: torch.nn.Module, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
    """``[len(output)]``: the draft's greedy next token (its full vocabulary, as vLLM runs it)
    before each output position, given the true prefix."""
    if not output:
        return np.zeros(0, dtype=np.int64)
    ids = torch.tensor([[*prompt, *output[:-1]]], dtype=torch.long)
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=ids.to(device)).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).to("cpu", torch.long).numpy()


def replay(
    prompt: Sequence[int],
    output: Sequence[int],
    propose: Callable[[np.ndarray, int], Sequence[int]],
    k: int,
) -> Replayed:
    """Step through a finished request: ``propose(context, pos)`` is the draft made with
    ``context`` (prompt + the first ``pos`` output tokens)."""
    out = np.asarray(list(output), dtype=np.int64)
    ctx = np.asarray([*prompt, *out.tolist()], dtype=np.int64)
    p = len(prompt)
    drafted = accepted = rejected = steps = 0
    pos = 1  # the prefill emitted output[0]
    while pos < out.size:
        draft = np.asarray(list(propose(ctx[: p + pos], pos))[:k], dtype=np.int64)
        seen = out[pos : pos + draft.size]
        draft = draft[: seen.size]  # past the request's end nothing was compared
        match = int(np.argmin(draft == seen)) if draft.size and not (draft == seen).all() else int(draft.size)
        drafted += int(draft.size)
        accepted += match
        if match < draft.size:
            rejected += 1
        steps += 1
        pos += match + 1
    return Replayed(drafted, accepted, rejected, steps)


def replay_draft(model: torch.nn.Module, prompt: Sequence[int], output: Sequence[int], k: int) -> Replayed:
    """:func:`replay` of vLLM's draft-model speculation (one forward of the draft)."""
    guess = draft_argmax(model, prompt, output)
    return replay(prompt, output, lambda _ctx, pos: guess[pos : pos + k], k)


def replay_ngram(prompt: Sequence[int], output: Sequence[int], k: int, min_n: int, max_n: int) -> Replayed:
    return replay(prompt, output, lambda ctx, _pos: ngram_draft(ctx, k, min_n, max_n), k)


def replay_copy(
    prompt: Sequence[int], output: Sequence[int], k: int, refs: Sequence[Sequence[int]], min_n: int = 1
) -> Replayed:
    from specops.serving.vllm.plugin.specops_vllm_copy import propose_copy

    arrays = [np.asarray(list(r), dtype=np.int64) for r in refs if len(r)]
    return replay(prompt, output, lambda ctx, _pos: propose_copy(ctx, arrays, k, min_n), k)

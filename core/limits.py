"""The one definition of a model's context size and the one check of a request's prompt.

The engine (``SpecEngine``, ``CachedLM``) and the HTTP replica (``ServingState.prepare``)
both call these, so a limit is enforced once and stated the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from specops.core.errors import InvalidRequestError, PromptTooLongError

UNBOUNDED = 1 << 30
"""The context size of a model whose config states none."""


def context_size(model_config) -> int:
    """Tokens a model can attend over: its ``max_position_embeddings``."""
    return int(getattr(model_config, "max_position_embeddings", UNBOUNDED) or UNBOUNDED)


def check_k(k: object) -> None:
    """Tokens drafted per step must be a positive integer."""
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise InvalidRequestError(f"k (tokens drafted per step) must be an integer >= 1, got {k!r}", "speculation.k")


def check_prompt(
    ids: Sequence[int], *, vocab_size: int, context: int, limit: int | None = None, field: str = "prompt"
) -> None:
    """Raise the caller's error unless ``ids`` is a non-empty prompt of in-vocabulary tokens
    that leaves room in a ``context``-token model for at least one new token.

    ``limit`` is a server-side cap on prompt tokens (``max_prompt_tokens``): with it, the
    message states ``min(limit, context - 1)``, the one bound enforced. ``field`` is what the
    caller sent (``messages`` for a chat, whose rendered text is the prompt): the error names it.
    """
    what = "prompt" if field == "prompt" else f"{field} (rendered)"
    if not ids:
        raise InvalidRequestError(f"{what} is empty: give at least one token", field)
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise InvalidRequestError(f"{what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", field)
    if limit is not None:
        limit = min(limit, context - 1)  # the one limit enforced, and the one stated
        if len(ids) > limit:
            raise PromptTooLongError(f"{what} has {len(ids)} tokens; the limit is {limit}: shorten it", field)
    if len(ids) >= context:
        raise PromptTooLongError(
            f"{what} has {len(ids)} tokens but the model context is {context}; "
            f"shorten it to at most {context - 1} tokens",
            field,
        )

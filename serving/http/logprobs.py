"""Log-probabilities in OpenAI's two response shapes.

The engine gives one :class:`~specops.serving.engine.types.TokenLogprob` per output token (the target's,
from the verification pass that emitted it: ``specops.serving.engine.sampling.token_logprobs``). Here
they become text: each token as the tokenizer decodes it alone (vLLM's choice; a token that is
part of a multi-byte character decodes to U+FFFD, and ``bytes`` in the chat shape gives the
UTF-8 of that text), then

- ``/v1/completions`` (``logprobs: N``): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, ``top_logprobs`` a list of ``{token text: logprob}`` of the N most probable
  tokens at each position (None when N is 0), ``text_offset`` each token's character offset in
  the choice's text;
- ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs: N``): ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}``.

Only the tokens behind the text the client gets are reported: output cut by a stop sequence
reports the tokens up to the one the stop sequence starts in, as vLLM does. With ``echo``
(completions) the prompt's tokens come first, the first one's ``token_logprobs`` and
``top_logprobs`` entries null (nothing predicts it), as OpenAI's and vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

from specops.serving.engine.types import TokenLogprob


@dataclass(frozen=True)
class Entry:
    """One reported token: its text, logprob and alternatives as (text, logprob)."""

    text: str
    logprob: float | None
    """None for a prompt's first token (``echo``): nothing predicts it."""
    top: tuple[tuple[str, float], ...]


def entries(tokenizer, logprobs: list[TokenLogprob]) -> list[Entry]:
    """``logprobs`` as text (each token decoded alone, special tokens as their names)."""
    cache: dict[int, str] = {}

    def text(t: int) -> str:
        if t not in cache:
            cache[t] = tokenizer.decode([t])
        return cache[t]

    return [Entry(text(x.token), x.logprob, tuple((text(t), v) for t, v in x.top)) for x in logprobs]


def covered(tokenizer, ids: list[int], chars: int) -> int:
    """How many of ``ids`` the first ``chars`` characters of their text hold: the tokens up to and
    including the one in which character ``chars - 1`` lies (all when the text is that long)."""
    if chars <= 0:
        return 0
    lo, hi = 1, len(ids)  # the least n whose text reaches `chars` characters
    if len(tokenizer.decode(ids, skip_special_tokens=True)) <= chars:
        return len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def completion_shape(items: list[Entry], *, top: int, offset: int = 0) -> dict:
    """The completions shape; ``offset``: the text's character offset of the first token."""
    offsets, at = [], offset
    for e in items:
        offsets.append(at)
        at += len(e.text)
    return {
        "tokens": [e.text for e in items],
        "token_logprobs": [e.logprob for e in items],
        "top_logprobs": [None if e.logprob is None else dict(e.top) for e in items] if top else None,
        "text_offset": offsets,
    }


def chat_shape(items: list[Entry]) -> dict:
    """The chat shape (``refusal``: none, a model here never refuses by a separate channel)."""

    def one(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**one(e.text, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in items],
        "refusal": None,
    }

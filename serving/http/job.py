"""One admitted request as the client gets it: its :class:`Job` (the plan, streaming callbacks, the
text and tokens handed out so far) and what decides which of its tokens go out: stop sequences
(:func:`find_stop`, :func:`held_back`) and the log-probabilities behind the text sent
(:func:`delta_logprobs`, :func:`prompt_logprobs`). ``specops.serving.http.server`` runs jobs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specops.serving.engine.prefix import SharedPrefix
from specops.serving.engine.types import TokenLogprob
from specops.serving.http import logprobs as logprobs_fmt
from specops.serving.http.tools import ToolFormat, tool_calls
from specops.serving.plan import DecodePlan
from specops.streams.records import CHOICE_SEPARATOR


class ClientGone(Exception):
    """The streaming client disconnected: stop decoding (nothing is logged)."""


@dataclass
class Job:
    """One admitted request, from its plan to the response: what streaming and cancelling need."""

    plan: DecodePlan
    token_ids: bool = False
    """The response carries the prompt's and the output's token ids (``return_token_ids``)."""
    on_delta: Callable[[str, list[TokenLogprob] | None], None] | None = None
    """Streaming: each new piece of text, with the log-probabilities of the tokens it completes
    (None unless the request asked for them)."""
    on_emit: Callable[[], None] | None = None
    """Called on the decode thread after each step that emitted tokens (the API times non-streamed requests by it)."""
    created: int = field(default_factory=lambda: int(time.time()))
    cancel: threading.Event = field(default_factory=threading.Event)
    # filled in by run()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per ``output_ids`` token, when the request asked for log-probabilities."""
    text: str = ""
    sent: int = 0
    """Characters of ``text`` already handed to ``on_delta``."""
    sent_tokens: int = 0
    """Tokens whose log-probabilities went out with ``on_delta`` (streaming with logprobs)."""
    index: int = 0
    """Which of the request's choices this is (``n``, ``best_of``)."""
    report_logprobs: bool = False
    """The response carries the log-probabilities (the request asked; ``best_of`` computes them anyway, to rank)."""
    echo: bool = False
    """Completions' ``echo``: the prompt (and its log-probabilities) goes before the output."""
    score_only: bool = False
    """``echo`` with ``max_tokens: 0``: the prompt is scored and nothing generated (the decode stops
    after its first step, whose token is dropped)."""
    echoed: bool = False
    """The prompt went out with ``on_delta`` (streaming with ``echo``)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """The prompt tokens' log-probabilities (``echo`` with ``logprobs``), the first one's None."""
    stopped: bool = False
    abandoned: bool = False
    """The API answered with the request timeout while a step had not returned (``ServingState.abandon``)."""
    shut_down: bool = False
    """Still decoding when the server closed the replica (``ServingState.close``)."""
    tools: ToolFormat | None = None
    """Chat with tools that may be called: the format calls are parsed in (their text is held back)."""
    parallel_tools: bool = True
    """``parallel_tool_calls``: more than one call may be returned."""
    tool_calls: list[dict] = field(default_factory=list)
    """The calls parsed out of the output (OpenAI's ``message.tool_calls``)."""

    @property
    def request_id(self) -> str:
        """The id in the logged records and the server's log (``DecodePlan.request_id``)."""
        return self.plan.request_id

    @property
    def public_id(self) -> str:
        """The id the client sees (the response's ``id`` and ``X-Request-Id``): its own, when it sent one."""
        return self.plan.client_request_id or self.plan.request_id


def prompt_logprobs(job: Job, context: list[TokenLogprob], context_len: int) -> list[TokenLogprob] | None:
    """The prompt's entries of the context's log-probabilities (one per context token after the
    first: the prompt is the context's last tokens, after any retrieved passages); None when
    the request did not ask for log-probabilities."""
    if job.plan.params.prompt_logprobs is None:
        return None
    prompt = list(job.plan.prompt_ids)
    start = context_len - len(prompt)
    return [context[j - 1] if j >= 1 else TokenLogprob(prompt[0], None) for j in range(start, context_len)]


def delta_logprobs(job: Job, tokenizer, *, whole: bool) -> list[TokenLogprob] | None:
    """The log-probabilities of the tokens behind ``job.text`` not sent yet (``whole``: the text
    holds all the output so far, nothing held back or cut), or None when none were asked for."""
    if job.plan.params.logprobs is None:
        return None
    n = len(job.output_ids) if whole else logprobs_fmt.covered(tokenizer, job.output_ids, len(job.text))
    n = min(n, len(job.logprobs))
    out = job.logprobs[job.sent_tokens : n]
    job.sent_tokens = max(job.sent_tokens, n)
    return out


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop sequence starts in ``text``, if any."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` not to stream yet: an incomplete UTF-8 character
    (decoded as U+FFFD) or a prefix of a stop sequence that the next tokens may complete."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


def choice_plan(plan: DecodePlan, index: int, *, rank: bool = False, prefix: SharedPrefix | None = None) -> DecodePlan:
    """Choice ``index`` of a request (``n``, ``best_of``): the plan with the seed ``seed + index``
    (vLLM's rule: a seeded request's choices are reproducible and differ), a request id of its
    own (``<id>#<index>``, the trainer's held-out split keeps a request's choices together), and
    with ``rank`` log-probabilities computed (``best_of`` ranks the choices by them); with ``prefix``,
    choice 0 prefills the prompt and the others load its keys and values (``specops.serving.engine.prefix``)."""
    params = plan.params
    changes: dict = {}
    if prefix is not None:
        plan = replace(plan, prefix_share=prefix.handle(lead=not index))
    if index and params.seed is not None:
        changes["seed"] = (params.seed + index) % (1 << 64)
    if rank and params.logprobs is None:
        changes["logprobs"] = 0
    if not index and not changes:
        return plan
    rid = f"{plan.request_id}{CHOICE_SEPARATOR}{index}" if index else plan.request_id
    return replace(plan, params=replace(params, **changes), request_id=rid)


def send_echo(job: Job, tokenizer) -> None:
    """Streaming with ``echo``: the prompt (and its log-probabilities) goes out once, before the output."""
    if job.echo and not job.echoed and job.on_delta is not None:
        job.on_delta(job.plan.prompt_text or tokenizer.decode(list(job.plan.prompt_ids)), job.prompt_logprobs)
        job.echoed = True


def streamable(job: Job, text: str, stops: list[str]) -> str:
    """The part of ``text`` (no stop sequence in it) that may go out now: without an incomplete
    character or a stop sequence's prefix at the end, and, with tools, before the first call (a
    call goes out parsed, at the end)."""
    marks = [*stops, job.tools.OPEN] if job.tools is not None and job.tools.OPEN else stops
    if job.tools is not None and (at := job.tools.call_start(text)) >= 0:
        return text[:at]
    return text[: len(text) - held_back(text, marks)]


def split_tools(job: Job, text: str) -> str:
    """The content of a finished output with tools (``job.tool_calls`` set from its calls; the
    first alone without ``parallel_tool_calls``); ``text`` itself otherwise."""
    if job.tools is None:
        return text
    content, calls = job.tools.parse(text)
    job.tool_calls = tool_calls(calls if job.parallel_tools else calls[:1])
    return content

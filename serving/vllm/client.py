"""One request to a vLLM server, as token ids in and token ids out, streamed.

The front door has already tokenized the prompt (with the chat template for chat requests),
so it sends vLLM the token ids (``"prompt": [ids]``) and asks for the generated ids back
(``"return_token_ids": true``): the output is then the exact token sequence the target
produced, which the stream records need, and the text is detokenized here exactly as our
own engine's output is. ``stream`` is always on towards vLLM: the front door hands each
chunk's tokens on as they come (and stops reading, which aborts the request in vLLM, when a
stop sequence matched or the client went away).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import urllib3

from specops.serving.engine.grammar import JSON_LAYOUT
from specops.serving.engine.sampling import LOGPROB_FLOOR
from specops.serving.engine.types import TokenLogprob
from specops.serving.vllm.process import VLLMError

FINISH = {"stop": "eos", "length": "length", "abort": "length"}
"""vLLM's finish reasons as our engine names them (``specops.serving.engine.types``)."""


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    """Our engine's name for why it ended (``eos``, ``length``), on the last chunk only."""
    speculation: dict | None = None
    """vLLM's per-request speculative-decoding counts (``metrics.speculative_decoding`` of the final
    usage chunk, with ``--per-request-spec-decode-metrics detailed``): ``per_step_accepted`` and
    ``per_step_drafted``, one entry per verify step."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per ``token_ids`` token when the request asked for them (``request_body(logprobs=N)``)."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """With ``echo`` (the request's ``prompt_logprobs``), on the first chunk only: one per prompt token
    after the first, as our engine's ``GenerationResult.prompt_logprobs``."""


def structured_outputs(spec) -> dict:
    """vLLM's ``structured_outputs`` for a ``specops.serving.engine.grammar.GrammarSpec``: JSON with our layout
    (``JSON_LAYOUT`` in the schema's ``x-guidance``, which the server's llguidance backend reads), so
    the grammar, and with it the output, is the one our engine decodes under."""
    if spec.kind in ("json_object", "json_schema"):
        schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
        return {"json": schema}
    if spec.kind == "choice":
        return {"choice": json.loads(spec.source)}
    return {spec.kind: spec.source}  # regex, grammar (Lark)


def request_body(
    prompt_ids: list[int],
    *,
    model: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    eos_ids: tuple[int, ...] = (),
    top_k: int = 0,
    min_p: float = 0.0,
    logprobs: int | None = None,
    adjust=None,
) -> dict:
    """The completion request vLLM's OpenAI server takes; ``top_k`` and ``min_p`` (vLLM's own
    parameters, ``specops.serving.engine.types.SamplingParams``) go only when on (0: off); ``logprobs``
    (N alternatives) asks for each token's log-probability, its tokens named by id
    (``return_tokens_as_token_ids``: ``"token_id:123"``) so they map back to ids exactly;
    ``adjust`` (the request's ``SamplingParams``) carries its penalties, ``logit_bias``,
    ``min_tokens`` and ``ignore_eos`` in vLLM's own fields."""
    body = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": int(max_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "stream": True,
        # the final usage chunk carries vLLM's per-request speculation counts (process.py turns them on)
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    if top_k > 0:
        body["top_k"] = int(top_k)
    if min_p > 0.0:
        body["min_p"] = float(min_p)
    if seed is not None:
        body["seed"] = int(seed)
    if adjust is not None and adjust.ignore_eos:  # runs to max_tokens: vLLM's own flag, no stop ids
        body["ignore_eos"] = True
    elif eos_ids:
        body["stop_token_ids"] = list(eos_ids)
    if adjust is not None:  # ``specops.serving.engine.types.SamplingParams``' penalties and biases, vLLM's names
        if adjust.presence_penalty:
            body["presence_penalty"] = float(adjust.presence_penalty)
        if adjust.frequency_penalty:
            body["frequency_penalty"] = float(adjust.frequency_penalty)
        if adjust.repetition_penalty != 1.0:
            body["repetition_penalty"] = float(adjust.repetition_penalty)
        if adjust.logit_bias:
            body["logit_bias"] = {str(t): float(b) for t, b in adjust.logit_bias}
        if adjust.min_tokens:
            body["min_tokens"] = int(adjust.min_tokens)
        if adjust.grammar is not None:
            body["structured_outputs"] = structured_outputs(adjust.grammar)
    if adjust is not None and adjust.prompt_logprobs is not None:  # scoring the prompt: vLLM's echo with logprobs
        body["echo"] = True
        logprobs = max(int(logprobs or 0), int(adjust.prompt_logprobs))  # vLLM: one N for the prompt and output
    if logprobs is not None:
        body["logprobs"] = int(logprobs)
        body["return_tokens_as_token_ids"] = True
    return body


def _token_id(name: str) -> int:
    """``"token_id:123"`` (``return_tokens_as_token_ids``) -> 123."""
    if not isinstance(name, str) or not name.startswith("token_id:"):
        raise ValueError(f"a logprobs token that is not named by id: {name!r}")
    return int(name[len("token_id:") :])


def parse_logprobs(raw: dict, n_tokens: int, top: int) -> tuple[TokenLogprob, ...]:
    """A completion chunk's ``logprobs`` block as one :class:`TokenLogprob` per token: vLLM's
    ``top_logprobs`` holds the ``top`` most probable tokens and the chosen one when it is not
    among them; the alternatives kept are the ``top`` most probable, as our engine's."""
    names, values = raw.get("tokens") or [], raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or [None] * len(names)
    if not (len(names) == len(values) == len(tops) == n_tokens):
        raise ValueError(f"logprobs for {len(names)} tokens in a chunk of {n_tokens}")
    out = []
    for name, value, alts in zip(names, values, tops, strict=True):
        if value is None:  # an echoed prompt's first token: nothing predicts it
            out.append(TokenLogprob(_token_id(name), None, ()))
            continue
        ranked = sorted(((_token_id(k), float(v)) for k, v in (alts or {}).items()), key=lambda a: -a[1])
        out.append(TokenLogprob(_token_id(name), max(float(value), LOGPROB_FLOOR), tuple(ranked[:top])))
    return tuple(out)


def stream_completion(http: urllib3.PoolManager, url: str, body: dict, *, timeout_s: float) -> Iterator[Chunk]:
    """POST ``body`` to ``url``/v1/completions and yield each chunk's new token ids.

    Closing the generator (the caller stops early) closes the connection: vLLM aborts the
    request. A refused request, a dropped connection or a malformed chunk raises :class:`VLLMError`."""
    try:
        resp = http.request(
            "POST",
            url + "/v1/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
            preload_content=False,
            timeout=urllib3.Timeout(connect=5.0, read=timeout_s),
            retries=False,
        )
    except urllib3.exceptions.HTTPError as exc:
        raise VLLMError(f"vLLM at {url} is unreachable: {exc}") from exc
    try:
        if resp.status != 200:
            raise VLLMError(f"vLLM at {url} answered {resp.status}: {resp.read(2000).decode(errors='replace')}")
        finished = False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            try:
                event = json.loads(data)
                if event.get("choices") == [] and "usage" in event:  # the final usage chunk
                    spec = (event.get("metrics") or {}).get("speculative_decoding")
                    yield Chunk((), None, spec if isinstance(spec, dict) else None)
                    continue
                choice = event["choices"][0]
                ids = tuple(int(t) for t in (choice.get("token_ids") or ()))
                lps = prompt_lps = None
                if "logprobs" in body:
                    # echo: the first chunk's logprobs cover the prompt (named in prompt_token_ids), then its tokens
                    n_prompt = len(choice.get("prompt_token_ids") or ()) if body.get("echo") else 0
                    lps = parse_logprobs(choice.get("logprobs") or {}, n_prompt + len(ids), int(body["logprobs"]))
                    if n_prompt:
                        prompt_lps, lps = lps[1:n_prompt], lps[n_prompt:]
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
                raise VLLMError(f"vLLM at {url} sent a chunk that is not a completion: {data[:200]!r}") from exc
            reason = choice.get("finish_reason")
            if reason is not None:
                finished = True
            finish = FINISH.get(reason, "length") if reason is not None else None
            yield Chunk(ids, finish, logprobs=lps, prompt_logprobs=prompt_lps)
        if not finished:
            raise VLLMError(f"vLLM at {url} ended the stream without a finish reason")
    except urllib3.exceptions.HTTPError as exc:
        raise VLLMError(f"vLLM at {url} dropped the stream: {exc}") from exc
    finally:
        resp.release_conn() if resp.status == 200 and getattr(resp, "_fp", None) is None else resp.close()

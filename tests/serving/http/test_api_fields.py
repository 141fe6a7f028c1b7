"""The request fields common clients send: accepted and ignored (and named), honoured (``top_k``,
``min_p``), or refused with a 400 naming them; a typo is still refused.

One real server over the tiny bootstrapped models for the module.
"""

from __future__ import annotations

import json
import logging

import pytest
import requests

from specops.serving.http.schema import IGNORED_FIELDS, IGNORED_HEADER
from tests.serving.http.api_support import MODEL, assert_error, running, serve_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models), tmp_path_factory.mktemp("fields")) as srv:
        yield srv


def _post(srv, path: str, **body) -> requests.Response:
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    base |= {"messages": MESSAGES} if path == CHAT else {"prompt": "def foo(x):"}
    return requests.post(srv.url + path, json=base | body, timeout=120)


def _text(resp: requests.Response) -> str:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _streamed(resp: requests.Response) -> tuple[str, list[dict]]:
    assert resp.status_code == 200, resp.text
    events = [json.loads(line.removeprefix(b"data: ")) for line in resp.iter_lines() if line and b"[DONE]" not in line]
    text = "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e["choices"])
    return text, events


COMMON = {
    "store": False,
    "metadata": {"team": "search", "trace": "abc-123"},
    "service_tier": "auto",
    "user": "user-42",
    "parallel_tool_calls": True,
}


def test_fields_that_do_not_change_the_output_are_accepted_and_named(server, caplog):
    caplog.set_level(logging.INFO, logger="specops.serving.http.server")
    plain = _post(server, CHAT)
    assert IGNORED_HEADER not in plain.headers  # nothing ignored, no header
    r = _post(server, CHAT, **COMMON)
    assert _text(r) == _text(plain)
    assert r.headers[IGNORED_HEADER] == "user,store,metadata,service_tier,parallel_tool_calls"
    rid = r.headers["X-Request-Id"]
    line = next(rec.getMessage() for rec in caplog.records if rid in rec.getMessage())
    assert "user, store, metadata, service_tier, parallel_tool_calls" in line
    # streamed, with vLLM's and OpenAI's stream options (usage still comes once, in the last chunk)
    options = {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}
    with requests.post(
        server.url + CHAT,
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "store": True}
        | {"stream": True, "stream_options": options},
        stream=True,
        timeout=120,
    ) as s:
        text, events = _streamed(s)
        assert s.headers[IGNORED_HEADER] == (
            "store,stream_options.continuous_usage_stats,stream_options.include_obfuscation"
        )
    assert text == _text(plain)
    assert events[-1]["usage"]["completion_tokens"] == 6 and events[-1]["choices"] == []
    # completions take the same, but parallel_tool_calls (no tools there) is a field it does not know
    done = _post(server, COMPLETIONS, store=True, metadata={"k": "v"}, service_tier="default")
    assert done.status_code == 200 and done.headers[IGNORED_HEADER] == "store,metadata,service_tier"
    assert_error(_post(server, COMPLETIONS, parallel_tool_calls=False), 400, "invalid_request", "parallel_tool_calls")
    assert set(IGNORED_FIELDS) == {*COMMON, *(f"stream_options.{k}" for k in options if k != "include_usage")}


@pytest.mark.parametrize(
    "path, body, code, param",
    [
        (COMPLETIONS, {"n": 17}, "invalid_request", "n"),
        (CHAT, {"best_of": 2}, "invalid_request", "best_of"),  # a completions field only
        (CHAT, {"top_logprobs": 3}, "unsupported_parameter", "top_logprobs"),  # without logprobs: true
        (CHAT, {"tool_choice": "auto"}, "unsupported_parameter", "tool_choice"),
        (CHAT, {"functions": [{"name": "f"}]}, "unsupported_parameter", "functions"),
        (CHAT, {"function_call": "auto"}, "unsupported_parameter", "function_call"),
        (CHAT, {"logit_bias": {"x": 1.0}}, "invalid_request", "logit_bias"),
        (CHAT, {"logit_bias": {"999999": 1.0}}, "invalid_request", "logit_bias"),
        (CHAT, {"logit_bias": {"5": 101.0}}, "invalid_request", "logit_bias.5"),
        (CHAT, {"presence_penalty": 2.5}, "invalid_request", "presence_penalty"),
        (CHAT, {"repetition_penalty": 0}, "invalid_request", "repetition_penalty"),
        (CHAT, {"min_tokens": 7, "max_tokens": 6}, "invalid_request", "min_tokens"),
        (COMPLETIONS, {"presence_penalty": 0.5, "knnlm": {"datastore": "x"}}, "invalid_request", "presence_penalty"),
        (COMPLETIONS, {"top_k": -2}, "invalid_request", "top_k"),
        (COMPLETIONS, {"top_k": 2.5}, "invalid_request", "top_k"),
        (CHAT, {"min_p": 1.5}, "invalid_request", "min_p"),
        (CHAT, {"min_p": -0.1}, "invalid_request", "min_p"),
        (CHAT, {"service_tier": "fastest"}, "invalid_request", "service_tier"),
        (CHAT, {"store": "yes"}, "invalid_request", "store"),
        (CHAT, {"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_request", "metadata"),
        (CHAT, {"metadata": {"k": 1}}, "invalid_request", "metadata.k"),
        (CHAT, {"temprature": 0.5}, "invalid_request", "temprature"),  # a typo is never ignored
        (
            CHAT,
            {"stream": True, "stream_options": {"continuous_usage": 1}},
            "invalid_request",
            "stream_options.continuous_usage",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, path, body, code, param):
    r = _post(server, path, **body)
    err = assert_error(r, 400, code, param)
    assert IGNORED_HEADER not in r.headers
    if code == "invalid_request" and param in ("temprature", "stream_options.continuous_usage"):
        assert err["message"] == f"unrecognized request argument: {param}"


def test_top_k_and_min_p_are_honoured(server):
    """A filter that keeps one token samples the greedy output; vLLM's "off" values change nothing."""
    greedy = _text(_post(server, COMPLETIONS, max_tokens=12))
    differs = 0
    for seed in range(3):
        sampled = dict(
            max_tokens=12, temperature=1.5, seed=seed, speculation={"method": "draft"}
        )  # (auto: not reproducible)
        assert _text(_post(server, COMPLETIONS, top_k=1, **sampled)) == greedy
        assert _text(_post(server, CHAT, min_p=1.0, **sampled)) == _text(_post(server, CHAT, max_tokens=12))
        free = _text(_post(server, COMPLETIONS, **sampled))
        differs += free != greedy
        assert _text(_post(server, COMPLETIONS, top_k=-1, min_p=0, **sampled)) == free
        assert _text(_post(server, COMPLETIONS, top_k=0, **sampled)) == free
        assert _text(_post(server, COMPLETIONS, top_k=10**6, **sampled)) == free  # past the vocabulary: off
    assert differs  # at this temperature, unfiltered sampling is not greedy: the filters did the work

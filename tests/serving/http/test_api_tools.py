"""Tool calling: ``tools`` rendered in the model's format (Hermes here: the tiny pair's template
takes no tools), calls parsed into ``message.tool_calls`` (streamed as deltas), ``tool_choice``
``required`` and a named function held to the function's schema by a grammar under every method,
``tool`` messages in the history, and 400s naming the field.

One real server over the tiny bootstrapped models for the module; the format's own pieces are
checked without one in ``test_tools_format.py``.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.serving.http.api_support import MODEL, assert_error, running, serve_config

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models), tmp_path_factory.mktemp("tools")) as srv:
        yield srv


def _post(srv, **body) -> requests.Response:
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "return_token_ids": True}
    return requests.post(srv.url + CHAT, json=base | body, timeout=120)


def _ok(srv, **body) -> dict:
    r = _post(srv, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _check_weather(call: dict) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"city", "unit"} and len(args["city"]) <= 6 and args["unit"] in ("c", "f")


@pytest.mark.parametrize("method", ["target", "draft", "pld", "llma", "auto"])
def test_a_named_function_is_called_with_arguments_that_follow_its_schema(server, method):
    out = _ok(server, tools=[WEATHER, TIME], tool_choice=NAMED, speculation={"method": method})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
    _check_weather(choice["message"]["tool_calls"][0])
    ref = _ok(server, tools=[WEATHER, TIME], tool_choice=NAMED, speculation={"method": "target"})
    assert choice["token_ids"] == ref["choices"][0]["token_ids"]  # lossless under the grammar


def test_required_calls_one_of_the_tools_and_parallel_false_keeps_one(server):
    for parallel in (True, False):
        msg = _ok(server, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
        calls = msg["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] in ("get_weather", "get_time") for c in calls)
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
        if not parallel:
            assert len(calls) == 1


def test_auto_and_none_leave_free_text(server):
    for choice in ("auto", "none"):
        msg = _ok(server, tools=[WEATHER], tool_choice=choice, max_tokens=16)["choices"][0]
        assert msg["finish_reason"] in ("stop", "length") and isinstance(msg["message"]["content"], str)
        assert "tool_calls" not in msg["message"]  # a random model writes no call


def test_streamed_calls_come_as_deltas(server):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "tools": [WEATHER],
        "tool_choice": NAMED,
    }
    r = requests.post(server.url + CHAT, json=body, timeout=120, stream=True)
    assert r.status_code == 200, r.text
    events = [json.loads(x.removeprefix(b"data: ")) for x in r.iter_lines() if x and b"[DONE]" not in x]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert not "".join(d.get("content") or "" for d in deltas)  # the call's text is not streamed as content
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0
    _check_weather(calls[0])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_conversation_with_calls_and_results_goes_on(server):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    ]
    out = _ok(server, messages=history, tools=[WEATHER], max_tokens=8)
    assert out["usage"]["prompt_tokens"] > _ok(server, max_tokens=8)["usage"]["prompt_tokens"]


def test_the_openai_client_reads_the_calls(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0, tools=[WEATHER], tool_choice=NAMED
    )
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "unit"}
    assert resp.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "body,code,param",
    [
        ({"tool_choice": "required"}, "unsupported_parameter", "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "unsupported_parameter",
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER, WEATHER]}, "unsupported_parameter", "tools"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "unsupported_parameter", "response_format"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "invalid_request",
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "invalid_request", "tools.0.type"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "invalid_request", "tool_choice"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, code, param):
    assert_error(_post(server, **body), 400, code, param)

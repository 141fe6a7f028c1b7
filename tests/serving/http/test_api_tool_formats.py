"""Tool calling through a chat template that renders tools itself and names a format other than
Hermes (``specops.serving.http.tools``: Llama 3 JSON, Mistral): the server picks the format from the
template, a named function's call follows that format's grammar, and the call is parsed back into
``message.tool_calls``, whole and streamed.

A real server per format over a copy of the tiny models whose template says which format it uses.
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests

from tests.serving.http.api_support import MODEL, running, serve_config

CHAT = "/v1/chat/completions"
TEMPLATES = {
    # Llama 3.1's templates name <|python_tag|>; Mistral's name [TOOL_CALLS] (each rendered here in a few lines)
    "llama3_json": "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %} (<|python_tag|>)\n"
    "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:",
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | length }}[/AVAILABLE_TOOLS] [TOOL_CALLS]\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:",
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": [1, 2]}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Add 2 and 3."}],
    "max_tokens": 40,
    "temperature": 0,
    "tools": [ADD],
    "tool_choice": {"type": "function", "function": {"name": "add"}},
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def server(request, tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    models = shutil.copytree(tiny_models, root / "models")
    (models / "target" / "chat_template.jinja").write_text(TEMPLATES[request.param])
    with running(serve_config(models), root) as srv:
        yield request.param, srv


def _check(call: dict) -> None:
    assert call["type"] == "function" and call["function"]["name"] == "add"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"a", "b"} and 0 <= args["a"] <= 99 and args["b"] in (1, 2)


def test_a_named_call_in_the_templates_format_is_parsed(server):
    fmt, srv = server
    r = requests.post(srv.url + CHAT, json=BODY | {"return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, (fmt, choice)
    assert len(choice["message"]["tool_calls"]) == 1
    _check(choice["message"]["tool_calls"][0])


def test_the_streamed_call_comes_as_one_delta(server):
    fmt, srv = server
    r = requests.post(srv.url + CHAT, json=BODY | {"stream": True}, timeout=120, stream=True)
    assert r.status_code == 200, r.text
    events = [json.loads(x.removeprefix(b"data: ")) for x in r.iter_lines() if x and b"[DONE]" not in x]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert not "".join(d.get("content") or "" for d in deltas), fmt  # the call is held back, then parsed
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0, fmt
    _check(calls[0])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

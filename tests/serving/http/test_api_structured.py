"""Structured output through the API: OpenAI's ``response_format`` (``json_object``, ``json_schema``)
and vLLM's ``structured_outputs`` / ``guided_*`` on both endpoints, streamed and not, with
target-only's output under every method, through the ``openai`` client, and 400s naming the field.

One real server over the tiny bootstrapped models for the module.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
import requests

from tests.serving.http.api_support import MODEL, assert_error, running, serve_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
METHODS = ["draft", "llma", "pld", "auto"]  # dresd and retrieval need a datastore: tests/serving/engine/test_grammar.py


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models), tmp_path_factory.mktemp("structured")) as srv:
        yield srv


def _body(path: str, **body) -> dict:
    base = {"model": MODEL, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    base |= {"messages": [{"role": "user", "content": "Weather in JSON?"}]} if path == CHAT else {"prompt": "Weather:"}
    return base | body


def _post(srv, path: str, **body) -> dict:
    r = requests.post(srv.url + path, json=_body(path, **body), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _text(choice: dict) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_json_schema_output_parses_and_follows_the_schema(server, path):
    choice = _post(server, path, response_format=JSON_SCHEMA)["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # the object closed within max_tokens
    value = json.loads(_text(choice))
    assert set(value) == {"city", "rain"} and len(value["city"]) <= 8 and isinstance(value["rain"], bool)
    obj = _post(server, path, response_format={"type": "json_object"})["choices"][0]
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(_text(obj)), dict)
    else:  # a random model may not close an open-ended object in time: a prefix of one
        assert _text(obj).startswith("{")


@pytest.mark.parametrize(
    "field",
    [
        {"structured_outputs": {"regex": r"[a-z]{2,5}( [a-z]{2,5}){2}"}},
        {"guided_regex": r"[a-z]{2,5}( [a-z]{2,5}){2}"},
        {"structured_outputs": {"choice": ["sunny", "rainy", "grey skies"]}},
        {"guided_choice": ["sunny", "rainy", "grey skies"]},
        {"structured_outputs": {"grammar": 'start: "it is " ("sunny" | "rainy")'}},
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": json.dumps(SCHEMA)},
    ],
    ids=lambda f: (
        "-".join(f) + "-" + "-".join(f[next(iter(f))]) if isinstance(f[next(iter(f))], dict) else next(iter(f))
    ),
)
def test_vllms_fields(server, field):
    text = _text(_post(server, COMPLETIONS, **field)["choices"][0])
    ((name, value),) = field.items()
    spec = value if name == "structured_outputs" else {name.removeprefix("guided_"): value}
    if "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    elif "choice" in spec:
        assert text in spec["choice"]
    elif "grammar" in spec:
        assert text in ("it is sunny", "it is rainy")
    else:
        assert set(json.loads(text)) == {"city", "rain"}


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_target_onlys_output(server, method):
    for path in (CHAT, COMPLETIONS):
        ref = _post(
            server,
            path,
            response_format=JSON_SCHEMA,
            speculation={"method": "target"},
            logprobs=True if path == CHAT else 2,
        )["choices"][0]
        got = _post(
            server,
            path,
            response_format=JSON_SCHEMA,
            speculation={"method": method},
            logprobs=True if path == CHAT else 2,
        )["choices"][0]
        assert got["token_ids"] == ref["token_ids"] and _text(got) == _text(ref), (method, path)
        a = got["logprobs"]["content"] if path == CHAT else got["logprobs"]["token_logprobs"]
        b = ref["logprobs"]["content"] if path == CHAT else ref["logprobs"]["token_logprobs"]
        assert len(a) == len(b)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_streamed_output_adds_up_to_the_whole(server, path):
    whole = _text(_post(server, path, response_format=JSON_SCHEMA, speculation={"method": "pld"})["choices"][0])
    r = requests.post(
        server.url + path,
        json=_body(path, response_format=JSON_SCHEMA, stream=True, speculation={"method": "pld"}),
        timeout=120,
        stream=True,
    )
    assert r.status_code == 200, r.text
    events = [json.loads(x.removeprefix(b"data: ")) for x in r.iter_lines() if x and b"[DONE]" not in x]
    parts = [
        (e["choices"][0].get("delta", {}).get("content") if path == CHAT else e["choices"][0].get("text")) or ""
        for e in events
        if e.get("choices")
    ]
    assert "".join(parts) == whole and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_n_choices_each_follow_the_schema(server):
    out = _post(server, CHAT, response_format=JSON_SCHEMA, n=3, temperature=1.0, seed=4)
    assert len(out["choices"]) == 3
    for c in out["choices"]:
        if c["finish_reason"] == "stop":
            assert set(json.loads(_text(c))) == {"city", "rain"}


def test_the_openai_client_parses_it(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in JSON?"}],
        max_tokens=40,
        temperature=0,
        response_format=JSON_SCHEMA,
    )
    assert set(json.loads(resp.choices[0].message.content)) == {"city", "rain"}


@pytest.mark.parametrize(
    "path,body,code,param",
    [
        (CHAT, {"response_format": {"type": "json_schema"}}, "invalid_request", "response_format.json_schema"),
        (CHAT, {"response_format": {"type": "xml"}}, "invalid_request", "response_format.type"),
        (
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "invalid_request",
            "response_format.json_schema.schema",
        ),
        (COMPLETIONS, {"guided_regex": "(a|b"}, "invalid_request", "guided_regex"),
        (COMPLETIONS, {"structured_outputs": {"grammar": "start: ("}}, "invalid_request", "structured_outputs.grammar"),
        (COMPLETIONS, {"guided_choice": []}, "invalid_request", "guided_choice"),
        (
            COMPLETIONS,
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "unsupported_parameter",
            "guided_regex",
        ),
        (COMPLETIONS, {"structured_outputs": {"whitespace_pattern": " "}}, "invalid_request", None),
        (
            COMPLETIONS,
            {"guided_regex": "a+", "knnlm": {"datastore": "prose"}},
            "invalid_request",
            None,
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, path, body, code, param):
    r = requests.post(server.url + path, json=_body(path, **body), timeout=60)
    if param is None:
        assert r.status_code == 400, r.text
        return
    assert_error(r, 400, code, param)

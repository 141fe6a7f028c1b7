"""Compatibility suite: two independent client libraries that speak the OpenAI API, the official
``openai`` SDK and LangChain's ``ChatOpenAI`` (``langchain-openai``), through every field issue 57
added (log-probabilities, ``echo``, ``n``/``best_of``, penalties and ``logit_bias``, structured
output, tools), streamed and not, against a live server: each call must parse in the client with
the fields it reads. The same calls against a vLLM server, compared shape by shape, are in
``tests/serving/vllm/test_vllm_engine.py`` (``test_responses_have_vllms_shapes``).

One real server over the tiny bootstrapped models for the module.
"""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from tests.serving.http.api_support import MODEL, running, serve_config

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models), tmp_path_factory.mktemp("compat")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_openai_completions_fields(client):
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=8, temperature=0)
    r = client.completions.create(**kw, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("def add(a, b):") and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    r = client.completions.create(**{**kw, "temperature": 1.0}, n=3, best_of=4, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens <= 32
    r = client.completions.create(
        **kw, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"5": 2.0}, stop=["\n\n"], seed=1
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(**kw, extra_body={"guided_choice": ["yes", "no"], "repetition_penalty": 1.2})
    assert r.choices[0].text in ("yes", "no")
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}, logprobs=1))
    assert chunks[-1].usage.completion_tokens > 0
    assert "".join(c.choices[0].text for c in chunks if c.choices) == client.completions.create(**kw).choices[0].text


def test_openai_chat_fields(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    r = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, n=2)
    assert len(r.choices) == 2 and all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    r = client.chat.completions.create(
        **kw, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    )
    assert set(json.loads(r.choices[0].message.content)) == {"city", "rain"}
    kw["max_tokens"] = 100  # room for a whole call
    r = client.chat.completions.create(
        **kw, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] in ("c", "f")
    stream = client.chat.completions.create(
        **kw, stream=True, tools=[TOOL], tool_choice="required", parallel_tool_calls=False
    )
    calls = [t for c in stream if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"


class Weather(BaseModel):
    city: str = Field(max_length=8)
    rain: bool


def test_langchain_chat_model(server):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=24)
    msg = llm.invoke("Weather in Paris?")
    assert isinstance(msg.content, str) and msg.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(c.content for c in llm.stream("Weather in Paris?")) == msg.content
    roomy = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=80)
    out = roomy.with_structured_output(Weather, method="json_schema").invoke("Weather in Paris?")
    assert isinstance(out, Weather) and len(out.city) <= 8
    tooled = roomy.bind_tools([TOOL], tool_choice="get_weather").invoke([HumanMessage("Weather?")])
    assert tooled.tool_calls and tooled.tool_calls[0]["name"] == "get_weather"
    assert tooled.tool_calls[0]["args"]["unit"] in ("c", "f")
    scored = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=4, logprobs=True
    ).invoke("hi")
    assert len(scored.response_metadata["logprobs"]["content"]) == scored.usage_metadata["output_tokens"]
    many = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=1.0, max_tokens=4, n=2, seed=2
    ).generate([[HumanMessage("hi")]])
    assert len(many.generations[0]) == 2

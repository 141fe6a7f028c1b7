"""The Hermes tool format (``serving.http.tools``): what the prompt shows, with and without a chat
template that renders tools itself, how calls are parsed out of text, and the grammar of a forced
call (its arguments follow the function's schema)."""

from __future__ import annotations

import copy
import json

from llguidance import LLMatcher, LLTokenizer

from specops.core.models import load_tokenizer, render_chat
from specops.serving.http import tools

FN = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]
HERMES = tools.FORMATS["hermes"]


def test_parse_takes_the_calls_out_and_leaves_the_rest():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    content, calls = HERMES.parse(text)
    assert content == "Let me add." and [c["name"] for c in calls] == ["add", "add"]
    assert json.loads(calls[1]["arguments"]) == {"a": 3, "b": 4}
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert HERMES.parse(broken) == (broken, [])  # what is not a call stays text
    assert HERMES.parse("no calls") == ("no calls", [])


def test_without_a_tools_template_the_hermes_section_and_history_are_text(tiny_models):
    tok = load_tokenizer(tiny_models / "target")
    messages, extra = tools.messages_for(tok, HISTORY, [FN])
    assert extra == {} and messages[0]["role"] == "system"
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name": "add"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    plain, _ = tools.messages_for(tok, HISTORY[:2], [])
    assert plain == HISTORY[:2]


def test_a_template_that_renders_tools_gets_them_as_they_are(tiny_models):
    tok = copy.deepcopy(load_tokenizer(tiny_models / "target"))
    tok.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if m.tool_calls %}CALLS {{ m.tool_calls | length }}{% endif %}\n{% endfor %}"
    )
    messages, extra = tools.messages_for(tok, HISTORY, [FN])
    assert messages == HISTORY and extra == {"tools": [FN]}
    text = render_chat(tok, messages, **extra)
    assert text.startswith("TOOL add\n") and "CALLS 1" in text and "tool: 5" in text


def test_a_forced_call_follows_the_functions_schema():
    t = LLTokenizer("byte")
    spec = tools.grammar(None, [FN], {"type": "function", "function": {"name": "add"}}, parallel=False)
    g = spec.llguidance()
    assert LLMatcher.validate_grammar(g, t) == ""
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    m = LLMatcher(t, g)
    assert m.consume_tokens(t.tokenize_str(good)) and m.is_accepting()
    for bad in (
        '<tool_call>\n{"name": "sub", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": "x", "b": 2}}\n</tool_call>',
    ):
        ids = t.tokenize_str(bad)
        assert LLMatcher(t, g).validate_tokens(ids) < len(ids)
    assert tools.grammar(None, [FN], "auto", parallel=True) is None
    many = tools.grammar(None, [FN], "required", parallel=True).llguidance()
    m = LLMatcher(t, many)
    assert m.consume_tokens(t.tokenize_str(good + "\n" + good)) and m.is_accepting()

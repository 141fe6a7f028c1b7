"""The tool formats (``specops.serving.http.tools``; Hermes, Llama 3 JSON, Mistral): what the prompt shows, with and without a chat
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


LLAMA, MISTRAL = tools.FORMATS["llama3_json"], tools.FORMATS["mistral"]


def _with_template(tiny_models, template: str):
    tok = copy.deepcopy(load_tokenizer(tiny_models / "target"))
    tok.chat_template = template
    return tok


def test_the_format_is_the_one_the_templates_markers_name(tiny_models):
    renders = "{% for t in tools %}{{ t.function.name }}{% endfor %}"
    assert tools.format_for(_with_template(tiny_models, renders + "<|python_tag|>")) is LLAMA
    assert tools.format_for(_with_template(tiny_models, renders + "[TOOL_CALLS]")) is MISTRAL
    assert tools.format_for(_with_template(tiny_models, renders)).name == "hermes"
    # a template that takes no tools gets them rendered by us, in Hermes, whatever it names
    assert tools.format_for(_with_template(tiny_models, "{{ messages }}<|python_tag|>")).name == "hermes"
    assert tools.format_for(None).name == "hermes"


def test_llama3_calls_are_the_whole_answer():
    one = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    for text in (one, "<|python_tag|>" + one, " " + one + " "):
        content, calls = LLAMA.parse(text)
        assert content == "" and calls == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}], text
    content, calls = LLAMA.parse(one + "; " + one.replace("1", "5"))
    assert content == "" and [json.loads(c["arguments"])["a"] for c in calls] == [1, 5]
    for text in ("Sure: " + one, '{"a": 1}', one + " and then some", "{broken"):
        assert LLAMA.parse(text) == (text, []), text  # not a call: the text stays content
    assert json.loads(LLAMA.call_text("add", '{"a": 1}')) == {"name": "add", "parameters": {"a": 1}}


def test_mistral_calls_are_an_array_after_the_tag():
    arr = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]'
    for text in ("[TOOL_CALLS]" + arr, arr):  # decoded without special tokens, the tag is gone
        content, calls = MISTRAL.parse(text)
        assert content == "" and [json.loads(c["arguments"])["b"] for c in calls] == [2, 4]
    for text in ("[1, 2]", "[]", "Sure", "[TOOL_CALLS][{"):
        assert MISTRAL.parse(text) == (text, []), text
    assert MISTRAL.call_text("add", '{"a": 1}') == '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'


def test_a_stream_holds_back_what_may_be_a_call():
    assert [LLAMA.call_start(t) for t in ("", "  ", "{", "<|py", "Hello {")] == [0, 0, 0, 0, -1]
    assert [MISTRAL.call_start(t) for t in ("", "[", "[TOOL", "Sure [")] == [0, 0, 0, -1]
    assert [HERMES.call_start(t) for t in ("", "Let me <tool_call>", "<tool")] == [-1, 7, -1]


def test_each_formats_forced_call_follows_the_schema_and_parses_back():
    t = LLTokenizer("byte")
    cases = {
        LLAMA: ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "; "),
        MISTRAL: ('{"name": "add", "arguments": {"a": 1, "b": 2}}', ", "),
    }
    for fmt, (call, sep) in cases.items():
        wrap = (lambda body: f"[{body}]") if fmt is MISTRAL else (lambda body: body)
        g = tools.GrammarSpec("grammar", fmt.call_grammar([FN], parallel=True), "tool_choice").llguidance()
        assert LLMatcher.validate_grammar(g, t) == "", fmt.name
        for text in (wrap(call), wrap(call + sep + call)):
            m = LLMatcher(t, g)
            assert m.consume_tokens(t.tokenize_str(text)) and m.is_accepting(), (fmt.name, text)
            assert len(fmt.parse(text)[1]) == text.count('"name"'), fmt.name
        bad = wrap(call.replace('"a": 1', '"a": "x"'))
        assert LLMatcher(t, g).validate_tokens(t.tokenize_str(bad)) < len(t.tokenize_str(bad)), fmt.name
        single = tools.GrammarSpec("grammar", fmt.call_grammar([FN], parallel=False), "tool_choice").llguidance()
        two = t.tokenize_str(wrap(call + sep + call))
        assert LLMatcher(t, single).validate_tokens(two) < len(two), fmt.name

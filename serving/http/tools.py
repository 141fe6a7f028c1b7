"""Tool calling on ``/v1/chat/completions``: the tools rendered into the prompt in the model's tool
format, the calls parsed out of the output into ``message.tool_calls``, and, for ``tool_choice``
``required`` or a named function, a grammar (``specops.serving.engine.grammar``) that makes the output a call
whose arguments follow the function's JSON schema.

**Formats.** A format is a :class:`ToolFormat`: how the tools and a call look in text, how a tool
result is handed back, where a call begins in a stream, and the grammar of a call. Three are built in:

- **Hermes** (Qwen 2/2.5/3, Hermes 2/3, SmolLM3 and most open chat models trained for tools): each
  call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
  ``</tool_call>`` lines, anywhere in the answer; results come back between ``<tool_response>`` tags.
- **Llama 3 JSON** (Llama 3.1/3.2/3.3, whose templates name ``<|python_tag|>``): the whole answer is
  the call, ``{"name": ..., "parameters": {...}}``, calls separated by ``;``, after an optional
  ``<|python_tag|>``.
- **Mistral** (templates that name ``[TOOL_CALLS]``): the whole answer is ``[TOOL_CALLS]`` and a
  JSON array of ``{"name": ..., "arguments": {...}}`` objects (the v3 form; the v11 form
  ``[TOOL_CALLS]name[ARGS]{...}`` is not parsed).

A chat template that takes ``tools`` itself (its source names ``tools``) renders them, and the
history's calls and results, its own way, and :func:`format_for` picks the format its markers name;
one that does not (the default SmolLM2 pair's) gets the Hermes system section below and the history
in Hermes text. Adding a format: subclass :class:`ToolFormat` (``system``, ``call_text``,
``result_message``, ``parse``, ``call_grammar``, and ``call_start`` unless a marker ``OPEN`` begins
its calls), add it to :data:`FORMATS`, and teach :func:`format_for` the template that uses it
(``docs/api.md`` says the same).
"""

from __future__ import annotations

import json
import re
import secrets

from specops.serving.engine.grammar import JSON_LAYOUT, GrammarSpec


class ToolFormat:
    """How one family of chat models writes tool calls (module docstring)."""

    name = ""
    OPEN = ""
    """The text that begins a call wherever it appears (Hermes); empty where the call is the whole answer."""

    def call_start(self, text: str) -> int:
        """Where a call begins, or may be beginning, in the answer so far (its index), or -1: a stream
        sends the text before it and holds the rest back, to go out parsed at the end."""
        return text.find(self.OPEN) if self.OPEN else -1

    def system(self, tools: list[dict]) -> str:
        raise NotImplementedError

    def call_text(self, name: str, arguments: str) -> str:
        raise NotImplementedError

    def result_message(self, content: str) -> dict:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def call_grammar(self, tools: list[dict], *, parallel: bool) -> str:
        raise NotImplementedError


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def system(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You may call one or more functions to help with the user's request. The functions are "
            f"described, as JSON schemas, inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
            "To call a function, answer with a JSON object of its name and arguments inside "
            "<tool_call></tool_call> tags, one per call:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
        )

    def call_text(self, name: str, arguments: str) -> str:
        call = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
        return f"{self.OPEN}\n{call}\n{self.CLOSE}"

    def result_message(self, content: str) -> dict:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """``(content, calls)``: the text outside the call blocks, and each block that holds a JSON
        object with a string ``name`` as ``{"name", "arguments"}`` (arguments as JSON text). A block
        that does not parse stays in the content, as the model wrote it."""
        calls, kept, last = [], [], 0
        for m in self.BLOCK.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                continue
            call = _call_object(obj, "arguments")
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last : m.start()])
            last = m.end()
        if not calls:
            return text, []
        kept.append(text[last:])
        return "".join(kept).strip(), calls

    def call_grammar(self, tools: list[dict], *, parallel: bool) -> str:
        """A Lark grammar (llguidance's, with ``%json``): one call of one of ``tools`` (more than one,
        on lines of their own, when ``parallel``), its arguments following the function's schema."""
        body = _call_schemas(tools, "arguments")
        repeat = ' ("\\n" call)*' if parallel else ""
        return (
            f"start: call{repeat}\n"
            f'call: "{self.OPEN}\\n" body "\\n{self.CLOSE}"\n'
            f"body: %json {json.dumps(body, ensure_ascii=False)}\n"
        )


def _arguments(arguments: str):
    """An earlier turn's call arguments (JSON text) as the value to write back; text that is not JSON
    is kept as the string it was."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


def _leads(text: str, markers: tuple[str, ...]) -> bool:
    """Whether the answer so far (leading whitespace aside) is, or may still become, one that starts
    with one of ``markers`` (nothing yet counts: a call could still come)."""
    head = text.lstrip()
    return any(head.startswith(m) or m.startswith(head) for m in markers)


def _call_object(obj, key: str) -> dict | None:
    """``{"name", "arguments"}`` (arguments as JSON text) of a JSON object that names a function, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}


def _call_schemas(tools: list[dict], key: str) -> dict:
    """The JSON schema of one call of one of ``tools``: its ``name`` and, under ``key``, its arguments."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                key: t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    body = options[0] if len(options) == 1 else {"anyOf": options}
    return {**body, "x-guidance": JSON_LAYOUT}


class Llama3Json(ToolFormat):
    """Llama 3.1/3.2/3.3's JSON tool calling: the answer is ``{"name": ..., "parameters": {...}}``
    (``; ``-separated when several), after an optional ``<|python_tag|>`` (a special token, dropped
    from decoded text)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def system(self, tools: list[dict]) -> str:
        listed = "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\nRespond in the format "
            '{"name": function name, "parameters": dictionary of argument name and its value}. '
            f"Do not use variables.\n\n{listed}"
        )

    def call_text(self, name: str, arguments: str) -> str:
        return json.dumps({"name": name, "parameters": _arguments(arguments)}, ensure_ascii=False)

    def result_message(self, content: str) -> dict:
        return {"role": "ipython", "content": content}

    def call_start(self, text: str) -> int:
        return 0 if _leads(text, ("{", self.TAG)) else -1

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """The calls, when the whole answer is one or more call objects; else the text as content."""
        body = text.strip()
        body = body[len(self.TAG) :].lstrip() if body.startswith(self.TAG) else body
        calls, at, decoder = [], 0, json.JSONDecoder()
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _call_object(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return ("", calls) if calls else (text, [])

    def call_grammar(self, tools: list[dict], *, parallel: bool) -> str:
        repeat = ' ("; " call)*' if parallel else ""
        schema = json.dumps(_call_schemas(tools, "parameters"), ensure_ascii=False)
        return f"start: call{repeat}\ncall: %json {schema}\n"


class Mistral(ToolFormat):
    """Mistral's tool calling (v3 templates): the answer is ``[TOOL_CALLS]`` (a special token, dropped
    from decoded text) and a JSON array of ``{"name": ..., "arguments": {...}}`` objects. A forced call
    (a grammar) is the array alone: a grammar cannot name the special token portably."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def system(self, tools: list[dict]) -> str:
        return f"[AVAILABLE_TOOLS]{json.dumps(tools, ensure_ascii=False)}[/AVAILABLE_TOOLS]"

    def call_text(self, name: str, arguments: str) -> str:
        return self.TAG + json.dumps([{"name": name, "arguments": _arguments(arguments)}], ensure_ascii=False)

    def result_message(self, content: str) -> dict:
        return {"role": "user", "content": f"[TOOL_RESULTS]{content}[/TOOL_RESULTS]"}

    def call_start(self, text: str) -> int:
        return 0 if _leads(text, ("[", self.TAG)) else -1

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """The calls, when the whole answer is an array of call objects; else the text as content."""
        body = text.strip()
        body = body[len(self.TAG) :].lstrip() if body.startswith(self.TAG) else body
        try:
            objs = json.loads(body) if body.startswith("[") else []
        except ValueError:
            return text, []
        calls = [_call_object(o, "arguments") for o in objs] if isinstance(objs, list) else []
        if not calls or None in calls:
            return text, []
        return "", calls

    def call_grammar(self, tools: list[dict], *, parallel: bool) -> str:
        repeat = ' (", " call)*' if parallel else ""
        schema = json.dumps(_call_schemas(tools, "arguments"), ensure_ascii=False)
        return f'start: "[" call{repeat} "]"\ncall: %json {schema}\n'


FORMATS = {"hermes": Hermes(), "llama3_json": Llama3Json(), "mistral": Mistral()}

MARKERS = ((Llama3Json.TAG, "llama3_json"), (Mistral.TAG, "mistral"))
"""What in a chat template's source names its tool format (checked in order; Hermes otherwise)."""


def format_for(tokenizer) -> ToolFormat:
    """The tool format of ``tokenizer``'s chat template: the one whose marker a template that renders
    ``tools`` names; Hermes otherwise (and for a template that does not take ``tools``: we render them)."""
    if native(tokenizer):
        template = tokenizer.chat_template
        for marker, name in MARKERS:
            if marker in template:
                return FORMATS[name]
    return FORMATS["hermes"]


def native(tokenizer) -> bool:
    """Whether the chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def selected(tools: list[dict], choice) -> list[dict]:
    """The tools a ``tool_choice`` allows: all, or the named one."""
    if isinstance(choice, dict):
        return [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    return tools


def messages_for(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], dict]:
    """The chat as the template takes it, and the template's extra arguments: with a template that
    renders ``tools``, the OpenAI messages as they are and ``tools``; else the Hermes system section
    first (merged into the request's system message) and calls and results as Hermes text."""
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return [{"role": m["role"], "content": m["content"] or ""} for m in messages], {}
    if native(tokenizer):
        return messages, ({"tools": tools} if tools else {})
    fmt = format_for(tokenizer)
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            out.append(fmt.result_message(m["content"] or ""))
        elif m.get("tool_calls"):
            calls = [fmt.call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"] or "", *calls]))})
        else:
            out.append({"role": m["role"], "content": m["content"] or ""})
    if tools:
        section = fmt.system(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, {}


def grammar(tokenizer, tools: list[dict], choice, *, parallel: bool) -> GrammarSpec | None:
    """The grammar ``tool_choice`` ``required`` or a named function puts on the output, or None."""
    if choice == "required" or isinstance(choice, dict):
        lark = format_for(tokenizer).call_grammar(selected(tools, choice), parallel=parallel and choice == "required")
        return GrammarSpec("grammar", lark, "tool_choice")
    return None


def tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's ``message.tool_calls``: each call with an id of its own."""
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": dict(c)} for c in calls]

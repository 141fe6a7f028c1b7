"""A request body from bytes to a JSON object: every way it can fail is a 400 naming the field.

:func:`parse` decodes the text (UTF-8, or the UTF-16/32 that JSON detection allows), parses
standard JSON and walks the result once. It refuses, as
:class:`~specops.core.errors.InvalidRequestError` with ``param`` set to the field:

- JSON that does not parse: a syntax error; ``NaN`` or ``Infinity`` (not JSON); a number
  longer than Python's integer digit limit (``sys.get_int_max_str_digits()``, 4300);
  nesting deeper than the parser's recursion limit. The field named is the top-level
  one whose value fails, found by parsing the members one at a time (on this error path only);
- nesting deeper than :data:`MAX_DEPTH` levels (no valid request nests more than a few);
- text that is not valid Unicode, in a value or in a field name: a lone surrogate (the JSON
  escape ``"\\ud800"`` with no pair) or an invalid UTF-8 byte. The tokenizer cannot take
  it and a JSON response cannot quote it; an escaped surrogate *pair* is a valid character.

Pydantic then validates types and bounds (see :mod:`specops.serving.http.schema`).
"""

from __future__ import annotations

import json
import re

from specops.core.errors import InvalidRequestError, clip

MAX_DEPTH = 32
"""Deepest nesting accepted; the request object itself is level 1 (``messages[0].content[0]`` is level 5)."""

_WS = re.compile(r"[ \t\n\r]*")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def parse(body: bytes) -> dict:
    """The JSON object in ``body``; raises :class:`InvalidRequestError` naming the field at fault."""
    try:  # an invalid UTF-8 byte becomes a lone surrogate, reported with its field by the walk below
        text = body.decode(json.detect_encoding(body), errors="surrogateescape")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid {exc.encoding} text: {exc.reason}") from None
    try:
        data = _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        field = _failing_field(text)
        where = f"{field}: not" if field else "request body is not"
        raise InvalidRequestError(f"{where} valid JSON: {_why(exc)}", field) from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    problem = _find_problem(data)
    if problem is not None:
        field, what = problem
        raise InvalidRequestError(f"{field}: {what}" if field else what, field or None)
    return data


def _why(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return f"nested too deeply to parse (the limit is {MAX_DEPTH} levels)"
    if isinstance(exc, json.JSONDecodeError):
        return str(exc)
    return str(exc).split(";")[0]  # int digits: "Exceeds the limit (4300 digits) ...: value has 500000 digits"


def _failing_field(text: str) -> str | None:
    """The top-level field whose value does not parse; None when the object itself is broken."""
    i = _WS.match(text).end()
    if not text.startswith("{", i):
        return None
    i += 1
    while True:
        i = _WS.match(text, i).end()
        try:
            key, i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        if not isinstance(key, str) or _bad_char(key) is not None:
            return None
        i = _WS.match(text, i).end()
        if not text.startswith(":", i):
            return None
        try:
            _, i = _DECODER.raw_decode(text, _WS.match(text, i + 1).end())
        except (ValueError, RecursionError):
            return clip(key)
        i = _WS.match(text, i).end()
        if not text.startswith(",", i):
            return None
        i += 1


def _find_problem(data: dict) -> tuple[str, str] | None:
    """(field, what is wrong) for the first string that is not valid Unicode or the first nesting too deep."""
    stack: list[tuple[tuple, dict | list, int]] = [((), data, 1)]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return _name(path), f"nested more than {MAX_DEPTH} levels deep"
        children = []
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and (at := _bad_char(key)) is not None:
                return _name(path), f"a field name is not valid Unicode text: {_what(key, at)}"
            if isinstance(item, str):
                if (at := _bad_char(item)) is not None:
                    return _name((*path, key)), f"not valid Unicode text: {_what(item, at)}"
            elif isinstance(item, (dict, list)):
                children.append(((*path, key), item, depth + 1))
        stack.extend(reversed(children))
    return None


def _bad_char(text: str) -> int | None:
    """Index of the first character that UTF-8 cannot encode (a lone surrogate), if any."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _what(text: str, at: int) -> str:
    return f"a lone surrogate (\\u{ord(text[at]):04x}) or an invalid UTF-8 byte at character {at}"


def _name(path: tuple) -> str:
    """A field path as pydantic writes it (``messages.0.content``), clipped."""
    return clip(".".join(str(p) for p in path))

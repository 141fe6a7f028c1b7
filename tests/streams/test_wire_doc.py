"""docs/streams.md documents the wire format: its field tables and header codes must
match the code exactly."""

from __future__ import annotations

import re
from pathlib import Path

from specops.streams import codec

DOC = Path(__file__).resolve().parents[2] / "docs" / "streams.md"
ROW = re.compile(r"^\| `([^`]+)` \| `([^`]+)` \|")


def _section_fields(text: str, heading: str) -> dict[str, str]:
    body = text.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    return dict(m.groups() for line in body.splitlines() if (m := ROW.match(line)))


def test_field_tables_match_the_codec():
    text = DOC.read_text()
    for code, (cls, fields) in codec._TYPES.items():
        documented = _section_fields(text, cls.__name__)
        assert documented == fields, f"{cls.__name__}: docs/streams.md table differs from streams/codec.py"
        assert f"{code} `{cls.__name__}`" in text


def test_header_and_array_codes_match_the_codec():
    text = DOC.read_text()
    assert codec.MAGIC == b"SO" and 'magic | `b"SO"`' in text
    assert codec.HEADER.size == 6 and "6-byte header" in text
    assert (codec.COMPRESS_NONE, codec.COMPRESS_ZSTD) == (0, 1) and "0 none, 1 zstd" in text
    assert codec.ARRAY_EXT == 1 and "extension type 1" in text
    names = {1: "int32", 2: "float32", 3: "float16"}
    assert {c: d.name for c, d in codec._DTYPES.items()} == names
    assert "1 int32, 2 float32, 3 float16" in text
    assert codec.COMPRESS_MIN_BYTES == 256 and "256 bytes or more" in text
    assert codec.MAX_BODY_BYTES == 256 * 1024 * 1024 and "256 MiB" in text

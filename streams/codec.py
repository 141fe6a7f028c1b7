"""The wire format of stream records (documented in ``docs/streams.md``).

A record value is a 6-byte header followed by a body::

    offset  size  field
    0       2     magic  b"SO"
    2       1     record type   1 MissRecord, 2 GenerationRecord, 3 ModelEvent, 4 DeadLetter
    3       1     compression   0 none, 1 zstd (one frame holding the whole body)
    4       2     schema version, little-endian uint16

The body is a MessagePack map from short field names to values. Arrays are MessagePack
extension type 1 whose payload is ``dtype code (u8), ndim (u8), shape (ndim x u32 LE),
raw little-endian C-order bytes``; dtype codes are 1 int32, 2 float32, 3 float16.
Bodies over ``COMPRESS_MIN_BYTES`` are zstd-compressed (level 3). Decoding never
executes or unpickles anything; it bounds the decompressed size, checks every field
and then calls the record's ``validate()``. Any problem raises
:class:`~specops.streams.errors.RecordValidationError`.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import zstandard

from specops.streams.errors import RecordValidationError
from specops.streams.records import (
    SCHEMA_VERSION,
    ContextSpan,
    DeadLetter,
    GenerationRecord,
    MissRecord,
    ModelEvent,
    Record,
    SamplingInfo,
)

MAGIC = b"SO"
HEADER = struct.Struct("<2sBBH")
COMPRESS_NONE, COMPRESS_ZSTD = 0, 1
COMPRESS_MIN_BYTES = 256
MAX_BODY_BYTES = 256 * 1024 * 1024
"""Decompression bound: a body claiming more than this is refused (zip-bomb guard)."""
ZSTD_LEVEL = 3
ARRAY_EXT = 1
_DTYPES = {1: np.dtype("<i4"), 2: np.dtype("<f4"), 3: np.dtype("<f2")}
_DTYPE_CODES = {np.dtype(np.int32): 1, np.dtype(np.float32): 2, np.dtype(np.float16): 3}

# record type code, class, {wire name: attribute}
_MISS_FIELDS = {
    "rid": "request_id",
    "cl": "cluster",
    "m": "method",
    "dm": "draft_model",
    "dv": "draft_version",
    "sp": "sampling",
    "tok": "token_ids",
    "np": "num_prompt_tokens",
    "V": "vocab_size",
    "pos": "positions",
    "dt": "drafted_tokens",
    "dk": "dist_kind",
    "lp": "logprobs",
    "ti": "topk_ids",
    "res": "residual",
    "nd": "num_drafted",
    "na": "num_accepted",
    "ts": "timestamp",
    "av": "artifact_versions",
    "cs": "context_spans",
    "eng": "engine",
}
_GEN_FIELDS = {
    "rid": "request_id",
    "cl": "cluster",
    "m": "method",
    "dm": "draft_model",
    "dv": "draft_version",
    "p": "prompt_ids",
    "o": "output_ids",
    "V": "vocab_size",
    "fr": "finish_reason",
    "ts": "timestamp",
    "av": "artifact_versions",
    "cs": "context_spans",
    "pol": "policy",
}
_EVENT_FIELDS = {
    "k": "kind",
    "n": "model_name",
    "v": "version",
    "pv": "previous_version",
    "a": "alias",
    "r": "reason",
    "ts": "timestamp",
}
_DEAD_FIELDS = {
    "st": "source_topic",
    "sp": "source_partition",
    "so": "source_offset",
    "key": "key",
    "val": "value",
    "r": "reason",
    "et": "error_type",
    "g": "consumer_group",
    "ts": "timestamp",
}
_TYPES: dict[int, tuple[type, dict[str, str]]] = {
    1: (MissRecord, _MISS_FIELDS),
    2: (GenerationRecord, _GEN_FIELDS),
    3: (ModelEvent, _EVENT_FIELDS),
    4: (DeadLetter, _DEAD_FIELDS),
}
_CODES = {cls: code for code, (cls, _) in _TYPES.items()}
_OPTIONAL = {"ti", "res"}  # MissRecord fields that are None for full distributions
_SINCE_V2 = {"av", "cs"}  # absent from schema 1 bodies: decoded as their defaults
_ABSENT_OK = {"pol", "eng"}  # optional at any schema (older producers never wrote it; older consumers ignore it)

_compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)


def _pack_array(a: np.ndarray) -> msgpack.ExtType:
    code = _DTYPE_CODES.get(a.dtype)
    if code is None:
        raise ValueError(f"arrays of dtype {a.dtype} cannot be encoded")
    a = np.ascontiguousarray(a, dtype=_DTYPES[code])
    head = struct.pack(f"<BB{a.ndim}I", code, a.ndim, *a.shape)
    return msgpack.ExtType(ARRAY_EXT, head + a.tobytes())


def _unpack_array(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT:
        return msgpack.ExtType(code, data)  # refused later by the field checks
    if len(data) < 2:
        raise ValueError("array extension shorter than its header")
    dcode, ndim = data[0], data[1]
    if dcode not in _DTYPES or ndim > 4:
        raise ValueError(f"array has unknown dtype code {dcode} or ndim {ndim}")
    end = 2 + 4 * ndim
    if len(data) < end:
        raise ValueError("array extension truncated in its shape")
    shape = struct.unpack_from(f"<{ndim}I", data, 2)
    dtype = _DTYPES[dcode]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - end != expected:
        raise ValueError(f"array of shape {shape} {dtype} needs {expected} bytes, has {len(data) - end}")
    # copy so the record owns writable memory independent of the message buffer
    return np.frombuffer(data, dtype=dtype, offset=end).reshape(shape).astype(dtype.newbyteorder("="), copy=True)


def _to_wire(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return _pack_array(value)
    if isinstance(value, SamplingInfo):
        return [value.temperature, value.top_p, value.max_new_tokens, value.seed]
    if isinstance(value, tuple) and all(isinstance(v, ContextSpan) for v in value):
        return [[v.kind, v.start, v.end] for v in value]
    return value


def encode(record: Record, *, compress: bool = True) -> bytes:
    """Validate ``record`` and return its wire bytes."""
    record.validate()
    code = _CODES[type(record)]
    fields = _TYPES[code][1]
    body = {
        wire: _to_wire(getattr(record, attr))
        for wire, attr in fields.items()
        if wire not in _ABSENT_OK or getattr(record, attr)
    }  # an empty optional field is left out
    raw = msgpack.packb(body, use_bin_type=True)
    method = COMPRESS_NONE
    if compress and len(raw) >= COMPRESS_MIN_BYTES:
        raw, method = _compressor.compress(raw), COMPRESS_ZSTD
    return HEADER.pack(MAGIC, code, method, record.schema) + raw


def peek_type(data: bytes) -> str:
    """The record type named in the header, or ``"?"`` when the header is invalid."""
    if len(data) >= HEADER.size:
        magic, code, _, _ = HEADER.unpack_from(data)
        if magic == MAGIC and code in _TYPES:
            return _TYPES[code][0].__name__
    return "?"


def decode(data: bytes) -> Record:
    """Parse and validate wire bytes; raises RecordValidationError saying what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordValidationError("record", "header", f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < HEADER.size:
        raise RecordValidationError(
            "record", "header", f"{len(data)} bytes is shorter than the {HEADER.size}-byte header"
        )
    magic, code, method, schema = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise RecordValidationError(
            "record", "header", f"bad magic {magic!r} (expected {MAGIC!r}): not a specops record"
        )
    if code not in _TYPES:
        raise RecordValidationError("record", "header", f"unknown record type {code}")
    cls, fields = _TYPES[code]
    name = cls.__name__
    if schema < 1 or schema > SCHEMA_VERSION:
        raise RecordValidationError(
            name,
            "schema",
            f"version {schema} is not readable by this build (reads 1..{SCHEMA_VERSION}); upgrade the consumer",
        )
    body = data[HEADER.size :]
    if method == COMPRESS_ZSTD:
        try:
            declared = zstandard.frame_content_size(body)  # -1 when the frame does not say
            if declared > MAX_BODY_BYTES:
                raise RecordValidationError(
                    name, "body", f"zstd frame inflates to {declared} bytes, over the {MAX_BODY_BYTES}-byte limit"
                )
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY_BYTES)
        except zstandard.ZstdError as e:
            raise RecordValidationError(name, "body", f"zstd decompression failed: {e}") from None
    elif method != COMPRESS_NONE:
        raise RecordValidationError(name, "header", f"unknown compression code {method}")
    try:
        raw = msgpack.unpackb(body, raw=False, ext_hook=_unpack_array, strict_map_key=True, max_bin_len=MAX_BODY_BYTES)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RecordValidationError(name, "body", f"not a valid MessagePack body: {e}") from None
    if not isinstance(raw, dict):
        raise RecordValidationError(name, "body", f"expected a map, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {"schema": schema}
    for wire, attr in fields.items():
        if wire not in raw:
            if wire in _OPTIONAL and cls is MissRecord:
                kwargs[attr] = None
                continue
            if (wire in _SINCE_V2 and schema < 2) or wire in _ABSENT_OK:
                continue  # the dataclass default: no artifact versions, one prompt span
            raise RecordValidationError(name, attr, "missing")
        value = raw[wire]
        if isinstance(value, msgpack.ExtType):
            raise RecordValidationError(name, attr, f"unknown extension type {value.code}")
        if attr == "sampling":
            value = _sampling(name, value)
        elif attr == "context_spans":
            value = _context_spans(name, value)
        kwargs[attr] = value
    try:
        record = cls(**kwargs)
    except TypeError as e:  # pragma: no cover - fields are checked above
        raise RecordValidationError(name, "body", str(e)) from None
    record.validate()
    return record


def _context_spans(name: str, value: Any) -> tuple[ContextSpan, ...]:
    if not isinstance(value, list) or not all(isinstance(v, list) and len(v) == 3 for v in value):
        raise RecordValidationError(name, "context_spans", "expected a list of [kind, start, end]")
    return tuple(ContextSpan(*v) for v in value)


def _sampling(name: str, value: Any) -> SamplingInfo:
    if not isinstance(value, list) or len(value) != 4:
        raise RecordValidationError(name, "sampling", "expected [temperature, top_p, max_new_tokens, seed]")
    return SamplingInfo(*value)

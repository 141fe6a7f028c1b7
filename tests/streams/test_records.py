"""Record encoding is compact and bit-exact, and decoding refuses every malformed input
with a typed error that names the field."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import zstandard

from specops.streams import codec
from specops.streams.errors import RecordValidationError
from specops.streams.records import SCHEMA_VERSION, DeadLetter, MissRecord
from tests.streams.records_factory import assert_same_record, generation_record, miss_record, model_event


@pytest.mark.parametrize("compress", [True, False])
def test_every_record_type_round_trips_bit_exact(compress):
    dead = DeadLetter(
        "spec.misses",
        3,
        17,
        b"code",
        b"\x00garbage\xff",
        "record.header: bad magic",
        "RecordValidationError",
        "trainer",
    )
    for rec in [
        miss_record(1),
        miss_record(2, kind="full"),
        miss_record(3, dtype=np.float16),
        miss_record(4, m=0),
        generation_record(5),
        model_event(),
        dead,
    ]:
        data = codec.encode(rec, compress=compress)
        assert data[:2] == b"SO" and data[4:6] == SCHEMA_VERSION.to_bytes(2, "little")
        assert_same_record(rec, codec.decode(data))


def test_encoding_is_binary_and_compressed():
    rec = miss_record(1, vocab=4096, n=120, m=12, k=64)
    data = codec.encode(rec)
    assert data[3] == codec.COMPRESS_ZSTD
    raw_tensors = rec.token_ids.nbytes + rec.logprobs.nbytes + rec.topk_ids.nbytes + rec.residual.nbytes
    assert len(data) < raw_tensors  # smaller than the raw arrays it carries
    json_like = len(str(rec.logprobs.tolist()))
    assert len(data) < json_like / 2


def _bad(rec: MissRecord, **changes) -> MissRecord:
    return dataclasses.replace(rec, **changes)


BASE = miss_record(7)


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"token_ids": BASE.token_ids.astype(np.int64)}, "token_ids", "dtype"),
        ({"token_ids": BASE.token_ids.reshape(2, -1)}, "token_ids", "dimension"),
        ({"vocab_size": 10}, "token_ids", "[0, 10)"),
        ({"positions": BASE.positions - 15}, "positions", "must lie in the output"),
        ({"positions": BASE.positions[::-1].copy()}, "positions", ""),
        ({"drafted_tokens": BASE.token_ids[BASE.positions].copy()}, "drafted_tokens", "must differ"),
        ({"drafted_tokens": BASE.drafted_tokens[:-1].copy()}, "drafted_tokens", "shape"),
        ({"num_accepted": BASE.num_drafted + 1}, "num_accepted", "outside"),
        ({"num_drafted": 3, "num_accepted": 0}, "positions", "were not accepted"),
        ({"logprobs": np.full_like(BASE.logprobs, np.nan)}, "logprobs", "NaN"),
        ({"logprobs": BASE.logprobs + 5.0}, "logprobs", "<= 0"),
        ({"logprobs": BASE.logprobs - 0.5}, "logprobs", "not normalised"),
        ({"residual": BASE.residual + 2}, "residual", "[0, 1]"),
        ({"topk_ids": np.zeros_like(BASE.topk_ids)}, "topk_ids", "repeats"),
        ({"topk_ids": BASE.topk_ids[:, :3].copy()}, "topk_ids", "shape"),
        ({"logprobs": BASE.logprobs.astype(np.float64)}, "logprobs", "dtype"),
        ({"dist_kind": "sparse"}, "dist_kind", "must be"),
        ({"cluster": ""}, "cluster", "empty"),
        ({"timestamp": float("nan")}, "timestamp", "finite"),
        ({"schema": SCHEMA_VERSION + 1}, "schema", "outside"),
    ],
)
def test_invalid_miss_records_are_refused_with_the_field_named(changes, field, words):
    rec = _bad(BASE, **changes)
    with pytest.raises(RecordValidationError) as err:
        codec.encode(rec)
    assert err.value.field == field and words in err.value.reason, str(err.value)


def test_full_distribution_rows_must_cover_the_vocab():
    rec = miss_record(2, kind="full")
    with pytest.raises(RecordValidationError, match="columns"):
        codec.encode(dataclasses.replace(rec, logprobs=rec.logprobs[:, :-1].copy()))


def _raw(rec) -> tuple[bytes, dict]:
    data = codec.encode(rec, compress=False)
    return data[:6], msgpack.unpackb(data[6:], raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))


def _pack(header: bytes, body: dict) -> bytes:
    return header + msgpack.packb(body, use_bin_type=True)


def test_malformed_bytes_are_refused_with_a_reason():
    good = codec.encode(miss_record(1))
    header, body = _raw(miss_record(1))
    cases = {
        b"": "shorter than",
        b"XX" + good[2:]: "bad magic",
        good[:2] + b"\x09" + good[3:]: "unknown record type",
        good[:3] + b"\x07" + good[4:]: "unknown compression",
        good[:4] + (SCHEMA_VERSION + 1).to_bytes(2, "little") + good[6:]: "upgrade the consumer",
        good[:-9]: "zstd",
        header + b"\xc1\xc1": "MessagePack",
        _pack(header, {k: v for k, v in body.items() if k != "pos"}): "positions: missing",
        _pack(header, {**body, "lp": msgpack.ExtType(1, body["lp"].data[:-4])}): "needs",
        _pack(header, {**body, "lp": msgpack.ExtType(7, b"\x00")}): "unknown extension",
        _pack(header, [1, 2, 3]): "expected a map",  # type: ignore[arg-type]
        _pack(header, {**body, "sp": "greedy"}): "sampling",
    }
    for data, words in cases.items():
        with pytest.raises(RecordValidationError) as err:
            codec.decode(data)
        assert words in str(err.value), (words, str(err.value))


def test_unknown_fields_are_ignored_for_forward_compatibility():
    header, body = _raw(model_event())
    rec = codec.decode(_pack(header, {**body, "new_field": 1}))
    assert rec.version == "4"


def test_decompression_is_bounded(monkeypatch):
    monkeypatch.setattr(codec, "MAX_BODY_BYTES", 4096)
    body = msgpack.packb({"pad": b"\x00" * 100_000}, use_bin_type=True)
    data = codec.HEADER.pack(codec.MAGIC, 3, codec.COMPRESS_ZSTD, 1) + zstandard.ZstdCompressor().compress(body)
    assert len(data) < 1000
    with pytest.raises(RecordValidationError, match="zstd"):
        codec.decode(data)


def test_peek_type_names_the_record_or_says_unknown():
    assert codec.peek_type(codec.encode(model_event())) == "ModelEvent"
    assert codec.peek_type(b"nope") == "?"


# ---------------------------------------------------------------- schema 2: what the target saw
def test_v1_bytes_still_decode():
    """Real schema-1 encodings (kept as fixtures) decode with v2's defaults."""
    from pathlib import Path

    from specops.streams.records import ContextSpan

    here = Path(__file__).parent / "fixtures"
    miss = codec.decode((here / "miss_v1.bin").read_bytes())
    gen = codec.decode((here / "generation_v1.bin").read_bytes())
    assert miss.schema == 1 and gen.schema == 1
    assert miss.artifact_versions == {} and miss.context_spans == ()
    assert miss.spans == (ContextSpan("prompt", 0, miss.num_prompt_tokens),)
    assert gen.spans == (ContextSpan("prompt", 0, len(gen.prompt_ids)),)
    assert (gen.request_prompt_ids == gen.prompt_ids).all()
    assert miss.draft_version == "3" and miss.method == "draft"


def test_v2_round_trips_artifacts_and_spans():
    import dataclasses

    from specops.streams.records import SCHEMA_VERSION, ContextSpan

    spans = (ContextSpan("reference", 0, 8), ContextSpan("retrieved", 8, 14), ContextSpan("prompt", 14, 20))
    rec = dataclasses.replace(miss_record(), artifact_versions={"draft": "3", "datastore": "2"}, context_spans=spans)
    back = codec.decode(codec.encode(rec))
    assert back.schema == SCHEMA_VERSION == 2
    assert back.artifact_versions == {"draft": "3", "datastore": "2"} and back.context_spans == spans
    gen = dataclasses.replace(
        generation_record(), context_spans=(ContextSpan("reference", 0, 5), ContextSpan("prompt", 5, 12))
    )
    assert (codec.decode(codec.encode(gen)).request_prompt_ids == gen.prompt_ids[5:12]).all()


@pytest.mark.parametrize(
    "spans, reason",
    [
        ((("prompt", 0, 30),), "past the context"),
        ((("reference", 0, 20),), "no span is the prompt"),
        ((("prompt", 0, 10), ("reference", 5, 20)), "overlaps or is out of order"),
        ((("rumour", 0, 20),), "must be a ContextSpan of kind"),
    ],
)
def test_bad_spans_are_refused_with_the_reason(spans, reason):
    import dataclasses

    from specops.streams.errors import RecordValidationError
    from specops.streams.records import ContextSpan

    rec = dataclasses.replace(miss_record(), context_spans=tuple(ContextSpan(*s) for s in spans))
    with pytest.raises(RecordValidationError, match=reason):
        codec.encode(rec)


# ---------------------------------------------------------------- an external engine's records (no distributions)
def test_external_engine_records_round_trip_and_carry_no_positions():
    """``engine`` names an external engine (vLLM) that logged no distributions: such a record has
    ``m == 0`` and is not ``scored``; our engine's records leave the key out, byte for byte as before."""
    ours = miss_record(4, m=0)
    assert ours.scored and "eng" not in _raw(ours)[1]
    assert codec.encode(ours, compress=False) == codec.encode(dataclasses.replace(ours, engine=""), compress=False)
    vllm = dataclasses.replace(ours, engine="vllm")
    header, body = _raw(vllm)
    assert body["eng"] == "vllm"
    back = codec.decode(codec.encode(vllm))
    assert_same_record(vllm, back)
    assert back.engine == "vllm" and not back.scored and back.num_rejected == 0
    del body["eng"]  # a producer that predates the field: our engine
    assert codec.decode(_pack(header, body)).scored


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"engine": "vllm"}, "positions", "logs no distributions"),  # an external engine with positions
        ({"engine": "v" * 33}, "engine", "longer than 32"),
        ({"engine": 3}, "engine", "expected a string"),
    ],
)
def test_external_engine_records_are_validated(changes, field, words):
    with pytest.raises(RecordValidationError) as err:
        codec.encode(_bad(BASE, **changes))
    assert err.value.field == field and words in err.value.reason, str(err.value)

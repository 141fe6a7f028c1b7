"""``specops sessions rebuild`` on a --tiny bootstrap, a local stream and a real SQLite registry."""

from __future__ import annotations

import json

from specops.cli.main import main
from specops.core.models import load_tokenizer, tokenizer_hash
from specops.registry import RegistryConfig, RegistryStore
from specops.streams import StreamConfig
from tests.trainer.test_sessions import _publish, _slice


def test_sessions_rebuild_registers_and_says_what_it_did(sqlite_uri, tiny_models, tmp_path, capsys):
    stream = f"local://{tmp_path / 'streams'}"
    _publish(StreamConfig(url=stream, fsync=False), [_slice(10 * i) for i in range(6)], "code")
    _publish(StreamConfig(url=stream, fsync=False), [_slice(3)], "prose")
    common = [
        "sessions",
        "rebuild",
        "--registry",
        sqlite_uri,
        "--stream",
        stream,
        "--model-dir",
        str(tiny_models),
        "--min-new",
        "4",
    ]
    assert main([*common, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["consumed"] == 7 and out["status"] == "promoted"
    (row,) = out["clusters"]
    assert (row["cluster"], row["version"], row["outcome"], row["outputs"], row["tokens"]) == (
        "code",
        "1",
        "promoted",
        6,
        120,
    )
    v = RegistryStore(RegistryConfig(uri=sqlite_uri)).artifact("sessions").by_alias("code")
    assert v.version == "1" and v.tags["tokenizer_sha256"] == tokenizer_hash(load_tokenizer(tiny_models / "target"))
    # prose is still short of --min-new, so nothing was committed: everything is read again, and
    # code's outputs name the version they are in (no second version of the same outputs).
    assert main(common) == 0
    text = capsys.readouterr().out
    assert "consumed 7 generations" in text and "sessions-code: version 1 (6 outputs, 120 tokens)" in text
    assert ": unchanged" in text and "waiting for 4 new outputs: prose" in text

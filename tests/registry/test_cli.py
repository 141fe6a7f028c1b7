"""``specops registry ls|promote|rollback|retain`` on a real SQLite store, ModelEvents included."""

from __future__ import annotations

import json

from specops.cli.main import main
from specops.core.models import load_tokenizer, tokenizer_hash
from specops.registry import CHAMPION, RegistryConfig, RegistryStore
from specops.streams import StreamConfig, codec, open_stream


def _sha(models):
    return tokenizer_hash(load_tokenizer(models / "target"))


def test_registry_commands(sqlite_uri, tiny_models, tmp_path, capsys):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    for score in (0.3, 0.4, 0.5):
        reg.artifact("draft").register(
            "code",
            tiny_models / "draft",
            tokenizer_sha256=_sha(tiny_models),
            metrics={"offline_acceptance_sampling": score},
        )
    stream = f"local://{tmp_path}/log"
    common = ["--registry", sqlite_uri]
    checked = ["--model-dir", str(tiny_models)]  # promote checks the version against the target serving uses
    assert main(["registry", "promote", "code", "1", *common, "--stream", stream, *checked]) == 0
    assert (
        main(["registry", "promote", "code", "3", *common, "--stream", stream, "--reason", "canary ok", *checked]) == 0
    )
    assert main(["registry", "rollback", "code", *common, "--stream", stream, "--reason", "p99 regressed"]) == 0
    assert reg.artifact("draft").aliases("code")[CHAMPION] == "1"
    assert reg.artifact("draft").get("code", "3").tags["rolled_back"] == "p99 regressed"
    capsys.readouterr()
    assert main(["registry", "ls", *common, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["version"], r["aliases"], r["status"]) for r in rows] == [
        ("1", "champion", ""),
        ("2", "", ""),
        ("3", "challenger", "rolled back"),
    ]
    assert rows[2]["offline_sampling"] == 0.5
    assert main(["registry", "retain", *common, "--keep", "1"]) == 0
    assert "archived 2" in capsys.readouterr().out
    assert main(["registry", "ls", *common]) == 0  # the table renders
    assert main(["registry", "rollback", "code", *common, "--stream", "none"]) == 2  # nothing before version 1
    assert "no earlier champion" in capsys.readouterr().err
    with open_stream(StreamConfig.from_env(url=stream)) as s:
        events = [codec.decode(m.value) for m in s.read("spec.events", timeout_s=1.0)]
    assert [(e.kind, e.version, e.previous_version) for e in events] == [
        ("promotion", "1", ""),
        ("promotion", "3", "1"),
        ("rollback", "1", "3"),
    ]

"""``specops datastore build|ls|promote|inspect`` on a --tiny bootstrap and a real SQLite registry."""

from __future__ import annotations

import json

import pytest

from specops.cli import main
from specops.registry import RegistryConfig, RegistryStore
from tests.conftest import random_prompts


def test_datastore_commands(sqlite_uri, tiny_models, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "\n".join(
            [json.dumps({"token_ids": p * 3}) for p in random_prompts(8, seed=3)]
            + [
                json.dumps({"prompt_ids": [5, 6, 7], "output_ids": [8, 9, 10, 11]}),
                json.dumps({"text": "def add(a, b):\n    return a + b\n"}),
            ]
        )
    )
    common = ["--registry", sqlite_uri, "--stream", "none"]
    build = [
        "datastore",
        "build",
        "--model-dir",
        str(tiny_models),
        "--documents",
        str(docs),
        "--dims",
        "8",
        "--index",
        "flat",
        *common,
    ]
    assert main([*build, "--out", str(tmp_path / "ds"), "--register", "code"]) == 0
    out = capsys.readouterr().out
    assert "registered datastore-code version 1" in out and "champion -> 1" in out  # first one: promoted
    assert main([*build, "--register", "code"]) == 0  # a second version stays the challenger
    assert "champion ->" not in capsys.readouterr().out
    kind = RegistryStore(RegistryConfig(uri=sqlite_uri)).artifact("datastore")
    v2 = kind.get("code", "2")
    assert v2.tags["source"] == f"file:{docs}" and float(v2.tags["num_entries"]) > 0 and v2.tags["config_hash"]

    assert main(["datastore", "ls", "--registry", sqlite_uri, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["version"], r["aliases"]) for r in rows] == [("1", "champion"), ("2", "challenger")]
    assert rows[1]["entries"] == int(float(v2.tags["num_entries"])) and rows[1]["bytes_per_entry"] > 0
    assert main(["datastore", "ls", "--registry", sqlite_uri]) == 0 and "datastore versions" in capsys.readouterr().out
    assert main(["datastore", "promote", "code", "2", *common, "--reason", "test"]) == 0
    assert "champion 1 -> 2" in capsys.readouterr().out
    assert main(["datastore", "inspect", "--cluster", "code", "--registry", sqlite_uri]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_entries"] == rows[1]["entries"]
    assert main(["datastore", "inspect", str(tmp_path / "ds")]) == 0  # the saved copy verifies and loads
    capsys.readouterr()


def test_bad_documents_name_the_line(tiny_models, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"token_ids": [1, 2, 3]}) + "\n" + json.dumps({"token_ids": [1, -2]}) + "\n")
    with pytest.raises(SystemExit) as exc:
        rc = main(["datastore", "build", "--model-dir", str(tiny_models), "--documents", str(docs), "--stream", "none"])
        raise SystemExit(rc)
    assert exc.value.code != 0
    assert f"{docs}:2" in capsys.readouterr().err

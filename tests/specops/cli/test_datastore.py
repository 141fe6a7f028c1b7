"""``specops datastore build|ls|promote|inspect`` on a --tiny bootstrap and a real SQLite registry."""

from __future__ import annotations

import json

import pytest

from specops.cli.main import main
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


def _build(sqlite_uri, tiny_models, docs, *extra):
    return main(
        [
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
            "--registry",
            sqlite_uri,
            "--stream",
            "none",
            *extra,
        ]
    )


def test_build_measures_the_draft_shape_on_held_out_documents(sqlite_uri, tiny_models, tmp_path, capsys):
    from specops.core.datastore import Datastore

    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"token_ids": p * 3}) for p in random_prompts(20, seed=5)))
    assert _build(sqlite_uri, tiny_models, docs, "--register", "code", "--promote") == 0
    out = capsys.readouterr().out
    assert "from 18 documents" in out and "2 more held out" in out  # every 10th held out, as rebuilds do
    assert "draft shape " in out and "measured on 2 held-out documents" in out and "offline MAR" in out
    kind = RegistryStore(RegistryConfig(uri=sqlite_uri)).artifact("datastore")
    v = kind.by_alias("code")
    kind.fetch(v, tmp_path / "ds")
    shape = Datastore.load(tmp_path / "ds").meta["shape"]  # where serving's resolve_shape reads it
    assert {"n_drafts", "k", "node_cost", "replayed", "mar", "speed_vs_target", "beats_target"} <= set(shape)
    assert v.tags["shape"] == f"{shape['n_drafts']}x{shape['k']}" and v.metric("mar") == pytest.approx(shape["mar"])
    assert v.metric("shape_speed_vs_target") == pytest.approx(shape["speed_vs_target"])
    assert ("no draft shape beats target-only" in out) == (not shape["beats_target"])

    assert main(["datastore", "ls", "--registry", sqlite_uri, "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["shape"] == v.tags["shape"] and row["mar"] == pytest.approx(shape["mar"], abs=1e-4)
    assert row["speed_vs_target"] == pytest.approx(shape["speed_vs_target"])
    assert row["note"] == ("" if shape["beats_target"] else "no shape beats target-only")
    assert main(["datastore", "ls", "--registry", sqlite_uri]) == 0
    assert v.tags["shape"] in capsys.readouterr().out


def test_build_warns_when_no_shape_beats_target_only(sqlite_uri, tiny_models, tmp_path, capsys):
    from specops.cli.artifact import _datastore_note

    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"token_ids": p * 3}) for p in random_prompts(6, seed=7)))
    # a drafted token costing 100 target passes: no shape can beat target-only
    assert _build(sqlite_uri, tiny_models, docs, "--register", "slow", "--node-cost", "100") == 0
    out = capsys.readouterr().out
    assert "1 more held out" in out  # fewer than 10 documents: the last one is held out
    assert "WARNING: no draft shape beats target-only" in out
    assert _build(sqlite_uri, tiny_models, docs, "--register", "unmeasured", "--heldout-every", "0") == 0
    assert "WARNING: --heldout-every 0: no measured draft shape" in capsys.readouterr().out
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"token_ids": [1, 2, 3, 4, 5]}) + "\n")
    assert _build(sqlite_uri, tiny_models, one, "--out", str(tmp_path / "one")) == 0
    assert "too few to hold one out" in capsys.readouterr().out

    assert main(["datastore", "ls", "--registry", sqlite_uri, "--json"]) == 0
    rows = {r["cluster"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["slow"]["note"] == "no shape beats target-only" and rows["slow"]["speed_vs_target"] < 1.0
    assert rows["unmeasured"]["note"].startswith("no measured shape") and rows["unmeasured"]["shape"] == ""
    assert main(["datastore", "ls", "--registry", sqlite_uri]) == 0
    table = capsys.readouterr().out
    assert "no shape beats target-only" in table and "no measured shape" in table
    assert _datastore_note(1.3) == ""

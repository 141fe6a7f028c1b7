"""``specops artifact KIND ls|describe|promote|rollback|retain`` on a real SQLite registry: one set of
commands for every kind (drafts, datastores and the router here), and the per-kind aliases are the same code."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from specops.cli import (
    artifact,
    datastore,
    kb,
    knnlm,
    registry,
    router,
)
from specops.cli.main import build_parser, main
from specops.core.models import load_tokenizer, tokenizer_hash
from specops.registry import CHAMPION, KINDS, RegistryConfig, RegistryStore
from tests.registry.router_factory import saved_router


def _json_rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _sha(models):
    return tokenizer_hash(load_tokenizer(models / "target"))


def test_artifact_commands_on_drafts(sqlite_uri, tiny_models, capsys):
    drafts = RegistryStore(RegistryConfig(uri=sqlite_uri)).artifact("draft")
    for score in (0.3, 0.4, 0.5):
        drafts.register(
            "code",
            tiny_models / "draft",
            tokenizer_sha256=_sha(tiny_models),
            metrics={"offline_acceptance_sampling": score},
        )
    reg, events = ["--registry", sqlite_uri], ["--registry", sqlite_uri, "--stream", "none"]
    assert main(["artifact", "draft", "promote", "code", "1", *events, "--model-dir", str(tiny_models)]) == 0
    assert capsys.readouterr().out.strip() == "draft-code: champion none -> 1"
    assert (
        main(
            [
                "artifact",
                "draft",
                "promote",
                "code",
                "3",
                *events,
                "--reason",
                "canary ok",
                "--model-dir",
                str(tiny_models),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == "draft-code: champion 1 -> 3"
    assert main(["artifact", "draft", "ls", *reg, "--json"]) == 0
    rows = _json_rows(capsys)
    assert [(r["model"], r["version"], r["aliases"]) for r in rows] == [
        ("draft-code", "1", ""),
        ("draft-code", "2", ""),
        ("draft-code", "3", "challenger,champion"),
    ]
    assert rows[2]["offline_sampling"] == 0.5
    assert main(["artifact", "draft", "rollback", "code", *events, "--reason", "p99 regressed"]) == 0
    assert "champion 3 -> 1 (rolled back)" in capsys.readouterr().out
    assert drafts.aliases("code")[CHAMPION] == "1" and drafts.get("code", "3").tags["rolled_back"] == "p99 regressed"
    assert main(["artifact", "draft", "describe", "code", *reg]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["model"] == "draft-code" and described["aliases"] == {"champion": "1", "challenger": "3"}
    assert described["versions"][2]["tags"]["rolled_back"] == "p99 regressed"
    assert main(["artifact", "draft", "retain", *reg, "--keep", "1"]) == 0
    assert "draft-code: archived 2" in capsys.readouterr().out
    assert main(["artifact", "draft", "ls", *reg]) == 0 and "draft versions" in capsys.readouterr().out


def _datastore_dir(path, n: int):
    path.mkdir(parents=True)
    save_file({"keys": torch.randn(n, 4), "next_tokens": torch.arange(n)}, str(path / "datastore.safetensors"))
    (path / "datastore.json").write_text(json.dumps({"num_entries": n}))
    return path


def test_artifact_commands_on_datastores_and_the_router(sqlite_uri, tmp_path, capsys):
    store = RegistryStore(RegistryConfig(uri=sqlite_uri))
    ds = store.artifact("datastore")
    for i in range(2):
        ds.register("sql", _datastore_dir(tmp_path / f"d{i}", 4 + i), metrics={"num_entries": 4.0 + i})
    reg, events = ["--registry", sqlite_uri], ["--registry", sqlite_uri, "--stream", "none"]
    assert main(["artifact", "datastore", "promote", "sql", "1", *events]) == 0
    assert main(["artifact", "datastore", "promote", "sql", "2", *events]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "datastore-sql: champion 1 -> 2"
    assert main(["artifact", "datastore", "ls", *reg, "--json"]) == 0
    rows = _json_rows(capsys)
    assert [(r["cluster"], r["version"], r["aliases"], r["entries"]) for r in rows] == [
        ("sql", "1", "", 4),
        ("sql", "2", "challenger,champion", 5),
    ]
    assert main(["datastore", "ls", *reg, "--json"]) == 0  # the alias prints the same rows
    assert _json_rows(capsys) == rows
    assert main(["artifact", "datastore", "rollback", "sql", *events]) == 0
    assert ds.by_alias("sql").version == "1" and "(rolled back)" in capsys.readouterr().out
    assert main(["artifact", "datastore", "describe", "sql", *reg]) == 0
    assert json.loads(capsys.readouterr().out)["aliases"]["champion"] == "1"

    routers = store.artifact("router")  # an unkeyed kind: no key argument
    first = routers.register("", saved_router(tmp_path / "r1", ("a", "b"))).version
    second = routers.register("", saved_router(tmp_path / "r2", ("a", "b", "c"))).version
    assert main(["artifact", "router", "promote", first, *events]) == 0
    assert main(["router", "promote", second, *events, "--reason", "alias"]) == 0
    assert f"router: champion {first} -> {second}" in capsys.readouterr().out
    assert main(["artifact", "router", "rollback", *events]) == 0
    assert routers.by_alias().version == first and "(rolled back)" in capsys.readouterr().out
    assert main(["artifact", "router", "ls", *reg, "--json"]) == 0
    rows = _json_rows(capsys)
    assert [(r["version"], r["clusters"]) for r in rows] == [(first, "a,b"), (second, "a,b,c")]
    assert main(["artifact", "router", "describe", *reg]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "router"


def test_every_kind_has_the_five_commands_and_the_aliases_share_their_code():
    parser = build_parser()
    for kind in KINDS:
        for command in ("ls", "describe", "promote", "rollback", "retain"):
            argv = ["artifact", kind, command] + (
                ["k"] if KINDS[kind].keyed and command in ("describe", "promote", "rollback") else []
            )
            argv += ["7"] if command == "promote" else []
            assert parser.parse_args(argv).func.__module__ == "specops.cli.artifact", argv
    for argv in (
        ["registry", "ls"],
        ["registry", "promote", "c", "1"],
        ["registry", "rollback", "c"],
        ["registry", "retain"],
        ["datastore", "ls"],
        ["datastore", "promote", "c", "1"],
        ["router", "ls"],
        ["router", "promote", "1"],
        ["kb", "ls"],
        ["knnlm", "ls"],
    ):
        assert parser.parse_args(argv).func.__module__ == "specops.cli.artifact", argv
    args = parser.parse_args(["registry", "retain", "--cluster", "code", "--keep", "3"])
    assert (args.registry_command, args.kind, args.key, args.keep) == ("retain", "draft", "code", 3)
    for module in (datastore, kb, knnlm, registry, router):
        assert not hasattr(module, "cmd_ls"), module.__name__  # no listing of their own
    assert artifact.LISTINGS.keys() <= KINDS.keys()

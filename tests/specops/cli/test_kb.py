"""``specops kb build|ls|search`` on a few text files and a real SQLite registry."""

from __future__ import annotations

import json

from specops.cli.main import main
from specops.registry import RegistryConfig, RegistryStore
from specops.serving.retrieval.kb import load_kb_from_registry

TEXTS = {
    "otters.txt": "Sea otters hold hands while they sleep so that they do not drift apart on the ocean currents. ",
    "volcano.txt": "Basaltic lava from a shield volcano flows far because it is runny and poor in silica. ",
    "teapot.txt": "A cast iron teapot keeps green tea warm while the leaves steep for three minutes. ",
}


def test_kb_build_ls_search(sqlite_uri, tiny_models, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for name, text in TEXTS.items():
        (src / name).write_text(text * 4)
    common = ["--registry", sqlite_uri, "--stream", "none"]
    build = [
        "kb",
        "build",
        "--name",
        "facts",
        "--source",
        str(src),
        "--embedder",
        "hash",
        "--model-dir",
        str(tiny_models),
        *common,
    ]
    assert main([*build, "--out", str(tmp_path / "kb")]) == 0
    out = capsys.readouterr().out
    assert "3 passages from 3 files" in out and "registered kb-facts version 1 (challenger, champion)" in out

    kind = RegistryStore(RegistryConfig(uri=sqlite_uri)).artifact("kb")
    v = kind.by_alias("facts")
    assert v.version == "1" and v.tags["embedder"] == "hash" and v.tags["retrievers"] == "exact,hnsw,scann,bm25"
    kb = load_kb_from_registry(RegistryStore(RegistryConfig(uri=sqlite_uri)), "facts", cache_dir=tmp_path / "cache")
    assert kb.version == "1" and kb.num_passages == 3 and kb.meta["chunking"]["tokenizer"].startswith("the target's")
    (tmp_path / "cache" / "kb-facts" / "1" / "bm25.json").write_text("{}")  # a damaged cached copy is fetched again
    again = load_kb_from_registry(RegistryStore(RegistryConfig(uri=sqlite_uri)), "facts", cache_dir=tmp_path / "cache")
    assert again.passages([0]) == kb.passages([0])

    assert main(["kb", "ls", "--registry", sqlite_uri, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["name"], r["version"], r["aliases"], r["passages"], r["retrievers"]) for r in rows] == [
        ("facts", "1", "challenger,champion", 3, "exact,hnsw,scann,bm25")
    ]
    assert rows[0]["bytes_per_passage"] > 0
    assert main(["kb", "ls", "--registry", sqlite_uri]) == 0 and "knowledge bases" in capsys.readouterr().out

    for retriever in ("exact", "bm25", "hnsw"):
        assert (
            main(
                [
                    "kb",
                    "search",
                    "facts",
                    "why do sea otters hold hands",
                    "--retriever",
                    retriever,
                    "-k",
                    "2",
                    "--registry",
                    sqlite_uri,
                ]
            )
            == 0
        )
        out = capsys.readouterr().out.splitlines()
        assert "kb facts (version 1, 3 passages)" in out[0] and out[1].split()[-1] == "otters.txt", (retriever, out)
        assert "Sea otters hold hands" in out[2]
    assert main(["kb", "search", "facts", "iron teapot", "--kb-dir", str(tmp_path / "kb"), "-k", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("teapot.txt")


def test_kb_errors_name_what_to_fix(sqlite_uri, tiny_models, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(TEXTS["otters.txt"] * 3)
    assert (
        main(
            [
                "kb",
                "build",
                "--name",
                "small",
                "--source",
                str(src),
                "--embedder",
                "hash",
                "--retrievers",
                "exact,bm25",
                "--model-dir",
                str(tiny_models),
                "--out",
                str(tmp_path / "kb"),
                "--no-register",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["kb", "search", "small", "otters", "--retriever", "scann", "--kb-dir", str(tmp_path / "kb")]) == 2
    assert "no 'scann' retriever; it was built with exact, bm25" in capsys.readouterr().err
    assert main(["kb", "search", "nothing", "otters", "--registry", sqlite_uri]) == 2
    assert "kb-nothing has no version" in capsys.readouterr().err
    assert main(["kb", "build", "--name", "x", "--source", str(src), "--no-register", "--stream", "none"]) == 2
    assert "--no-register without --out" in capsys.readouterr().err

"""``specops knnlm build|ls`` on a --tiny bootstrap and a real SQLite registry."""

from __future__ import annotations

import json

import pytest

from specops.cli.main import main
from specops.core.models import load_model, load_tokenizer, tokenizer_hash
from specops.registry import RegistryConfig, RegistryStore
from specops.serving.ralm.knnlm.decode import KnnConfig, KnnLM
from specops.serving.ralm.knnlm.store import KnnDatastoreError, load_knnlm

TEXT = (
    "The quick brown fox jumps over the lazy dog. A printer queue holds jobs until the spooler sends them.\n"
    "Partition tables describe the sectors of a disk; the shell expands variables before a command.\n"
)


def test_knnlm_build_and_ls(sqlite_uri, tiny_models, tmp_path, capsys):
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    for i in range(3):
        (src / "sub" / f"doc{i}.txt").write_text(TEXT * (i + 2))
    common = ["--registry-uri", sqlite_uri, "--stream", "none"]
    build = ["knnlm", "build", "--name", "notes", "--models", str(tiny_models), "--max-tokens", "600", *common]
    assert main([*build, "--source", str(src), "--out", str(tmp_path / "saved")]) == 0
    out = capsys.readouterr().out
    assert "registered knnlm-notes version 1" in out and "champion -> 1" in out
    # the default source: the bootstrap's prose training files; ivfpq; a challenger only
    assert main([*build, "--index", "ivfpq", "--nprobe", "2", "--no-promote"]) == 0
    assert "champion ->" not in capsys.readouterr().out

    assert main(["knnlm", "ls", "--registry", sqlite_uri, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["version"], r["aliases"], r["searcher"]) for r in rows] == [
        ("1", "champion", "exact"),
        ("2", "challenger", "ivfpq"),
    ]
    assert rows[0]["entries"] > 100 and rows[1]["bytes_per_entry"] < rows[0]["bytes_per_entry"]
    assert rows[0]["source"].startswith("files:") and rows[1]["source"] == "bootstrap-prose-train"
    assert (
        main(["knnlm", "ls", "--registry", sqlite_uri]) == 0 and "kNN-LM datastore versions" in capsys.readouterr().out
    )

    # the champion loads from the registry, verified, for this target and tokenizer, and decodes
    target = load_model(tiny_models / "target")
    tok_sha = tokenizer_hash(load_tokenizer(tiny_models / "target"))
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    store, v = load_knnlm(reg, "notes", target=target, tokenizer_sha256=tok_sha)
    assert v.version == "1" and store.num_entries == rows[0]["entries"] and store.searcher.kind == "exact"
    prompt = load_tokenizer(tiny_models / "target")("The printer queue", add_special_tokens=False)["input_ids"]
    base = KnnLM(target, store, KnnConfig(mode="baseline", k=8)).generate(prompt)
    assert KnnLM(target, store, KnnConfig(k=8)).generate(prompt).token_ids == base.token_ids
    ivf, _ = load_knnlm(reg, "notes", alias="challenger", target=target, nprobe=3)
    assert ivf.searcher.kind == "ivfpq" and ivf.searcher.nprobe == 3
    with pytest.raises(KnnDatastoreError, match="tokenizer"):
        load_knnlm(reg, "notes", target=target, tokenizer_sha256="0" * 64)
    with pytest.raises(KnnDatastoreError, match="no version"):
        load_knnlm(reg, "other")


def test_no_source_files_is_a_clear_error(tiny_models, tmp_path, capsys):
    rc = main(
        [
            "knnlm",
            "build",
            "--name",
            "x",
            "--models",
            str(tiny_models),
            "--source",
            str(tmp_path / "none*"),
            "--no-register",
        ]
    )
    assert rc != 0 and "no file found" in capsys.readouterr().err

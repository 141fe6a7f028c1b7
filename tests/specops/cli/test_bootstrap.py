"""``specops bootstrap`` puts the router's MiniLM embedder on the models volume beside the pair
(``--embedder-only`` for a models directory filled another way)."""

from __future__ import annotations

import pytest
import torch

from specops.cli.main import main
from specops.core import embed
from specops.core.embed import check_minilm_dir


def run(*args: str) -> int:
    threads = str(torch.get_num_threads())  # in-process: leave the other tests' thread count as it is
    return main(["--threads", threads, "bootstrap", *args])


def test_bootstrap_copies_the_embedder_into_the_models_dir(tmp_path, capsys):
    out = tmp_path / "models"
    assert run("--tiny", "--out", str(out)) == 0
    assert f"router embedder (all-MiniLM-L6-v2) ready in {out / 'embedder'}" in capsys.readouterr().out
    assert check_minilm_dir(out / "embedder") == out / "embedder"
    assert sorted(p.name for p in out.iterdir()) == ["draft", "embedder", "manifest.json", "target"]
    assert embed.MiniLMEmbedder(out / "embedder").config_sha256 == embed.MiniLMEmbedder().config_sha256


def test_embedder_only_fills_a_models_dir_made_another_way(tmp_path, capsys, monkeypatch):
    out = tmp_path / "own-target"
    (out / "target").mkdir(parents=True)
    (out / "target" / "config.json").write_text("{}")
    assert run("--embedder-only", "--out", str(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["embedder", "target"]  # nothing else built or replaced
    check_minilm_dir(out / "embedder")
    capsys.readouterr()
    monkeypatch.setattr(embed, "minilm_package_dir", lambda: None)  # an image without the package
    assert run("--embedder-only", "--out", str(out)) == 0  # a valid copy is kept
    assert "router embedder kept in" in capsys.readouterr().out
    assert run("--embedder-only", "--out", str(tmp_path / "empty")) == 1
    assert "error: the router embedder was not copied" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run("--embedder-only", "--tiny", "--out", str(out))  # one kind of work per run

"""``specops models check``, and a trainer started on a models directory without the router's embedder.

The check is the one serving's load would fail on, run without weights; the marker it writes is what the chart's
pods wait for. A trainer that refits routers on the minilm embedder, started where embedder/ is missing (your own
model pair in compose), exits at once saying which command fills it and which setting does without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specops.cli.main import main
from specops.core.embed import EMBEDDER_DIR_ENV, MINILM_FILES
from specops.core.model_layout import READY_MARKER, file_sha256, layout_files


def a_models_dir(tiny_models: Path, dest: Path, *, embedder: bool = True) -> Path:
    """A copy of the tiny bootstrap at ``dest`` with, unless not ``embedder``, an embedder/ of small stand-in files
    (every file the MiniLM check requires, no embedder.json: the layout check reads no weights)."""
    shutil.copytree(tiny_models, dest, ignore=shutil.ignore_patterns("embedder", READY_MARKER))
    if embedder:
        (dest / "embedder").mkdir()
        for name in MINILM_FILES:
            (dest / "embedder" / name).write_text(json.dumps({"stand-in": name}))
    return dest


def test_check_passes_a_complete_directory_and_marks_it(tiny_models, tmp_path, capsys):
    src = a_models_dir(tiny_models, tmp_path / "models")
    assert main(["models", "check", str(src)]) == 0
    assert "share one tokenizer" in capsys.readouterr().out and not (src / READY_MARKER).exists()
    assert main(["models", "check", "--mark", str(src)]) == 0
    marker = json.loads((src / READY_MARKER).read_text())
    assert sorted(marker["files"]) == list(layout_files(src)) and READY_MARKER not in marker["files"]
    entry = marker["files"]["target/model.safetensors"]
    assert entry["sha256"] == file_sha256(src / "target/model.safetensors")
    assert entry["size"] == (src / "target/model.safetensors").stat().st_size
    assert [p.name for p in src.iterdir() if p.name.startswith(".")] == [], "no temporary marker left"


def test_check_names_what_is_missing_and_marks_nothing(tiny_models, tmp_path, capsys):
    src = a_models_dir(tiny_models, tmp_path / "models", embedder=False)
    assert main(["models", "check", "--mark", str(src)]) == 2
    err = capsys.readouterr().err
    assert "has no embedder/" in err and f"specops bootstrap --embedder-only --out {src}" in err
    assert not (src / READY_MARKER).exists()
    assert main(["models", "check", "--no-embedder", "--mark", str(src)]) == 0
    assert json.loads((src / READY_MARKER).read_text())["embedder"] is False
    (src / "draft" / "tokenizer.json").unlink()
    assert main(["models", "check", "--no-embedder", str(src)]) == 2
    assert "draft: no tokenizer loads from it" in capsys.readouterr().err


def test_a_trainer_without_the_router_embedder_says_which_command_fills_it(tiny_models, tmp_path, monkeypatch, capsys):
    """Compose with your own model (issue 58): train.toml's router_refit_every builds the router's embedder at
    start, from SPECOPS_EMBEDDER_DIR (the images: /models/default/embedder), which nothing filled."""
    models = tmp_path / "default"
    shutil.copytree(tiny_models, models, ignore=shutil.ignore_patterns("embedder"))
    monkeypatch.setenv("SPECOPS_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv(EMBEDDER_DIR_ENV, str(models / "embedder"))
    argv = ["train", "--model-dir", str(models), "--stream", f"local://{tmp_path / 'streams'}"]
    argv += ["--router-refit-every", "600", "--max-records", "1", "--idle-exit", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "specops train: error: --router-refit-every" in err
    assert f"holds no MiniLM embedder: run `specops bootstrap --embedder-only --out {models}`" in err
    assert "leaves target/ and draft/ alone" in err and "--router-embedder target" in err
    assert "router_refit_every = 0" in err


@pytest.mark.parametrize("name", ["embedder", "minilm"])
def test_the_embedder_hint_names_the_directory_bootstrap_writes(name, tmp_path, monkeypatch):
    from specops.core.embed import minilm_dir
    from specops.core.errors import RouterError

    monkeypatch.setenv(EMBEDDER_DIR_ENV, str(tmp_path / name))
    with pytest.raises(RouterError) as err:
        minilm_dir()
    if name == "embedder":
        assert f"--embedder-only --out {tmp_path}`" in str(err.value)
    else:  # --embedder-only writes OUT/embedder: not this directory's name
        assert "--embedder-only --out DIR` (it writes DIR/embedder: copy that to" in str(err.value)

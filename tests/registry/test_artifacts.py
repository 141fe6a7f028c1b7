"""Draft artifacts: what gets packed, and every way a download is refused."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from specops.registry.artifacts import MANIFEST, pack, verify_dir
from specops.registry.errors import ArtifactFormatError, ArtifactIntegrityError


@pytest.fixture
def packed(tiny_models, tmp_path) -> tuple[Path, str]:
    out = tmp_path / "packed"
    return out, pack(tiny_models / "draft", out, meta={"cluster": "c"})


def test_pack_is_safetensors_and_json_with_checksums(packed, tiny_models):
    out, sha = packed
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", MANIFEST} <= names
    assert all(n.endswith((".safetensors", ".json")) for n in names)
    manifest = verify_dir(out, sha)
    assert manifest["meta"]["cluster"] == "c" and len(manifest["meta"]["config_sha256"]) == 64
    digest = hashlib.sha256((tiny_models / "draft" / "model.safetensors").read_bytes()).hexdigest()
    assert manifest["files"]["model.safetensors"]["sha256"] == digest


def test_checkpoint_leaves_optimizer_out_and_borrows_the_tokenizer(tiny_models, tmp_path):
    ckpt = tmp_path / "v000001"
    ckpt.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copy(tiny_models / "draft" / name, ckpt / name)
    (ckpt / "optimizer.safetensors").write_bytes(b"x")
    (ckpt / "trained.safetensors").write_bytes(b"x")  # the trained weights behind a published average
    (ckpt / "state.json").write_text("{}")
    with pytest.raises(ArtifactFormatError, match="tokenizer"):
        pack(ckpt, tmp_path / "no-tok")
    pack(ckpt, tmp_path / "out", tokenizer_dir=tiny_models / "target")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert "optimizer.safetensors" not in names and "state.json" not in names and "tokenizer.json" in names
    assert "trained.safetensors" not in names


def test_pack_refuses_pickles_and_dirs_without_weights(tiny_models, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(tiny_models / "draft", d)
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ArtifactFormatError, match="only .safetensors, .json, .jinja files"):
        pack(d, tmp_path / "out")
    (d / "pytorch_model.bin").unlink()
    (d / "model.safetensors").unlink()
    with pytest.raises(ArtifactFormatError, match="no .safetensors"):
        pack(d, tmp_path / "out2")


@pytest.mark.parametrize("damage", ["flip_weight", "truncate", "extra_file", "missing_file", "manifest_edit", "pickle"])
def test_verify_refuses_damage(packed, damage):
    out, sha = packed
    if damage == "flip_weight":
        data = bytearray((out / "model.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (out / "model.safetensors").write_bytes(bytes(data))
    elif damage == "truncate":
        (out / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:-10])
    elif damage == "extra_file":
        (out / "extra.json").write_text("{}")
    elif damage == "missing_file":
        (out / "config.json").unlink()
    elif damage == "manifest_edit":
        m = json.loads((out / MANIFEST).read_text())
        m["meta"]["cluster"] = "other"
        (out / MANIFEST).write_text(json.dumps(m))
    elif damage == "pickle":  # a manifest that lists a pickle, consistently hashed: still refused
        (out / "evil.bin").write_bytes(b"x")
        m = json.loads((out / MANIFEST).read_text())
        m["files"]["evil.bin"] = {"sha256": hashlib.sha256(b"x").hexdigest(), "bytes": 1}
        blob = json.dumps(m).encode()
        (out / MANIFEST).write_bytes(blob)
        sha = hashlib.sha256(blob).hexdigest()
    with pytest.raises(ArtifactIntegrityError):
        verify_dir(out, sha)

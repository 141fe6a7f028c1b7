"""``specops registry promote`` runs the checks serving runs before it swaps a version in (issue 58):
a version every replica would refuse (a flipped byte, a mis-shaped, NaN or missing tensor, another
vocabulary, another tokenizer) is refused with the reason and the champion stays; ``registry ls``
shows which version each replica serves and what it refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from specops.cli.main import main
from specops.core.errors import ModelConfigError
from specops.core.models import load_model, load_tokenizer, tokenizer_hash
from specops.registry import CHAMPION, RegistryConfig, RegistryStore
from tests.conftest import tiny_llama


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _weights(path: Path) -> Path:
    return next(path.glob("*.safetensors"))


def _variants(tiny_models: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Broken drafts, each with the words its refusal must contain."""
    draft = tiny_models / "draft"
    out: dict[str, tuple[Path, str]] = {}
    shape = _copy(draft, root / "shape")  # the config says another width than the weights have
    cfg = json.loads((shape / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (shape / "config.json").write_text(json.dumps(cfg))
    out["shape"] = (shape, "mlp.")
    nan = _copy(draft, root / "nan")
    tensors = load_file(_weights(nan))
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, _weights(nan), metadata={"format": "pt"})
    out["nan"] = (nan, "non-finite")
    missing = _copy(draft, root / "missing")
    tensors = load_file(_weights(missing))
    gone = next(k for k in tensors if k.endswith("layers.0.mlp.down_proj.weight"))
    del tensors[gone]
    save_file(tensors, _weights(missing), metadata={"format": "pt"})
    out["missing"] = (missing, "missing_keys")
    vocab = root / "vocab"  # the target's tokenizer, another vocabulary
    tiny_llama(32, 1, seed=3, vocab=101).save_pretrained(vocab, safe_serialization=True)
    for f in draft.glob("tokenizer*"):
        shutil.copy(f, vocab / f.name)
    out["vocab"] = (vocab, "vocabulary 101")
    return out


@pytest.fixture
def reg(sqlite_uri):
    return RegistryStore(RegistryConfig(uri=sqlite_uri))


def _promote(uri: str, tiny_models: Path, version: str, *extra: str) -> int:
    argv = ["registry", "promote", "code", version, "--registry", uri, "--stream", "none"]
    return main([*argv, "--model-dir", str(tiny_models), *extra])


def test_promote_refuses_what_serving_would_refuse(reg, sqlite_uri, tiny_models, tmp_path, capsys):
    drafts = reg.artifact("draft")
    sha = tokenizer_hash(load_tokenizer(tiny_models / "target"))
    good = drafts.register("code", tiny_models / "draft", tokenizer_sha256=sha).version
    assert _promote(sqlite_uri, tiny_models, good) == 0
    cases = {
        k: (drafts.register("code", p, tokenizer_sha256=sha).version, w)
        for k, (p, w) in _variants(tiny_models, tmp_path).items()
    }
    cases["tokenizer"] = (
        drafts.register("code", tiny_models / "draft", tokenizer_sha256="f" * 64).version,
        "tokenizer",
    )
    flipped = drafts.register("code", tiny_models / "draft", tokenizer_sha256=sha)
    stored = next(p for p in Path(tmp_path.parent).rglob("*.safetensors") if flipped.run_id in str(p))
    data = bytearray(stored.read_bytes())
    data[-10] ^= 0xFF
    stored.write_bytes(bytes(data))
    cases["flipped byte"] = (flipped.version, "sha256")
    capsys.readouterr()
    for what, (version, words) in cases.items():
        assert _promote(sqlite_uri, tiny_models, version) == 2, what
        err = capsys.readouterr().err
        assert "not promoted:" in err and words in err.split("not promoted:")[1], (what, err)
        assert drafts.aliases("code")[CHAMPION] == good, what
    # the operator's override: moved unchecked (serving then keeps the old one and says so)
    assert _promote(sqlite_uri, tiny_models, cases["nan"][0], "--no-validate") == 0
    assert drafts.aliases("code")[CHAMPION] == cases["nan"][0]
    # without a target to check against, it says what to pass
    assert (
        main(
            [
                "registry",
                "promote",
                "code",
                good,
                "--registry",
                sqlite_uri,
                "--stream",
                "none",
                "--model-dir",
                str(tmp_path / "nowhere"),
            ]
        )
        == 2
    )
    assert "--model-dir" in capsys.readouterr().err


def test_a_mis_shaped_tensor_is_named_with_both_shapes(tiny_models, tmp_path):
    shape, _ = _variants(tiny_models, tmp_path)["shape"]
    with pytest.raises(ModelConfigError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight .* shape \[\d+, \d+\]"):
        load_model(shape)
    with pytest.raises(ModelConfigError) as info:
        load_model(shape)
    msg = str(info.value)
    assert msg.count("[") == 2 and "config.json" in msg and "ignore_mismatched_sizes" not in msg, msg


def test_ls_shows_what_each_replica_serves_and_refused(reg, sqlite_uri, tiny_models, capsys):
    drafts = reg.artifact("draft")
    for _ in range(3):
        drafts.register("code", tiny_models / "draft", tokenizer_sha256="t")
    drafts.report_served("code", "pod-a-8000", "1")
    drafts.report_served("code", "pod-b-8000", "1", "3: its tokenizer (sha256 0123) is not the target's")
    drafts.report_served("code", "pod-c-8000", "2")
    capsys.readouterr()
    assert main(["registry", "ls", "--registry", sqlite_uri, "--json"]) == 0
    rows = {r["version"]: r["served_by"] for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows == {"1": ["pod-a-8000", "pod-b-8000"], "2": ["pod-c-8000"], "3": []}
    assert main(["registry", "ls", "--registry", sqlite_uri]) == 0
    out = capsys.readouterr().out
    assert "served by" in out and "pod-c-8000" in out
    assert "replica pod-b-8000 serves 1 and refused version 3: its tokenizer" in out

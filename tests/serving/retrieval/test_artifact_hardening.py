"""Loaded artifacts are verified, and a bad one is refused once, clearly:

- a corrupt registry KB champion is refused once and retried with backoff, not re-fetched per
  request: a 503 naming ``retrieval.kb`` while nothing good is loaded, the last good version
  serving otherwise (issue 34, item 5);
- a DReSD datastore (``--datastore-dir``, or a registry version) carries a sha256 of every file
  and of its description: a flipped byte, a token id of -3, NaN in the projection, an unlisted
  file or a datastore of the unverifiable first format are refused naming the file (item 6)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from specops.core import datastore as ds
from specops.core.datastore import (
    DATA_FILE,
    INDEX_FILE,
    META_FILE,
    Datastore,
    DatastoreConfig,
)
from specops.core.errors import ArtifactUnavailableError, DatastoreError
from specops.core.index import IndexConfig
from specops.core.passage import Passage
from specops.registry import RegistryConfig, RegistryStore
from specops.registry.artifacts import sha256_file
from specops.serving.fleet.catalog import NamedArtifacts
from specops.serving.retrieval.kb import KnowledgeBase, build_kb, register_kb
from tests.serving.http.api_support import MODEL, assert_error, running, serve_config

TEXTS = {
    "ls(1)": "ls lists directory contents. With -l it shows permissions, owners, sizes and times of each file.",
    "cp(1)": "cp copies files and directories. With -r it copies directories recursively, keeping the tree.",
    "tar(1)": "tar stores many files in one archive and extracts them again; -z compresses with gzip.",
    "grep(1)": "grep prints lines that match a pattern; -i ignores case and -r searches directories.",
}
CFG = DatastoreConfig(dims=16, value_len=12, index=IndexConfig(kind="flat"))


# ---------------------------------------------------------------- item 5: a corrupt KB champion
def _kb(name: str, extra: str = "") -> KnowledgeBase:
    passages = [
        Passage(i, title, text + extra, source=f"/man/{title}") for i, (title, text) in enumerate(TEXTS.items())
    ]
    return build_kb(name, passages, embedder="hash", retrievers=("exact",), progress=False)


def _register(reg, name: str, *, extra: str = "", corrupt: bool = False) -> str:
    """A version of ``kb-<name>`` promoted to champion; ``corrupt``: a byte of its stored file flipped
    after registration (the registry's manifest no longer matches)."""
    v = register_kb(reg, _kb(name, extra), promote=True)
    if corrupt:
        stored = Path(v.source.removeprefix("file://")) / "passages.safetensors"
        blob = bytearray(stored.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        stored.write_bytes(bytes(blob))
    return str(v.version)


def _post(srv, kb: str):
    return requests.post(
        f"{srv.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "how do I copy a directory",
            "max_tokens": 2,
            "temperature": 0,
            "retrieval": {"kb": kb, "retriever": "exact"},
        },
        timeout=120,
    )


def test_a_corrupt_kb_champion_is_refused_once_with_a_503_and_retried_with_backoff(tiny_models, sqlite_uri, tmp_path):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    broken = _register(reg, "broken", corrupt=True)
    good = _register(reg, "docs")
    with running(serve_config(tiny_models, registry=sqlite_uri), tmp_path / "srv") as srv:
        kbs = srv.state.kbs
        kbs.backoff_initial_s, kbs.backoff_max_s = 30.0, 120.0  # no retry falls inside this test by itself

        # Nothing good of "broken": a 503 naming the field, fetched once for five requests.
        for _ in range(5):
            err = assert_error(_post(srv, "broken"), 503, "artifact_unavailable", "retrieval.kb")
        assert f"version {broken} of kb-broken" in err["message"] and "ArtifactIntegrityError" in err["message"]
        assert kbs.attempts["broken"] == 1
        refusal = kbs.refused["broken"]
        assert refusal.version == broken and refusal.attempts == 1
        # The backoff over: one more fetch, refused again, the next delay doubled.
        kbs.refused["broken"] = type(refusal)(refusal.version, refusal.reason, 1, time.monotonic() - 1)
        assert_error(_post(srv, "broken"), 503, "artifact_unavailable", "retrieval.kb")
        assert_error(_post(srv, "broken"), 503, "artifact_unavailable", "retrieval.kb")
        assert kbs.attempts["broken"] == 2 and kbs.refused["broken"].attempts == 2
        assert 50 < kbs.refused["broken"].retry_at - time.monotonic() <= 60

        # A good version serves; a corrupt new champion is refused and the good one keeps serving.
        ok = _post(srv, "docs")
        assert ok.status_code == 200, ok.text
        assert ok.json()["retrieval"]["kb_version"] == good
        bad = _register(reg, "docs", extra=" Changed.", corrupt=True)
        assert kbs.poll_once() == [] and kbs.refused["docs"].version == bad
        assert kbs.poll_once() == [] and kbs.attempts["docs"] == 2  # within its backoff: not fetched again
        for _ in range(3):
            again = _post(srv, "docs")
            assert again.status_code == 200, again.text
            assert again.json()["retrieval"]["kb_version"] == good
        assert kbs.attempts["docs"] == 2


def test_a_refused_name_recovers_when_a_good_champion_arrives(sqlite_uri, tmp_path):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    _register(reg, "docs", corrupt=True)
    kbs = NamedArtifacts(
        "kb",
        KnowledgeBase.load,
        registry=reg,
        cache_dir=tmp_path / "cache",
        field="retrieval.kb",
        backoff_initial_s=30.0,
    )
    with pytest.raises(ArtifactUnavailableError) as info:
        kbs.get("docs")
    assert info.value.param == "retrieval.kb"
    with pytest.raises(ArtifactUnavailableError):
        kbs.get("docs")
    assert kbs.attempts["docs"] == 1
    fixed = _register(reg, "docs", extra=" Fixed.")
    assert kbs.poll_once() == ["docs"]  # a new champion version is tried at once, backoff or not
    assert kbs.get("docs").version == fixed and "docs" not in kbs.refused


# ---------------------------------------------------------------- item 6: datastore files are verified
@pytest.fixture(scope="module")
def saved(tiny_target, tmp_path_factory) -> Path:
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 97, size=30).tolist() for _ in range(8)]
    store, _ = Datastore.build(tiny_target, docs, CFG)
    return store.save(tmp_path_factory.mktemp("ds") / "good")


def _copy(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    out.mkdir(parents=True)
    for p in saved.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    return out


def _rehash(path: Path) -> None:
    """Rewrite datastore.json's checksums for the files as they are now: a consistent but wrong datastore."""
    meta = json.loads((path / META_FILE).read_text())
    meta["files"] = {name: sha256_file(path / name) for name in (DATA_FILE, INDEX_FILE)}
    meta["json_sha256"] = ds._json_sha(meta)
    (path / META_FILE).write_text(json.dumps(meta))


def _edit(path: Path, name: str, fn) -> None:
    tensors = load_file(str(path / DATA_FILE))
    tensors[name] = fn(tensors[name].clone())
    save_file(tensors, str(path / DATA_FILE))


def test_a_good_datastore_loads_and_says_it_is_checksummed(saved, tiny_target):
    store = Datastore.load(saved)
    store.check_fits(tiny_target)
    meta = json.loads((saved / META_FILE).read_text())
    assert meta["format"] == "specops-dresd/2" and set(meta["files"]) == {DATA_FILE, INDEX_FILE}
    assert store.num_entries == meta["num_entries"] > 0


def test_a_flipped_byte_is_refused_naming_the_file(saved, tmp_path):
    path = _copy(saved, tmp_path)
    blob = bytearray((path / DATA_FILE).read_bytes())
    blob[-3] ^= 0x01  # inside the tensors, not the header: it still parses
    (path / DATA_FILE).write_bytes(bytes(blob))
    with pytest.raises(DatastoreError, match=f"{DATA_FILE} does not match its sha256"):
        Datastore.load(path)


def test_an_edited_description_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    meta = json.loads((path / META_FILE).read_text())
    meta["num_entries"] += 1
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(DatastoreError, match=f"{META_FILE} does not match its own sha256"):
        Datastore.load(path)


def test_a_negative_token_id_is_refused_even_with_matching_checksums(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit(path, "tokens", lambda t: t.index_fill_(0, torch.tensor([5]), -3))
    _rehash(path)
    with pytest.raises(DatastoreError, match=f"{DATA_FILE}: token id -3 is negative"):
        Datastore.load(path)


def test_non_finite_numbers_and_wrong_sizes_are_refused(saved, tmp_path, tiny_target):
    path = _copy(saved, tmp_path)
    _edit(path, "znorm_mean", lambda t: t.index_fill_(0, torch.tensor([0]), float("nan")))
    _rehash(path)
    with pytest.raises(DatastoreError, match="znorm_mean hold NaN"):
        Datastore.load(path)
    path = _copy(saved, tmp_path / "sizes")
    _edit(path, "entry_pos", lambda t: t[:-1].clone())
    _rehash(path)
    with pytest.raises(DatastoreError, match="num_entries"):
        Datastore.load(path)
    path = _copy(saved, tmp_path / "vocab")  # in range for the file, past this target's vocabulary
    _edit(path, "tokens", lambda t: t.index_fill_(0, torch.tensor([5]), 500))
    _rehash(path)
    with pytest.raises(DatastoreError, match=r"token id 500, outside this target's vocabulary \[0, 97\)"):
        Datastore.load(path).check_fits(tiny_target)


def test_an_unlisted_file_and_an_unverifiable_old_datastore_are_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / "extra.json").write_text("{}")
    with pytest.raises(DatastoreError, match=r"files not listed in datastore.json: \['extra.json'\]"):
        Datastore.load(path)
    path = _copy(saved, tmp_path / "old")  # as the first format wrote it: no checksums of its files
    meta = json.loads((path / META_FILE).read_text())
    for key in ("files", "json_sha256"):
        meta.pop(key)
    meta["format"] = "specops-dresd/1"
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(DatastoreError, match=r"specops-dresd/1, which has no checksums.*rebuild it"):
        Datastore.load(path)

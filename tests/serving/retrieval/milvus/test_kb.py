"""Knowledge bases served by Milvus (``specops.serving.retrieval.milvus.kb``), on Milvus Lite in a temporary
directory: the same results as the in-memory KB of the same passages (ids and score bits), rows
independent of the batch, a request's cache scoring like the KB, the manifest through the
registry, every refusal on load, the RaLM loops' output, the CLI, and a `milvus-lite server`
process reached over http."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from specops.core.errors import KBError
from specops.core.passage import Passage
from specops.serving.retrieval import kb as kb_module
from specops.serving.retrieval.kb import KnowledgeBase, build_kb, load_kb_from_registry, register_kb
from specops.serving.retrieval.milvus.build import build_milvus_kb, collection_name
from specops.serving.retrieval.milvus.kb import MilvusKB, MilvusRetriever, RequestView
from specops.serving.retrieval.milvus.service import URI_ENV, client_for
from specops.serving.retrieval.retrievers import ANN_OVERFETCH

TOPICS = [
    "disk partition table sector boot",
    "network socket packet route firewall",
    "compiler linker object symbol library",
    "printer queue spool job paper",
    "shell variable quote expand glob",
    "mail header recipient smtp relay",
]
QUERIES = [
    "disk partition table",
    "a network socket sends a packet through the firewall",
    "linker symbol",
    "",  # an empty text: every score is 0, the lowest ids win
    "printer spool job queue paper jam",
    "quote and expand a shell variable",
    "smtp relay",
    "boot sector",
]


def _passages(n: int, seed: int = 0) -> list[Passage]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = TOPICS[i % len(TOPICS)].split()
        text = " ".join(rng.choice(words + ["the", "of", "and", f"item{i}"], size=14))
        out.append(Passage(i, f"doc{i}.txt", text, source=f"/src/{i % 7}/doc{i}.txt"))
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("milvus") / "kb.db")


@pytest.fixture(scope="module")
def passages() -> list[Passage]:
    return _passages(300)


@pytest.fixture(scope="module")
def memory_kb(passages) -> KnowledgeBase:
    return build_kb("facts", passages, embedder="hash", retrievers=("exact",), progress=False)


@pytest.fixture(scope="module")
def milvus_kb(passages, db) -> MilvusKB:
    return build_milvus_kb("facts", passages, uri=db, embedder="hash", progress=False, meta={"note": "test"})


@pytest.fixture(scope="module")
def hnsw_kb(passages, db) -> MilvusKB:
    return build_milvus_kb("facts", passages, uri=db, embedder="hash", retriever="hnsw", progress=False, batch=64)


def _small(db: str, name: str, n: int = 40) -> MilvusKB:
    return build_milvus_kb(name, _passages(n, seed=1), uri=db, embedder="hash", progress=False)


# ---------------------------------------------------------------- build and search
def test_build_records_the_collection(milvus_kb, hnsw_kb, memory_kb, db):
    m = milvus_kb.meta["milvus"]
    assert m["uri"] == str(Path(db).resolve()) and m["index"] == "FLAT" and m["metric"] == "IP"
    assert m["collection"] == collection_name("facts", m["content_sha256"]) == f"kb_facts_{m['content_sha256'][:12]}"
    assert hnsw_kb.meta["milvus"]["index"] == "HNSW" and hnsw_kb.meta["milvus"]["collection"] != m["collection"]
    assert milvus_kb.retrievers == ("exact",) and hnsw_kb.retrievers == ("hnsw",)
    assert (milvus_kb.num_passages, milvus_kb.dims) == (memory_kb.num_passages, memory_kb.dims)
    assert milvus_kb.meta["embedder"] == memory_kb.meta["embedder"] and milvus_kb.meta["note"] == "test"
    assert milvus_kb.bytes_per_passage > 4 * milvus_kb.dims and milvus_kb.describe()["backend"] == "milvus"
    # the same build again reuses its finished collection
    again = build_milvus_kb("facts", _passages(300), uri=db, embedder="hash", progress=False)
    assert again.meta["milvus"]["reused"] and again.meta["milvus"]["collection"] == m["collection"]


@pytest.mark.parametrize("k", [1, 5, 20])
def test_exact_search_equals_the_in_memory_exact_retriever(milvus_kb, memory_kb, k):
    mem, mil = memory_kb.retriever("exact"), milvus_kb.retriever("exact")
    queries = mem.encode(QUERIES)
    assert all((a == b).all() for a, b in zip(queries, mil.encode(QUERIES)))  # the embedder stays local
    want_ids, want_scores = mem.search(queries, k)
    ids, scores = mil.search(queries, k)
    assert (ids == want_ids).all() and (_bits(scores) == _bits(want_scores)).all()
    assert (ids[QUERIES.index("")] == np.arange(k)).all()


def test_exact_search_widens_past_near_ties(memory_kb, db, monkeypatch):
    """Twenty passages with the same vector tie with each other for every query: the top 3 are
    the three lowest ids, which only a search wider than k + overfetch can prove."""
    limits = []
    real = MilvusRetriever._milvus_search
    monkeypatch.setattr(
        MilvusRetriever, "_milvus_search", lambda self, q, limit: limits.append(limit) or real(self, q, limit)
    )
    same = [Passage(i, "twin", "alpha beta gamma" + " !" * (i + 1)) for i in range(20)]  # one vector, 20 texts
    other = _passages(30, seed=3)
    kb = build_milvus_kb("twins", other + same, uri=db, embedder="hash", progress=False)
    mem = build_kb("twins", other + same, embedder="hash", retrievers=("exact",), progress=False).retriever("exact")
    q = mem.encode(["alpha beta gamma"])
    ids, scores = kb.retriever("exact").search(q, 3)
    want_ids, want_scores = mem.search(q, 3)
    assert (ids == want_ids).all() and (_bits(scores) == _bits(want_scores)).all()
    assert limits == [3 + ANN_OVERFETCH, 4 * (3 + ANN_OVERFETCH)]


@pytest.mark.parametrize("which", ["exact", "hnsw"])
def test_a_batch_equals_each_query_alone(milvus_kb, hnsw_kb, which):
    kb = milvus_kb if which == "exact" else hnsw_kb
    r = kb.retriever(which)
    queries = r.encode(QUERIES)
    ids, scores = r.search(queries, 10)
    for i, q in enumerate(queries):
        one_ids, one_scores = r.search([q], 10)
        assert (one_ids[0] == ids[i]).all() and (_bits(one_scores[0]) == _bits(scores[i])).all(), QUERIES[i]
    assert (ids >= 0).all()


def test_hnsw_ranks_its_candidates_with_exact_scores(hnsw_kb, memory_kb):
    mem = memory_kb.retriever("exact")
    queries = mem.encode(QUERIES)
    ids, scores = hnsw_kb.retriever("hnsw").search(queries, 5)
    for row in range(len(queries)):
        assert (_bits(scores[row]) == _bits(mem.score([queries[row]], ids[row])[0])).all()
    want, _ = mem.search(queries, 1)
    assert (ids[:, 0] == want[:, 0]).mean() >= 0.75  # approximate, but near-exact on 300 passages


def test_request_view_scores_like_the_kb(milvus_kb, memory_kb):
    mem, base = memory_kb.retriever("exact"), milvus_kb.retriever("exact")
    view = base.for_request()
    assert isinstance(view, RequestView) and view.kind == "exact"
    # embedded Milvus Lite searches in this process's Python threads: RaLMSpec verifies synchronously
    assert base.search_holds_gil is True and view.search_holds_gil is True
    queries = view.encode(QUERIES)
    ids, _ = view.search(queries, 20)
    remembered = len(view)
    assert 20 <= remembered <= ids.size
    cached = np.unique(ids)
    assert (_bits(view.score(queries, cached)) == _bits(mem.score(queries, cached))).all()
    assert len(view) == remembered  # every one of them was already held: scored locally
    unseen = np.array([i for i in range(memory_kb.num_passages) if i not in set(cached.tolist())][:7] + [-1])
    got = view.score(queries, unseen)  # fetched in one get, then held
    assert (_bits(got) == _bits(mem.score(queries, unseen))).all() and np.isneginf(got[:, -1]).all()
    assert len(view) == remembered + 7
    assert (_bits(base.score(queries, unseen)) == _bits(got)).all()  # the shared retriever scores the same
    with pytest.raises(KBError, match="passage ids must be in"):
        view.score(queries, np.array([memory_kb.num_passages]))


def test_request_views_share_nothing_and_stay_bounded(milvus_kb):
    base = milvus_kb.retriever("exact")
    a, b = base.for_request(), base.for_request()
    a.search(a.encode(QUERIES[:2]), 10)
    assert len(a) > 0 and len(b) == 0
    small = RequestView(base, capacity=5)
    small.search(small.encode(QUERIES), 10)
    assert len(small) == 5


def test_passages_round_trip(milvus_kb, memory_kb):
    ids = [5, 0, 299, 5, 42]
    assert milvus_kb.passages(ids) == memory_kb.passages(ids) and milvus_kb.passages([]) == []
    with pytest.raises(KBError, match="outside 'facts'"):
        milvus_kb.passages([300])


def test_bm25_and_scann_are_refused_naming_what_was_built(milvus_kb):
    with pytest.raises(KBError, match=r"no 'bm25' retriever; it is served by Milvus with exact .*corpus statistics"):
        milvus_kb.retriever("bm25")
    with pytest.raises(KBError, match="no 'scann' retriever"):
        milvus_kb.retriever("scann")
    with pytest.raises(KBError, match="bm25 needs corpus statistics"):
        build_milvus_kb("x", _passages(5), uri="/nowhere/kb.db", embedder="hash", retriever="bm25", progress=False)


# ---------------------------------------------------------------- the manifest
def test_manifest_registers_and_loads_from_the_registry(milvus_kb, memory_kb, sqlite_uri, tmp_path):
    from specops.registry import RegistryConfig, RegistryStore

    out = milvus_kb.save(tmp_path / "manifest")
    meta = json.loads((out / "kb.json").read_text())
    assert meta["backend"] == "milvus" and meta["format"] == "specops-kb/1"
    assert set(meta["files"]) == {"hash_embedder.safetensors"} and set(p.name for p in out.iterdir()) == {
        "kb.json",
        "hash_embedder.safetensors",
    }
    assert isinstance(KnowledgeBase.load(out), MilvusKB) and MilvusKB.load(out).version == ""
    registry = RegistryStore(RegistryConfig(uri=sqlite_uri))
    v = register_kb(registry, milvus_kb)
    assert v.tags["backend"] == "milvus" and v.tags["milvus_collection"] == milvus_kb.meta["milvus"]["collection"]
    assert register_kb(registry, milvus_kb).version == v.version  # same collection, same version
    loaded = load_kb_from_registry(registry, "facts", cache_dir=tmp_path / "cache")
    assert isinstance(loaded, MilvusKB) and loaded.version == v.version
    queries = loaded.retriever("exact").encode(QUERIES)
    ids, scores = loaded.retriever("exact").search(queries, 5)
    want_ids, want_scores = memory_kb.retriever("exact").search(queries, 5)
    assert (ids == want_ids).all() and (_bits(scores) == _bits(want_scores)).all()
    assert loaded.describe()["version"] == v.version


def test_serving_follows_a_milvus_champion_and_a_rebuild_leaves_it_intact(db, sqlite_uri, tmp_path):
    from specops.registry import RegistryConfig, RegistryStore
    from specops.serving.fleet.catalog import NamedArtifacts

    registry = RegistryStore(RegistryConfig(uri=sqlite_uri))
    first = _small(db, "served")
    register_kb(registry, first)
    kbs = NamedArtifacts(
        "kb", KnowledgeBase.load, registry=registry, cache_dir=tmp_path / "cache", field="retrieval.kb"
    )
    old = kbs.get("served")
    assert isinstance(old.artifact, MilvusKB) and old.version == first.version
    second = build_milvus_kb("served", _passages(50, seed=2), uri=db, embedder="hash", progress=False)
    assert second.meta["milvus"]["collection"] != first.meta["milvus"]["collection"]
    register_kb(registry, second)
    assert kbs.poll_once() == ["served"] and kbs.get("served").version == second.version
    assert kbs.get("served").artifact.num_passages == 50
    r = old.artifact.retriever("exact")  # a request still holding the old champion finishes with it
    assert r.search(r.encode(["disk"]), 3)[0].shape == (1, 3) and old.artifact.passages([39])[0].id == 39


def test_an_edited_manifest_is_refused(milvus_kb, tmp_path):
    out = milvus_kb.save(tmp_path / "m")
    meta = json.loads((out / "kb.json").read_text())
    meta["milvus"]["collection"] = "kb_other_000000000000"
    (out / "kb.json").write_text(json.dumps(meta))
    with pytest.raises(KBError, match="does not match its own sha256"):
        KnowledgeBase.load(out)


# ---------------------------------------------------------------- validation on load
def test_a_missing_collection_says_how_to_rebuild(db, tmp_path):
    kb = _small(db, "gone")
    out = kb.save(tmp_path / "m")
    client_for(db).drop_collection(kb.meta["milvus"]["collection"])
    with pytest.raises(KBError, match=r"not in the Milvus service at .*specops kb build --name gone --backend milvus"):
        KnowledgeBase.load(out)


def test_a_row_count_not_the_manifests_is_refused(db, tmp_path):
    kb = _small(db, "fewer")
    out = kb.save(tmp_path / "m")
    client_for(db).delete(kb.meta["milvus"]["collection"], ids=[3])
    with pytest.raises(KBError, match="holds 39 passages; the manifest says 40"):
        KnowledgeBase.load(out)


def test_another_build_is_refused_by_its_content_sha(db, tmp_path):
    kb = _small(db, "other")
    out = kb.save(tmp_path / "m")
    coll = kb.meta["milvus"]["collection"]
    client_for(db).alter_collection_properties(coll, properties={"specops.content_sha256": "f" * 64})
    with pytest.raises(KBError, match="holds content ffffffffffff, not the manifest's"):
        KnowledgeBase.load(out)
    client_for(db).drop_collection_properties(coll, property_keys=["specops.content_sha256"])
    with pytest.raises(KBError, match="of an unfinished build"):
        KnowledgeBase.load(out)
    rebuilt = _small(db, "other")  # a build of that content drops the unfinished collection and fills it again
    assert not rebuilt.meta["milvus"]["reused"] and isinstance(KnowledgeBase.load(out), MilvusKB)


def test_vector_dims_not_the_manifests_are_refused(db, tmp_path):
    from pymilvus import DataType, MilvusClient

    kb = _small(db, "dims", n=4)
    out = kb.save(tmp_path / "m")
    coll, client = kb.meta["milvus"]["collection"], client_for(db)
    client.drop_collection(coll)
    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=8)
    index = MilvusClient.prepare_index_params()
    index.add_index(field_name="vector", index_type="FLAT", metric_type="IP")
    client.create_collection(coll, schema=schema, index_params=index)
    client.insert(coll, [{"id": i, "vector": [0.5] * 8} for i in range(4)])
    client.alter_collection_properties(coll, properties={"specops.content_sha256": kb.meta["milvus"]["content_sha256"]})
    with pytest.raises(KBError, match="has vectors of 8 dims; the manifest says 384"):
        KnowledgeBase.load(out)


def test_an_unreachable_service_names_the_uri_and_the_env_var(milvus_kb, tmp_path, monkeypatch):
    out = milvus_kb.save(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    monkeypatch.setenv(URI_ENV, f"http://127.0.0.1:{port}")
    with pytest.raises(KBError, match=rf"cannot reach the Milvus service at http://127.0.0.1:{port}.*{URI_ENV}"):
        KnowledgeBase.load(out)
    monkeypatch.setenv(URI_ENV, str(tmp_path / "absent.db"))
    with pytest.raises(KBError, match=rf"no Milvus Lite database at .*absent.db.*{URI_ENV}"):
        KnowledgeBase.load(out)
    assert not (tmp_path / "absent.db").exists()


def test_non_finite_vectors_are_never_inserted(db, monkeypatch):
    real = kb_module.embed_passages

    def broken(embedder, texts, **kw):
        out = real(embedder, texts, **kw)
        out[2, 0] = np.nan
        return out

    monkeypatch.setattr(kb_module, "embed_passages", broken)
    before = set(client_for(db).list_collections())
    with pytest.raises(KBError, match=r"passages \[2\] have non-finite vectors; nothing was inserted"):
        _small(db, "nan")
    assert set(client_for(db).list_collections()) == before


def test_credentials_in_the_uri_are_not_recorded():
    with pytest.raises(KBError, match="carries credentials"):
        build_milvus_kb("x", _passages(3), uri="http://root:secret@127.0.0.1:1", embedder="hash", progress=False)


# ---------------------------------------------------------------- the RaLM loops
@pytest.fixture(scope="module")
def pair(tiny_models):
    from specops.core.models import load_model_dir

    return load_model_dir(tiny_models)


@pytest.mark.parametrize("which", ["exact", "hnsw"])
def test_ralm_output_equals_the_memory_kb(pair, passages, milvus_kb, hnsw_kb, memory_kb, which, monkeypatch):
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams
    from specops.serving.ralm.loop import RalmConfig, RalmGenerator

    views = []
    real = MilvusRetriever.for_request
    monkeypatch.setattr(MilvusRetriever, "for_request", lambda self: views.append(real(self)) or views[-1])
    kb = milvus_kb if which == "exact" else hnsw_kb
    configs = {"ralmseq": RalmConfig(mode="ralmseq"), "ralmspec": RalmConfig(), "s3": RalmConfig(speculation_stride=3)}
    with ThreadPoolExecutor(2) as pool:
        for text in ("disk partition table of the sector", "a network socket sends a packet"):
            prompt = pair.tokenizer.encode(text, add_special_tokens=False)
            runs = {}
            for backend, knowledge in (("memory", memory_kb), ("milvus", kb)):
                texts = lambda ids, knowledge=knowledge: [p.text for p in knowledge.passages(ids)]  # noqa: E731
                for mode, cfg in configs.items():
                    gen = RalmGenerator(
                        SpecEngine(pair),
                        knowledge.retriever(which if backend == "milvus" else "exact"),
                        texts,
                        pair.tokenizer,
                        cfg,
                        pool=pool,
                    )
                    runs[backend, mode] = gen.generate(prompt, SamplingParams(max_new_tokens=16))
                    assert gen.retriever is knowledge.retriever(gen.retriever.kind)  # the view was per request
            seq = runs["milvus", "ralmseq"]
            assert runs["milvus", "ralmspec"].token_ids == runs["milvus", "s3"].token_ids == seq.token_ids
            assert runs["milvus", "ralmspec"].passages == seq.passages
            if which == "exact":
                for mode in configs:
                    assert runs["milvus", mode].token_ids == runs["memory", mode].token_ids, (text, mode)
                    assert runs["milvus", mode].passages == runs["memory", mode].passages
    assert len(views) == 2 * len(configs) and all(len(v) > 0 for v in views)


# ---------------------------------------------------------------- the CLI
def test_cli_builds_and_searches_a_milvus_kb(sqlite_uri, tiny_models, db, tmp_path, capsys):
    from specops.cli.main import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "otters.txt").write_text("Sea otters hold hands while they sleep so they do not drift apart. " * 4)
    (src / "teapot.txt").write_text("A cast iron teapot keeps green tea warm while the leaves steep. " * 4)
    common = ["--registry", sqlite_uri, "--stream", "none"]
    build = ["kb", "build", "--name", "notes", "--source", str(src), "--embedder", "hash"]
    build += ["--model-dir", str(tiny_models), "--backend", "milvus", "--milvus-uri", db, *common]
    assert main([*build, "--retrievers", "exact,bm25"]) == 2
    assert "give exactly one of exact or hnsw" in capsys.readouterr().err
    assert main([*build, "--out", str(tmp_path / "manifest")]) == 0
    out = capsys.readouterr().out
    assert "2 passages" in out and "collection kb_notes_" in out and db in out and "passages/s" in out
    assert "registered kb-notes version 1" in out
    assert main(["kb", "search", "notes", "why do otters hold hands", "-k", "1", "--registry", sqlite_uri]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "Milvus collection kb_notes_" in lines[0] and lines[1].endswith("otters.txt")
    assert main(["kb", "search", "notes", "tea", "--kb-dir", str(tmp_path / "manifest"), "--retriever", "bm25"]) == 2
    assert "no 'bm25' retriever" in capsys.readouterr().err
    assert main(["kb", "build", "--name", "m", "--milvus-uri", db, "--no-register", "--out", str(tmp_path / "x")]) == 2
    assert "add --backend milvus" in capsys.readouterr().err


# ---------------------------------------------------------------- a Milvus server process
def test_a_milvus_lite_server_over_http(tmp_path, memory_kb, passages, monkeypatch):
    exe = shutil.which("milvus-lite") or str(Path(sys.executable).with_name("milvus-lite"))
    if not os.access(exe, os.X_OK):
        pytest.skip("the milvus-lite command is not installed (pip install milvus-lite)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [exe, "server", "--data-dir", str(tmp_path / "server.db"), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"milvus-lite server did not start: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.2)
        uri = f"http://127.0.0.1:{port}"
        kb = build_milvus_kb("served", passages, uri=uri, embedder="hash", progress=False)
        assert kb.meta["milvus"]["uri"] == uri
        out = kb.save(tmp_path / "manifest")
        monkeypatch.setenv(URI_ENV, f"http://localhost:{port}")  # this deployment's address for the service
        loaded = KnowledgeBase.load(out)
        assert loaded.uri == f"http://localhost:{port}"
        r = loaded.retriever("exact")
        assert r.search_holds_gil is False and r.for_request().search_holds_gil is False  # its own process
        queries = r.encode(QUERIES)
        ids, scores = r.search(queries, 5)
        want_ids, want_scores = memory_kb.retriever("exact").search(queries, 5)
        assert (ids == want_ids).all() and (_bits(scores) == _bits(want_scores)).all()
        assert loaded.passages([7]) == memory_kb.passages([7])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

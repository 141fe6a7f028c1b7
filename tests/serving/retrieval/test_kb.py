"""Knowledge bases: sources, chunking, the four retrievers (batch-invariant, cache scores equal
KB scores), files that round-trip and refuse corruption."""

from __future__ import annotations

import gzip
import json
import pickle
import random
import shutil

import numpy as np
import pytest

from specops.core.errors import KBError
from specops.core.passage import chunk_text, token_counter
from specops.serving.retrieval.kb import META_FILE, KnowledgeBase, build_kb
from specops.serving.retrieval.retriever import RETRIEVER_KINDS, Retriever
from specops.serving.retrieval.retrievers import DenseRetriever, ExactScorer
from specops.trainer.kb_sources import HeldOut, list_source_files, passages_from_sources

TOPICS = {
    "aquarium.txt": (
        "The zebrafish aquarium must be kept at twenty six degrees with a gentle filter.",
        "fish tank water gravel plants feeding light heater pump algae",
    ),
    "bread.txt": (
        "Sourdough bread rises overnight when the starter is fed with rye flour.",
        "oven dough crust yeast bake loaf kneading salt butter wheat",
    ),
    "comet.txt": (
        "A comet's tail always points away from the sun because of the solar wind.",
        "orbit ice nucleus telescope astronomer sky planet gravity dust star",
    ),
    "violin.txt": (
        "The violin bow is strung with horsehair and rubbed with rosin before playing.",
        "music string orchestra concert melody tune scale note practice chord",
    ),
    "glacier.txt": (
        "Glaciers carve U-shaped valleys as they slowly grind down the mountains.",
        "ice snow valley erosion moraine climate cold peak rock melt",
    ),
    "chess.txt": (
        "In chess the knight is the only piece that can jump over other pieces.",
        "board move king queen pawn rook bishop check game opening",
    ),
}
MAN_PAGE = r""".TH FROBNICATE 1 "2024" "test" "User Commands"
.SH NAME
frobnicate \- twiddle the flux capacitor of a quantum widget
.SH SYNOPSIS
.B frobnicate
[\fB\-v\fR] \fIwidget\fR
.SH DESCRIPTION
.B frobnicate
recalibrates the flux capacitor inside a quantum widget so that its gizmo resonates at the
frequency printed on the label. Use \fB\-v\fR to print every recalibration step.
.SH SEE ALSO
.BR widget (7)
"""
QUERIES = {  # query -> the file whose first passage answers it
    "how warm should the zebrafish aquarium water be": "aquarium.txt",
    "feeding a sourdough starter with rye flour": "bread.txt",
    "why does a comet tail point away from the sun": "comet.txt",
    "rosin on a violin bow of horsehair": "violin.txt",
    "recalibrate the flux capacitor of a quantum widget": "frobnicate(1)",
}


def _doc(lead: str, vocab: str, seed: int, n_words: int = 180) -> str:
    rng = random.Random(seed)
    words = vocab.split()
    filler = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(n_words // 12)]
    return lead + "\n" + "\n".join(filler) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("kb-corpus")
    for i, (name, (lead, vocab)) in enumerate(TOPICS.items()):
        (root / "docs").mkdir(exist_ok=True)
        (root / "docs" / name).write_text(_doc(lead, vocab, seed=i))
    shutil.copy(root / "docs" / "chess.txt", root / "docs" / "chess-copy.txt")  # exact duplicate passages
    (root / "docs" / "packed.txt.gz").write_bytes(
        gzip.compress(b"Compressed notes about gzip streams and deflate blocks. " * 8)
    )
    (root / "docs" / "image.bin").write_bytes(bytes(range(256)) * 4)  # binary: skipped
    (root / "docs" / "tie-a.txt").write_text("lantern lantern marmalade quokka " * 30)
    (root / "docs" / "tie-b.txt").write_text("quokka marmalade lantern lantern " * 30)  # same words, other order
    (root / "man" / "man1").mkdir(parents=True)
    (root / "man" / "man1" / "frobnicate.1").write_text(MAN_PAGE)
    return root


@pytest.fixture(scope="module")
def passages(corpus):
    out, stats = passages_from_sources([str(corpus / "docs"), str(corpus / "man")], progress=False)
    assert stats.files_skipped == 1 and stats.files_read == 11 and stats.heldout_excluded == 0
    return out


@pytest.fixture(scope="module", params=["hash", "minilm"])
def kb(request, passages):
    return build_kb(f"test-{request.param}", passages, embedder=request.param, progress=False)


def _first(kb: KnowledgeBase, title: str) -> int:
    return next(p.id for p in kb.passages(range(kb.num_passages)) if p.title == title)


# ---------------------------------------------------------------- sources and chunks
def test_sources_render_man_pages_and_title_files(passages, corpus):
    by_title = {}
    for p in passages:
        by_title.setdefault(p.title, []).append(p)
    man = by_title["frobnicate(1)"][0]
    assert "flux capacitor" in man.text and ".SH" not in man.text and "\\f" not in man.text
    assert man.source == str((corpus / "man" / "man1" / "frobnicate.1").absolute())
    assert "deflate blocks" in by_title["packed.txt"][0].text  # gzip read, titled without .gz
    assert "image.bin" not in by_title
    assert [p.id for p in passages] == list(range(len(passages)))


def test_heldout_files_are_excluded_by_path_and_by_text(corpus):
    comet = corpus / "docs" / "comet.txt"
    by_path = HeldOut(paths=frozenset([str(comet.absolute())]), origin="test")
    out, stats = passages_from_sources([str(corpus / "docs")], heldout=by_path, progress=False)
    assert stats.heldout_excluded == 1 and not any(p.title == "comet.txt" for p in out)
    # A held-out document's twin under another path is held out too.
    from specops.trainer.kb_sources import _digest

    twin = HeldOut(digests=frozenset([_digest(comet.read_text())]), origin="test")
    assert passages_from_sources([str(corpus / "docs")], heldout=twin, progress=False)[1].heldout_excluded == 1
    included = passages_from_sources([str(corpus / "docs")], heldout=by_path, include_heldout=True, progress=False)
    assert included[1].heldout_excluded == 0 and any(p.title == "comet.txt" for p in included[0])


def test_man_pages_are_capped_per_family(tmp_path):
    for i in range(5):
        (tmp_path / "man1").mkdir(exist_ok=True)
        (tmp_path / "man1" / f"gcloud_{i}.1").write_text(MAN_PAGE)
    files = list_source_files([str(tmp_path)], max_pages_per_family=2)
    assert [t for _, t in files] == ["gcloud_0(1)", "gcloud_2(1)"]  # evenly spaced
    assert len(list_source_files([str(tmp_path / "man1" / "*.1")], max_pages_per_family=0)) == 5


def test_chunks_are_even_and_fit_the_token_limit(tiny_models):
    from specops.core.models import load_tokenizer

    text = " ".join(f"word{i}" for i in range(130))
    chunks = chunk_text(text, 100)
    assert [len(c.split()) for c in chunks] == [65, 65]
    assert chunk_text("line one\n  line two", 100) == ["line one\n  line two"]  # a slice: line breaks kept
    count = token_counter(load_tokenizer(tiny_models / "target"))
    long = " ".join(f"supercalifragilistic{i}expialidocious" for i in range(100)) + " " + "x" * 3000
    chunks = chunk_text(long, 100, max_tokens=64, count_tokens=count)
    assert len(chunks) > 2 and max(count(c) for c in chunks) <= 64
    assert "".join("".join(c.split()) for c in chunks) == "".join(long.split())  # nothing lost


# ---------------------------------------------------------------- retrievers
def test_exact_duplicates_are_dropped(kb, passages):
    assert kb.meta["duplicates_dropped"] > 0 and kb.num_passages == len(passages) - kb.meta["duplicates_dropped"]
    texts = [" ".join(p.text.split()) for p in kb.passages(range(kb.num_passages))]
    assert len(set(texts)) == len(texts)


@pytest.mark.parametrize("kind", RETRIEVER_KINDS)
def test_retrievers_find_batch_invariant_and_score_like_the_kb(kb, kind):
    r = kb.retriever(kind)
    assert isinstance(r, Retriever) and r.kind == kind
    texts = list(QUERIES)
    queries = r.encode(texts)
    ids, scores = r.search(queries, 4)
    assert ids.shape == scores.shape == (5, 4) and ids.dtype == np.int64 and scores.dtype == np.float32
    for row, text in enumerate(texts):
        assert ids[row, 0] == _first(kb, QUERIES[text]), (kind, text, kb.passages(ids[row, :1]))
    # Alone, in another order or in another batch: the same bits.
    for row in range(5):
        alone = r.search([r.encode([texts[row]])[0]], 4)
        assert np.array_equal(alone[0][0], ids[row]) and np.array_equal(alone[1][0], scores[row])
    rev = r.search(queries[::-1], 4)
    assert np.array_equal(rev[0][::-1], ids) and np.array_equal(rev[1][::-1], scores)
    # The local cache's scores are the KB's, bit for bit; -1 scores -inf.
    for row in range(5):
        cached = r.score([queries[row]], np.concatenate([ids[row][::-1], [-1]]))[0]
        assert np.array_equal(cached[:-1], scores[row][::-1]) and cached[-1] == -np.inf
    assert r.score(queries, ids[0]).shape == (5, 4)


@pytest.mark.parametrize("kind", ["exact", "bm25"])
def test_ties_go_to_the_lower_id(kb, kind):
    if kind == "exact" and kb.embedder.kind != "hash":
        pytest.skip("only the bag-of-words embedder gives two texts the same vector")
    a, b = _first(kb, "tie-a.txt"), _first(kb, "tie-b.txt")
    r = kb.retriever(kind)
    ids, scores = r.search(r.encode(["quokka marmalade lantern"]), 2)
    assert list(ids[0]) == [min(a, b), max(a, b)] and scores[0, 0] == scores[0, 1]


def test_hnsw_results_do_not_depend_on_earlier_searches(kb):
    r = kb.retriever("hnsw")
    q = r.encode(["glaciers grinding mountains"])
    first = r.search(q, 1)
    r.search(q, kb.num_passages)  # a wide search raises the index's search breadth
    again = r.search(q, 1)
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])


def test_exact_search_is_the_true_top_k_despite_float32_near_ties():
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((3000, 384)).astype(np.float32)
    emb[1000:1010] = emb[5]  # exact ties
    emb[2000] = emb[5] + 1e-4 * rng.standard_normal(384)  # a near tie
    emb = (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float16)
    r = DenseRetriever("exact", ExactScorer(emb), embedder=None)
    queries = [emb[5].astype(np.float32), emb[7].astype(np.float32)] + [
        rng.standard_normal(384).astype(np.float32) / 20 for _ in range(3)
    ]
    ids, scores = r.search(queries, 12)
    full = np.stack([q.astype(np.float16).astype(np.float64) for q in queries]) @ emb.astype(np.float64).T
    full = full.astype(np.float32)
    for row in range(len(queries)):
        want = np.lexsort((np.arange(3000), -full[row]))[:12]
        assert np.array_equal(ids[row], want) and np.array_equal(scores[row], full[row][want])
    assert [i for i in ids[0] if i == 5 or 1000 <= i < 1010] == [5, *range(1000, 1010)]  # ties: lower id first
    zero = r.search([np.zeros(384, np.float32)], 3)  # an empty text's zero vector ties everywhere
    assert list(zero[0][0]) == [0, 1, 2] and not zero[1].any()


def test_a_retriever_not_built_is_named(passages):
    kb = build_kb("small", passages[:6], embedder="hash", retrievers=("exact", "bm25"), progress=False)
    assert kb.retrievers == ("exact", "bm25")
    with pytest.raises(KBError, match="no 'scann' retriever.*exact, bm25"):
        kb.retriever("scann")
    with pytest.raises(KBError, match="retrievers"):
        build_kb("small", passages, embedder="hash", retrievers=("faiss",), progress=False)


# ---------------------------------------------------------------- files
def test_files_round_trip(kb, tmp_path):
    path = kb.save(tmp_path / "kb")
    again = KnowledgeBase.load(path)
    assert again.name == kb.name and again.version == "" and again.retrievers == kb.retrievers
    assert again.passages([0, kb.num_passages - 1]) == kb.passages([0, kb.num_passages - 1])
    meta = json.loads((path / META_FILE).read_text())
    assert meta["format"] == "specops-kb/1" and meta["bytes_per_passage"] > 0
    assert meta["embedder"]["kind"] == kb.embedder.kind and set(meta["build_s"]) >= {"embed", "total"}
    for kind in kb.retrievers:
        q = kb.retriever(kind).encode(list(QUERIES))
        a, b = (
            kb.retriever(kind).search(q, 5),
            again.retriever(kind).search(again.retriever(kind).encode(list(QUERIES)), 5),
        )
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), kind


def test_corrupt_foreign_and_unlisted_files_are_refused(passages, tmp_path):
    kb = build_kb("files", passages, embedder="hash", progress=False)
    path = kb.save(tmp_path / "kb")
    names = sorted(p.name for p in path.iterdir())
    assert set(names) == {
        "kb.json",
        "passages.safetensors",
        "embeddings.safetensors",
        "hash_embedder.safetensors",
        "hnsw.safetensors",
        "scann.safetensors",
        "bm25.safetensors",
        "bm25.json",
    }
    for name in names:  # one flipped byte anywhere: refused
        bad = tmp_path / f"flip-{name}"
        shutil.copytree(path, bad)
        blob = bytearray((bad / name).read_bytes())
        blob[len(blob) // 2] ^= 0x01
        (bad / name).write_bytes(bytes(blob))
        with pytest.raises(KBError, match="not a usable knowledge base"):
            KnowledgeBase.load(bad)
    extra = tmp_path / "extra"
    shutil.copytree(path, extra)
    (extra / "scores.pkl").write_bytes(pickle.dumps({"data": [1.0]}))
    with pytest.raises(KBError, match=r"not listed.*scores\.pkl"):
        KnowledgeBase.load(extra)
    # A kb.json that lists a pickle (with its true sha256 and its own sha256 redone) is still refused.
    listed = tmp_path / "listed"
    shutil.copytree(extra, listed)
    from specops.registry.artifacts import sha256_file as _sha256
    from specops.serving.retrieval.kb import _canonical_sha

    meta = json.loads((listed / META_FILE).read_text())
    meta["files"]["scores.pkl"] = _sha256(listed / "scores.pkl")
    meta["meta_sha256"] = _canonical_sha(meta)
    (listed / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(KBError, match="only safetensors and JSON"):
        KnowledgeBase.load(listed)
    foreign = tmp_path / "foreign"
    shutil.copytree(path, foreign)
    meta = json.loads((foreign / META_FILE).read_text())
    meta["format"] = "specops-datastore/1"
    (foreign / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(KBError, match="format"):
        KnowledgeBase.load(foreign)

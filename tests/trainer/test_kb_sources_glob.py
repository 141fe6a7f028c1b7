"""KB sources: ``**`` globs read the whole tree, and the build counts and warns about what it left out."""

from __future__ import annotations

import json
import logging

from specops.trainer import kb_sources
from specops.trainer.kb_sources import SourceStats, list_source_files, passages_from_sources

TEXT = "Sea otters hold hands while they sleep so that they do not drift apart on the ocean currents. " * 3


def _tree(root):
    """Five .txt files 0 to 3 directories below ``root`` and one .md file."""
    for rel in ("top.txt", "a/one.txt", "a/b/two.txt", "a/b/c/three.txt", "x/y/z/deep.txt", "a/b/c/notes.md"):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{rel}: {TEXT}")
    return root


def test_double_star_reads_the_whole_tree_and_counts_it(tmp_path):
    root = _tree(tmp_path / "docs")
    passages, stats = passages_from_sources([f"{root}/**/*.txt"], progress=False)
    titles = sorted(p.title for p in passages)
    assert titles == ["a/b/c/three.txt", "a/b/two.txt", "a/one.txt", "top.txt", "x/y/z/deep.txt"]
    assert (stats.files_matched, stats.files_listed, stats.files_read, stats.files_skipped) == (5, 5, 5, 0)
    assert stats.unmatched_sources == [] and stats.to_dict()["files_matched"] == 5
    # One level only without **; a directory source is still walked whole.
    assert [t for _, t in list_source_files([f"{root}/*/*.txt"])] == ["a/one.txt"]
    assert len(list_source_files([str(root)])) == 6


def test_a_source_that_matches_nothing_warns(tmp_path, caplog):
    _tree(tmp_path / "docs")
    stats = SourceStats()
    with caplog.at_level(logging.WARNING, logger=kb_sources.log.name):
        files = list_source_files(
            [f"{tmp_path}/docs/**/*.rst", str(tmp_path / "missing"), f"{tmp_path}/docs/**/*.md"], stats=stats
        )
    assert [t for _, t in files] == ["a/b/c/notes.md"] and stats.files_matched == 1
    assert stats.unmatched_sources == [f"{tmp_path}/docs/**/*.rst", str(tmp_path / "missing")]
    assert "*.rst' matches no file" in caplog.text and "missing' is no file or directory" in caplog.text


def test_skipped_files_are_counted_by_reason_and_warned_about(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(kb_sources, "MAX_BYTES", 2000)
    root = _tree(tmp_path / "docs")
    (root / "a" / "latin1.txt").write_bytes(b"caf\xe9 " + TEXT.encode())  # not UTF-8
    (root / "a" / "b" / "big.txt").write_text(TEXT * 20)  # over MAX_BYTES
    (root / "stub.txt").write_text("see elsewhere")  # too short
    (root / "blob.txt").write_bytes(b"\x00\x01" * 100)  # binary
    with caplog.at_level(logging.WARNING, logger=kb_sources.log.name):
        passages, stats = passages_from_sources([f"{root}/**/*.txt"], progress=False)
    assert (stats.files_matched, stats.files_read, stats.files_skipped) == (9, 5, 4)
    assert stats.skipped == {"not UTF-8": 1, "too large": 1, "too short": 1, "binary": 1}
    assert stats.skipped_summary() == (
        "1 too large (over 2,000 bytes), 1 binary, 1 not UTF-8, 1 too short (under 100 characters of text)"
    )
    assert "4 of 9 files skipped: 1 too large" in caplog.text and "latin1.txt (not UTF-8)" in caplog.text
    assert len({p.title for p in passages}) == 5


def test_kb_build_prints_what_it_matched_read_and_skipped(tiny_models, tmp_path, capsys):
    from specops.cli.main import main

    root = _tree(tmp_path / "docs")
    (root / "a" / "latin1.txt").write_bytes(b"caf\xe9 " + TEXT.encode())
    args = ["kb", "build", "--name", "nested", "--source", f"{root}/**/*.txt", "--source", f"{root}/**/*.rst"]
    args += ["--embedder", "hash", "--retrievers", "exact", "--model-dir", str(tiny_models)]
    assert main([*args, "--no-register", "--out", str(tmp_path / "kb"), "--stream", "none"]) == 0
    out = capsys.readouterr().out
    assert "5 passages from 5 files read of 6 matched (1 skipped: 1 not UTF-8, 0 held out" in out, out
    assert f"warning: no file matched '{root}/**/*.rst'" in out
    saved = json.loads((tmp_path / "kb" / "kb.json").read_text())["sources"]
    assert (saved["files_matched"], saved["files_read"], saved["skipped"]) == (6, 5, {"not UTF-8": 1})


def test_the_embedding_bar_shows_the_rate_and_the_time_left(capsys, monkeypatch):
    """``kb build``'s embedding bar counts passages against their total, so tqdm shows passages/s
    and the time left (issue 43: a slow MiniLM build should say how long it will take)."""
    from specops.core.passage import Passage
    from specops.serving.retrieval.kb import prepare_passages

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    passages = [Passage(i, f"doc{i}", f"passage {i} about queues and caches " * 4) for i in range(40)]
    prepare_passages("bar", passages, embedder="hash", progress=True)
    err = capsys.readouterr().err
    assert "passage/s" in err and "embedding" in err
    assert "<" in err  # tqdm's [elapsed<remaining, rate]

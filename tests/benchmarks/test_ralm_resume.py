"""benchmarks/ralm_resume.py: which knowledge-base differences stop a resumed point's waves."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks.ralm_resume import Checkpoint, kb_fingerprint


def _kb(**sources):
    described = {
        "passages": 99239,
        "build_s": 12.0,
        "version": 3,
        "sources": {"heldout_excluded": 594, "heldout_origin": "the bootstrap manifest m.json", **sources},
    }
    return SimpleNamespace(describe=lambda: json.loads(json.dumps(described)))


def _checkpoint(tmp_path, saved_kb: dict) -> Checkpoint:
    path = tmp_path / "ck.json"
    rows = [{"wave": 0}]
    path.write_text(
        json.dumps(
            {
                "settings": {},
                "points": [],
                "sessions": [],
                "knnlm": {},
                "partial": {"index": 0, "kb": saved_kb, "rows": rows, "cpu": "x"},
            }
        )
    )
    return Checkpoint(path, {})


def test_where_the_heldout_list_was_read_from_does_not_stop_a_resume(tmp_path):
    # the checkpoint's KB was built beside a model dir without a manifest: same split, other wording
    saved = {**_kb().describe(), "build_s": 99.0}
    saved["sources"]["heldout_origin"] = "the bootstrap's split recomputed (seed 0)"
    assert _checkpoint(tmp_path, saved).rows(0, kb_fingerprint(_kb())) == [{"wave": 0}]


def test_a_different_heldout_list_or_corpus_does(tmp_path):
    saved = _kb().describe()
    with pytest.raises(SystemExit, match="knowledge base differs"):
        _checkpoint(tmp_path, saved).rows(0, kb_fingerprint(_kb(heldout_excluded=12)))
    saved["passages"] = 5
    with pytest.raises(SystemExit, match="knowledge base differs"):
        _checkpoint(tmp_path, saved).rows(0, kb_fingerprint(_kb()))


def test_each_wave_says_which_cpu_measured_it_and_a_point_names_every_one(tmp_path, monkeypatch):
    import benchmarks.ralm_resume as resume

    ck = _checkpoint(tmp_path, _kb().describe())
    monkeypatch.setattr(resume, "cpu_model", lambda: "CPU A")
    rows = [{"wave": 0}]
    ck.save_rows(0, _kb().describe(), rows)
    monkeypatch.setattr(resume, "cpu_model", lambda: "CPU B")
    rows.append({"wave": 1})
    ck.save_rows(0, _kb().describe(), rows, {"speedup": 1.2})  # on another machine: wave 0 keeps its CPU
    saved = json.loads((tmp_path / "ck.json").read_text())["partial"]
    assert [r["cpu"] for r in saved["rows"]] == ["CPU A", "CPU B"]
    assert saved["so_far"] == {"speedup": 1.2}  # the summary a partial reading quotes
    assert resume.cpus_of(rows + [{"wave": 2, "cpu": "CPU B"}]) == "CPU A (1 wave), CPU B (2 waves)"
    assert resume.cpus_of(rows[1:]) == "CPU B"


def _old_checkpoint(tmp_path, points: list[dict], partial_point: dict | None, ablations=True):
    """A checkpoint written before ``ablate_at`` existed (``--ablations`` then meant every point)."""
    path = tmp_path / "old.json"
    partial = {"index": len(points), "kb": {}, "rows": [], "cpu": "x", "so_far": partial_point}
    settings = {"points": "[]", "ablations": ablations}
    path.write_text(
        json.dumps({"settings": settings, "points": points, "sessions": [], "knnlm": {}, "partial": partial})
    )
    return path, settings


MEM = {"backend": "memory", "retriever": "exact"}


def test_a_checkpoint_from_before_ablate_at_resumes_when_it_only_ablated_memory_exact_points(tmp_path):
    path, settings = _old_checkpoint(tmp_path, [MEM, MEM], MEM)
    ck = Checkpoint(path, {**settings, "ablate_at": "memory-exact"})
    assert ck.data["settings"]["ablate_at"] == "memory-exact"  # recorded: the next resume compares it


def test_but_not_when_it_ablated_a_service_point_under_the_old_meaning(tmp_path):
    path, settings = _old_checkpoint(tmp_path, [MEM, {"backend": "milvus-lite", "retriever": "exact"}], None)
    with pytest.raises(SystemExit, match="ablate_at"):
        Checkpoint(path, {**settings, "ablate_at": "memory-exact"})
    # without ablations the scope never mattered
    path, settings = _old_checkpoint(tmp_path, [{"backend": "milvus-lite", "retriever": "exact"}], None, False)
    Checkpoint(path, {**settings, "ablate_at": "memory-exact"})


def test_a_checkpoint_with_ablate_at_must_match_it(tmp_path):
    path, settings = _old_checkpoint(tmp_path, [MEM], None)
    Checkpoint(path, {**settings, "ablate_at": "memory-exact"})._write()
    with pytest.raises(SystemExit, match="ablate_at"):
        Checkpoint(path, {**settings, "ablate_at": "all"})


def test_ablations_run_where_the_scope_says():
    from benchmarks.ralm_curve import Point, ablated

    mem, hnsw, milvus = Point("memory", "exact", 10), Point("memory", "hnsw", 10), Point("milvus-lite", "exact", 10)
    assert [ablated(p, True, "memory-exact") for p in (mem, hnsw, milvus)] == [True, False, False]
    assert [ablated(p, True, "all") for p in (mem, hnsw, milvus)] == [True, True, True]
    assert not ablated(mem, False, "all")

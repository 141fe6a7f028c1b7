"""The soak-and-fault run (``benchmarks/faults.py``) in short form: serve, train and an
``mlflow server`` as separate processes under load while each is SIGKILLed once at a
random point and restarted. Its invariants must hold: no request fails outside the
server's kill windows, no accepted record is lost, no version is registered twice, and
every answered output is the target-only greedy output. Timings are never asserted.

The checks themselves are tested first, on made-up runs, so that each can fail.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import faults as bench
from benchmarks.faults import Attempt, Window
from specops.serving.plan import plain_generate

MISSES, GENERATIONS = bench.TOPICS
SEED = 31
"""Seeds the tiny models, the prompts and the kill plan. Over 6 s of load, seed 31 kills the MLflow
server at 0.5 s, the trainer at 3.2 s and the serving replica at 4.5 s, each restarted within 3 s: the
replica has accepted records by then (what the lost-records check checks) and the three restarts,
each seconds of imports, overlap instead of running one after another (seed 0 killed the replica
after 1 s, before it had accepted a record, and its 15 s of load spread the restarts over 16 s)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The benchmark's tiny random pair (a --tiny bootstrap), built once for both tests that need it."""
    return bench.tiny_pair(tmp_path_factory.mktemp("faults") / "models", seed=SEED)


def _answered(rid: str, epoch: int, start: float, end: float) -> Attempt:
    return Attempt(rid, 0, 0, epoch, start, end, status=200)


def _run(attempts: list[Attempt], logged: list[str], *, published: int, final_epoch: int = 1) -> dict:
    """A run whose first server (epoch 0) was killed at t=10 after accepting ``published`` records per
    topic, and whose stream holds ``logged`` request ids (both topics, in this order)."""
    rows = [{"partition": 0, "offset": i, "rid": rid} for i, rid in enumerate(logged)]
    kill = Window("server", 10.0, 1.0, back_at=20.0, epoch=0, published={MISSES: published, GENERATIONS: published})
    return {
        "attempts": attempts,
        "windows": [kill],
        "records": {MISSES: rows, GENERATIONS: rows},
        "final_epoch": final_epoch,
    }


def test_record_check_counts_only_provable_losses():
    a = [_answered("a0", 0, 0, 1), _answered("a1", 0, 2, 3), _answered("a2", 0, 9, 9.5), _answered("b0", 1, 21, 22)]
    # a2 was answered but still queued when its server died: the documented limit, not a loss
    ok = bench.check_records(_run(a, ["a0", "a1", "b0"], published=2))
    assert (ok["lost"], ok["unaccepted_at_kill"], ok["checked"]) == (0, 2, 8)
    # a0 is missing though a1, sent after a0's answer arrived, is on disk: a hole
    hole = bench.check_records(_run(a, ["a1", "a2", "b0"], published=0))
    assert hole["lost"] == 2 and {d["topic"] for d in hole["lost_detail"]} == {MISSES, GENERATIONS}
    # the server had accepted 3 records per topic before the kill, 2 are in the stream
    short = bench.check_records(_run(a, ["a0", "a1", "b0"], published=3))
    assert short["lost"] == 2
    # the gracefully stopped server (epoch 1) flushes: its answered request must be there
    final = bench.check_records(_run(a, ["a0", "a1"], published=2))
    assert final["lost"] == 2 and final["lost_detail"][0]["epoch"] == 1
    dup = bench.check_records(_run(a, ["a0", "a0", "a1", "b0"], published=3))
    assert (dup["lost"], dup["duplicates"]) == (0, 2)
    # the final server refused b0's two records (a build error): never accepted, counted as dropped
    refused = bench.check_records(
        {**_run(a, ["a0", "a1"], published=2), "scrapes": {1: {"dropped": {"build_error": 2}}}}
    )
    assert (refused["lost"], refused["dropped"]) == (0, 2)


def test_version_check_finds_a_repeated_source_or_training_window():
    def v(version: str, source: str, window: str) -> dict:
        return {"version": version, "tags": {"source_id": source, "lineage_offsets": window}, "aliases": []}

    distinct = [v("1", "t/c/v000001", '{"0": [0, 9]}'), v("2", "t/c/v000002", '{"0": [0, 20]}')]
    assert bench.check_versions(distinct)["duplicated"] == 0
    same_source = [*distinct, v("3", "t/c/v000002", '{"0": [0, 31]}')]
    assert bench.check_versions(same_source)["duplicated"] == 1
    same_window = [*distinct, v("3", "t/c/v000004", '{"0": [0, 20]}')]
    assert [d["version"] for d in bench.check_versions(same_window)["duplicates"]] == ["3"]


def test_only_the_servers_windows_excuse_a_failure():
    windows = [Window("server", 10.0, 1.0, back_at=20.0), Window("mlflow", 30.0, 1.0, back_at=40.0)]
    attempts = [
        Attempt("in-flight", 0, 0, 0, 9.0, 10.1),
        Attempt("down", 0, 1, 1, 12.0, 12.1),
        Attempt("503", 0, 2, 1, 19.5, 19.6, status=503),
        Attempt("registry-down", 0, 3, 1, 31.0, 31.5),
        Attempt("after", 0, 4, 1, 21.0, 21.5, status=500),
        _answered("ok", 1, 35.0, 36.0),
    ]
    bench.classify(attempts, windows, 50.0)
    assert [a.kind for a in attempts] == ["in_flight", "down", "down", "failed", "failed", "answered"]


@pytest.mark.slow  # a tiny bootstrap and reference decodes
def test_output_check_tells_the_targets_output_from_another(models):
    from argparse import Namespace

    from specops.core.models import load_model_dir
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams

    pair = load_model_dir(models)
    args = Namespace(seed=0, max_tokens=8, vocab=pair.vocab_size)
    ref = plain_generate(
        SpecEngine(pair), bench.make_prompt(0, 0, 0, args.vocab), SamplingParams(max_new_tokens=8), method="target"
    ).token_ids
    other = [(t + 1) % args.vocab or 1 for t in ref]  # not the target's choice anywhere
    text = pair.tokenizer.decode
    served = [
        Attempt("same", 0, 0, 0, 0, 1, status=200, text=text(ref, skip_special_tokens=True)),
        Attempt("other", 0, 0, 0, 1, 2, status=200, text=text(other, skip_special_tokens=True)),
        Attempt("unlogged", 0, 0, 0, 2, 3, status=200, text=text(other, skip_special_tokens=True)),
    ]
    logged = {GENERATIONS: [{"rid": "same", "output_ids": list(ref)}, {"rid": "other", "output_ids": other}]}
    got = bench.check_outputs(served, logged, models, args)
    assert (got["checked"], got["identical"], got["ties"], got["diverged"], got["tokens_checked"]) == (3, 1, 0, 2, 2)
    assert got["diverged_detail"][0]["worst_gap"] > bench.TIE_TOL


@pytest.mark.slow  # three processes killed and restarted: about a minute on 2 busy cores
def test_kills_keep_the_invariants(models, tmp_path):
    out, work = tmp_path / "faults.json", tmp_path / "work"
    argv = [
        "--models",
        str(models),
        "--seed",
        str(SEED),
        "--duration-s",
        "6",
        "--kills",
        "3",
        "--clients",
        "2",
        "--min-gap-s",
        "1",
        "--tail-s",
        "2",
        "--ready-timeout-s",
        "400",
        "--workdir",
        str(work),
        "--json",
        str(out),
        "--no-doc",
    ]
    rc = bench.main(argv)
    report = json.loads(out.read_text())
    s = report["summary"]
    logs = "\n".join((work / "logs" / f"{name}.log").read_text()[-3000:] for name in bench.COMPONENTS)
    assert rc == 0 and s["invariants_hold"], f"violations: {s['violations']}\n{logs}"
    assert s["kills"] == {"server": 1, "trainer": 1, "mlflow": 1}
    assert all(w["back_at"] is not None and w["back_at"] > w["killed_at"] for w in report["kills"])
    # the replica was killed with records accepted: the lost-records check had something to check (SEED)
    assert sum(next(w for w in report["kills"] if w["component"] == "server")["published"].values()) > 0
    assert s["answered"] > 0 and s["failed_outside_kill_windows"] == 0
    assert s["accepted_records_lost"] == 0 and s["records_checked"] == 2 * s["answered"]
    assert s["versions_duplicated"] == 0
    assert s["outputs_diverged"] == 0 and s["outputs_checked"] == s["answered"]
    assert s["outputs_identical"] + s["outputs_tie_flips"] == s["answered"]  # a tie flip is rare, but the target's
    assert s["server_exit_on_sigterm"] == 0
    # issue 34: tenants isolated, cluster names bounded (the owner's own extraction is the positive control)
    iso = report["isolation"]
    assert iso["bogus_clusters_refused"] == iso["bogus_clusters_sent"] == bench.BOGUS_CLUSTERS
    assert not iso["made_up_labels"] and not iso["readyz_names_cluster"]
    assert iso["control_hits"] > 0 and iso["control_tokens_recovered"] > 0
    assert iso["cross_tenant_hits"] == iso["cross_tenant_reference_tokens"] == iso["cross_tenant_tokens_recovered"] == 0


def test_isolation_violations_name_each_breach():
    """The isolation invariants' judge: a clean report passes; each breach, and a failed positive
    control (which would make a clean cross-tenant result meaningless), is a violation."""
    clean = {
        "readyz_names_cluster": False,
        "bogus_clusters_sent": 3,
        "bogus_clusters_refused": 3,
        "made_up_labels": [],
        "secret_tokens": 32,
        "control_hits": 1,
        "control_tokens_recovered": 4,
        "cross_tenant_hits": 0,
        "cross_tenant_reference_tokens": 0,
        "cross_tenant_tokens_recovered": 0,
    }
    records = {GENERATIONS: [{"rid": "a", "cluster": bench.CLUSTER}]}
    assert bench.isolation_violations(clean, records) == []
    breaches = [
        {"readyz_names_cluster": True},
        {"bogus_clusters_refused": 2},
        {"made_up_labels": ["made-up-1"]},
        {"cross_tenant_hits": 1},
        {"cross_tenant_reference_tokens": 40},
        {"cross_tenant_tokens_recovered": 2},
        {"control_hits": 0},
        {"secret_tokens": 0},
        {"error": "ConnectionError"},
    ]
    for breach in breaches:
        assert len(bench.isolation_violations({**clean, **breach}, records)) == 1, breach
    stray = {GENERATIONS: [{"rid": "b", "cluster": "made-up-7"}]}
    assert "made-up-7" in bench.isolation_violations(clean, stray)[0]

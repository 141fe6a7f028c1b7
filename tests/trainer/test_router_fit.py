"""Router fitting: names stay stable across refits, a refit from spec.generations registers and
promotes a version and commits offsets only after registering, the bootstrap router comes from
training text only, the refit runs as a scheduled job, and ``specops router`` drives it all."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from specops.cli.main import main
from specops.core.embed import MiniLMEmbedder, TargetHiddenEmbedder
from specops.core.models import load_model, load_tokenizer
from specops.core.router import Router
from specops.registry import RegistryConfig, RegistryStore, RegistryUnavailableError
from specops.streams import OutMessage, StreamConfig, codec, open_stream
from specops.streams.records import GenerationRecord
from specops.trainer.bootstrap import load_manifest
from specops.trainer.bootstrap.corpus import read_document
from specops.trainer.router_fit import (
    RefitConfig,
    RefitResult,
    RouterRefitter,
    _match,
    bootstrap_router,
    bootstrap_texts,
    fit_router,
)
from specops.trainer.schedule import ROUTER_JOB_ID, ScheduleConfig, ScheduleConfigError, TrainerScheduler
from tests.serving.router_texts import HELDOUT, TRAIN

GROUP = "router-refit"


@pytest.fixture(scope="module")
def minilm() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture(scope="module")
def first(minilm) -> Router:
    return fit_router(TRAIN, minilm, seed=0)


def _truth() -> dict[str, str]:
    return {t: c for data in (TRAIN, HELDOUT) for c, texts in data.items() for t in texts}


# ---------------------------------------------------------------- 1. names stay stable
def test_refit_keeps_cluster_names(first, minilm):
    truth = _truth()
    texts = list(truth)
    random.Random(5).shuffle(texts)
    again = fit_router(texts, minilm, init=first, seed=3)  # unlabelled, shuffled, more texts
    assert again.clusters == first.clusters == ("code", "prose", "sql")
    assert [d.cluster for d in again.route_batch(texts)] == [truth[t] for t in texts]
    assert again.metrics["agreement"] == 1.0 and sum(again.fitted_on.values()) == len(texts)

    # the names follow the centroids, not the row order of the router seeding the fit
    flipped = Router(
        centroids=first.centroids[::-1].copy(),
        clusters=first.clusters[::-1],
        embedder_kind=first.embedder_kind,
        embedder_sha256=first.embedder_sha256,
    )
    refit = fit_router(texts, minilm, init=flipped, seed=7)
    assert refit.clusters == ("sql", "prose", "code")
    assert [d.cluster for d in refit.route_batch(texts)] == [truth[t] for t in texts]

    # a larger k adds fresh names, a new label seeds its own cluster, a smaller k is refused
    grown = fit_router(texts, minilm, 4, init=first, seed=1)
    assert grown.clusters[:3] == first.clusters and grown.clusters[3] == "c0"
    german = [
        "Der Hund läuft schnell über die grüne Wiese.",
        "Wir gehen morgen früh zusammen in die Stadt.",
        "Das Wetter ist heute sehr schön und warm.",
    ]
    labelled = fit_router(texts + german, minilm, init=first, labels=[None] * len(texts) + ["german"] * 3)
    assert labelled.clusters == ("code", "prose", "sql", "german") and labelled.fitted_on["german"] >= 1
    with pytest.raises(ValueError, match="keeps every cluster"):
        fit_router(texts, minilm, 2, init=first)
    # exact matching beats greedy: greedy would pair 0.9 then 0.1
    assert _match(np.array([[0.9, 0.8], [0.85, 0.1]])) == [1, 0]


# ---------------------------------------------------------------- 2. refit from the stream
class DownOnRegister:
    """The registry, except that registering fails (as when it goes down mid-refit)."""

    def __init__(self, reg: RegistryStore) -> None:
        self.reg = reg

    def artifact(self, kind: str):
        view = self.reg.artifact(kind)

        class Down:
            def __getattr__(self, name):
                return getattr(view, name)

            def register(self, *a, **kw):
                raise RegistryUnavailableError("registry down (test)")

        return Down()


def _publish(cfg: StreamConfig, tokenizer, items: list[tuple[str, str]]) -> None:
    with open_stream(cfg) as stream, stream.producer() as producer:
        msgs = []
        for i, (text, cluster) in enumerate(items):
            ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
            rec = GenerationRecord(
                request_id=f"r{time.monotonic_ns()}-{i}",
                cluster=cluster,
                method="draft",
                draft_model=f"draft-{cluster}",
                draft_version="",
                prompt_ids=ids,
                output_ids=np.zeros(2, np.int32),
                vocab_size=len(tokenizer),
                finish_reason="length",
            )
            msgs.append(OutMessage(key=rec.key, value=codec.encode(rec)))
        producer.publish(cfg.topics.generations, msgs)


def _committed(cfg: StreamConfig) -> dict[int, int]:
    with open_stream(cfg) as s:
        return {p: o for p, o in s.committed(GROUP, cfg.topics.generations).items() if o}


def _end(cfg: StreamConfig) -> dict[int, int]:
    with open_stream(cfg) as s:
        return {p: o for p, o in s.end_offsets(cfg.topics.generations).items() if o}


def test_refit_from_stream_registers_promotes_then_commits(minilm, tiny_models, sqlite_uri, tmp_path):
    cfg = StreamConfig(url=f"local://{tmp_path / 'streams'}", fsync=False)
    tokenizer = load_tokenizer(tiny_models / "target")
    changes = []
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri), on_change=changes.append)
    _publish(cfg, tokenizer, [(t, c) for c, texts in TRAIN.items() for t in texts])  # 15 labelled prompts

    waiting = RouterRefitter(cfg, reg, tokenizer, minilm, RefitConfig(min_records=50, poll_timeout_s=0.2))
    assert waiting.run_once().status == "waiting" and _committed(cfg) == {}
    assert {b[0] for b in waiting.buffer} == {t for ts in TRAIN.values() for t in ts}  # prompts decode exactly
    waiting.close()

    down = RouterRefitter(cfg, DownOnRegister(reg), tokenizer, minilm, RefitConfig(min_records=10, poll_timeout_s=0.2))
    with pytest.raises(RegistryUnavailableError):
        down.run_once()
    down.close()
    assert _committed(cfg) == {} and reg.artifact("router").versions() == []  # not registered: nothing committed

    refitter = RouterRefitter(cfg, reg, tokenizer, minilm, RefitConfig(min_records=10, poll_timeout_s=0.2))
    try:
        r1 = refitter.run_once()  # the uncommitted records came back
        assert (r1.status, r1.consumed, r1.version) == ("promoted", 15, "1") and r1.reason == "no champion yet"
        assert _committed(cfg) == _end(cfg)
        v1 = reg.artifact("router").by_alias()
        assert v1.version == "1" and v1.clusters == ("code", "prose", "sql") and v1.metric("records_used") == 15
        assert [(c.model_name, c.version) for c in changes] == [("router", "1")]

        # new prompts from the fallback cluster: they seed no name; the refit keeps the names and routes them right
        _publish(cfg, tokenizer, [(t, "default") for texts in HELDOUT.values() for t in texts])
        r2 = refitter.run_once()
        assert (r2.status, r2.consumed, r2.version) == ("promoted", 9, "2") and r2.metrics["agreement"] >= 0.9
        v2 = reg.artifact("router").by_alias()
        assert v2.version == "2" and v2.clusters == v1.clusters and v2.tags["parent_version"] == "1"
        offsets = json.loads(v2.tags["lineage_offsets"])
        assert sum(hi - lo + 1 for lo, hi in offsets.values()) == 9  # lineage: the records since the last commit
        assert _committed(cfg) == _end(cfg)
        champion = refitter.champion()
        assert champion.version == "2"
        truth = _truth()
        heldout = [t for ts in HELDOUT.values() for t in ts]
        assert [d.cluster for d in champion.bind(minilm).route_batch(heldout)] == [truth[t] for t in heldout]

        assert refitter.run_once().status == "no_new_records" and len(reg.artifact("router").versions()) == 2
    finally:
        refitter.close()


# ---------------------------------------------------------------- 3. the bootstrap router
def test_bootstrap_router_on_the_tiny_bootstrap(minilm, tiny_models):
    texts = bootstrap_texts(tiny_models, per_domain=6)
    assert sorted(texts) == ["code", "prose"] and all(len(v) == 6 for v in texts.values())
    manifest = load_manifest(tiny_models)
    for domain, snippets in texts.items():
        train = [read_document(p, domain) or "" for p in manifest["domains"][domain]["train"]]
        heldout = [read_document(p, domain) or "" for p in manifest["domains"][domain]["heldout"]]
        for s in snippets:
            assert any(s in doc for doc in train) and not any(s in doc for doc in heldout)
    router = bootstrap_router(tiny_models, minilm, per_domain=6)
    assert router.clusters == ("code", "prose") and router.fitted_on == {"code": 6, "prose": 6}
    assert router.route("import sys\nfor line in sys.stdin:\n    print(line)").cluster == "code"
    assert router.route("This manual page documents the program and its options.").cluster == "prose"
    target = TargetHiddenEmbedder(load_model(tiny_models / "target"), load_tokenizer(tiny_models / "target"))
    on_target = bootstrap_router(tiny_models, target, per_domain=4)
    assert on_target.clusters == ("code", "prose") and on_target.dim == target.dim
    assert on_target.embedder_kind == "target" and on_target.route("x = 1").cluster in on_target.clusters


# ---------------------------------------------------------------- 4. the scheduled job
class FakeTrainer:
    def __init__(self, out):
        self.out, self.clusters = out, {}

    def step(self) -> int:
        return 0


class FakeRefitter:
    def __init__(self) -> None:
        self.calls = 0

    def run_once(self) -> RefitResult:
        self.calls += 1
        return RefitResult("waiting", 0, 0)


def test_router_refit_is_a_scheduled_job(tmp_path):
    with pytest.raises(ScheduleConfigError, match="no router refitter"):
        TrainerScheduler(FakeTrainer(tmp_path), ScheduleConfig(router_refit_s=5))
    assert ScheduleConfig(router_refit_s=0).router_refit_s is None
    with pytest.raises(ScheduleConfigError, match="router_refit_s"):
        ScheduleConfig(router_refit_s=-1)
    refitter = FakeRefitter()
    cfg = ScheduleConfig(tick_seconds=60, eval_seconds=60, router_refit_s=0.2)
    sched = TrainerScheduler(FakeTrainer(tmp_path), cfg, router_refitter=refitter)
    sched.start()
    try:
        assert ROUTER_JOB_ID in sched.jobs()
        deadline = time.monotonic() + 20
        while refitter.calls < 2:
            assert time.monotonic() < deadline, "the router refit job did not run"
            time.sleep(0.05)
    finally:
        sched.shutdown()
    assert sched.router_refits.get("waiting", 0) >= 2
    busy = TrainerScheduler(
        FakeTrainer(tmp_path), ScheduleConfig(load_signal=lambda: 0.99, router_refit_s=60), router_refitter=refitter
    )
    calls = refitter.calls
    assert busy.refit_router() == "skipped_load" and refitter.calls == calls
    off = TrainerScheduler(FakeTrainer(tmp_path), ScheduleConfig(tick_seconds=60, eval_seconds=60))
    off.start()  # the same job store with refits switched off: the leftover job goes
    try:
        assert ROUTER_JOB_ID not in off.jobs() and "distill-tick" in off.jobs()
    finally:
        off.shutdown()


# ---------------------------------------------------------------- 5. the command line
def test_cli_router_bootstrap_ls_route_fit(minilm, tiny_models, sqlite_uri, tmp_path, capsys):
    reg_args = ["--registry", sqlite_uri]
    assert (
        main(
            ["router", "bootstrap", "--model-dir", str(tiny_models), "--per-domain", "4", "--stream", "none", *reg_args]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "router version 1: clusters code, prose" in out and "champion" in out
    assert main(["router", "ls", "--json", *reg_args]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 1 and rows[0]["aliases"] == "challenger,champion" and rows[0]["clusters"] == "code,prose"
    assert main(["router", "route", "def f(x):\n    return x + 1", "--json", *reg_args]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert decision["cluster"] == "code" and decision["router_version"] == "1" and 0 <= decision["distance"] < 1
    stream = f"local://{tmp_path / 'streams'}"
    assert main(["router", "fit", "--stream", stream, "--model-dir", str(tiny_models), *reg_args]) == 0
    assert "router refit: no_new_records" in capsys.readouterr().out

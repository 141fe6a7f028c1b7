"""The online trainer: updates raise held-out acceptance, state survives restarts, and a
killed trainer loses no record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM

from specops.core import draft_vocab
from specops.core.draft_vocab import DraftVocab
from specops.streams import open_stream
from specops.streams.tansu import TansuBroker
from specops.trainer import checkpoint as ckpt
from specops.trainer.acceptance import evaluate_records
from specops.trainer.data import draft_logits, teacher_example
from specops.trainer.online.trainer import OnlineConfig, OnlineTrainer, _holdout, holdout_key_for
from specops.trainer.replay import ReplayConfig
from tests.conftest import SUBSET, VOCAB
from tests.tolerances import assert_f32_close
from tests.trainer.logged import log_requests

ROOT = Path(__file__).resolve().parents[3]
N_REQUESTS = 40

PAPER_PLUS = {"positions": "rejected", "replay": ReplayConfig(policy="recent", capacity=32), "steps_per_update": 4}
"""The recipe these tests were written for (the trainer's defaults before benchmarks/osd.py --grid chose others)."""


KAFKA_GROUP_TIMINGS = {"session_timeout_s": 2.0, "heartbeat_interval_s": 0.3, "max_poll_interval_s": 60.0}
"""Short group timings, so a tansu consumer group joins and rebalances in seconds."""


@pytest.fixture(scope="module", params=["local", "kafka"])
def logged(request, close_pair, tmp_path_factory):
    """N_REQUESTS logged requests over two clusters on each real backend, and the draft's dir.

    Kafka: a tansu broker of this module's own (memory-only), so the default topic names
    hold exactly these records.
    """
    root = tmp_path_factory.mktemp(f"online-{request.param}")
    extra: dict = {}
    if request.param == "kafka":
        broker = TansuBroker(root / "broker.log").start()
        request.addfinalizer(broker.stop)
        extra = {"url": broker.url, **KAFKA_GROUP_TIMINGS}
    return log_requests(
        close_pair, root, N_REQUESTS, seed=21, cluster_of=lambda i: "code" if i % 3 else "prose", **extra
    )


def _assert_all_committed(stream, group: str, topic: str) -> None:
    """Every partition's committed offset is its end (Kafka also reports 0 for an empty partition)."""
    committed = stream.committed(group, topic)
    assert {p: committed.get(p, 0) for p in stream.end_offsets(topic)} == stream.end_offsets(topic)


def _idle_s(cfg) -> float:
    """Idle time before a run stops: a Kafka group takes seconds to join before the first record."""
    return 15.0 if cfg.url.startswith("kafka://") else 1.0


def _caught_up(stream, group: str, topic: str) -> bool:
    """Every partition's committed offset has reached its end."""
    committed = stream.committed(group, topic)
    return all(committed.get(p, 0) >= end for p, end in stream.end_offsets(topic).items())


def _drain(trainer: OnlineTrainer, cfg) -> int:
    """``trainer.run(max_idle_s=_idle_s(cfg))`` that ends sooner on Kafka: up to ``_idle_s`` for the group
    to join and the first record, then short runs until the group has committed every record (a member
    expired on a starved machine rejoins within the group's 2 s session timeout and goes on), not 15 s
    of idle polls. The same records are consumed, trained and committed (an update runs every
    ``interval`` records of a cluster, whatever the passes' sizes), and it still ends on polls that
    found nothing."""
    if not cfg.url.startswith("kafka://"):
        return trainer.run(max_idle_s=_idle_s(cfg))
    first = trainer.run(max_idle_s=_idle_s(cfg), max_records=1)
    return first + _until_caught_up(trainer, cfg) if first else 0


def _until_caught_up(trainer: OnlineTrainer, cfg, limit_s: float = 120.0) -> int:
    """Short runs (each ends on half a second of empty polls) until the trainer's group has committed
    every partition's end, then one more; the records they consumed."""
    consumed, deadline = 0, time.monotonic() + limit_s
    with open_stream(cfg) as s:
        while time.monotonic() < deadline:
            consumed += trainer.run(max_idle_s=0.5)
            if _caught_up(s, trainer.cfg.group, cfg.topics.misses):
                return consumed + trainer.run(max_idle_s=0.5)
    raise AssertionError(f"group {trainer.cfg.group} not caught up in {limit_s} s")


def _history(out: Path, cluster: str) -> list[dict]:
    path = out / cluster / "updates.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_updates_raise_heldout_acceptance_and_commit_everything(logged, tmp_path):
    cfg, draft_dir = logged
    out = tmp_path / "trainer"
    trainer = OnlineTrainer(cfg, draft_dir, out, OnlineConfig(**PAPER_PLUS, interval=4, holdout_every=4))
    consumed = _drain(trainer, cfg)
    trainer.close()
    assert consumed >= N_REQUESTS  # more only if a starved member was expired and records were redelivered
    base = AutoModelForCausalLM.from_pretrained(draft_dir)
    for cluster in ("code", "prose"):
        hist = _history(out, cluster)
        assert hist, f"no update for {cluster}"
        held_out = [h.record for h in trainer.clusters[cluster].holdout]
        before, after = evaluate_records(base, held_out), trainer.evaluate(cluster)
        assert after.num_positions == before.num_positions > 0
        assert after.sampling > before.sampling, (cluster, before, after)
        assert hist[-1]["eval_after"] == after.to_dict()
        assert all(h["loss_last"] < h["loss_first"] for h in hist if h["loss_first"] is not None)
        latest = ckpt.latest_version(out, cluster)
        state = ckpt.load_state(latest)
        assert state["version"] == len(hist) and state["config_hash"] == trainer.cfg.digest()
        assert state["lineage"]["topic"] == "spec.misses" and state["lineage"]["offsets"]
    with open_stream(cfg) as s:
        _assert_all_committed(s, "trainer", cfg.topics.misses)


def test_the_lag_is_the_age_of_the_oldest_record_polled_and_zero_once_caught_up(logged, tmp_path):
    cfg, draft_dir = logged
    # a group of its own: the module's other tests consumed and committed every record as "trainer"
    online = OnlineConfig(**PAPER_PLUS, interval=10_000, group="trainer-lag")
    trainer = OnlineTrainer(cfg, draft_dir, tmp_path / "trainer", online)
    deadline, n = time.monotonic() + _idle_s(cfg) + 15, 0
    while not n and time.monotonic() < deadline:  # a Kafka group joins before its first records
        n = trainer.step(max_records=4)
    lag = REGISTRY.get_sample_value("specops_trainer_lag_seconds")
    with open_stream(cfg) as s:  # no record polled is older than the topic's oldest
        oldest = min(m.timestamp_ms for m in s.read(cfg.topics.misses, timeout_s=1.0)) / 1000.0
    assert n and 0 < lag <= time.time() - oldest + 1.0, (n, lag)
    _until_caught_up(trainer, cfg)  # ends on polls that found nothing (the group joined above)
    trainer.close()
    assert REGISTRY.get_sample_value("specops_trainer_lag_seconds") == 0.0


def test_a_draft_vocabulary_is_what_updates_train_and_evaluations_score(close_pair, tmp_path):
    """A base draft with a draft vocabulary: updates run only those head rows (the target's
    distribution restricted to them) and still raise held-out acceptance as serving scores it."""
    vocab = DraftVocab(torch.tensor(SUBSET), VOCAB)
    cfg, draft_dir = log_requests(close_pair, tmp_path, 24, seed=5, cluster_of=lambda i: "code", partitions=1)
    draft_vocab.save(draft_dir, vocab, source="test")
    out = tmp_path / "trainer"
    trainer = OnlineTrainer(cfg, draft_dir, out, OnlineConfig(**PAPER_PLUS, interval=4, holdout_every=4))
    trainer.run(max_idle_s=1.0)
    trainer.close()
    st = trainer.clusters["code"]
    assert torch.equal(trainer._train_vocab(st).token_ids, vocab.token_ids)
    ex = teacher_example(next(h.record for h in st.holdout if h.record.num_rejected))
    full = draft_logits(st.model, ex)
    assert_f32_close(draft_logits(st.model, ex, vocab), full[:, vocab.token_ids])
    hist = _history(out, "code")
    assert hist and all(h["loss_last"] < h["loss_first"] for h in hist if h["loss_first"] is not None)
    # evaluations score the draft as serving does: argmax over the draft vocabulary only
    held_out = [h.record for h in st.holdout]
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab.token_ids] = False
    matched = total = 0
    with torch.no_grad():
        for rec in (r for r in held_out if r.sampling.temperature == 0.0):
            ids = torch.from_numpy(rec.token_ids).long()
            # the published draft: the trainer's moving average of the weights (OnlineConfig.average_decay)
            logits = st.published(input_ids=ids[:-1].unsqueeze(0)).logits[0, rec.num_prompt_tokens - 1 :]
            logits[:, outside] = float("-inf")
            matched += int((logits.argmax(-1) == ids[rec.num_prompt_tokens :]).sum())
            total += len(ids) - rec.num_prompt_tokens
    acc = trainer.evaluate("code")
    assert total > 0 and (acc.served, acc.served_positions) == (matched / total, total)
    assert (ckpt.latest_version(out, "code") / draft_vocab.FILE).is_file()  # every version carries it


@pytest.mark.slow
def test_restart_resumes_weights_optimiser_and_buffers(logged, tmp_path):
    cfg, draft_dir = logged
    out = tmp_path / "trainer"
    ocfg = OnlineConfig(
        positions="rejected",
        steps_per_update=4,
        group="resume",
        interval=5,
        replay=__import__("specops.trainer.replay").trainer.replay.ReplayConfig(policy="recent", capacity=50),
    )
    first = OnlineTrainer(cfg, draft_dir, out, ocfg)
    _drain(first, cfg)
    first.close()
    saved = {
        c: (st.version, {k: v.clone() for k, v in st.model.state_dict().items()}, len(first.buffers[c]))
        for c, st in first.clusters.items()
    }
    second = OnlineTrainer(cfg, draft_dir, out, ocfg)
    try:
        for cluster, (version, weights, buffered) in saved.items():
            st = second.state(cluster)
            assert st.version == version
            for k, v in st.model.state_dict().items():
                assert torch.equal(v, weights[k]), k
            assert second.buffers[cluster].items() and len(second.buffers[cluster]) == buffered
            opt_state = st.opt.state_dict()["state"]
            assert opt_state and all(int(s["step"]) == version * ocfg.steps_per_update for s in opt_state.values())
        assert second.step() == 0  # everything was committed
    finally:
        second.close()


@pytest.mark.slow
def test_killed_trainer_loses_no_record(logged, tmp_path):
    cfg, draft_dir = logged
    out = tmp_path / "trainer"
    cmd = [
        sys.executable,
        "-m",
        "specops.cli.main",
        "--threads",  # one, as each xdist worker: two would oversubscribe the 2-core machine the suite shares
        "1",
        "train",
        "--registry",
        "none",
        "--stream",
        cfg.url,
        "--draft",
        str(draft_dir),
        "--out",
        str(out),
        "--group",
        "killed",
        "--interval",
        "1",
        "--steps",
        "1",
        "--holdout-every",
        "5",
        "--idle-exit",
        str(10 + _idle_s(cfg)),
        "--positions",
        "rejected",
    ]
    # the killed member keeps its partitions until its session times out: keep that short, below --idle-exit
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SPECOPS_STREAM_FSYNC": "0",
        "SPECOPS_STREAM_SESSION_TIMEOUT_S": "2",
        "SPECOPS_STREAM_HEARTBEAT_INTERVAL_S": "0.3",
        "SPECOPS_STREAM_MAX_POLL_INTERVAL_S": "60",
    }
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "first.log", "w"))
    deadline = time.monotonic() + 300  # generous: a loaded machine imports slowly
    while time.monotonic() < deadline and sum(len(_history(out, c)) for c in ("code", "prose")) < 5:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    trained_before = sum(len(_history(out, c)) for c in ("code", "prose"))
    assert 5 <= trained_before < N_REQUESTS, "the kill should land mid-run"
    # the restart trains what the kill left, then would idle --idle-exit (11 s local, 25 s Kafka): it is
    # interrupted (it exits 0, "everything committed is checkpointed") once its group has committed every
    # record instead; started with SIGINT ignored, as `specops train &` from a script is: the trainer puts
    # the handler back
    ignore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    with open(tmp_path / "second.log", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=ignore_sigint)
        with open_stream(cfg) as s:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                if _caught_up(s, "killed", cfg.topics.misses):
                    break
                time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(timeout=60)
    second = (tmp_path / "second.log").read_text()
    assert returncode == 0 and "interrupted; everything committed is checkpointed" in second, second[-2000:]
    trained = {rid for c in ("code", "prose") for h in _history(out, c) for rid in h["request_ids"]}
    key = holdout_key_for(out)  # the subprocesses' key (the suite's: unkeyed)
    held_out = {f"r{i}" for i in range(N_REQUESTS) if _holdout(f"r{i}", 5, key)}
    assert trained | held_out == {f"r{i}" for i in range(N_REQUESTS)}
    with open_stream(cfg) as s:
        _assert_all_committed(s, "killed", cfg.topics.misses)


def test_a_commit_refused_after_a_rebalance_is_logged_and_the_records_come_back_once(close_pair, tmp_path, caplog):
    """The group takes a partition away between a pass's poll and its commit (another member
    joins, as when this one missed its session timeout): the pass logs it and returns, and
    once the partition is back its records are recognised rather than buffered twice."""
    n = 12
    cfg, draft_dir = log_requests(
        close_pair, tmp_path, n, seed=5, cluster_of=lambda i: "code" if i % 2 else "chat", max_new_tokens=12
    )  # clusters keyed to partitions 1 and 0
    trainer = OnlineTrainer(
        cfg, draft_dir, tmp_path / "trainer", OnlineConfig(**PAPER_PLUS, group="rebal", interval=1000)
    )
    raw, joined = trainer.consumer.consumer, []

    def poll_then_rebalance(**kw):
        got = type(raw).poll(raw, **kw)
        if got and not joined:
            joined.append(trainer.stream.consumer("rebal", [cfg.topics.misses]))  # takes one of the two partitions
        return got

    raw.poll = poll_then_rebalance
    try:
        with caplog.at_level("WARNING", logger="specops.trainer.online.trainer"):
            first = trainer.step()
        assert first > 0 and "not committed, the group rebalanced" in caplog.text
        joined[0].close()  # leaves without committing: its partition (and our uncommitted records) come back
        trainer.run(
            max_idle_s=4.0
        )  # rebalances within heartbeat_interval_s / 2: the partition and its records come back
        held = [h.source for c in ("code", "chat") for h in [*trainer.buffers[c].items(), *trainer.clusters[c].holdout]]
        assert len(held) == len(set(held)) == n
        _assert_all_committed(trainer.stream, "rebal", cfg.topics.misses)
    finally:
        trainer.close()


def test_a_restart_before_the_commit_trains_no_record_twice(close_pair, tmp_path):
    """Killed after an update was checkpointed but before the commit: the records come back,
    and those already trained (evicted from a small replay buffer, so not recognised by the
    buffer) are skipped instead of trained again into a version of the same window."""
    from specops.trainer.replay import ReplayConfig

    cfg, draft_dir = log_requests(
        close_pair, tmp_path, 24, seed=21, cluster_of=lambda i: "c", partitions=1, greedy_only=True, max_new_tokens=12
    )
    ocfg = OnlineConfig(
        positions="rejected",
        steps_per_update=4,
        group="g",
        interval=4,
        holdout_every=1000,
        poll_records=24,
        replay=ReplayConfig(policy="recent", capacity=8),
    )
    first = OnlineTrainer(cfg, draft_dir, tmp_path / "out", ocfg)

    def killed():
        raise SystemExit("killed before the commit")

    first.consumer.commit = killed
    with pytest.raises(SystemExit):
        first.step()
    first.close()
    trained = _history(tmp_path / "out", "c")
    assert len(trained) == 6
    second = OnlineTrainer(cfg, draft_dir, tmp_path / "out", ocfg)
    try:
        assert second.step() == 24  # redelivered, all of it
        assert _history(tmp_path / "out", "c") == trained, "a redelivered window was trained again"
        assert second.clusters["c"].version == 6
        with open_stream(cfg) as s:
            _assert_all_committed(s, "g", cfg.topics.misses)
    finally:
        second.close()


def test_a_kill_between_checkpoint_and_history_line_is_repaired_on_restart(close_pair, tmp_path, monkeypatch):
    """Killed after an update's checkpoint was written but before its history line (and with
    the last line torn): the restart skips the records that checkpoint trained, so it writes
    the missing line back from the checkpoint. Every record is then in exactly one line."""
    cfg, draft_dir = log_requests(
        close_pair, tmp_path, 12, seed=3, cluster_of=lambda i: "c", partitions=1, greedy_only=True, max_new_tokens=12
    )
    ocfg = OnlineConfig(**PAPER_PLUS, group="g", interval=4, holdout_every=1000, poll_records=12)
    out = tmp_path / "out"
    first = OnlineTrainer(cfg, draft_dir, out, ocfg)
    real_append = ckpt.append_history

    def append_then_die(root, cluster, entry):
        if entry["version"] == 2:
            with open(root / cluster / "updates.jsonl", "a") as f:
                f.write('{"torn": ')  # a write the kill cut short
            raise SystemExit("killed between the checkpoint and its history line")
        real_append(root, cluster, entry)

    monkeypatch.setattr(ckpt, "append_history", append_then_die)
    with pytest.raises(SystemExit):
        first.step()
    first.close()
    monkeypatch.setattr(ckpt, "append_history", real_append)
    assert [h["version"] for h in _history_lines(out, "c")] == [1]
    second = OnlineTrainer(cfg, draft_dir, out, ocfg)
    try:
        second.run(max_idle_s=1.0)
        hist = _history(out, "c")
        assert [h["version"] for h in hist] == [1, 2, 3] and hist[1]["recovered"] is True
        new_in = [
            set(h["request_ids"]) - set().union(*(p["request_ids"] for p in hist[:i])) for i, h in enumerate(hist)
        ]
        assert set().union(*new_in) == {f"r{i}" for i in range(12)} and all(len(n) == 4 for n in new_in)
    finally:
        second.close()


def _history_lines(out: Path, cluster: str) -> list[dict]:
    """The complete lines only (the last one may be torn)."""
    lines = (out / cluster / "updates.jsonl").read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines]

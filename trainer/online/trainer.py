"""The online distillation loop (OSD Algorithm 1, lines 18-21), one draft per cluster.

Each pass of :meth:`OnlineTrainer.step` reads top to bottom:

1. **consume** a batch of MissRecords from ``spec.misses`` as a member of the consumer
   group (invalid records are dead-lettered by ``RecordConsumer``);
2. **buffer** each record in its cluster's replay buffer, or in the cluster's held-out
   set (one request in ``holdout_every``, chosen by a keyed hash of its request id: the key is the
   trainer's secret, ``holdout.key`` under ``--out``, so no client can steer its traffic to one side). The cluster is
   loaded first if it is not in memory; a record of a cluster beyond ``max_clusters`` is
   dead-lettered instead (``specops.trainer.clusters``: at most ``max_loaded_clusters`` in memory);
3. for every cluster with ``interval`` new requests: **score** them with the draft as it
   is (test-then-train: the gate's fresh evidence, ``specops.trainer.promote.Fresh``), then
   **update** its draft with the GKD
   loss at the logged rejected positions, using the logged target distributions
   (teacher sampling, OSD §4.1); **evaluate** expected acceptance on the held-out set
   before and after; **checkpoint** draft, optimiser and state durably. This happens
   in stream order, as soon as a cluster has I new requests, even inside one batch;
4. **persist** the buffers of the clusters touched;
5. **register** (with a registry): each cluster's newest checkpoint becomes a
   ``challenger`` version and goes through the promotion gate (``specops.trainer.promote``);
6. **commit** the consumer offsets.

Offsets are committed only after steps 4 and 5, so every committed record is either
inside a checkpointed and registered update or inside a durably persisted buffer: kill
the trainer anywhere and nothing is lost (at-least-once). When the registry cannot be
reached the pass does not commit; the next pass retries the registration (idempotent,
by checkpoint) and commits once it succeeds. When the group rebalanced since the poll the
commit is refused: the pass logs it and goes on, the records go to their partitions' new
owner (this trainer again, once it rejoins). (With ``register_every`` > 1 the updates in
between are committed once checkpointed and registered with the next registered one.)

Records delivered twice after a crash are taken once: those still buffered or held out
are recognised by their (topic, partition, offset); a training record at or below the
highest offset the cluster took from its partition (saved with the buffer, and in each
checkpoint's lineage) was trained or evicted before the crash and is skipped, so a
restart never trains a window twice nor registers a second version of it. (To retrain
from the start of a stream, start from an empty ``--out``, not only from reset offsets.)

The trainer is one class in three files: the loop here; loading, unloading and persisting
clusters in ``specops.trainer.online.state``; the optimiser steps and evaluation of an update in
``specops.trainer.online.update``; its configuration is ``specops.trainer.online.config``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge
from transformers import AutoModelForCausalLM

from specops.core.clusters import cluster_label
from specops.core.device import Placement
from specops.core.models import from_pretrained
from specops.streams import CommitFailedError, StreamConfig, open_stream
from specops.streams.consumer import RecordConsumer
from specops.streams.records import CHOICE_SEPARATOR, MissRecord
from specops.trainer import checkpoint as ckpt
from specops.trainer.clusters import ClusterBudget
from specops.trainer.data import TargetTeacher
from specops.trainer.losses import TargetDist
from specops.trainer.online.config import POSITIONS, OnlineConfig
from specops.trainer.online.state import ClusterState, ClusterStates, Held
from specops.trainer.online.update import DraftUpdates
from specops.trainer.promote import Promoter, load_draft_vocab, score_fresh
from specops.trainer.ranks import launched_world
from specops.trainer.replay import ReplayBuffers

__all__ = ["POSITIONS", "ClusterState", "Held", "OnlineConfig", "OnlineTrainer"]

log = logging.getLogger(__name__)

UPDATES = Counter("specops_trainer_updates_total", "Draft updates (checkpointed versions) per cluster", ["cluster"])
LAST_UPDATE = Gauge(
    "specops_trainer_last_update_timestamp_seconds", "Unix time of the cluster's newest update", ["cluster"]
)
LAG = Gauge(
    "specops_trainer_lag_seconds",
    "Age of the oldest record in the trainer's latest poll (append time to now; 0: the poll found none, caught up)",
)
# held-out acceptance and skipped steps are exported by specops.trainer.schedule and specops.trainer.losses


class OnlineTrainer(ClusterStates, DraftUpdates):
    """Consumes spec.misses and keeps one distilled draft per cluster."""

    def __init__(
        self,
        stream: StreamConfig,
        base_draft: Path,
        out_dir: Path,
        cfg: OnlineConfig | None = None,
        *,
        target: Path | torch.nn.Module | None = None,
        promoter: Promoter | None = None,
        teacher: Callable[[MissRecord], TargetDist] | None = None,
        fresh: int | None = None,
        holdout_key: bytes | None = None,
    ) -> None:
        self.stream_cfg = stream
        self.cfg = cfg or OnlineConfig()
        self.promoter = promoter
        self.fresh_keep = (promoter.cfg.fresh if promoter is not None else 0) if fresh is None else fresh
        """Per cluster, how many training requests are scored before they are trained on and kept
        for the gate (``specops.trainer.promote.Fresh``; default: the promoter's ``fresh``, 0 without one)."""
        self._unpublished: dict[str, int] = {}
        """Per cluster: the checkpoint version still to register (step 5)."""
        self.gate_results: list = []
        """Every gate decision of this process, in order (GateResult)."""
        self.placement = Placement(self.cfg.device, self.cfg.dtype)  # a missing GPU fails here, clearly
        self.target: torch.nn.Module | None = None
        rank, world = launched_world()
        self.teacher = teacher
        """The target's distribution at every output position of a record (``positions = "all"``, and
        records an external engine served, which carry none: ``MissRecord.scored``)."""
        needs_target = self.cfg.sampling != "teacher" or (self.cfg.positions == "all" and teacher is None)
        # a target given is loaded even when logged records need none: an external engine's records may come
        wants_target = needs_target or (target is not None and teacher is None)
        if wants_target and not (self.cfg.backend == "deepspeed" and world > 1 and rank != 0):
            # (rank 0 samples every update's examples; the other ranks only get their share)
            if target is None:
                why = (
                    f"{self.cfg.sampling} sampling" if self.cfg.sampling != "teacher" else "training at every position"
                )
                raise ValueError(f"{why} queries the target model: pass target= (specops train --target DIR)")
            self.target = (
                target
                if isinstance(target, torch.nn.Module)
                else from_pretrained(AutoModelForCausalLM, target, use_safetensors=True)
            )
            self.target.to(self.placement.torch_device).eval().requires_grad_(False)
            draft_cfg = (
                json.loads((Path(base_draft) / "config.json").read_text())
                if (Path(base_draft) / "config.json").is_file()
                else {}
            )
            if draft_cfg.get("vocab_size") not in (None, self.target.config.vocab_size):
                raise ValueError(
                    f"the target's vocabulary ({self.target.config.vocab_size} tokens) is not the draft's "
                    f"({draft_cfg['vocab_size']}): pass the draft's own target"
                )
            self._sample_gen = torch.Generator().manual_seed(self.cfg.seed)
            if self.teacher is None:  # built whenever there is a target: it runs only when a record needs it
                self.teacher = TargetTeacher(self.target, cache_size=max(512, 2 * self.cfg.replay.capacity))
        self.base_draft = Path(base_draft)
        self.vocab = load_draft_vocab(self.base_draft)
        """The base draft's draft vocabulary: evaluations score drafts as serving runs them."""
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.holdout_key = holdout_key if holdout_key is not None else holdout_key_for(self.out)
        """The key of the held-out split's hash (``_holdout``): the trainer's, never a client's."""
        self.buffers: ReplayBuffers[Held] = ReplayBuffers(self.cfg.replay)
        self.clusters: OrderedDict[str, ClusterState] = OrderedDict()
        """The clusters in memory, least recently used first (at most ``cfg.max_loaded_clusters``)."""
        self.budget = ClusterBudget(self.cfg.max_loaded_clusters, self.cfg.max_clusters, ckpt.clusters_in(self.out))
        """Which clusters exist and which are unloaded (``specops.trainer.clusters``)."""
        self._seen: set[tuple[str, int, int]] = set()
        self._through: dict[str, dict[tuple[str, int], int]] = {}
        """Per cluster and (topic, partition): the highest offset of a training record this
        cluster took (buffered, and then trained or evicted). Offsets grow in a partition, so a
        redelivered training record at or below it was taken before a restart."""
        self._rng = random.Random(self.cfg.seed)
        self.link = None
        """``specops.trainer.ranks.RankLink`` under DeepSpeed's launcher with several ranks, else None."""
        if self.cfg.backend == "deepspeed" and world > 1:
            from specops.trainer.ds_backend import init_distributed

            self.link = init_distributed(self._ds_config(), ranks=True)
            if not self.link.is_root:  # a gradient worker: rank 0 alone consumes, checkpoints and registers
                if promoter is not None:
                    raise ValueError("only rank 0 registers drafts: pass promoter=None on the other ranks")
                self.stream = self.consumer = None
                return
            log.info(
                "rank 0 of %d: consuming and checkpointing; every rank computes its share of each update",
                self.link.world,
            )
        self.stream = open_stream(stream)
        self.consumer = RecordConsumer(
            self.stream,
            self.cfg.group,
            [stream.topics.misses],
            deadletter_topic=stream.topics.deadletter,
            expect=[MissRecord],
        )
        for cluster in sorted(self.budget.known):  # every checkpoint is registered before any commit
            self._check_registered(cluster)
        startup = self.budget.startup(self.out)  # the most recently written, oldest first
        self.budget.unloaded -= set(startup)  # loaded at start: not counted as reloads
        for cluster in startup:
            self.state(cluster)

    @property
    def world(self) -> int:
        return 1 if self.link is None else self.link.world

    def _ds_config(self):
        from specops.trainer.ds_backend import DeepSpeedConfig

        return DeepSpeedConfig(
            zero_stage=self.cfg.deepspeed_zero_stage, dist_backend="gloo" if self.placement.is_cpu else "nccl"
        )

    # ------------------------------------------------------------ the loop
    def step(self, max_records: int | None = None) -> int:
        """One pass of consume, buffer, update, persist, commit, of at most ``max_records``
        records (default: ``cfg.poll_records``). Returns records consumed."""
        limit = self.cfg.poll_records if max_records is None else max(1, min(max_records, self.cfg.poll_records))
        delivered = self.consumer.poll(max_records=limit, timeout_s=self.cfg.poll_timeout_s)  # 1.
        LAG.set(max((time.time() - d.message.timestamp_ms / 1000.0 for d in delivered), default=0.0))
        touched: set[str] = set()
        for d in delivered:  # 2.
            m = d.message
            source = (m.topic, m.partition, m.offset)
            if source in self._seen:
                continue  # redelivered after a crash: already buffered
            rec = d.record
            assert isinstance(rec, MissRecord)
            if not self.budget.admits(rec.cluster):  # one cluster more than max_clusters: no draft is made for it
                self.consumer.refuse(d, "cluster", self.budget.refusal(rec.cluster))
                continue
            if not rec.scored and self.teacher is None and self.cfg.sampling == "teacher":
                self.consumer.refuse(d, "engine", _unscored_refusal(rec))
                continue
            st = self.state(rec.cluster)  # first: a reloaded cluster brings back its buffered sources and offsets
            if source in self._seen:
                continue  # buffered before its cluster was unloaded or the trainer restarted
            heldout = _holdout(rec.request_id, self.cfg.holdout_every, self.holdout_key)
            through = self._through.setdefault(rec.cluster, {})
            if not heldout and m.offset <= through.get(source[:2], -1):
                continue  # redelivered after a crash: trained (or evicted) before it, not to be trained twice
            self._seen.add(source)
            held = Held(rec, source, bytes(m.value))
            touched.add(rec.cluster)
            if heldout:
                st.holdout.append(held)
                continue
            through[source[:2]] = m.offset
            buf = self.buffers[rec.cluster]
            buf.add(held)
            if self.fresh_keep:
                st.unscored.append(rec)
            if buf.num_new >= self.cfg.interval:  # 3. every I requests of this cluster
                self.update(rec.cluster)
        for cluster in sorted(touched):  # 4.
            if cluster in self.clusters:  # an unloaded one was persisted as it went
                self._persist(cluster)
        if not self.publish_pending():  # 5.
            return len(delivered)  # not committed: these records come back if the trainer dies now
        if delivered:  # 6.
            try:
                self.consumer.commit()
            except CommitFailedError as exc:
                # The group took partitions away since the poll (this member missed its session
                # timeout, or another one joined). Their records go to the new owner; this one
                # rejoins on its next poll, and what comes back to it is recognised in _seen.
                log.warning(
                    "offsets of this pass (%d records) not committed, the group rebalanced: %s", len(delivered), exc
                )
                return len(delivered)
            # after a commit only what the buffers hold can come back (crash before the next commit)
            self._seen = {h.source for c in self.buffers.clusters() for h in self.buffers[c]}
            self._seen |= {h.source for st in self.clusters.values() for h in st.holdout}
        return len(delivered)

    def update(self, cluster: str) -> dict:
        """Distil the cluster's draft on its buffer, evaluate, checkpoint. Returns the summary."""
        st, buf = self.state(cluster), self.buffers[cluster]
        t0 = time.perf_counter()
        if st.unscored:  # test, then train: the weights have not seen these requests yet
            st.fresh.extend(score_fresh(st.published, st.unscored, st.version, self.vocab))
            st.unscored.clear()
        before = self.evaluate(cluster)
        examples = self._examples(st, buf.items())
        vocab = self._train_vocab(st)
        if vocab is not None:  # the draft proposes only these tokens: learn the target's distribution over them
            examples = [replace(ex, target=ex.target.restrict(vocab.token_ids)) for ex in examples]
        losses, skipped = [], 0
        for _ in range(self.cfg.steps_per_update):
            loss, n_skipped = self._optimizer_step(st, examples, cluster)
            skipped += n_skipped
            if loss is not None:
                losses.append(loss)
        st.update_average(self.cfg.average_decay)  # what this version publishes (without averaging: the weights)
        st.version += 1  # the weights changed: a new version (and a new evaluation)
        after = self.evaluate(cluster)
        st.updates += 1
        st.records_trained += len(buf.items())
        st.positions_trained += sum(ex.num_positions for ex in examples)
        st.skipped_steps += skipped
        for h in buf.items():
            lo, hi = st.lineage.get(str(h.source[1]), [h.source[2], h.source[2]])
            st.lineage[str(h.source[1])] = [min(lo, h.source[2]), max(hi, h.source[2])]
        st.last_eval = {"before": before.to_dict(), "after": after.to_dict()}
        state = {
            "cluster": cluster,
            "updates": st.updates,
            "records_trained": st.records_trained,
            "positions_trained": st.positions_trained,
            "skipped_steps": st.skipped_steps,
            "eval": st.last_eval,
            "lineage": {"topic": self.stream_cfg.topics.misses, "offsets": st.lineage},
            "config": asdict(self.cfg),
            "config_hash": self.cfg.digest(),
            "base_draft": str(self.base_draft),
        }
        summary = {
            "cluster": cluster,
            "version": st.version,
            "requests": len(buf.items()),
            "positions": sum(ex.num_positions for ex in examples),
            "sampling": self.cfg.sampling,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "skipped_steps": skipped,
            "eval_before": before.to_dict(),
            "eval_after": after.to_dict(),
            "request_ids": [h.record.request_id for h in buf.items()],
            "seconds": round(time.perf_counter() - t0, 3),
        }
        # the summary rides in the checkpoint too: a kill between the two writes below leaves a
        # checkpoint whose history line _new_state writes back on restart (its records are not retrained)
        state["summary"] = summary
        ckpt.save_version(
            self.out,
            cluster,
            st.version,
            st.published,
            self._optimizer_files(st, cluster),
            state,
            extra_files=self._carried_files(),
            trained=None if st.average is None else _trained_weights(st.model),
        )
        st.saved_version = st.version
        ckpt.append_history(self.out, cluster, summary)
        buf.updated()
        UPDATES.labels(cluster=cluster_label(cluster)).inc()
        LAST_UPDATE.labels(cluster=cluster_label(cluster)).set(time.time())
        if self.promoter is not None and st.updates % self.promoter.cfg.register_every == 0:
            self._unpublished[cluster] = st.version
        log.info(
            "cluster %s: draft v%d after %d requests (%d positions): loss %s -> %s, held-out served agreement "
            "%.3f -> %.3f (%d positions), rejected-position acceptance %.3f -> %.3f (%d positions) in %.2fs",
            cluster,
            st.version,
            summary["requests"],
            summary["positions"],
            _f(summary["loss_first"]),
            _f(summary["loss_last"]),
            before.served,
            after.served,
            after.served_positions,
            before.sampling,
            after.sampling,
            after.num_positions,
            summary["seconds"],
        )
        return summary

    def publish_pending(self) -> bool:
        """Register and gate every cluster's newest unregistered checkpoint. False when the
        registry failed (the caller must not commit)."""
        from specops.registry import RegistryError

        for cluster, version in sorted(self._unpublished.items()):
            st = self.state(cluster)
            path = self.out / cluster / f"v{version:06d}"
            if st.version != version or not path.exists():  # superseded by a later checkpoint
                version, path = st.version, ckpt.latest_version(self.out, cluster)
            try:
                saved = ckpt.load_state(path)
                after = self.evaluate(cluster)
                result = self.promoter.publish(
                    cluster,
                    path,
                    version,
                    saved,
                    st.published,
                    [h.record for h in st.holdout],
                    after,
                    fresh=list(st.fresh),
                    champion_checkpoint=st.champion_checkpoint,
                )
            except RegistryError as exc:
                log.warning(
                    "cluster %s: registering checkpoint v%d failed (%s); offsets stay uncommitted, "
                    "retrying on the next pass",
                    cluster,
                    version,
                    exc,
                )
                time.sleep(min(5.0, self.cfg.poll_timeout_s))
                return False
            self.gate_results.append(result)
            if result.promoted:
                st.champion_checkpoint = version
            del self._unpublished[cluster]
        return True

    def run(self, *, max_idle_s: float | None = None, max_records: int | None = None, stop=None) -> int:
        """Loop until ``stop`` is set, ``max_records`` were consumed (exactly: the last pass polls
        only what is left), or nothing came for ``max_idle_s``."""
        consumed, idle_since = 0, time.monotonic()
        while (stop is None or not stop.is_set()) and (max_records is None or consumed < max_records):
            n = self.step(None if max_records is None else max_records - consumed)
            consumed += n
            if n:
                idle_since = time.monotonic()
            if max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                log.info("no records for %.0fs; stopping", max_idle_s)
                break
        return consumed

    def close(self) -> None:
        if self.link is not None and self.link.is_root:
            self.link.send_all({"op": "stop"})
        if self.consumer is not None:
            self.consumer.close()
            self.stream.close()


def _unscored_refusal(rec: MissRecord) -> str:
    return (
        f"request {rec.request_id} was served by {rec.engine}, which logs no target distributions; training "
        "on it recomputes them with the target: start the trainer with it (specops train --target DIR)"
    )


def _trained_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters the optimiser trains (frozen ones are the same in the published average)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


HOLDOUT_KEY_FILE = "holdout.key"
HOLDOUT_KEY_ENV = "SPECOPS_HOLDOUT_KEY"
"""The held-out key in hex, for trainers that must split alike without sharing ``--out`` (a
replacement trainer, the ranks of a test); ``unkeyed``: the plain hash, which a client can steer
(reproducible tests and benchmarks only). Unset: ``holdout.key`` under ``--out``."""


def holdout_key_for(out: Path) -> bytes:
    """The held-out split's key: ``$SPECOPS_HOLDOUT_KEY`` if set, else the one kept under ``out``."""
    value = os.environ.get(HOLDOUT_KEY_ENV, "").strip()
    if not value:
        return holdout_key_in(out)
    if value == "unkeyed":
        return b""
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(
            f"${HOLDOUT_KEY_ENV} must be at least 32 hex digits (or 'unkeyed'), got {len(value)} characters"
        )
    return key


def holdout_key_in(out: Path) -> bytes:
    """The held-out split's key kept under ``out`` (made, 32 random bytes, the first time): a restart
    splits the same way, and a client that picks its ``X-Request-Id`` cannot pick its side."""
    path = out / HOLDOUT_KEY_FILE
    try:
        with path.open("x") as f:  # exclusive: two processes starting on one --out agree on one key
            f.write(secrets.token_hex(32))
    except FileExistsError:
        pass
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(f"{path} is not a held-out key (64 hex digits); delete it and a new one is made")
    return key


def _holdout(request_id: str, every: int, key: bytes = b"") -> bool:
    """Whether a request is held out: a hash of its id (its choices' ``#i`` dropped: every choice of a
    request on the same side) keyed by the trainer's secret."""
    base = request_id.split(CHOICE_SEPARATOR, 1)[0].encode()
    digest = hmac.new(key, base, hashlib.sha256).hexdigest() if key else hashlib.sha256(base).hexdigest()
    return int(digest[:8], 16) % every == 0


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"

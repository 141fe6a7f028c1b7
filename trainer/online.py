"""The online distillation loop (OSD Algorithm 1, lines 18-21), one draft per cluster.

Each pass of :meth:`OnlineTrainer.step` reads top to bottom:

1. **consume** a batch of MissRecords from ``spec.misses`` as a member of the consumer
   group (invalid records are dead-lettered by ``RecordConsumer``);
2. **buffer** each record in its cluster's replay buffer, or in the cluster's held-out
   set (one request in ``holdout_every``, chosen by a hash of its request id). The cluster is
   loaded first if it is not in memory; a record of a cluster beyond ``max_clusters`` is
   dead-lettered instead (``trainer.clusters``: at most ``max_loaded_clusters`` in memory);
3. for every cluster with ``interval`` new requests: **update** its draft with the GKD
   loss at the logged rejected positions, using the logged target distributions
   (teacher sampling, OSD §4.1); **evaluate** expected acceptance on the held-out set
   before and after; **checkpoint** draft, optimiser and state durably. This happens
   in stream order, as soon as a cluster has I new requests, even inside one batch;
4. **persist** the buffers of the clusters touched;
5. **register** (with a registry): each cluster's newest checkpoint becomes a
   ``challenger`` version and goes through the promotion gate (``trainer.promote``);
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
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import Counter, Gauge
from transformers import AutoModelForCausalLM

from specops.serving.engine.device import Placement
from specops.serving.fleet.clusters import cluster_label
from specops.serving.engine.models import from_pretrained
from specops.serving.engine import draft_vocab
from specops.serving.engine.draft_vocab import DraftVocab
from specops.streams import CommitFailedError, StreamConfig, codec, open_stream
from specops.streams.consumer import RecordConsumer
from specops.streams.records import MissRecord
from specops.trainer import checkpoint as ckpt
from specops.trainer.acceptance import Acceptance, evaluate_records
from specops.trainer.clusters import ClusterBudget
from specops.trainer.data import Example, TargetTeacher, draft_logits, every_position_example, logs_every_position, teacher_example
from specops.trainer.losses import TargetDist
from specops.trainer.losses import LOSSES, checked_loss
from specops.trainer.promote import Promoter, load_draft_vocab
from specops.trainer.ranks import launched_world, pack_examples, shard, unpack_examples
from specops.trainer.replay import ReplayBuffers, ReplayConfig
from specops.trainer.sampling import SAMPLING, sampled_example

log = logging.getLogger(__name__)

POSITIONS = ("rejected", "all")

UPDATES = Counter("specops_trainer_updates_total", "Draft updates (checkpointed versions) per cluster", ["cluster"])
LAST_UPDATE = Gauge("specops_trainer_last_update_timestamp_seconds", "Unix time of the cluster's newest update",
                    ["cluster"])  # fmt: skip
# held-out acceptance and skipped steps are exported by trainer.schedule and trainer.losses


@dataclass
class OnlineConfig:
    """How the online trainer learns. Every field is stamped on each checkpoint."""

    group: str = "trainer"
    """Consumer group on ``spec.misses``; trainer replicas share it and split clusters."""
    interval: int = 8
    """Update a cluster's draft every I finished requests of that cluster (OSD uses 8)."""
    loss: str = "fkl"
    """``fkl`` (forward KL), ``rkl`` (reverse KL) or ``jsd`` (JSD[beta]) (OSD Eq. 4)."""
    beta: float = 0.5
    """JSD mixture weight."""
    tau: float = 1.0
    """Softmax temperature applied to both distributions."""
    lr: float = 1e-3
    """AdamW learning rate of every draft (OSD uses 5e-4; 1e-3 learned more on chat traffic in
    ``benchmarks/osd.py --grid``, 3e-3 less: docs/trainer.md)."""
    weight_decay: float = 0.0
    steps_per_update: int = 4
    """Optimiser steps per update, each over the whole buffer (4 learned clearly more than 1 in the grid)."""
    grad_clip: float = 1.0
    sampling: str = "teacher"
    """Where the loss applies (OSD §4.1): ``teacher`` (the logged rejected positions and
    logged target distributions), ``student`` or ``mixed`` (sequences sampled after the
    logged prompts from the draft, or from ``mix·p + (1-mix)·q``, scored by the target:
    needs the target model)."""
    positions: str = "all"
    """Where teacher sampling applies the loss: ``rejected`` (the logged rejected positions,
    OSD Algorithm 1) or ``all`` (every output position of each request). Serving logs the
    target's distribution only where a draft token was rejected, so ``all`` recomputes it by
    one target forward per request (``trainer.data.TargetTeacher``: needs the target model)
    unless a record already carries every position. ``all`` is the default: it learned more
    than the paper's rejected positions in the grid (docs/trainer.md)."""
    mix: float = 0.5
    """Target weight λ of mixed sampling, ``y_j ~ λ·p + (1-λ)·q``."""
    sample_max_new_tokens: int | None = None
    """Tokens sampled per request under student/mixed sampling (default: the logged output's length)."""
    replay: ReplayConfig = field(default_factory=lambda: ReplayConfig(policy="clear", capacity=32))
    """The replay buffer. Cleared after every update, as OSD does: each request is trained in one
    update. Keeping the 32 most recent (``recent``) learned more in the grid together with every
    position and 4 steps, at three times the trainer's CPU per request (docs/trainer.md): the
    choice for a trainer with a GPU of its own."""
    train_embeddings: bool = False
    """Also train the draft's token embeddings (and an LM head tied to them). Off: the
    default draft's embeddings are the target's, shared by every version; a few hundred
    positions per update would move only the rows of the tokens they contain."""
    holdout_every: int = 10
    """One request in N (by request-id hash) is held out for evaluation, never trained on."""
    holdout_capacity: int = 256
    """Most held-out requests kept per cluster (the most recent)."""
    poll_records: int = 256
    poll_timeout_s: float = 1.0
    seed: int = 0
    backend: str = "torch"
    """``torch`` (plain PyTorch) or ``deepspeed``: the same update through a DeepSpeed engine
    (ZeRO; one process, or data parallel over the ranks of DeepSpeed's launcher: see
    ``trainer.ds_backend`` and ``trainer.ranks``)."""
    deepspeed_zero_stage: int = 2
    """ZeRO stage (0, 1 or 2) when ``backend == "deepspeed"``."""
    device: str = "cpu"
    """Where drafts (and the target, for student / mixed sampling) train: cpu, cuda or cuda:N."""
    dtype: str = "float32"
    """Precision of the draft weights being trained (``serving.engine.device``)."""
    max_loaded_clusters: int = 8
    """Most clusters whose draft and optimiser state are held in memory; the least recently used
    idle one is unloaded (its checkpoint kept) and reloaded from it when its records come
    (``trainer.clusters``). Set it to at least the clusters that get traffic: each reload reads a checkpoint."""
    max_clusters: int = 64
    """Most clusters the trainer creates in all (those under ``--out`` count); records of a further
    cluster go to the dead-letter topic."""

    def __post_init__(self) -> None:
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {self.sampling!r}")
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {self.mix!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.backend not in ("torch", "deepspeed"):
            raise ValueError(f"backend must be 'torch' or 'deepspeed', got {self.backend!r}")
        if self.deepspeed_zero_stage not in (0, 1, 2):
            raise ValueError(f"deepspeed_zero_stage must be 0, 1 or 2, got {self.deepspeed_zero_stage!r}")
        if self.interval < 1 or self.steps_per_update < 1 or self.holdout_every < 2:
            raise ValueError("interval and steps_per_update must be >= 1, holdout_every >= 2")
        if not (0.0 < self.beta < 1.0) or self.tau <= 0 or self.lr <= 0:
            raise ValueError("need 0 < beta < 1, tau > 0 and lr > 0")
        if self.max_loaded_clusters < 1 or self.max_clusters < 1:
            raise ValueError(f"max_loaded_clusters and max_clusters must be >= 1, got {self.max_loaded_clusters} and "
                             f"{self.max_clusters}")  # fmt: skip

    def digest(self) -> str:
        """Hash of everything that changes the trained weights (not the memory bounds: an unloaded
        cluster reloads exactly)."""
        values = {k: v for k, v in asdict(self).items() if k not in ("max_loaded_clusters", "max_clusters")}
        return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Held:
    """A buffered record and where it came from."""

    record: MissRecord
    source: tuple[str, int, int]
    raw: bytes


@dataclass
class ClusterState:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    version: int = 0
    saved_version: int = 0
    """The version of its newest checkpoint (0: none, the base draft): unloadable when equal to ``version``."""
    updates: int = 0
    records_trained: int = 0
    positions_trained: int = 0
    skipped_steps: int = 0
    lineage: dict = field(default_factory=dict)
    """Per partition of spec.misses, [first, last] offsets this draft trained on."""
    holdout: deque = field(default_factory=deque)
    last_eval: dict = field(default_factory=dict)
    eval_cache: tuple | None = None
    """(version, held-out sources) and the Acceptance measured then: evaluations of unchanged
    weights on an unchanged held-out set are not repeated (before = the previous after)."""
    engine: Any = None
    """The DeepSpeed engine around ``model`` and ``opt`` (backend ``deepspeed``), else None."""


class OnlineTrainer:
    """Consumes spec.misses and keeps one distilled draft per cluster."""

    def __init__(self, stream: StreamConfig, base_draft: Path, out_dir: Path, cfg: OnlineConfig | None = None,
                 *, target: Path | torch.nn.Module | None = None, promoter: Promoter | None = None,
                 teacher: Callable[[MissRecord], TargetDist] | None = None) -> None:  # fmt: skip
        self.stream_cfg = stream
        self.cfg = cfg or OnlineConfig()
        self.promoter = promoter
        self._unpublished: dict[str, int] = {}
        """Per cluster: the checkpoint version still to register (step 5)."""
        self.gate_results: list = []
        """Every gate decision of this process, in order (GateResult)."""
        self.placement = Placement(self.cfg.device, self.cfg.dtype)  # a missing GPU fails here, clearly
        self.target: torch.nn.Module | None = None
        rank, world = launched_world()
        self.teacher = teacher
        """The target's distribution at every output position of a record (``positions = "all"``)."""
        needs_target = self.cfg.sampling != "teacher" or (self.cfg.positions == "all" and teacher is None)
        if needs_target and not (self.cfg.backend == "deepspeed" and world > 1 and rank != 0):
            # (rank 0 samples every update's examples; the other ranks only get their share)
            if target is None:
                why = f"{self.cfg.sampling} sampling" if self.cfg.sampling != "teacher" else "training at every position"
                raise ValueError(f"{why} queries the target model: pass target= (specops train --target DIR)")
            self.target = target if isinstance(target, torch.nn.Module) else \
                from_pretrained(AutoModelForCausalLM, target, use_safetensors=True)  # fmt: skip
            self.target.to(self.placement.torch_device).eval().requires_grad_(False)
            draft_cfg = json.loads((Path(base_draft) / "config.json").read_text()) if (Path(base_draft) / "config.json").is_file() else {}
            if draft_cfg.get("vocab_size") not in (None, self.target.config.vocab_size):
                raise ValueError(f"the target's vocabulary ({self.target.config.vocab_size} tokens) is not the draft's "
                                 f"({draft_cfg['vocab_size']}): pass the draft's own target")  # fmt: skip
            self._sample_gen = torch.Generator().manual_seed(self.cfg.seed)
            if self.cfg.positions == "all" and self.teacher is None:
                self.teacher = TargetTeacher(self.target, cache_size=max(512, 2 * self.cfg.replay.capacity))
        self.base_draft = Path(base_draft)
        self.vocab = load_draft_vocab(self.base_draft)
        """The base draft's draft vocabulary: evaluations score drafts as serving runs them."""
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.buffers: ReplayBuffers[Held] = ReplayBuffers(self.cfg.replay)
        self.clusters: OrderedDict[str, ClusterState] = OrderedDict()
        """The clusters in memory, least recently used first (at most ``cfg.max_loaded_clusters``)."""
        self.budget = ClusterBudget(self.cfg.max_loaded_clusters, self.cfg.max_clusters, ckpt.clusters_in(self.out))
        """Which clusters exist and which are unloaded (``trainer.clusters``)."""
        self._seen: set[tuple[str, int, int]] = set()
        self._through: dict[str, dict[tuple[str, int], int]] = {}
        """Per cluster and (topic, partition): the highest offset of a training record this
        cluster took (buffered, and then trained or evicted). Offsets grow in a partition, so a
        redelivered training record at or below it was taken before a restart."""
        self._rng = random.Random(self.cfg.seed)
        self.link = None
        """``trainer.ranks.RankLink`` under DeepSpeed's launcher with several ranks, else None."""
        if self.cfg.backend == "deepspeed" and world > 1:
            from specops.trainer.ds_backend import init_distributed

            self.link = init_distributed(self._ds_config(), ranks=True)
            if not self.link.is_root:  # a gradient worker: rank 0 alone consumes, checkpoints and registers
                if promoter is not None:
                    raise ValueError("only rank 0 registers drafts: pass promoter=None on the other ranks")
                self.stream = self.consumer = None
                return
            log.info("rank 0 of %d: consuming and checkpointing; every rank computes its share of each update",
                     self.link.world)  # fmt: skip
        self.stream = open_stream(stream)
        self.consumer = RecordConsumer(self.stream, self.cfg.group, [stream.topics.misses],
                                       deadletter_topic=stream.topics.deadletter, expect=[MissRecord])  # fmt: skip
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

        return DeepSpeedConfig(zero_stage=self.cfg.deepspeed_zero_stage,
                               dist_backend="gloo" if self.placement.is_cpu else "nccl")  # fmt: skip

    # ------------------------------------------------------------ state
    def _carried_files(self) -> dict[str, Path]:
        """Files of the base draft every version carries: its draft vocabulary (serving scores only those rows)."""
        src = self.base_draft / draft_vocab.FILE
        return {draft_vocab.FILE: src} if src.is_file() else {}

    def _new_state(self, cluster: str, opt_files: tuple[dict, dict] | None = None) -> ClusterState:
        """The cluster's draft, resumed from its newest checkpoint. On ranks other than 0
        (``opt_files``: the optimiser state rank 0 sent, or None) from the base draft, whose
        weights the engine's creation replaces with rank 0's."""
        path = ckpt.latest_version(self.out, cluster) if self.link is None or self.link.is_root else None
        model = from_pretrained(AutoModelForCausalLM, path or self.base_draft, use_safetensors=True)
        if not (self.placement.is_cpu and self.placement.dtype == "float32"):
            model.to(device=self.placement.torch_device, dtype=self.placement.torch_dtype)
        model.train()
        if not self.cfg.train_embeddings:
            model.get_input_embeddings().weight.requires_grad_(False)  # a tied head stays with them
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay)
        st = ClusterState(model=model, opt=opt, holdout=deque(maxlen=self.cfg.holdout_capacity))
        saved = ckpt.load_state(path) if path is not None else None
        was, now = (_opt_layout(saved.get("config", {})), _opt_layout(asdict(self.cfg))) if saved else (None, None)
        if saved is not None and was == now:
            opt_files = ckpt.load_optimizer_files(path)
        if self.link is not None and self.link.is_root:  # the other ranks build the same engine now
            tensors, layout = opt_files or ({}, None)
            self.link.send_all({"op": "open", "cluster": cluster, "layout": layout}, tensors)
        if self.cfg.backend == "deepspeed":  # imported only here: plain PyTorch runs never load deepspeed
            from specops.trainer.ds_backend import init_engine, load_optimizer_files

            # before loading optimiser state: under ZeRO 1/2 ``opt`` then steps ZeRO's flat fp32 partition
            st.engine = init_engine(model, opt, self.cfg.grad_clip, self._ds_config())
            if opt_files is not None:
                rank = 0 if self.link is None else self.link.rank
                load_optimizer_files(st.engine, *opt_files, rank=rank, world=self.world)
        elif opt_files is not None:
            ckpt.optimizer_from_files(opt, *opt_files)
        if saved is not None:
            st.saved_version = saved["version"]
            if was != now:
                log.warning("cluster %s: %s has optimiser layout %s, this run uses %s: weights resumed, "
                            "optimiser state starts fresh", cluster, path, was, now)  # fmt: skip
            st.version, st.updates = saved["version"], saved["updates"]
            st.records_trained, st.positions_trained = saved["records_trained"], saved["positions_trained"]
            st.skipped_steps, st.lineage = saved.get("skipped_steps", 0), saved.get("lineage", {}).get("offsets", {})
            st.last_eval = saved.get("eval", {})
            log.info("cluster %s: resumed draft v%d (%d updates) from %s", cluster, st.version, st.updates, path)
            if ckpt.history_version(self.out, cluster) < st.version and "summary" in saved:
                log.warning("cluster %s: the trainer stopped after checkpoint v%d but before its history line; "
                            "writing it back from the checkpoint", cluster, st.version)  # fmt: skip
                ckpt.append_history(self.out, cluster, {**saved["summary"], "recovered": True})
        else:
            log.info("cluster %s: new draft from %s", cluster, self.base_draft)
        return st

    def state(self, cluster: str) -> ClusterState:
        """The cluster's state in memory: loaded (from its checkpoint and buffers under ``--out``, or
        new from the base draft) if it is not, after unloading the least recently used idle one
        when ``cfg.max_loaded_clusters`` are loaded."""
        st = self.clusters.get(cluster)
        if st is not None:
            self.clusters.move_to_end(cluster)  # most recently used
            return st
        while len(self.clusters) >= self.cfg.max_loaded_clusters:
            victim = self.budget.victim(self.clusters, keep=cluster, pinned=self._unpublished.__contains__,
                                        idle=lambda c: self.clusters[c].version == self.clusters[c].saved_version)  # fmt: skip
            if victim is None:  # every other cluster has weights not yet checkpointed (cannot happen between steps)
                log.warning("cluster %s: loaded beyond max_loaded_clusters (%d): no idle cluster to unload", cluster,
                            self.cfg.max_loaded_clusters)  # fmt: skip
                break
            self._unload(victim)
        st = self.clusters[cluster] = self._new_state(cluster)
        self._restore(cluster, st)
        self.budget.loaded(cluster, len(self.clusters))
        return st

    def _unload(self, cluster: str) -> None:
        """Drop an idle cluster from memory: its draft and optimiser are in its newest checkpoint
        already (``saved_version == version``); its buffered and held-out records are written now."""
        st = self.clusters[cluster]
        assert st.version == st.saved_version, f"cluster {cluster}: v{st.version} is not checkpointed"
        self._persist(cluster)
        del self.clusters[cluster]
        self.buffers.drop(cluster)
        self._through.pop(cluster, None)  # restored from the buffer file and the checkpoint's lineage on reload
        if self.link is not None and self.link.is_root:
            self.link.send_all({"op": "close", "cluster": cluster})
        self.budget.dropped(cluster, len(self.clusters))
        log.info("cluster %s: unloaded (checkpoint v%d kept; %d clusters loaded)", cluster, st.version,
                 len(self.clusters))  # fmt: skip

    def _check_registered(self, cluster: str) -> None:
        """At start: queue the cluster's newest checkpoint for registration if it never was (a kill
        between checkpoint and registration), loaded or not, so it is registered before any commit."""
        path = ckpt.latest_version(self.out, cluster)
        version = ckpt.load_state(path).get("version", 0) if path is not None else 0
        if self.promoter is not None and version and self.promoter.is_registered(cluster, version) is None:
            log.info("cluster %s: checkpoint v%d was never registered; registering it before any commit", cluster,
                     version)  # fmt: skip
            self._unpublished[cluster] = version

    def _restore(self, cluster: str, st: ClusterState) -> None:
        """The cluster's persisted buffered and held-out records and offsets, back in memory."""
        through = self._through.setdefault(cluster, {})
        for p, (_, hi) in st.lineage.items():  # trained into the checkpoint, maybe not in the saved buffer
            tp = (self.stream_cfg.topics.misses, int(p))
            through[tp] = max(through.get(tp, -1), hi)
        saved = ckpt.load_buffer(self.out, cluster)
        if not saved:
            return
        for topic, p, offset in saved.get("through", []):
            through[(topic, p)] = max(through.get((topic, p), -1), offset)
        buf = self.buffers[cluster]
        for item in saved["buffer"]:
            held = self._held(item)
            buf.add(held)
            self._seen.add(held.source)
        buf.num_new = saved["num_new"]
        for item in saved["holdout"]:
            held = self._held(item)
            st.holdout.append(held)
            self._seen.add(held.source)
        log.info("cluster %s: restored %d buffered and %d held-out records", cluster, len(buf), len(st.holdout))

    @staticmethod
    def _held(item: list) -> Held:
        topic, partition, offset, raw = item
        rec = codec.decode(raw)
        assert isinstance(rec, MissRecord)
        return Held(rec, (topic, partition, offset), raw)

    def _persist(self, cluster: str) -> None:
        pack = [[*h.source, h.raw] for h in self.buffers[cluster].items()]
        hold = [[*h.source, h.raw] for h in self.clusters[cluster].holdout]
        through = [[t, p, o] for (t, p), o in sorted(self._through.get(cluster, {}).items())]
        ckpt.save_buffer(self.out, cluster, {"buffer": pack, "num_new": self.buffers[cluster].num_new, "holdout": hold,
                                             "through": through})  # fmt: skip

    # ------------------------------------------------------------ the loop
    def step(self, max_records: int | None = None) -> int:
        """One pass of consume, buffer, update, persist, commit, of at most ``max_records``
        records (default: ``cfg.poll_records``). Returns records consumed."""
        limit = self.cfg.poll_records if max_records is None else max(1, min(max_records, self.cfg.poll_records))
        delivered = self.consumer.poll(max_records=limit, timeout_s=self.cfg.poll_timeout_s)  # 1.
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
            st = self.state(rec.cluster)  # first: a reloaded cluster brings back its buffered sources and offsets
            if source in self._seen:
                continue  # buffered before its cluster was unloaded or the trainer restarted
            heldout = _holdout(rec.request_id, self.cfg.holdout_every)
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
                log.warning("offsets of this pass (%d records) not committed, the group rebalanced: %s", len(delivered), exc)
                return len(delivered)
            # after a commit only what the buffers hold can come back (crash before the next commit)
            self._seen = {h.source for c in self.buffers.clusters() for h in self.buffers[c]}
            self._seen |= {h.source for st in self.clusters.values() for h in st.holdout}
        return len(delivered)

    def update(self, cluster: str) -> dict:
        """Distil the cluster's draft on its buffer, evaluate, checkpoint. Returns the summary."""
        st, buf = self.state(cluster), self.buffers[cluster]
        t0 = time.perf_counter()
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
            "cluster": cluster, "updates": st.updates, "records_trained": st.records_trained,
            "positions_trained": st.positions_trained, "skipped_steps": st.skipped_steps, "eval": st.last_eval,
            "lineage": {"topic": self.stream_cfg.topics.misses, "offsets": st.lineage}, "config": asdict(self.cfg),
            "config_hash": self.cfg.digest(), "base_draft": str(self.base_draft),
        }  # fmt: skip
        summary = {
            "cluster": cluster, "version": st.version, "requests": len(buf.items()),
            "positions": sum(ex.num_positions for ex in examples), "sampling": self.cfg.sampling,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "skipped_steps": skipped, "eval_before": before.to_dict(),
            "eval_after": after.to_dict(), "request_ids": [h.record.request_id for h in buf.items()],
            "seconds": round(time.perf_counter() - t0, 3),
        }  # fmt: skip
        # the summary rides in the checkpoint too: a kill between the two writes below leaves a
        # checkpoint whose history line _new_state writes back on restart (its records are not retrained)
        state["summary"] = summary
        ckpt.save_version(self.out, cluster, st.version, st.model, self._optimizer_files(st, cluster), state,
                          extra_files=self._carried_files())  # fmt: skip
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
            cluster, st.version, summary["requests"], summary["positions"], _f(summary["loss_first"]),
            _f(summary["loss_last"]), before.served, after.served, after.served_positions, before.sampling,
            after.sampling, after.num_positions, summary["seconds"],
        )  # fmt: skip
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
                result = self.promoter.publish(cluster, path, version, saved, st.model,
                                               [h.record for h in st.holdout], after)  # fmt: skip
            except RegistryError as exc:
                log.warning("cluster %s: registering checkpoint v%d failed (%s); offsets stay uncommitted, "
                            "retrying on the next pass", cluster, version, exc)  # fmt: skip
                time.sleep(min(5.0, self.cfg.poll_timeout_s))
                return False
            self.gate_results.append(result)
            del self._unpublished[cluster]
        return True

    def _examples(self, st: ClusterState, items: list[Held]) -> list[Example]:
        """The sequences and positions this update trains on (see ``trainer.sampling``)."""
        if self.cfg.sampling == "teacher" and self.cfg.positions == "all":
            out = []
            for h in items:
                rec = h.record
                if len(rec.token_ids) <= rec.num_prompt_tokens:
                    continue
                if logs_every_position(rec):  # serving logged every position: no forward needed
                    out.append(teacher_example(rec))
                else:
                    assert self.teacher is not None
                    out.append(every_position_example(rec, self.teacher(rec)))
            return out
        if self.cfg.sampling == "teacher":
            return [teacher_example(h.record) for h in items if h.record.num_rejected]
        assert self.target is not None
        mix = 0.0 if self.cfg.sampling == "student" else self.cfg.mix
        return [sampled_example(self.target, st.model, h.record, mix=mix, max_new_tokens=self.cfg.sample_max_new_tokens,
                                generator=self._sample_gen) for h in items]  # fmt: skip

    def _optimizer_step(self, st: ClusterState, examples: list[Example], cluster: str = "") -> tuple[float | None, int]:
        """One step over ``examples``: position-weighted mean loss; non-finite examples skipped.
        With several ranks each computes its share (``trainer.ranks.shard``); the gradient is the same."""
        if not examples:
            return None, 0
        if self.link is not None:  # rank 0: every other rank gets its share of the examples
            shards = shard(examples, self.world)
            for dst in range(1, self.world):
                tensors, ids = pack_examples([examples[i] for i in shards[dst]])
                self.link.send(dst, {"op": "step", "cluster": cluster, "request_ids": ids}, tensors)
            examples = [examples[i] for i in shards[0]]
        return self._local_step(st, examples)

    def _local_step(self, st: ClusterState, examples: list[Example]) -> tuple[float | None, int]:
        """This rank's part of an optimiser step (all of it in one process)."""
        net = st.model if st.engine is None else st.engine  # DeepSpeed: forward through the engine
        net.train()
        st.opt.zero_grad(set_to_none=True)
        total, positions, skipped = None, 0, 0
        for ex in examples:
            logits = draft_logits(net, ex, self._train_vocab(st))  # [m, V], or [m, S] with a draft vocabulary
            loss, reason = checked_loss(logits, ex.target.to(logits.device), self.cfg.loss, beta=self.cfg.beta,
                                        tau=self.cfg.tau)  # fmt: skip
            if loss is None:
                skipped += 1
                log.warning("skipped request %s in the update: %s", ex.request_id, reason)
                continue
            m = ex.num_positions
            total = loss * m if total is None else total + loss * m
            positions += m
        if self.link is not None:  # the whole step's positions and loss, from every rank
            loss_sum = 0.0 if total is None else float(total.detach())
            loss_sum, positions, skipped = self.link.sum([loss_sum, positions, skipped])
            skipped = int(skipped)
        if not positions:
            return None, skipped  # on every rank alike: no backward, no step
        if total is None:  # this rank has nothing (or only skipped examples): a zero gradient, still reduced
            total = net(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.placement.torch_device)).logits.sum() * 0
        # DeepSpeed averages the ranks' gradients: scaled by W, the mean over all positions of the step
        scaled = total / positions if self.world == 1 else total * (self.world / positions)
        if st.engine is not None:  # ZeRO: reduce grads, clip to cfg.grad_clip, AdamW on the fp32 partition, copy back
            st.engine.backward(scaled)
            st.engine.step()
        else:
            scaled.backward()
            torch.nn.utils.clip_grad_norm_([p for p in st.model.parameters() if p.requires_grad], self.cfg.grad_clip)
            st.opt.step()
        return (float(scaled.detach()) if self.world == 1 else loss_sum / positions), skipped

    def _optimizer_files(self, st: ClusterState, cluster: str) -> tuple[dict, dict]:
        """The optimiser state a checkpoint keeps (ZeRO partitions gathered from every rank)."""
        if st.engine is None:
            return ckpt.optimizer_to_files(st.opt)
        from specops.trainer.ds_backend import optimizer_files

        if self.link is not None and self.link.is_root and self.cfg.deepspeed_zero_stage > 0:
            self.link.send_all({"op": "gather", "cluster": cluster})  # the other ranks contribute their partitions
        return optimizer_files(st.engine, self.link)

    def serve_rank(self) -> int:
        """Ranks other than 0: follow rank 0's commands until it stops. Returns steps taken."""
        assert self.link is not None and not self.link.is_root
        steps = 0
        while True:
            cmd, tensors = self.link.recv()
            op = cmd["op"]
            if op == "stop":
                log.info("rank %d: stopped by rank 0 after %d steps", self.link.rank, steps)
                return steps
            if op == "open":
                opt_files = (tensors, cmd["layout"]) if cmd["layout"] is not None else None
                self.clusters[cmd["cluster"]] = self._new_state(cmd["cluster"], opt_files)
            elif op == "step":
                self._local_step(self.clusters[cmd["cluster"]], unpack_examples(tensors, cmd["request_ids"]))
                steps += 1
            elif op == "close":  # rank 0 unloaded the cluster (trainer.clusters)
                self.clusters.pop(cmd["cluster"], None)
            elif op == "gather":
                self._optimizer_files(self.clusters[cmd["cluster"]], cmd["cluster"])
            else:
                raise RuntimeError(f"rank {self.link.rank}: unknown command {op!r} from rank 0")

    def _train_vocab(self, st: ClusterState) -> DraftVocab | None:
        """The draft vocabulary updates train on: the base draft's, except under DeepSpeed
        (its engine runs the whole model) or for a model whose head is not a plain linear map."""
        if self.vocab is None or st.engine is not None or not draft_vocab.supports_subset_head(st.model):
            return None
        return self.vocab

    def evaluate(self, cluster: str) -> Acceptance:
        """Acceptance of the cluster's current draft on its held-out records (``trainer.acceptance``)."""
        st = self.state(cluster)
        key = (st.version, tuple(h.source for h in st.holdout))
        if st.eval_cache is not None and st.eval_cache[0] == key:
            return st.eval_cache[1]
        acc = evaluate_records(st.model, [h.record for h in st.holdout], vocab=self.vocab)
        st.eval_cache = (key, acc)
        return acc

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


def _opt_layout(config: dict) -> str:
    """The optimiser-state layout a stamped config trains with; state resumes only into the same one."""
    from specops.trainer.ds_backend import optimizer_layout  # no deepspeed import

    trained = "all" if config.get("train_embeddings", True) else "no-embeddings"  # older checkpoints trained all
    return f"{optimizer_layout(config.get('backend', 'torch'), config.get('deepspeed_zero_stage', 2))}/{trained}"


def _holdout(request_id: str, every: int) -> bool:
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) % every == 0


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"

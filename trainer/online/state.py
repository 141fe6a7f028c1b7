"""The online trainer's clusters in memory: a cluster's draft and optimiser loaded from its
newest checkpoint (or the base draft), unloaded when idle, and its buffered and held-out
records persisted and restored (``specops.trainer.clusters`` decides which cluster goes).
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from specops.core import draft_vocab
from specops.core.device import Placement
from specops.core.models import from_pretrained
from specops.streams import StreamConfig, codec
from specops.streams.records import MissRecord
from specops.trainer import checkpoint as ckpt
from specops.trainer.clusters import ClusterBudget
from specops.trainer.online.config import OnlineConfig
from specops.trainer.promote import Promoter
from specops.trainer.replay import ReplayBuffers

log = logging.getLogger("specops.trainer.online.trainer")  # one logger for the whole loop, as before the split


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
    fresh: deque = field(default_factory=deque)
    """The newest training requests scored by the draft just before it trained on them
    (``specops.trainer.promote.Fresh``, oldest first): the gate's test-then-train evidence. In memory
    only: a restarted trainer starts collecting again."""
    unscored: list = field(default_factory=list)
    """Training records buffered since the last update, to be scored before it (when the gate uses fresh evidence)."""
    champion_checkpoint: int = 0
    """The checkpoint version this trainer last saw promoted for the cluster (0: none since it started)."""
    engine: Any = None
    """The DeepSpeed engine around ``model`` and ``opt`` (backend ``deepspeed``), else None."""
    average: torch.nn.Module | None = None
    """The moving average of ``model``'s weights the cluster publishes (``OnlineConfig.average_decay``), else None."""

    @property
    def published(self) -> torch.nn.Module:
        """The draft this cluster publishes: what checkpoints hold, evaluations score and serving runs
        (the average of the trained weights when averaging, else the trained weights)."""
        return self.model if self.average is None else self.average

    def update_average(self, decay: float) -> None:
        """``average = decay·average + (1-decay)·model`` over the trained parameters."""
        if self.average is None:
            return
        with torch.no_grad():
            for avg, p in zip(self.average.parameters(), self.model.parameters(), strict=True):
                if p.requires_grad:
                    avg.lerp_(p.detach(), 1.0 - decay)


class ClusterStates:
    """Part of :class:`~specops.trainer.online.trainer.OnlineTrainer`: loading, unloading and persisting
    clusters. The attributes below are set by the trainer."""

    cfg: OnlineConfig
    out: Path
    base_draft: Path
    placement: Placement
    link: Any
    stream_cfg: StreamConfig
    promoter: Promoter | None
    clusters: OrderedDict[str, ClusterState]
    buffers: ReplayBuffers[Held]
    budget: ClusterBudget
    world: int
    _unpublished: dict[str, int]
    _seen: set[tuple[str, int, int]]
    _through: dict[str, dict[tuple[str, int], int]]

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
        # the checkpoint's model.safetensors is what the cluster published: with averaging, the average
        average = copy.deepcopy(model).eval().requires_grad_(False) if self.cfg.average_decay else None
        trained = ckpt.load_trained(path) if path is not None else None
        if trained is not None:
            _load_trained(model, trained, path)
            if average is None:
                log.info(
                    "cluster %s: %s published a moving average; averaging is off now: training and publishing "
                    "resume from its trained weights",
                    cluster,
                    path,
                )
        elif average is not None and path is not None:
            log.info(
                "cluster %s: %s published its trained weights; averaging (decay %g) starts from them",
                cluster,
                path,
                self.cfg.average_decay,
            )
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay)
        st = ClusterState(
            model=model,
            opt=opt,
            holdout=deque(maxlen=self.cfg.holdout_capacity),
            fresh=deque(maxlen=max(1, self.fresh_keep)),
            average=average,
        )
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
                log.warning(
                    "cluster %s: %s has optimiser layout %s, this run uses %s: weights resumed, "
                    "optimiser state starts fresh",
                    cluster,
                    path,
                    was,
                    now,
                )
            st.version, st.updates = saved["version"], saved["updates"]
            st.records_trained, st.positions_trained = saved["records_trained"], saved["positions_trained"]
            st.skipped_steps, st.lineage = saved.get("skipped_steps", 0), saved.get("lineage", {}).get("offsets", {})
            st.last_eval = saved.get("eval", {})
            log.info("cluster %s: resumed draft v%d (%d updates) from %s", cluster, st.version, st.updates, path)
            if ckpt.history_version(self.out, cluster) < st.version and "summary" in saved:
                log.warning(
                    "cluster %s: the trainer stopped after checkpoint v%d but before its history line; "
                    "writing it back from the checkpoint",
                    cluster,
                    st.version,
                )
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
            victim = self.budget.victim(
                self.clusters,
                keep=cluster,
                pinned=self._unpublished.__contains__,
                idle=lambda c: self.clusters[c].version == self.clusters[c].saved_version,
            )
            if victim is None:  # every other cluster has weights not yet checkpointed (cannot happen between steps)
                log.warning(
                    "cluster %s: loaded beyond max_loaded_clusters (%d): no idle cluster to unload",
                    cluster,
                    self.cfg.max_loaded_clusters,
                )
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
        log.info(
            "cluster %s: unloaded (checkpoint v%d kept; %d clusters loaded)", cluster, st.version, len(self.clusters)
        )

    def _check_registered(self, cluster: str) -> None:
        """At start: queue the cluster's newest checkpoint for registration if it never was (a kill
        between checkpoint and registration), loaded or not, so it is registered before any commit."""
        path = ckpt.latest_version(self.out, cluster)
        version = ckpt.load_state(path).get("version", 0) if path is not None else 0
        if self.promoter is not None and version and self.promoter.is_registered(cluster, version) is None:
            log.info(
                "cluster %s: checkpoint v%d was never registered; registering it before any commit", cluster, version
            )
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
        ckpt.save_buffer(
            self.out,
            cluster,
            {"buffer": pack, "num_new": self.buffers[cluster].num_new, "holdout": hold, "through": through},
        )


def _load_trained(model: torch.nn.Module, trained: dict[str, torch.Tensor], path: Path) -> None:
    """Put a checkpoint's trained weights (``ckpt.TRAINED_FILE``) into ``model``, or a clear error.
    A parameter the file lacks was frozen when it was written, so equal in both: it keeps the
    checkpoint's value."""
    params = dict(model.named_parameters())
    unknown = sorted(set(trained) - set(params))
    if unknown:
        raise ValueError(f"{path / ckpt.TRAINED_FILE} holds weights the draft does not have: {unknown[:3]}")
    with torch.no_grad():
        for name, value in trained.items():
            p = params[name]
            if p.shape != value.shape:
                raise ValueError(
                    f"{path / ckpt.TRAINED_FILE}: {name} has shape {tuple(value.shape)}, the draft's {tuple(p.shape)}"
                )
            p.copy_(value.to(device=p.device, dtype=p.dtype))


def _opt_layout(config: dict) -> str:
    """The optimiser-state layout a stamped config trains with; state resumes only into the same one."""
    from specops.trainer.ds_backend import optimizer_layout  # no deepspeed import

    trained = "all" if config.get("train_embeddings", True) else "no-embeddings"  # older checkpoints trained all
    return f"{optimizer_layout(config.get('backend', 'torch'), config.get('deepspeed_zero_stage', 2))}/{trained}"

"""One update of a cluster's draft: its examples, the optimiser steps (sharded over the ranks
of DeepSpeed's launcher, ``specops.trainer.ranks``), the other ranks' command loop, and the held-out
evaluation (``specops.trainer.acceptance``)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from specops.core import draft_vocab
from specops.core.device import Placement
from specops.core.draft_vocab import DraftVocab
from specops.streams.records import MissRecord
from specops.trainer import checkpoint as ckpt
from specops.trainer.acceptance import Acceptance, evaluate_records
from specops.trainer.data import (
    Example,
    draft_logits,
    every_position_example,
    logs_every_position,
    rejected_example,
    teacher_example,
)
from specops.trainer.losses import TargetDist, checked_loss
from specops.trainer.online.config import OnlineConfig
from specops.trainer.online.state import ClusterState, Held
from specops.trainer.ranks import pack_examples, shard, unpack_examples
from specops.trainer.sampling import sampled_example

log = logging.getLogger("specops.trainer.online.trainer")  # one logger for the whole loop, as before the split


class DraftUpdates:
    """Part of :class:`~specops.trainer.online.trainer.OnlineTrainer`: the optimiser steps and evaluation of
    an update. The attributes below are set by the trainer; ``_new_state`` and ``state`` come from
    :class:`~specops.trainer.online.state.ClusterStates`."""

    cfg: OnlineConfig
    placement: Placement
    link: Any
    world: int
    vocab: DraftVocab | None
    target: torch.nn.Module | None
    teacher: Callable[[MissRecord], TargetDist] | None
    clusters: OrderedDict[str, ClusterState]
    _sample_gen: torch.Generator

    def _examples(self, st: ClusterState, items: list[Held]) -> list[Example]:
        """The sequences and positions this update trains on (see ``specops.trainer.sampling``).

        A record an external engine served (``not rec.scored``: no logged distribution) is
        trained by teacher forward: its target distributions come from the teacher, computed
        for the whole update in batched forwards first. At every position that is what a
        logged record gets too; at the rejected positions they are the positions where the
        cluster's current draft would be rejected (``specops.trainer.data.rejected_example``)."""
        unscored = [h.record for h in items if not h.record.scored]
        if unscored and self.cfg.sampling == "teacher":
            assert self.teacher is not None  # the loop refuses such records without one
            prefetch = getattr(self.teacher, "prefetch", None)
            if prefetch is not None:
                prefetch(unscored)
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
        if self.cfg.sampling == "teacher" and unscored:
            assert self.teacher is not None
            out = []
            for h in items:
                rec = h.record
                if rec.scored:
                    if rec.num_rejected:
                        out.append(teacher_example(rec))
                elif len(rec.token_ids) > rec.num_prompt_tokens:
                    ex = rejected_example(st.published, rec, self.teacher, self.vocab)
                    if ex.num_positions:
                        out.append(ex)
            return out
        if self.cfg.sampling == "teacher":
            return [teacher_example(h.record) for h in items if h.record.num_rejected]
        assert self.target is not None
        mix = 0.0 if self.cfg.sampling == "student" else self.cfg.mix
        return [
            sampled_example(
                self.target,
                st.published,
                h.record,
                mix=mix,
                max_new_tokens=self.cfg.sample_max_new_tokens,
                generator=self._sample_gen,
            )
            for h in items
        ]

    def _optimizer_step(self, st: ClusterState, examples: list[Example], cluster: str = "") -> tuple[float | None, int]:
        """One step over ``examples``: position-weighted mean loss; non-finite examples skipped.
        With several ranks each computes its share (``specops.trainer.ranks.shard``); the gradient is the same."""
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
            loss, reason = checked_loss(
                logits, ex.target.to(logits.device), self.cfg.loss, beta=self.cfg.beta, tau=self.cfg.tau
            )
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
            total = (
                net(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.placement.torch_device)).logits.sum() * 0
            )
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
            elif op == "close":  # rank 0 unloaded the cluster (specops.trainer.clusters)
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
        """Acceptance of the draft the cluster publishes on its held-out records (``specops.trainer.acceptance``)."""
        st = self.state(cluster)
        key = (st.version, tuple(h.source for h in st.holdout))
        if st.eval_cache is not None and st.eval_cache[0] == key:
            return st.eval_cache[1]
        acc = evaluate_records(st.published, [h.record for h in st.holdout], vocab=self.vocab)
        st.eval_cache = (key, acc)
        return acc

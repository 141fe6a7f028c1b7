"""The online trainer on several ranks: DeepSpeed's launcher, data parallel.

``deepspeed --num_gpus N --no_local_rank --module specops train --backend deepspeed ...``
starts N processes (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set by the
launcher). They are not N consumers: the consumer group, the replay buffers, evaluation,
checkpoints, the registry and the offset commits stay on **rank 0**, exactly as in one
process, so at-least-once delivery and "nothing trained twice" hold unchanged. The other
ranks only compute gradients. Rank 0 drives them with commands over a gloo group of its
own (CPU tensors; a separate group, so it works beside NCCL on GPUs):

| command | sent by rank 0 when | every rank then |
|---|---|---|
| ``open`` | a cluster's draft is first needed | builds the draft and its DeepSpeed engine (a collective: rank 0's weights are broadcast), loads its share of the saved optimiser state |
| ``step`` | each optimiser step of an update | computes the GKD loss on its share of the examples (balanced by positions), all-reduces the position count, ``engine.backward`` + ``engine.step`` |
| ``gather`` | a checkpoint is written | contributes its ZeRO partition of the optimiser state |
| ``stop`` | the trainer closes | returns |

The update equals the one-rank update: rank r's loss is ``W · Σ_{its examples} m_i·ℓ_i /
Σ_{all examples} m_i`` and DeepSpeed averages gradients over the W ranks, so the gradient is
that of the position-weighted mean loss over the whole buffer; clipping and AdamW then run on
ZeRO's partitions of the same numbers. Only float summation order differs.

Commands travel as bytes: a msgpack header and, for tensors, a safetensors blob (nothing is
pickled, not even between our own processes).
"""

from __future__ import annotations

import heapq
import logging
import os
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from specops.trainer.data import Example
from specops.trainer.losses import TargetDist

log = logging.getLogger(__name__)

ROOT = 0


def launched_world() -> tuple[int, int]:
    """(rank, world size) as the launcher set them in the environment; (0, 1) outside one."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class RankLink:
    """Rank 0's command channel to the other ranks, and the small collectives of an update."""

    rank: int
    world: int
    group: Any
    """A gloo process group over every rank (CPU tensors)."""

    @property
    def is_root(self) -> bool:
        return self.rank == ROOT

    # ------------------------------------------------------------ commands
    def send(self, dst: int, header: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        blob = st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}) if tensors else b""
        self._send_bytes(msgpack.packb({**header, "tensors": blob}), dst)

    def send_all(self, header: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
        for dst in range(1, self.world):
            self.send(dst, header, tensors)

    def recv(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The next command from rank 0 (blocks)."""
        header = msgpack.unpackb(self._recv_bytes(ROOT))
        blob = header.pop("tensors")
        return header, (st_load(blob) if blob else {})

    def _send_bytes(self, data: bytes, dst: int) -> None:
        torch.distributed.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=self.group)
        if data:
            torch.distributed.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=self.group)

    def _recv_bytes(self, src: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        torch.distributed.recv(size, src, group=self.group)
        buf = torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            torch.distributed.recv(buf, src, group=self.group)
        return buf.numpy().tobytes()

    # ------------------------------------------------------------ collectives
    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over the ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(t, group=self.group)
        return t.tolist()

    def gather_flat(self, part: torch.Tensor) -> torch.Tensor:
        """The ranks' equal-sized 1-D partitions, concatenated in rank order (on every rank)."""
        part = part.detach().cpu().contiguous()
        parts = [torch.empty_like(part) for _ in range(self.world)]
        torch.distributed.all_gather(parts, part, group=self.group)
        return torch.cat(parts)


# ---------------------------------------------------------------- examples on the wire
def pack_examples(examples: list[Example]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors (safetensors-ready) and request ids of ``examples``."""
    tensors: dict[str, torch.Tensor] = {}
    for i, ex in enumerate(examples):
        tensors[f"{i}.context"] = ex.context
        tensors[f"{i}.positions"] = ex.positions
        tensors[f"{i}.logprobs"] = ex.target.logprobs
        if ex.target.topk_ids is not None:
            tensors[f"{i}.topk_ids"] = ex.target.topk_ids
            tensors[f"{i}.residual"] = ex.target.residual
    return tensors, [ex.request_id for ex in examples]


def unpack_examples(tensors: dict[str, torch.Tensor], request_ids: list[str]) -> list[Example]:
    out = []
    for i, rid in enumerate(request_ids):
        if f"{i}.topk_ids" in tensors:
            target = TargetDist.topk(tensors[f"{i}.topk_ids"], tensors[f"{i}.logprobs"], tensors[f"{i}.residual"])
        else:
            target = TargetDist.full(tensors[f"{i}.logprobs"])
        out.append(Example(tensors[f"{i}.context"], tensors[f"{i}.positions"], target, rid))
    return out


def shard(examples: list[Example], world: int) -> list[list[int]]:
    """Indices of ``examples`` per rank, balanced by positions (longest first, to the least
    loaded rank; ties by rank). Deterministic, and every example goes to exactly one rank."""
    heap = [(0, r) for r in range(world)]
    shards: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(examples)), key=lambda i: (-examples[i].num_positions, i)):
        load, r = heapq.heappop(heap)
        shards[r].append(i)
        heapq.heappush(heap, (load + examples[i].num_positions, r))
    return [sorted(s) for s in shards]

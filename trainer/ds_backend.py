"""Run the online trainer's update through DeepSpeed (ZeRO stage 2 by default), on CPU.

``OnlineConfig(backend="deepspeed")`` makes each cluster's draft a DeepSpeed engine
wrapping the same model and the same client ``torch.optim.AdamW``. The update is
unchanged: the position-weighted mean GKD loss over the buffer, then
``engine.backward(loss)`` and ``engine.step()``, which reduce the gradients, clip them to
``OnlineConfig.grad_clip`` and step AdamW on ZeRO's flat fp32 partition, copying the
result back into the model's parameters.

Scope:

- one process, or N ranks under DeepSpeed's launcher (data parallel, see ``specops.trainer.ranks``:
  rank 0 consumes, checkpoints and registers, every rank computes the gradients of its share
  of each update). The process group is created once per process; in one process on a
  free local port, under the launcher from its ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
  ``WORLD_SIZE``.
- the CPU accelerator and gloo unless a GPU is there (``DS_ACCELERATOR`` set wins): with
  ``--device cuda`` each rank trains on ``cuda:LOCAL_RANK`` over NCCL.
- no compiled ops: DeepSpeed's C++ ops (CPU Adam, the shared-memory all-reduce) are never
  probed or JIT-built, so no compiler is needed and start-up takes seconds, not minutes.
  The optimiser is the client ``torch.optim.AdamW`` (``zero_allow_untested_optimizer``).
- fp32 only (bf16/fp16 off), micro-batch 1, no gradient accumulation: one ``engine.step()``
  is one optimiser step, exactly as in the plain PyTorch path.
- ZeRO stage 0, 1 or 2. Stage 3 partitions the parameters themselves, so the draft could no
  longer be evaluated or saved with ``save_pretrained`` as it is; it is rejected.

Checkpoints stay safetensors + JSON. ``engine.module`` is the Hugging Face model
(``save_pretrained`` works on it). Under ZeRO 1/2 the client AdamW holds one flat fp32
partition per parameter group and rank; ``optimizer_files`` gathers the ranks' partitions
into one flat ``exp_avg``/``exp_avg_sq`` vector per group, cut to the group's length (no
world-size padding), so a checkpoint written by N ranks resumes on M ranks
(``load_optimizer_files`` pads and slices it again). The layout still depends on the backend
and ZeRO stage, so a checkpoint is resumed with its optimiser state only by the same backend
and stage (see ``optimizer_layout``).

``deepspeed`` is imported only here, and only when an engine is made: plain PyTorch runs
never import it.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2)


@dataclass
class DeepSpeedConfig:
    """How the DeepSpeed engine of one draft is set up."""

    zero_stage: int = 2
    """ZeRO stage: 0 (none), 1 (optimiser state) or 2 (optimiser state + gradients)."""
    dist_backend: str = "gloo"
    """torch.distributed backend of the process group (gloo runs on the CPU)."""
    extra: dict = field(default_factory=dict)
    """Merged over the generated DeepSpeed JSON config (one level deep: dict values are
    updated, not replaced)."""

    def __post_init__(self) -> None:
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}")

    def ds_config(self, grad_clip: float) -> dict:
        """The DeepSpeed JSON config: fp32, micro-batch 1, no accumulation, client AdamW."""
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(grad_clip),
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
            "steps_per_print": 2**62,  # the trainer logs its own updates
            "wall_clock_breakdown": False,
        }
        for key, value in self.extra.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        return cfg


def optimizer_layout(backend: str, zero_stage: int) -> str:
    """Name of the optimiser-state layout a checkpoint was written with.

    Plain PyTorch (and ZeRO stage 0, which keeps the client optimiser on the model's
    parameters) keeps one state per parameter; ZeRO 1/2 keep one flat vector per group.
    """
    if backend != "deepspeed" or zero_stage == 0:
        return "per-parameter"
    return f"zero{zero_stage}-flat"  # gathered over the ranks: any world size reads it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_deepspeed():
    """Import deepspeed (the CPU accelerator unless a GPU is there) with its C++ ops marked unavailable."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    # DeepSpeed probes every op (compiler subprocesses) on first access to this dict and,
    # for the CPU accelerator, JIT-builds its shared-memory all-reduce when creating the
    # process group (about a minute on 2 cores). A gloo group needs neither; DeepSpeed keeps
    # this dict once made, so seeding it switches both off.
    if "__compatible_ops__" not in vars(deepspeed.ops):
        deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
    return deepspeed


RANK_TIMEOUT = timedelta(hours=24)
"""How long a rank waits in a collective: the other ranks idle in one while rank 0 has no
records (a crashed rank ends the job through the launcher, not through this timeout)."""
_LINK = None


def init_distributed(cfg: DeepSpeedConfig, *, ranks: bool = False):
    """Create the process group once per process (a no-op when it exists). With ``ranks``
    a launcher's world of any size is accepted and the ``specops.trainer.ranks.RankLink`` over it is
    returned; without, the world must be one process."""
    global _LINK
    deepspeed = _import_deepspeed()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
        for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(var, value)
        if cfg.dist_backend == "nccl":  # each rank its own GPU, before any model is placed
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend=cfg.dist_backend, timeout=RANK_TIMEOUT)
    world = torch.distributed.get_world_size()
    if world != 1 and not ranks:
        raise RuntimeError(f"this DeepSpeed engine runs in one process (world size 1), got world size {world}")
    if ranks and _LINK is None:
        from specops.trainer.ranks import RankLink

        group = torch.distributed.new_group(backend="gloo", timeout=RANK_TIMEOUT) if world > 1 else None
        _LINK = RankLink(torch.distributed.get_rank(), world, group)
    return _LINK


def init_engine(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, cfg: DeepSpeedConfig | None = None
) -> Any:
    """Wrap ``model`` and its client ``optimizer`` in a DeepSpeed engine (a collective over the
    ranks: every rank calls it for the same draft, and rank 0's weights are broadcast).

    After this the engine owns the optimiser step: under ZeRO 1/2 ``optimizer``'s parameter
    groups hold this rank's flat fp32 partition, so load saved optimiser state into it only
    now (``load_optimizer_files``). ``engine.module is model``.
    """
    cfg = cfg or DeepSpeedConfig()
    deepspeed = _import_deepspeed()
    if not torch.distributed.is_initialized():
        init_distributed(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg.ds_config(grad_clip))
    assert engine.module is model
    log.info(
        "DeepSpeed engine: ZeRO stage %d, %s process group of %d, client %s",
        cfg.zero_stage,
        cfg.dist_backend,
        torch.distributed.get_world_size(),
        type(optimizer).__name__,
    )
    return engine


# ---------------------------------------------------------------- optimiser state across world sizes
def _group_numel(zopt: Any, group: int) -> int:
    """Length of a parameter group's flat buffer without the world-size alignment padding."""
    assert not zopt.round_robin_gradients, "round-robin gradient order depends on the world size"
    return int(zopt.round_robin_bit16_offsets[group][-1] + zopt.round_robin_bit16_meta[group][-1].numel())


def optimizer_files(engine: Any, link: Any = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The engine's optimiser state as (tensors, JSON layout) for ``specops.trainer.checkpoint``,
    the same for any world size. Under ZeRO 1/2 with several ranks this is a collective
    (``link``, every rank calls it); every rank gets the whole state."""
    from specops.trainer.checkpoint import optimizer_to_files

    zopt = engine.optimizer
    client = getattr(zopt, "optimizer", zopt)
    tensors, layout = optimizer_to_files(client)
    if engine.zero_optimization_stage() == 0:
        return tensors, layout
    for key in sorted(tensors):
        group = int(key.split(".", 1)[0])
        t = tensors[key]
        if t.ndim != 1 or t.numel() != int(zopt.partition_size[group]):
            continue  # a scalar (step)
        full = link.gather_flat(t) if link is not None and link.world > 1 else t
        tensors[key] = full[: _group_numel(zopt, group)].clone()
    return tensors, layout


def load_optimizer_files(
    engine: Any, tensors: dict[str, torch.Tensor], layout: dict, rank: int = 0, world: int = 1
) -> None:
    """Load state written by ``optimizer_files`` (any world size) into this rank's engine."""
    from specops.trainer.checkpoint import optimizer_from_files

    zopt = engine.optimizer
    client = getattr(zopt, "optimizer", zopt)
    if engine.zero_optimization_stage() == 0:
        optimizer_from_files(client, tensors, layout)
        return
    mine = {}
    for key, t in tensors.items():
        group = int(key.split(".", 1)[0])
        n, size = _group_numel(zopt, group), int(zopt.partition_size[group])
        if t.ndim != 1 or t.numel() < n:
            mine[key] = t
            continue
        full = torch.zeros(size * world, dtype=t.dtype)
        full[:n] = t[:n]  # older single-rank checkpoints kept their alignment padding: cut it
        device = zopt.single_partition_of_fp32_groups[group].device
        mine[key] = full[rank * size : (rank + 1) * size].to(device)
    optimizer_from_files(client, mine, layout)

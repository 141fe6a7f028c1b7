"""Run the online trainer's update through DeepSpeed (ZeRO stage 2 by default), on CPU.

``OnlineConfig(backend="deepspeed")`` makes each cluster's draft a DeepSpeed engine
wrapping the same model and the same client ``torch.optim.AdamW``. The update is
unchanged: the position-weighted mean GKD loss over the buffer, then
``engine.backward(loss)`` and ``engine.step()``, which reduce the gradients, clip them to
``OnlineConfig.grad_clip`` and step AdamW on ZeRO's flat fp32 partition, copying the
result back into the model's parameters.

Scope, deliberately small:

- one process (world size 1): the trainer's consumer-group loop is not rank-aware, so a
  multi-rank job would run different updates on each rank and hang; ``init_engine``
  refuses one. The process group (gloo) is created once per process on a free local port;
  ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` already in the environment win.
- the CPU accelerator (``DS_ACCELERATOR=cpu`` unless set): the trainer's target
  distributions live on the CPU.
- no compiled ops: DeepSpeed's C++ ops (CPU Adam, the shared-memory all-reduce) are never
  probed or JIT-built, so no compiler is needed and start-up takes seconds, not minutes.
  The optimiser is the client ``torch.optim.AdamW`` (``zero_allow_untested_optimizer``).
- fp32 only (bf16/fp16 off), micro-batch 1, no gradient accumulation: one ``engine.step()``
  is one optimiser step, exactly as in the plain PyTorch path.
- ZeRO stage 0, 1 or 2. Stage 3 partitions the parameters themselves, so the draft could no
  longer be evaluated or saved with ``save_pretrained`` as it is; it is rejected.

Checkpoints stay safetensors + JSON. ``engine.module`` is the Hugging Face model
(``save_pretrained`` works on it), and under ZeRO-2 the client AdamW's state is plain
tensors for the flat fp32 partition (one ``exp_avg``/``exp_avg_sq`` vector per parameter
group), which ``trainer.checkpoint`` splits into safetensors and JSON like any other.
That layout depends on the backend and ZeRO stage, so a checkpoint is resumed with its
optimiser state only by the same backend and stage (see ``optimizer_layout``).

``deepspeed`` is imported only here, and only when an engine is made: plain PyTorch runs
never import it.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
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
    return f"zero{zero_stage}-flat-ws1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_deepspeed():
    """Import deepspeed on the CPU accelerator with its C++ ops marked unavailable."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    # DeepSpeed probes every op (compiler subprocesses) on first access to this dict and,
    # for the CPU accelerator, JIT-builds its shared-memory all-reduce when creating the
    # process group (about a minute on 2 cores). A world-size-1 gloo group needs neither;
    # DeepSpeed keeps this dict once made, so seeding it switches both off.
    if "__compatible_ops__" not in vars(deepspeed.ops):
        deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
    return deepspeed


def init_distributed(cfg: DeepSpeedConfig) -> None:
    """Create the process group once per process (a no-op when it exists)."""
    deepspeed = _import_deepspeed()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(var, value)
    deepspeed.init_distributed(dist_backend=cfg.dist_backend)
    world = torch.distributed.get_world_size()
    if world != 1:
        raise RuntimeError(f"the online trainer runs DeepSpeed in one process (world size 1), got world size {world}")


def init_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                cfg: DeepSpeedConfig | None = None) -> Any:  # fmt: skip
    """Wrap ``model`` and its client ``optimizer`` in a DeepSpeed engine.

    After this the engine owns the optimiser step: under ZeRO 1/2 ``optimizer``'s parameter
    groups hold the flat fp32 partition, so load saved optimiser state into it only now.
    ``engine.module is model``.
    """
    cfg = cfg or DeepSpeedConfig()
    deepspeed = _import_deepspeed()
    init_distributed(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg.ds_config(grad_clip))
    assert engine.module is model
    log.info("DeepSpeed engine: ZeRO stage %d, %s process group, client %s", cfg.zero_stage, cfg.dist_backend,
             type(optimizer).__name__)  # fmt: skip
    return engine

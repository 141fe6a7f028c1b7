"""How the online trainer learns: :class:`OnlineConfig`, stamped on every checkpoint
(the loop is ``specops.trainer.online.trainer``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from specops.trainer.losses import LOSSES
from specops.trainer.replay import ReplayConfig
from specops.trainer.sampling import SAMPLING

POSITIONS = ("rejected", "all")


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
    average_decay: float = 0.95
    """Publish an exponential moving average of the trained weights, ``avg = d·avg + (1-d)·weights``
    after every update, instead of the weights themselves (0: off, the weights are published). The average is what a
    checkpoint's ``model.safetensors`` holds, what the held-out evaluation, the gate's evidence and
    serving use; the trained weights are kept beside the optimiser state (``trained.safetensors``)
    and go on training. On the served chat streams 0.95 learned more than the trained weights on
    every domain measured, in a replay (``benchmarks/osd_average.py``) and live (``benchmarks/osd.py``:
    docs/trainer.md); an average also lags a drift by about ``1/(1-d)`` updates (50–70 requests of
    the new domain in the live shift run, within its bars). With ``backend="deepspeed"`` too: ZeRO stages 0-2 partition the
    optimiser state and gradients, not the weights, so rank 0 (which alone evaluates and publishes)
    averages the full weights after each step."""
    sampling: str = "teacher"
    """Where the loss applies (OSD §4.1): ``teacher`` (the logged rejected positions and
    logged target distributions), ``student`` or ``mixed`` (sequences sampled after the
    logged prompts from the draft, or from ``mix·p + (1-mix)·q``, scored by the target:
    needs the target model)."""
    positions: str = "all"
    """Where teacher sampling applies the loss: ``rejected`` (the logged rejected positions,
    OSD Algorithm 1) or ``all`` (every output position of each request). Serving logs the
    target's distribution only where a draft token was rejected, so ``all`` recomputes it by
    one target forward per request (``specops.trainer.data.TargetTeacher``: needs the target model)
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
    ``specops.trainer.ds_backend`` and ``specops.trainer.ranks``)."""
    deepspeed_zero_stage: int = 2
    """ZeRO stage (0, 1 or 2) when ``backend == "deepspeed"``."""
    device: str = "cpu"
    """Where drafts (and the target, for student / mixed sampling) train: cpu, cuda or cuda:N."""
    dtype: str = "float32"
    """Precision of the draft weights being trained (``specops.core.device``)."""
    max_loaded_clusters: int = 8
    """Most clusters whose draft and optimiser state are held in memory; the least recently used
    idle one is unloaded (its checkpoint kept) and reloaded from it when its records come
    (``specops.trainer.clusters``). Set it to at least the clusters that get traffic: each reload reads a checkpoint."""
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
        if not 0.0 <= self.average_decay < 1.0:
            raise ValueError(f"average_decay must be in [0, 1) (0: off), got {self.average_decay!r}")
        if self.max_loaded_clusters < 1 or self.max_clusters < 1:
            raise ValueError(
                f"max_loaded_clusters and max_clusters must be >= 1, got {self.max_loaded_clusters} and "
                f"{self.max_clusters}"
            )

    def digest(self) -> str:
        """Hash of everything that changes the published weights (not the memory bounds: an unloaded
        cluster reloads exactly)."""
        values = {k: v for k, v in asdict(self).items() if k not in ("max_loaded_clusters", "max_clusters")}
        if not self.average_decay:  # off: the hash of a config from before the field existed
            del values["average_decay"]
        return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]

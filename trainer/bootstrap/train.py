"""Model shapes, batches, losses and the two training loops of the bootstrap.

Order: (1) the target on hard labels, code and prose mixed 50/50; (2) the draft
distilled from the frozen target with forward KL on the same kind of text,
after a short hard-label warm start. Distillation, not hard labels, because
acceptance needs agreement with the target: at this scale a hard-label draft
can reach lower loss than a briefly trained target yet agree with it less.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """Llama shape; the vocab comes from the tokenizer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024

    def config(self, vocab_size: int, eot_id: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=eot_id,
            eos_token_id=eot_id,
            pad_token_id=eot_id,
        )


TARGET_SHAPE = ModelShape(hidden_size=128, num_layers=16, num_heads=4, intermediate_size=512)
DRAFT_SHAPE = ModelShape(hidden_size=128, num_layers=1, num_heads=4, intermediate_size=384)
# Tiny shapes keep a head size of 32: the smallest vLLM's CPU attention takes (its tests serve this pair).
TINY_TARGET_SHAPE = ModelShape(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256)
TINY_DRAFT_SHAPE = ModelShape(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=128)


@dataclass(frozen=True)
class TrainConfig:
    """Fixed-step schedule (reproducible; no time-based stopping)."""

    seq_len: int = 128
    """Tokens per training row (the model sees seq_len positions)."""
    batch_size: int = 8
    """Rows per step, half code and half prose."""
    long_seq_len: int = 512
    """Row length of the final ``*_long_steps`` of each phase, so positions up to 512 are trained."""
    long_batch_size: int = 2
    """Rows per long step (same tokens per step as the short steps)."""
    target_steps: int = 1100
    """Target optimizer steps on hard labels (the last target_long_steps use long rows)."""
    target_long_steps: int = 60
    target_lr: float = 3e-3
    """Target peak learning rate (linear warmup, cosine to 10%)."""
    draft_warm_steps: int = 100
    """Draft hard-label warm start steps (cheap: no target forward)."""
    draft_distill_steps: int = 500
    """Draft forward-KL distillation steps (each needs a target forward; the last draft_long_steps use long rows)."""
    draft_long_steps: int = 40
    draft_lr: float = 5e-3
    """Draft peak learning rate."""
    warmup_steps: int = 30
    """Linear warmup steps of every phase."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_windows: int = 64
    """Held-out windows per domain for the metrics."""
    eval_seq_len: int = 256
    """Tokens per held-out window."""

    def __post_init__(self) -> None:
        if self.batch_size % 2 or self.long_batch_size % 2:
            raise ValueError("batch sizes must be even (half code, half prose)")
        if self.target_long_steps > self.target_steps or self.draft_long_steps > self.draft_distill_steps:
            raise ValueError("long steps must be a suffix of their phase")


# --------------------------------------------------------------------------- data


@dataclass
class TokenStream:
    """One domain's documents as a single id stream, documents separated by eot."""

    ids: torch.Tensor  # [num_tokens] int64

    @classmethod
    def from_documents(cls, docs: list[list[int]], eot_id: int) -> TokenStream:
        flat: list[int] = []
        for d in docs:
            flat.append(eot_id)
            flat.extend(d)
        flat.append(eot_id)
        return cls(torch.tensor(flat, dtype=torch.long))

    def random_windows(self, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """[n, length] windows at seeded random offsets."""
        hi = self.ids.numel() - length
        assert hi > 0, f"stream of {self.ids.numel()} tokens shorter than a window of {length}"
        starts = torch.randint(0, hi + 1, (n,), generator=gen)
        return torch.stack([self.ids[s : s + length] for s in starts.tolist()])

    def contiguous_windows(self, n: int, length: int) -> torch.Tensor:
        """Up to n non-overlapping [length] windows from the start (deterministic eval)."""
        n = min(n, self.ids.numel() // length)
        assert n > 0, f"stream of {self.ids.numel()} tokens shorter than a window of {length}"
        return self.ids[: n * length].view(n, length)


@dataclass
class MixedBatches:
    """Seeded 50/50 code/prose batches of [batch, seq_len + 1] ids."""

    streams: dict[str, TokenStream]
    batch_size: int
    seq_len: int
    seed: int
    gen: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)

    def next(self) -> torch.Tensor:
        half = self.batch_size // 2
        rows = [self.streams[d].random_windows(half, self.seq_len + 1, self.gen) for d in sorted(self.streams)]
        return torch.cat(rows)  # [batch, seq_len + 1]


# --------------------------------------------------------------------------- losses


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy -log q(y_t | y_<t) over all positions.

    logits: [batch, seq, vocab] predicting labels [batch, seq].
    """
    assert logits.ndim == 3 and labels.shape == logits.shape[:2]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def forward_kl_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q) = sum_x p(x) (log p(x) - log q(x)), mean over positions.

    p = softmax(target_logits), q = softmax(draft_logits), both [batch, seq, vocab].
    Standard knowledge distillation at temperature 1 (Hinton et al. 2015;
    DistillSpec, Zhou et al. 2023, Sec. 3, forward-KL variant).
    """
    assert draft_logits.shape == target_logits.shape and draft_logits.ndim == 3
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    log_p = F.log_softmax(target_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [batch, seq]
    return kl.mean()


# --------------------------------------------------------------------------- loops


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


def _optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _step(model, opt, loss: torch.Tensor, lr: float, grad_clip: float) -> bool:
    """One optimizer step; a non-finite loss skips the step (logged) and returns False."""
    if not torch.isfinite(loss):
        log.warning("non-finite loss %s: step skipped", loss.item())
        opt.zero_grad(set_to_none=True)
        return False
    for g in opt.param_groups:
        g["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return True


def train_target(
    model: LlamaForCausalLM, batches: MixedBatches, long_batches: MixedBatches, cfg: TrainConfig
) -> list[float]:
    """Hard-label next-token training. Returns the loss per step."""
    model.train()
    opt = _optimizer(model, cfg.target_lr, cfg.weight_decay)
    losses: list[float] = []
    bar = tqdm(range(cfg.target_steps), desc="target", unit="step", dynamic_ncols=True)
    for step in bar:
        long = step >= cfg.target_steps - cfg.target_long_steps
        ids = (long_batches if long else batches).next()  # [batch, seq + 1]
        logits = model(input_ids=ids[:, :-1]).logits  # [batch, seq, vocab]
        loss = next_token_loss(logits, ids[:, 1:])
        _step(model, opt, loss, lr_at(step, cfg.target_steps, cfg.target_lr, cfg.warmup_steps), cfg.grad_clip)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    log.info("target: %d steps, final loss %.3f", cfg.target_steps, losses[-1] if losses else float("nan"))
    return losses


def train_draft(
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    batches: MixedBatches,
    long_batches: MixedBatches,
    cfg: TrainConfig,
) -> list[float]:
    """Hard-label warm start, then forward-KL distillation from the frozen target."""
    target.eval()
    draft.train()
    total = cfg.draft_warm_steps + cfg.draft_distill_steps
    opt = _optimizer(draft, cfg.draft_lr, cfg.weight_decay)
    losses: list[float] = []
    bar = tqdm(range(total), desc="draft", unit="step", dynamic_ncols=True)
    for step in bar:
        long = step >= total - cfg.draft_long_steps
        ids = (long_batches if long else batches).next()  # [batch, seq + 1]
        inputs = ids[:, :-1]
        draft_logits = draft(input_ids=inputs).logits  # [batch, seq, vocab]
        if step < cfg.draft_warm_steps:
            phase, loss = "ce", next_token_loss(draft_logits, ids[:, 1:])
        else:
            with torch.inference_mode():
                target_logits = target(input_ids=inputs).logits  # [batch, seq, vocab]
            phase, loss = "kl", forward_kl_loss(draft_logits, target_logits.clone())
        _step(draft, opt, loss, lr_at(step, total, cfg.draft_lr, cfg.warmup_steps), cfg.grad_clip)
        losses.append(loss.item())
        bar.set_postfix({phase: f"{loss.item():.3f}"})
    draft.eval()
    log.info(
        "draft: %d warm + %d distill steps, final KL %.3f",
        cfg.draft_warm_steps,
        cfg.draft_distill_steps,
        losses[-1] if losses else float("nan"),
    )
    return losses


def build_model(shape: ModelShape, vocab_size: int, eot_id: int, seed: int) -> LlamaForCausalLM:
    """Seeded random init, float32."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape.config(vocab_size, eot_id))
    model.generation_config.bos_token_id = eot_id
    model.generation_config.eos_token_id = eot_id
    model.generation_config.pad_token_id = eot_id
    return model.eval()


def num_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())

"""The default draft: a few of the target's own layers, distilled from the target.

OSD Algorithm 1, line 2 (warm-up): before serving, pre-train the draft to approximate the
target on a warm-up corpus, here the bootstrap's train files of both domains.

The draft is the target's architecture and tokenizer with ``len(layers)`` decoder layers:

1. **Initialise** from the target: its (tied) embeddings and LM head, its final norm and
   the decoder layers named in ``layers``. The embeddings stay frozen: only the layers and
   the norm learn (7M of SmolLM2's 135M parameters for two layers), the draft's head is
   the target's, and every version of the draft stores the same embedding matrix.
2. **Draft vocabulary**: the draft scores only the ``vocab_size`` most frequent tokens of
   the train text (``specops.core.draft_vocab``); on a CPU this is most of its cost saved.
3. **Distil** with forward KL from the target's next-token distribution, restricted to
   the draft vocabulary and renormalised, at every position of seeded windows of the
   train text. The target runs once per window; its final hidden states are kept (float16)
   so later epochs cost only the draft's own forward and backward.
4. **Evaluate** on held-out files as serving sees it: greedy agreement and expected
   acceptance ``Σ min(p, q)`` of the restricted draft against the full target.

Every step count is fixed and every draw seeded, so a run is reproducible on one machine.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel

from specops.core.draft_vocab import DraftVocab

from .train import TokenStream, lr_at

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftRecipe:
    """How the default draft is built. Every field is recorded in ``manifest.json``."""

    layers: tuple[int, ...] = (0, 1)
    """Target decoder layers copied into the draft, in order (its depth is their number)."""
    vocab_size: int = 8192
    """Rows of the LM head the draft scores: the most frequent tokens of the train text."""
    seq_len: int = 256
    """Tokens per training window."""
    batch_size: int = 8
    """Windows per step, half code and half prose."""
    teacher_batches: int = 64
    """Batches the target runs on (each window once); later epochs reuse its hidden states."""
    epochs: int = 3
    """Passes of the draft over those batches."""
    lr: float = 3e-3
    """Peak learning rate (linear warmup, cosine to 10%)."""
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_windows: int = 16
    """Held-out windows per domain for the metrics."""
    eval_seq_len: int = 256

    def __post_init__(self) -> None:
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(f"layers must be distinct non-negative layer indices, got {self.layers}")
        if self.batch_size % 2 or self.batch_size < 2:
            raise ValueError("batch_size must be even (half code, half prose)")
        if min(self.vocab_size, self.seq_len, self.teacher_batches, self.epochs) < 1:
            raise ValueError("vocab_size, seq_len, teacher_batches and epochs must be >= 1")

    @property
    def steps(self) -> int:
        return self.teacher_batches * self.epochs

    def record(self) -> dict:
        return {**asdict(self), "layers": list(self.layers)}


def frequent_vocab(streams: dict[str, TokenStream], size: int, vocab_size: int, always: list[int]) -> DraftVocab:
    """The ``size`` most frequent tokens of ``streams`` (ties by id), plus the ``always`` ids (EOS)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in streams.values():
        counts += torch.bincount(s.ids, minlength=vocab_size)[:vocab_size]
    counts[torch.tensor(always, dtype=torch.long)] = counts.max() + 1
    size = min(size, vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))[:size]
    return DraftVocab(torch.tensor(sorted(order)), vocab_size)


def init_draft(target: PreTrainedModel, layers: tuple[int, ...]) -> PreTrainedModel:
    """The target's architecture with ``layers`` of its decoder layers, and its embeddings,
    LM head and final norm."""
    n_target = int(target.config.num_hidden_layers)
    if max(layers) >= n_target:
        raise ValueError(f"the target has {n_target} layers; cannot take layer {max(layers)}")
    cfg = target.config.__class__.from_dict({**target.config.to_dict(), "num_hidden_layers": len(layers)})
    for attr in ("layer_types",):  # per-layer lists follow the chosen layers
        if isinstance(getattr(target.config, attr, None), list):
            setattr(cfg, attr, [getattr(target.config, attr)[i] for i in layers])
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    src = target.state_dict()
    state: dict[str, torch.Tensor] = {}
    for key in draft.state_dict():
        parts = key.split(".")
        if "layers" in parts:
            at = parts.index("layers")
            parts[at + 1] = str(layers[int(parts[at + 1])])
            state[key] = src[".".join(parts)].clone()
        else:
            state[key] = src[key].clone()
    draft.load_state_dict(state, strict=True)
    draft.tie_weights()
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def _windows(streams: dict[str, TokenStream], per_domain: int, length: int, gen: torch.Generator) -> torch.Tensor:
    return torch.cat([streams[d].random_windows(per_domain, length, gen) for d in sorted(streams)])


def distill(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    vocab: DraftVocab,
    streams: dict[str, TokenStream],
    recipe: DraftRecipe,
    seed: int,
) -> list[float]:
    """Forward KL from the target, restricted to the draft vocabulary; returns the loss per step."""
    gen = torch.Generator().manual_seed(seed)
    rows = target.get_output_embeddings().weight.detach()[vocab.token_ids].contiguous()  # [n, hidden], shared
    draft.train()
    for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        module.weight.requires_grad_(False)  # the target's embeddings and head, kept
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids [b, t], target hidden [b, t, h] float16)
    losses: list[float] = []
    order: list[int] = []
    bar = tqdm(range(recipe.steps), desc="draft distillation", unit="step", dynamic_ncols=True)
    for step in bar:
        epoch, i = divmod(step, recipe.teacher_batches)
        if epoch == 0:  # 1. a new batch: the target runs once on it
            ids = _windows(streams, recipe.batch_size // 2, recipe.seq_len, gen).to(target.device)  # [b, t]
            with torch.no_grad():
                hidden_t = target.base_model(input_ids=ids).last_hidden_state  # [b, t, h]
            cache.append((ids, hidden_t.half()))
        else:  # later epochs: the cached batches in a seeded order
            if i == 0:
                order = torch.randperm(len(cache), generator=gen).tolist()
            ids, hidden_16 = cache[order[i]]
            hidden_t = hidden_16.float()
        with torch.no_grad():
            logp = F.log_softmax(hidden_t @ rows.T, dim=-1)  # [b, t, n] target, restricted
        hidden_d = draft.base_model(input_ids=ids).last_hidden_state  # [b, t, h]
        logq = F.log_softmax(hidden_d @ rows.T, dim=-1)  # [b, t, n] draft, restricted
        loss = (logp.exp() * (logp - logq)).sum(-1).mean()
        if not torch.isfinite(loss):
            log.warning("draft distillation: non-finite loss at step %d, step skipped", step)
            opt.zero_grad(set_to_none=True)
            continue
        for g in opt.param_groups:
            g["lr"] = lr_at(step, recipe.steps, recipe.lr, recipe.warmup_steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(epoch=epoch + 1, kl=f"{loss.item():.3f}")
    draft.eval()
    for p in draft.parameters():
        p.requires_grad_(True)
    log.info(
        "draft: %d steps (%d target batches x %d epochs), final KL %.3f",
        recipe.steps,
        recipe.teacher_batches,
        recipe.epochs,
        losses[-1] if losses else math.nan,
    )
    return losses


@torch.inference_mode()
def evaluate_pair(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    vocab: DraftVocab | None,
    streams: dict[str, TokenStream],
    *,
    num_windows: int,
    seq_len: int,
    chunk: int = 4,
) -> dict:
    """Held-out metrics per domain, with the draft restricted to ``vocab`` as serving runs it.

    ``greedy_agreement``: share of positions where the draft's argmax is the target's;
    ``expected_acceptance``: mean ``Σ min(p, q)`` (Leviathan et al. 2023, §3.5); the
    target's ``heldout_loss`` in nats per token; ``vocab_coverage``: share of the target's
    argmax tokens inside the draft vocabulary.
    """
    out: dict = {
        "target": {"heldout_loss": {}},
        "draft": {"greedy_agreement": {}, "expected_acceptance": {}, "vocab_coverage": {}},
    }
    head = draft.get_output_embeddings()
    for domain, stream in sorted(streams.items()):
        windows = stream.contiguous_windows(num_windows, seq_len + 1)  # [n, t + 1]
        sums = {"loss": 0.0, "greedy": 0.0, "accept": 0.0, "cover": 0.0}
        n = 0
        for i in range(0, windows.shape[0], chunk):
            ids = windows[i : i + chunk].to(target.device)
            t_logits = target(input_ids=ids[:, :-1]).logits.float()  # [c, t, V]
            hidden = draft.base_model(input_ids=ids[:, :-1]).last_hidden_state  # [c, t, h]
            if vocab is not None:
                d_logits = vocab.logits(head, hidden.flatten(0, 1)).view(*hidden.shape[:2], -1)
            else:
                d_logits = head(hidden)
            p, q = t_logits.softmax(-1), d_logits.float().softmax(-1)
            top = t_logits.argmax(-1)
            w = ids.shape[0]
            sums["loss"] += F.cross_entropy(t_logits.flatten(0, 1), ids[:, 1:].flatten()).item() * w
            sums["greedy"] += (d_logits.argmax(-1) == top).float().mean().item() * w
            sums["accept"] += torch.minimum(p, q).sum(-1).mean().item() * w
            covered = (
                torch.isin(top, vocab.token_ids.to(top.device))
                if vocab is not None
                else torch.ones_like(top, dtype=torch.bool)
            )
            sums["cover"] += covered.float().mean().item() * w
            n += w
        out["target"]["heldout_loss"][domain] = round(sums["loss"] / n, 4)
        out["draft"]["greedy_agreement"][domain] = round(sums["greedy"] / n, 4)
        out["draft"]["expected_acceptance"][domain] = round(sums["accept"] / n, 4)
        out["draft"]["vocab_coverage"][domain] = round(sums["cover"] / n, 4)
    return out

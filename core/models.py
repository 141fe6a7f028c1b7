"""Loading a target/draft pair from local Hugging Face model directories.

Nothing is fetched from a hub (``local_files_only``), and weights load from safetensors
only (``use_safetensors=True``), so nothing is ever unpickled.

A loaded model is prepared for decoding: its linear layers take the few-row route of
``core.cpu_linear`` on a CPU, and a draft directory's ``draft_vocab.json`` is attached
(``core.draft_vocab``).

The target always runs in float32: its distribution is the output. The draft runs in
``DEFAULT_DRAFT_DTYPE`` (bfloat16) unless asked otherwise: a draft token costs reading the
draft's weights, and half the bytes make it 1.6x faster on our 2-core CPUs (the default
draft's cached 1-token forward 6.3 -> 3.8 ms; its greedy token agreed with float32's at
98 % of held-out positions). Verification never depends on the draft's precision, so the
output stays the target's token for token (greedy) and in distribution (sampling); the
draft's precision only moves acceptance. Checkpoints stay float32 (the trainer's); serving
casts when it loads, hot-swapped versions included.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specops.core import draft_vocab
from specops.core.cpu_linear import use_small_batch_linear
from specops.core.errors import ModelConfigError, TokenizerMismatchError

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def tokenizer_hash(tok: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's full definition (vocab, merges, normaliser, specials)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    else:
        blob = json.dumps(sorted(tok.get_vocab().items()))
    specials = json.dumps(tok.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((blob + specials).encode()).hexdigest()


@dataclass
class ModelPair:
    """A target, an optional draft, and the tokenizer they share."""

    target: PreTrainedModel
    draft: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase | None
    tokenizer_sha256: str = ""

    def __post_init__(self) -> None:
        if self.draft is not None:
            tv, dv = self.target.config.vocab_size, self.draft.config.vocab_size
            if tv != dv:
                raise TokenizerMismatchError(
                    f"target vocabulary has {tv} entries but the draft's has {dv}; "
                    "draft and target must share one tokenizer"
                )

    @property
    def vocab_size(self) -> int:
        return int(self.target.config.vocab_size)

    @property
    def context_size(self) -> int:
        """The target's context (``core.limits.context_size``)."""
        from specops.core.limits import context_size

        return context_size(self.target.config)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.target.generation_config.eos_token_id if self.target.generation_config else None
        if eos is None:
            eos = self.target.config.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


LOAD_LOCK = threading.RLock()
"""Held around every ``from_pretrained`` in this code base. transformers patches class
attributes for the duration of a load (``PreTrainedModel.tie_weights``, the ``torch.nn.init``
functions) and restores what it saw on entry, so two loads overlapping in two threads (a
hot-swap and the router's embedder, a trainer registering while serving follows) can leave
weight tying disabled for the whole process: every later model with a tied head then loads
with an uninitialised (meta) ``lm_head``."""


def from_pretrained(cls, *args, **kwargs):
    """``cls.from_pretrained(*args, **kwargs)`` under :data:`LOAD_LOCK`."""
    with LOAD_LOCK:
        return cls.from_pretrained(*args, **kwargs)


def check_model_dir(path: Path) -> Path:
    """A local HF model directory with safetensors weights, or a clear error."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelConfigError(f"{path} is not a model directory (no config.json); run `specops bootstrap` first")
    if not any(path.glob("*.safetensors")):
        raise ModelConfigError(f"{path} has no .safetensors weights; only safetensors are loaded")
    return path


DRAFT_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
"""Precisions a model can be served in, by name (float16: GPU only, ``core.device``)."""
DEFAULT_DRAFT_DTYPE = "bfloat16"


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a draft precision name (or a dtype itself), or a clear error."""
    if isinstance(name, torch.dtype):
        if name not in DRAFT_DTYPES.values():
            raise ModelConfigError(f"draft dtype {name} is not one of {sorted(DRAFT_DTYPES)}")
        return name
    try:
        return DRAFT_DTYPES[name]
    except KeyError:
        raise ModelConfigError(f"unknown draft dtype {name!r}; choose one of {', '.join(DRAFT_DTYPES)}") from None


def load_model(
    path: Path,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    loading_info: bool = False,
):
    """A model from a local directory (safetensors only), in ``dtype`` on ``device``, in eval
    mode, prepared for decoding. With ``loading_info``, also the dict of
    missing/unexpected/mismatched keys."""
    path = check_model_dir(path)
    # Loaded in float32, then the weights cast: from_pretrained(dtype=bfloat16) switches torch's
    # process-wide default dtype while it loads, so a request finishing on another thread
    # during a hot-swap would build its tensors in bfloat16. Buffers (rotary frequencies) stay
    # float32, as from_pretrained(dtype=...) leaves them; model.to(dtype) would round them.
    model, info = from_pretrained(
        AutoModelForCausalLM,
        path,
        local_files_only=True,
        use_safetensors=True,
        dtype=torch.float32,
        output_loading_info=True,
    )
    if resolve_dtype(dtype) != torch.float32:
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.to(resolve_dtype(dtype))
    if torch.device(device).type != "cpu":
        model.to(device)
    model.eval()
    prepare_for_decoding(model)
    try:
        draft_vocab.attach(model, draft_vocab.load(path, int(model.config.vocab_size)))
    except draft_vocab.DraftVocabError as exc:
        raise ModelConfigError(str(exc)) from exc
    return (model, info) if loading_info else model


def prepare_for_decoding(model: PreTrainedModel) -> PreTrainedModel:
    """Few-row linear products as ``W @ xᵀ`` on a CPU (``core.cpu_linear``); in place."""
    if next(model.parameters()).device.type == "cpu":
        use_small_batch_linear(model)
    return model


def render_chat(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """The prompt text of a chat: the tokenizer's chat template with the assistant's turn
    opened, or, for a base model without a template, the contents one paragraph each.
    ``/v1/chat/completions`` renders requests with this, and so do the workloads that
    stand in for its traffic (``specops.chat_workload``)."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages if m["content"])


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def load_pair(
    target_dir: Path,
    draft_dir: Path | None = None,
    *,
    draft_dtype: str | torch.dtype = DEFAULT_DRAFT_DTYPE,
    target_dtype: str | torch.dtype = torch.float32,
    device: str = "cpu",
) -> ModelPair:
    """Load a target (``target_dtype``, float32 by default) and optionally a draft (in
    ``draft_dtype``), both on ``device``; fail clearly if their tokenizers differ."""
    check_model_dir(target_dir)
    if draft_dir is not None:
        check_model_dir(draft_dir)
    target_tok = load_tokenizer(target_dir)
    target_hash = tokenizer_hash(target_tok)
    draft = None
    if draft_dir is not None:
        draft_hash = tokenizer_hash(load_tokenizer(draft_dir))
        if draft_hash != target_hash:
            raise TokenizerMismatchError(
                f"draft tokenizer at {draft_dir} (sha256 {draft_hash[:12]}) differs from the target's at "
                f"{target_dir} (sha256 {target_hash[:12]}); speculative decoding needs one shared tokenizer"
            )
        draft = load_model(draft_dir, dtype=draft_dtype, device=device)
    target = load_model(target_dir, dtype=target_dtype, device=device)
    pair = ModelPair(target=target, draft=draft, tokenizer=target_tok, tokenizer_sha256=target_hash)
    log.info(
        "loaded target %s (%.1fM params, %s on %s)%s",
        target_dir,
        sum(p.numel() for p in target.parameters()) / 1e6,
        target.dtype,
        device,
        f" and draft {draft_dir} ({sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params, {draft.dtype})"
        if draft
        else "",
    )
    return pair


def load_model_dir(
    model_dir: Path,
    *,
    draft_dtype: str | torch.dtype = DEFAULT_DRAFT_DTYPE,
    target_dtype: str | torch.dtype = torch.float32,
    device: str = "cpu",
) -> ModelPair:
    """Load the pair under a bootstrap-style directory: ``model_dir/target`` and ``model_dir/draft``."""
    model_dir = Path(model_dir)
    draft_dir = model_dir / "draft"
    return load_pair(
        model_dir / "target",
        draft_dir if draft_dir.is_dir() else None,
        draft_dtype=draft_dtype,
        target_dtype=target_dtype,
        device=device,
    )

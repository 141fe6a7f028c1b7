"""DReSD keys: the target's last hidden state, z-normalised, reduced by PCA and L2-normalised
(DReSD §3.1-3.4, Alg. 1 lines 2 and 4-6).

- ``v``: the target's final hidden state at a position (after the last norm, before the LM
  head), the one the verifier returns with each verdict;
- z-norm (Eq. 1): ``(v - E[V]) / sqrt(Var[V] + eps)``, mean and variance per dimension
  over a bounded sample ``V`` of keys (the paper's ~1M);
- PCA: the top ``l`` principal components of the z-normed sample (``l = 64``; Table 2 finds
  no gain past 64);
- magnitude norm (Eq. 2): ``v_l / max(||v_l||_2, eps)``, so that inner product is cosine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

EPS = 1e-6


@dataclass
class Projection:
    """Fitted z-norm statistics and PCA components."""

    mean: np.ndarray
    """[hidden] float32 E[V]."""
    scale: np.ndarray
    """[hidden] float32 sqrt(Var[V] + eps)."""
    components: np.ndarray
    """[hidden, dims] float32 principal directions, by decreasing variance."""
    explained: np.ndarray
    """[dims] float32 explained-variance ratio of each kept component."""

    @property
    def hidden_size(self) -> int:
        return int(self.mean.shape[0])

    @property
    def dims(self) -> int:
        return int(self.components.shape[1])

    @classmethod
    def fit(cls, sample: np.ndarray, dims: int) -> Projection:
        """Fit on ``sample`` [n, hidden] float32 (n >= 2)."""
        assert sample.ndim == 2 and sample.shape[0] >= 2, sample.shape
        x = sample.astype(np.float64)
        mean = x.mean(axis=0)
        scale = np.sqrt(x.var(axis=0) + EPS)
        z = (x - mean) / scale
        cov = z.T @ z / (z.shape[0] - 1)  # [hidden, hidden]
        values, vectors = np.linalg.eigh(cov)  # ascending
        order = np.argsort(values)[::-1]
        dims = min(dims, sample.shape[1])
        keep = order[:dims]
        # A fixed sign per component (largest entry positive), so refits of the same data agree.
        comps = vectors[:, keep]
        comps *= np.sign(comps[np.abs(comps).argmax(axis=0), np.arange(dims)])
        total = max(values.clip(min=0).sum(), EPS)
        return cls(
            mean.astype(np.float32),
            scale.astype(np.float32),
            np.ascontiguousarray(comps, dtype=np.float32),
            (values[keep].clip(min=0) / total).astype(np.float32),
        )

    def apply(self, hidden: np.ndarray | torch.Tensor) -> np.ndarray:
        """Keys of ``hidden`` [n, hidden]: [n, dims] float32 of unit length."""
        v = hidden.detach().float().cpu().numpy() if isinstance(hidden, torch.Tensor) else np.asarray(hidden)
        v = v.reshape(-1, self.hidden_size).astype(np.float32, copy=False)
        low = ((v - self.mean) / self.scale) @ self.components
        return (low / np.maximum(np.linalg.norm(low, axis=1, keepdims=True), EPS)).astype(np.float32)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "znorm_mean": torch.from_numpy(self.mean),
            "znorm_scale": torch.from_numpy(self.scale),
            "pca_components": torch.from_numpy(self.components),
            "pca_explained": torch.from_numpy(self.explained),
        }

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> Projection:
        p = cls(
            t["znorm_mean"].numpy(), t["znorm_scale"].numpy(), t["pca_components"].numpy(), t["pca_explained"].numpy()
        )
        h, d = p.components.shape
        if p.mean.shape != (h,) or p.scale.shape != (h,) or p.explained.shape != (d,) or not (p.scale > 0).all():
            raise ValueError(
                f"projection tensors disagree: mean {p.mean.shape}, scale {p.scale.shape}, "
                f"components {p.components.shape}, explained {p.explained.shape}"
            )
        return p


@torch.no_grad()
def target_hidden_states(
    target, docs: Iterable[list[int]], *, max_len: int = 1024, batch_tokens: int = 4096
) -> Iterator[tuple[int, np.ndarray]]:
    """The target's final hidden state at every position of every document, in batches of
    about ``batch_tokens`` tokens (documents of similar length padded together). Yields
    ``(doc_index, hidden [len, hidden] float32)`` in an order of its choosing; documents are
    cut to ``max_len`` tokens."""
    base = getattr(target, "model", target)  # the decoder stack: hidden states after its final norm
    device = next(target.parameters()).device
    docs = [list(d[:max_len]) for d in docs]
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    batch: list[int] = []

    def run(batch: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        width = max(len(docs[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(docs[i])] = torch.tensor(docs[i])
            mask[row, : len(docs[i])] = 1
        out = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # [b, width, hidden]
        out = out.float().cpu().numpy()
        for row, i in enumerate(batch):
            yield i, out[row, : len(docs[i])]

    for i in order:
        if not docs[i]:
            continue
        if batch and (len(batch) + 1) * len(docs[i]) > batch_tokens:
            yield from run(batch)
            batch = []
        batch.append(i)
    if batch:
        yield from run(batch)

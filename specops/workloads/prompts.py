"""Prompts cut from the held-out documents of a bootstrap, for the demo and benchmarks."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

NEAR_DUPLICATE = 0.5
"""Jaccard similarity of token :data:`SHINGLE`-gram sets at or above which two prompts are
near-duplicates. Between two 64-token windows, one changed word leaves a similarity of ~0.88
(each changed token breaks up to 4 of the 61 shingles), five leave ~0.5; the same text
shifted, or with other text around it, stays at 0.5 or above while about 44 tokens (~70%) of
the window are shared. Windows that share half their text (~0.36) and unrelated text (~0)
are kept as distinct."""
SHINGLE = 4
"""Tokens per shingle (contiguous token n-gram) compared by :class:`NearDuplicateFilter`."""


@dataclass(frozen=True)
class Prompt:
    domain: str
    source: str
    text: str
    token_ids: list[int]


def heldout_prompts(
    model_dir: Path, tokenizer, domain: str, n: int, num_tokens: int = 96, seed: int = 0, per_doc: int = 1
) -> list[Prompt]:
    """``n`` prompts of ``num_tokens`` tokens from held-out files of ``domain``.

    Each prompt starts at a line boundary at a seeded position in a held-out document,
    so the models have never trained on it; a document gives at most ``per_doc``
    prompts (distinct positions).
    """
    from specops.trainer.bootstrap.corpus import read_document

    paths = _heldout_paths(model_dir, domain)
    rng = random.Random(seed)
    order = list(range(len(paths)))
    rng.shuffle(order)
    newline_ids = newline_token_ids(tokenizer)
    prompts: list[Prompt] = []
    for i in order:
        text = read_document(paths[i], domain)  # rendered exactly as in training; None if unreadable now
        if text is None:
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < num_tokens * 2:
            continue
        # Start right after a seeded line break, leaving room for num_tokens tokens.
        newline_positions = [j for j, t in enumerate(ids[: len(ids) - num_tokens]) if t in newline_ids]
        if not newline_positions:
            starts = [-1]
        elif per_doc == 1:  # one draw, as always: keeps the prompts of earlier benchmark runs
            starts = [rng.choice(newline_positions)]
        else:
            starts = rng.sample(newline_positions, min(per_doc, len(newline_positions)))
        for start in (s + 1 for s in starts):
            window = ids[start : start + num_tokens]
            prompts.append(Prompt(domain=domain, source=str(paths[i]), text=tokenizer.decode(window), token_ids=window))
            if len(prompts) == n:
                return prompts
    return prompts


def _heldout_paths(model_dir: Path, domain: str) -> list[str]:
    from specops.trainer.bootstrap import load_manifest

    manifest = load_manifest(Path(model_dir))
    if domain not in manifest["domains"]:
        raise ValueError(f"unknown domain {domain!r}; the bootstrap has {sorted(manifest['domains'])}")
    return manifest["domains"][domain]["heldout"]


def newline_token_ids(tokenizer) -> set[int]:
    """Ids of the tokens whose text contains a line break (decoded in one batch)."""
    ids = list(range(len(tokenizer)))
    return {i for i, text in zip(ids, tokenizer.batch_decode([[i] for i in ids])) if "\n" in text}


def distinct_prompts(
    model_dir: Path,
    tokenizer,
    domain: str,
    n: int,
    num_tokens: int = 64,
    seed: int = 0,
    *,
    spacing: int | None = None,
    near_duplicate: float | None = NEAR_DUPLICATE,
) -> list[Prompt]:
    """``n`` prompts of ``num_tokens`` tokens from held-out files of ``domain``, pairwise distinct.

    Each prompt starts right after a line break. Within a document, two prompts start at
    least ``spacing`` tokens apart (default ``3 * num_tokens``), so no prompt contains the
    text that follows another one: a draft that learned from serving one prompt has not
    seen the next. Documents are visited in a seeded order and each gives as many prompts
    as fit; the list is then shuffled (seeded), so consecutive requests come from different
    documents. Fewer than ``n`` come back when the held-out files have no more room.

    Across all documents, no two prompts have the same token ids, and (unless
    ``near_duplicate`` is None) no two are near-duplicates: a window whose token-shingle
    Jaccard similarity with an already kept prompt is at least ``near_duplicate`` (default
    :data:`NEAR_DUPLICATE`) is skipped (:class:`NearDuplicateFilter`). Held-out files repeat
    license and copyright boilerplate word for word, or with a name changed; without this, the
    "distinct" prompts of a machine with many packages were not. A skipped window does not
    count for ``spacing``: the next line break after it is tried. Where nothing repeats, the
    prompts are the same as without the filter.
    """
    from specops.trainer.bootstrap.corpus import read_document

    from_ = spacing if spacing is not None else 3 * num_tokens
    if from_ < num_tokens:
        raise ValueError(f"spacing {from_} is shorter than a prompt ({num_tokens} tokens): prompts would overlap")
    seen = NearDuplicateFilter(near_duplicate)
    paths = _heldout_paths(model_dir, domain)
    rng = random.Random(f"distinct:{seed}")
    order = list(range(len(paths)))
    rng.shuffle(order)
    newline_ids = newline_token_ids(tokenizer)
    out: list[Prompt] = []
    for i in order:
        text = read_document(paths[i], domain)
        if text is None:
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        start = rng.randrange(max(1, min(from_, len(ids))))
        while len(out) < n:
            nl = next((j for j in range(start, len(ids) - num_tokens) if ids[j] in newline_ids), None)
            if nl is None:
                break
            window = ids[nl + 1 : nl + 1 + num_tokens]
            if not seen.add(window):  # the same text, or nearly, is already a prompt: try the next line
                start = nl + 1
                continue
            out.append(
                Prompt(domain=domain, source=f"{paths[i]}@{nl + 1}", text=tokenizer.decode(window), token_ids=window)
            )
            start = nl + 1 + from_
        if len(out) >= n:
            break
    rng.shuffle(out)
    return out


# --------------------------------------------------------------------------- near-duplicates


def shingles(token_ids: Sequence[int], k: int = SHINGLE) -> set[tuple[int, ...]]:
    """The set of contiguous ``k``-token tuples of ``token_ids`` (the whole of it when shorter)."""
    ids = tuple(token_ids)
    if len(ids) <= k:
        return {ids}
    return {ids[i : i + k] for i in range(len(ids) - k + 1)}


def jaccard(a: Sequence[int], b: Sequence[int], k: int = SHINGLE) -> float:
    """Jaccard similarity of the ``k``-token shingle sets of two token id sequences."""
    sa, sb = shingles(a, k), shingles(b, k)
    return len(sa & sb) / len(sa | sb)


class NearDuplicateFilter:
    """Keeps token id sequences that are neither equal nor near-equal to one already kept.

    ``add(ids)`` returns True and remembers ``ids`` when no kept sequence has the same ids
    and none has a :func:`jaccard` similarity (``shingle``-token shingles) of at least
    ``threshold`` with it; otherwise it returns False and remembers nothing. ``threshold``
    None keeps every sequence that is not an exact repeat. The result depends only on the
    order of the calls (no hashing seed, no sampling).

    An inverted index (shingle -> kept sequences) means a call computes the exact similarity
    only with the kept sequences that share a shingle with ``ids``: a call on a 64-token
    window costs ~0.1 ms with thousands kept (5,000 windows filter in under half a second).
    Token ids may be any ints (numpy or torch scalars too).
    """

    def __init__(self, threshold: float | None = NEAR_DUPLICATE, shingle: int = SHINGLE):
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError(f"near-duplicate threshold {threshold} is not in (0, 1]")
        if shingle < 1:
            raise ValueError(f"shingle {shingle} is not a positive number of tokens")
        self.threshold, self.shingle = threshold, shingle
        self._exact: set[tuple[int, ...]] = set()
        self._sizes: list[int] = []  # shingle-set size of each kept sequence
        self._index: dict[tuple[int, ...], list[int]] = {}  # shingle -> positions in _sizes

    def __len__(self) -> int:
        return len(self._exact)

    def is_duplicate(self, token_ids: Sequence[int]) -> bool:
        """``token_ids`` would be dropped by :meth:`add` (nothing is remembered)."""
        return self._check(token_ids)[0]

    def add(self, token_ids: Sequence[int]) -> bool:
        """Keep ``token_ids`` (True) unless it repeats or nearly repeats a kept one (False)."""
        dup, key, sh = self._check(token_ids)
        if dup:
            return False
        self._exact.add(key)
        if sh is not None:
            kept = len(self._sizes)
            self._sizes.append(len(sh))
            for s in sh:
                self._index.setdefault(s, []).append(kept)
        return True

    def _check(self, token_ids: Sequence[int]) -> tuple[bool, tuple[int, ...], set | None]:
        key = tuple(int(t) for t in token_ids)
        if key in self._exact:
            return True, key, None
        if self.threshold is None:
            return False, key, None
        sh = shingles(key, self.shingle)
        common: dict[int, int] = {}
        for s in sh:
            for j in self._index.get(s, ()):
                common[j] = common.get(j, 0) + 1
        for j, inter in common.items():
            if inter / (len(sh) + self._sizes[j] - inter) >= self.threshold:
                return True, key, sh
        return False, key, sh


def dedupe(items: Iterable[T], threshold: float | None = NEAR_DUPLICATE, *, shingle: int = SHINGLE) -> list[T]:
    """``items`` in order, less each exact or near-duplicate of an earlier kept one.

    An item is a sequence of token ids or has them as ``.token_ids`` (a :class:`Prompt`);
    items are compared as :class:`NearDuplicateFilter` ``(threshold, shingle)`` does.
    """
    keep = NearDuplicateFilter(threshold, shingle)
    return [x for x in items if keep.add(getattr(x, "token_ids", x))]

"""Prompts cut from the held-out documents of a bootstrap, for the demo and benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path


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
    from trainer.bootstrap import load_manifest
    from trainer.bootstrap.corpus import read_document

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
    from trainer.bootstrap import load_manifest

    manifest = load_manifest(Path(model_dir))
    if domain not in manifest["domains"]:
        raise ValueError(f"unknown domain {domain!r}; the bootstrap has {sorted(manifest['domains'])}")
    return manifest["domains"][domain]["heldout"]


def newline_token_ids(tokenizer) -> set[int]:
    """Ids of the tokens whose text contains a line break (decoded in one batch)."""
    ids = list(range(len(tokenizer)))
    return {i for i, text in zip(ids, tokenizer.batch_decode([[i] for i in ids])) if "\n" in text}


def distinct_prompts(model_dir: Path, tokenizer, domain: str, n: int, num_tokens: int = 64, seed: int = 0,
                     *, spacing: int | None = None) -> list[Prompt]:  # fmt: skip
    """``n`` prompts of ``num_tokens`` tokens from held-out files of ``domain``, pairwise disjoint.

    Each prompt starts right after a line break. Within a document, two prompts start at
    least ``spacing`` tokens apart (default ``3 * num_tokens``), so no prompt contains the
    text that follows another one: a draft that learned from serving one prompt has not
    seen the next. Documents are visited in a seeded order and each gives as many prompts
    as fit; the list is then shuffled (seeded), so consecutive requests come from different
    documents. Fewer than ``n`` come back when the held-out files have no more room.
    """
    from trainer.bootstrap.corpus import read_document

    from_ = spacing if spacing is not None else 3 * num_tokens
    if from_ < num_tokens:
        raise ValueError(f"spacing {from_} is shorter than a prompt ({num_tokens} tokens): prompts would overlap")
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
            out.append(Prompt(domain=domain, source=f"{paths[i]}@{nl + 1}", text=tokenizer.decode(window),
                              token_ids=window))  # fmt: skip
            start = nl + 1 + from_
        if len(out) >= n:
            break
    rng.shuffle(out)
    return out

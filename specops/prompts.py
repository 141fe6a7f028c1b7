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

    manifest = load_manifest(Path(model_dir))
    if domain not in manifest["domains"]:
        raise ValueError(f"unknown domain {domain!r}; the bootstrap has {sorted(manifest['domains'])}")
    paths = manifest["domains"][domain]["heldout"]
    rng = random.Random(seed)
    order = list(range(len(paths)))
    rng.shuffle(order)
    newline_ids = {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}
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

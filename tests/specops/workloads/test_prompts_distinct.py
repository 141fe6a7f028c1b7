"""``specops.workloads.prompts.distinct_prompts`` never serves the same or nearly the same text twice, even
when held-out documents repeat boilerplate (license and copyright paragraphs under
/usr/share/doc do). The bootstrap here is a manifest over files written to ``tmp_path`` and a
word-level tokenizer built from them: nothing depends on which files the machine holds."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from specops.workloads.prompts import (
    NEAR_DUPLICATE,
    SHINGLE,
    NearDuplicateFilter,
    Prompt,
    dedupe,
    distinct_prompts,
    jaccard,
    shingles,
)

BOILERPLATE = (
    "This program is free software: you can\n"
    "redistribute it under the GNU General Public\n"
    "License, and it comes with absolutely no\n"
    "warranty of any kind whatsoever, see COPYING.\n"
)
NEAR_COPY = BOILERPLATE.replace("absolutely", "positively")  # one word changed
NUM_TOKENS = 32
"""A prompt is as long as the boilerplate (4 lines of 7 words): a prompt that holds all of it is it."""


class WordTokenizer:
    """Words (with their leading space) and line breaks as tokens; the vocabulary is fixed up front."""

    PATTERN = re.compile(r"\n| ?[^\s]+| +")

    def __init__(self, texts: list[str]):
        words = sorted({w for t in texts for w in self.PATTERN.findall(t)})
        self.vocab = ["<unk>", *words]
        self.ids = {w: i for i, w in enumerate(self.vocab)}

    def __len__(self) -> int:
        return len(self.vocab)

    def __call__(self, text: str, add_special_tokens: bool = False, verbose: bool = False) -> dict:
        return {"input_ids": [self.ids.get(w, 0) for w in self.PATTERN.findall(text)]}

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)

    def batch_decode(self, batch: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


def prose(rng: random.Random, lines: int, words: int = 7) -> str:
    """Lines of seeded pseudo-words: unrelated text shares (almost) no 4-gram with anything."""
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pu", "da", "fe"]
    word = lambda: "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4)))  # noqa: E731
    return "".join(" ".join(word() for _ in range(words)) + "\n" for _ in range(lines))


@pytest.fixture
def bootstrap(tmp_path):
    """A model dir whose held-out prose is 16 copyright files: 8 hold BOILERPLATE, 6 NEAR_COPY, 2 neither.

    Half the files open with a header line longer than ``spacing``, so their first prompt is
    the paragraph right after it (as a copyright file's license is); in the others it sits
    among lines of prose, where prompts cut it at any line.
    """
    docs = []
    for k in range(16):
        rng = random.Random(k)
        middle = BOILERPLATE if k < 8 else NEAR_COPY if k < 14 else ""
        head = prose(rng, 1, words=2 * NUM_TOKENS) if k % 2 == 0 else prose(rng, 13)
        docs.append(head + middle + prose(rng, 13))
    paths = []
    for k, text in enumerate(docs):
        path = tmp_path / "share" / "doc" / f"pkg{k}" / "copyright"
        path.parent.mkdir(parents=True)
        path.write_text(text)
        paths.append(str(path))
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    manifest = {"format": 2, "kind": "tiny", "domains": {"prose": {"train": [], "heldout": paths}}}
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    tok = WordTokenizer(docs)
    assert len(tok(BOILERPLATE)["input_ids"]) == len(tok(NEAR_COPY)["input_ids"]) == NUM_TOKENS
    return model_dir, tok


def whole_boilerplate(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts that hold the whole boilerplate paragraph or its near copy."""
    return [p for p in prompts if BOILERPLATE in p.text or NEAR_COPY in p.text]


@pytest.mark.parametrize("seed", range(8))
def test_distinct_prompts_skip_repeated_and_nearly_repeated_boilerplate(bootstrap, seed):
    model_dir, tok = bootstrap
    kw = {"num_tokens": NUM_TOKENS, "seed": seed, "spacing": NUM_TOKENS}
    prompts = distinct_prompts(model_dir, tok, "prose", 500, **kw)
    assert len(prompts) >= 32 and all(len(p.token_ids) == NUM_TOKENS for p in prompts)
    assert len({tuple(p.token_ids) for p in prompts}) == len(prompts), "two prompts have the same token ids"
    worst = max(jaccard(a.token_ids, b.token_ids) for a, b in itertools.combinations(prompts, 2))
    assert worst < NEAR_DUPLICATE
    assert len(whole_boilerplate(prompts)) <= 1
    assert distinct_prompts(model_dir, tok, "prose", 500, **kw) == prompts, "seeded: the same call, the same list"
    # The files do repeat the paragraph where prompts are cut: exact deduplication alone keeps the
    # near copy next to it.
    exact_only = distinct_prompts(model_dir, tok, "prose", 500, **kw, near_duplicate=None)
    assert len({tuple(p.token_ids) for p in exact_only}) == len(exact_only)
    assert {p.text for p in whole_boilerplate(exact_only)} == {BOILERPLATE, NEAR_COPY}
    # Asking for fewer gives a subset, still distinct.
    few = distinct_prompts(model_dir, tok, "prose", 10, **kw)
    assert len(few) == 10 and len(whole_boilerplate(few)) <= 1


def test_near_duplicate_filter_keeps_first_of_equal_and_near_equal_sequences():
    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(64)]
    one_changed = [*base[:30], 5000, *base[31:]]
    unrelated = [rng.randrange(1000) for _ in range(64)]
    assert jaccard(base, one_changed) >= NEAR_DUPLICATE > jaccard(base, unrelated)
    f = NearDuplicateFilter()
    assert f.add(base) and len(f) == 1
    assert not f.add(list(base)) and not f.add(tuple(base)), "an exact repeat"
    assert f.is_duplicate(one_changed) and not f.add(one_changed), "one token of 64 changed"
    assert not f.is_duplicate(unrelated) and len(f) == 1, "is_duplicate remembers nothing"
    assert f.add(unrelated) and len(f) == 2
    half = [*base[:32], *unrelated[32:]]  # half of each kept one: similarity ~1/3 with both
    assert max(jaccard(half, base), jaccard(half, unrelated)) < NEAR_DUPLICATE and f.add(half)
    # threshold None: exact repeats only
    g = NearDuplicateFilter(None)
    assert g.add(base) and g.add(one_changed) and not g.add(base)
    # sequences shorter than a shingle are compared whole
    assert shingles([1, 2], SHINGLE) == {(1, 2)}
    h = NearDuplicateFilter()
    assert h.add([1, 2]) and not h.add([1, 2]) and h.add([2, 1]) and h.add([])
    with pytest.raises(ValueError):
        NearDuplicateFilter(0.0)
    with pytest.raises(ValueError):
        NearDuplicateFilter(1.5)


def test_dedupe_keeps_order_and_accepts_prompts_or_id_lists():
    rng = random.Random(1)
    a = [rng.randrange(500) for _ in range(40)]
    b = [rng.randrange(500) for _ in range(40)]
    near_a = [*a[:-1], 999]
    assert dedupe([a, b, a, near_a]) == [a, b]
    assert dedupe([a, b, a, near_a], None) == [a, b, near_a]
    ps = [Prompt("code", f"f@{i}", "", ids) for i, ids in enumerate([near_a, a, b])]
    assert dedupe(ps) == [ps[0], ps[2]]


def test_near_duplicate_filter_scales_to_thousands_of_prompts():
    rng = random.Random(2)
    windows = [[rng.randrange(4096) for _ in range(64)] for _ in range(3000)]
    f = NearDuplicateFilter()
    assert all(f.add(w) for w in windows)
    assert not any(f.add([*w[:-1], 4097]) for w in windows)

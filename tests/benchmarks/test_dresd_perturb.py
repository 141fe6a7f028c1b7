"""The paraphrase-robustness set: perturbations are consistent and touch the context's end, and
only cases whose target continuation is unchanged are kept."""

from __future__ import annotations

import builtins
import keyword
import random
import re

import pytest
import torch

from benchmarks.dresd_perturb import (
    SYNONYMS,
    build_perturbed_set,
    common_suffix,
    perturb_code,
    perturb_prose,
)

CODE = '''def summarize(records, limit):
    """Count the records under the limit."""
    count = 0
    for record in records:
        if len(record) < limit:
            count += 1
    total = sum(len(record) for record in records)
    return count, total
'''

CODE_2 = """class Inventory:
    def __init__(self, capacity):
        self.capacity = capacity
        self.stock = []

    def add_item(self, item, quantity):
        entries = [item] * quantity
        self.stock.extend(entries)
        return len(entries)
"""

PROSE = (
    "The program reads the whole file first, and it writes the answer later. "
    "We often use a big buffer to begin the task quickly. "
    "Many users need help when they start, so the manual shows an example."
)

PROSE_2 = (
    "This option is useful when the input is large; it reduces the time needed. "
    "The tool can also check the result and fix a small error before it ends."
)

IDENT = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z_][A-Za-z0-9_]*")


def _renames(edits):
    return dict(e.split("->") for e in edits)


def test_perturb_code_renames_consistently_and_touches_the_tail():
    seen_multi = False
    for seed in range(20):
        out = perturb_code(CODE, random.Random(seed))
        assert out is not None
        text, edits = out
        renames = _renames(edits)
        assert 1 <= len(renames) <= 3 and text != CODE
        seen_multi |= len(renames) > 1
        for old, new in renames.items():
            assert old not in IDENT.findall(text), f"{old} renamed only partly (seed {seed})"
            assert old in IDENT.findall(CODE)
            assert IDENT.findall(CODE).count(old) == IDENT.findall(text).count(new)  # every occurrence
            assert new not in IDENT.findall(CODE)  # no collision with an existing name
            assert old not in keyword.kwlist and old not in dir(builtins) and len(old) >= 3
        # Undoing the renames gives back the original: nothing else changed.
        back = IDENT.sub(lambda m: {v: k for k, v in renames.items()}.get(m.group(0), m.group(0)), text)
        assert back == CODE
        # Keywords and builtins are all still there, and the last 120 characters changed.
        for word in ("def", "for", "in", "if", "return", "len", "sum"):
            assert IDENT.findall(text).count(word) == IDENT.findall(CODE).count(word)
        assert text[-120:] != CODE[-120:]
    assert seen_multi
    assert perturb_code(CODE, random.Random(7)) == perturb_code(CODE, random.Random(7))
    assert perturb_code(CODE_2, random.Random(3)) is not None


def test_perturb_code_leaves_attributes_and_imports_alone():
    for seed in range(20):
        text, edits = perturb_code(CODE_2, random.Random(seed))
        renamed = set(_renames(edits))
        assert not renamed & {"self", "capacity", "stock", "extend", "__init__"}, edits


def test_perturb_code_needs_a_candidate_near_the_end():
    text = "def helper_function(value):\n    return value\n" + "# " + "x = 1; " * 30 + "\n"
    assert perturb_code(text, random.Random(0)) is None  # names only far from the end
    assert perturb_code("print(len([1, 2, 3]))\nx = 1\n", random.Random(0)) is None  # builtins, short names
    assert perturb_code("", random.Random(0)) is None


def test_perturb_prose_keeps_capitalisation_and_touches_the_tail():
    swapped = False
    for text in (PROSE, PROSE_2):
        for seed in range(20):
            out = perturb_prose(text, random.Random(seed))
            assert out is not None
            new, edits = out
            assert text[-120:] != new[-120:]
            assert new.endswith(".")
            words = [e for e in edits if not e.startswith("swap")]
            assert 1 <= len(words) <= 4
            for e in words:
                old, rep = e.split("->")
                assert rep.lower() in SYNONYMS[old.lower()]
                assert old[0].isupper() == rep[0].isupper() and old.isupper() == rep.isupper()
            swapped |= any(e.startswith("swap") for e in edits)
    assert swapped  # clause swaps happen too
    assert perturb_prose(PROSE, random.Random(5)) == perturb_prose(PROSE, random.Random(5))
    assert perturb_prose("Zebra quagga xylophone.", random.Random(0)) is None


def test_clause_swap_keeps_the_sentence_and_the_last_one():
    text = "The file is read first, and the output is printed later. It is done now."
    for seed in range(30):
        new, edits = perturb_prose(text + " We start.", random.Random(seed))
        if any(e.startswith("swap") for e in edits):
            assert new.split(". ")[0].startswith("The output is printed later, and the file is read first")
            assert new.endswith("."), new
            return
    pytest.fail("no clause swap in 30 seeds")


def test_common_suffix():
    assert common_suffix([1, 2, 3], [9, 2, 3]) == 2
    assert common_suffix([1, 2], [3]) == 0
    assert common_suffix([5], [5]) == 1


def _greedy_one(target, ids, n):
    with torch.no_grad():
        out = target.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.slow  # the tiny bootstrap and generate calls (about 10 s)
def test_build_perturbed_set_keeps_only_unchanged_continuations(tiny_models):
    from specops.core.models import load_model_dir

    pair = load_model_dir(tiny_models)
    target, tok = pair.target, pair.tokenizer
    check = 6
    for domain, texts in (("code", [CODE, CODE_2, "1 + 2\n"]), ("prose", [PROSE, PROSE_2])):
        contexts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        cases = [(c, _greedy_one(target, c, check + 2)) for c in contexts]
        wrong = [(t + 1) % target.config.vocab_size for t in cases[0][1]]
        cases.append((contexts[0], wrong))  # a recorded continuation the target does not produce
        kept, stats = build_perturbed_set(
            target, tok, cases, domain=domain, check_tokens=check, seed=1, batch=2, progress=False
        )
        assert stats["candidates"] == len(cases)
        assert stats["dropped_changed_continuation"] >= 1
        assert stats["candidates"] == (
            stats["kept"] + stats["dropped_changed_continuation"] + stats["dropped_unperturbable"]
        )
        assert stats["perturbed"] == stats["kept"] + stats["dropped_changed_continuation"]
        assert stats["check_tokens"] == check and stats["kept"] == len(kept) >= 1
        if domain == "code":
            assert stats["dropped_unperturbable"] == 1  # "1 + 2": nothing to rename
        assert all(c.continuation != wrong for c in kept)
        for case in kept:
            assert case.domain == domain and case.edits
            assert case.prompt_ids != case.original_ids
            assert case.original_ids in contexts
            assert case.tail_overlap == common_suffix(case.prompt_ids, case.original_ids) < len(case.prompt_ids)
            # Re-generated independently from the perturbed context: the recorded continuation.
            assert _greedy_one(target, case.prompt_ids, check) == case.continuation[:check]
        assert stats["mean_tail_overlap"] == pytest.approx(sum(c.tail_overlap for c in kept) / len(kept))
    # Reproducible for a seed, and max_cases caps the kept cases.
    again, _ = build_perturbed_set(target, tok, cases, domain="prose", check_tokens=check, seed=1, progress=False)
    assert [c.prompt_ids for c in again] == [c.prompt_ids for c in kept]
    capped, st = build_perturbed_set(
        target, tok, cases, domain="prose", check_tokens=check, max_cases=1, batch=1, progress=False
    )
    assert len(capped) == 1 and st["kept"] == 1
    with pytest.raises(ValueError, match="domain"):
        build_perturbed_set(target, tok, cases, domain="math", progress=False)

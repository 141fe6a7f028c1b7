"""The questions of ``benchmarks/ralm.py``: built deterministically from a knowledge base's own
documents, so the answer is in the KB (the paper's "Question: ... Answer:" template).

- **man**: a man page of section 1 or 8 whose NAME line says what it does:
  "What does the `ls` command do?" (answer: the NAME line);
- **doc**: ``/usr/share/doc``: questions written in FAQ files, then "What is <package> and what
  is it for?" for packages with a README;
- **license**: "Under which license is <package> distributed?" for packages whose copyright
  file names a licence.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from specops.serving.retrieval.kb import KnowledgeBase


@dataclass(frozen=True)
class Question:
    set: str
    prompt: str
    title: str
    """The KB document that answers it."""
    answer: str
    """The text in that document that answers it (for the reader; never scored)."""


MAN_TITLE = re.compile(r"([A-Za-z0-9][\w.+-]{0,40})\(([18])[a-z]*\)")
NAME_LINE = re.compile(
    r"\bNAME\s+(.{1,80}?)\s+(?:-{1,2}|\u2013|\u2014)\s+(.{3,160}?)(?=\n|\s+SYNOPSIS\b|\s+DESCRIPTION\b|$)"
)
FAQ_QUESTION = re.compile(r"([A-Z][^?.!:\n]{14,150}\?)")
DOC_TITLE = re.compile(r"([\w.+-]+)/(README[\w.-]*|FAQ[\w.-]*|copyright)")
LICENSE = re.compile(r"License:\s*([^\n]{2,60}?)(?=\n|\s+(?:Files|Copyright|License|Comment):|$)")


def question_sets(kb: KnowledgeBase, per_set: int, seed: int = 0) -> dict[str, list[Question]]:
    """The man / doc / license sets from ``kb``'s own documents (deterministic for a KB)."""
    first: dict[str, str] = {}  # title -> its first passage
    faq: list[tuple[str, str]] = []
    for p in kb.passages(range(kb.num_passages)):
        first.setdefault(p.title, p.text)
        if "/FAQ" in p.title:
            faq += [(p.title, q) for q in FAQ_QUESTION.findall(p.text)]
    man, readme, licence = [], [], []
    for title, text in first.items():
        if (m := MAN_TITLE.fullmatch(title)) and (n := NAME_LINE.search(text)) and m.group(1) in n.group(1):
            man.append(
                Question(
                    "man",
                    f"Question: What does the `{m.group(1)}` command do?\nAnswer:",
                    title,
                    f"{n.group(1)} - {n.group(2)}",
                )
            )
        elif (d := DOC_TITLE.fullmatch(title)) and d.group(2).startswith("README"):
            readme.append(
                Question(
                    "doc",
                    f"Question: What is {d.group(1)} and what is it for?\nAnswer:",
                    title,
                    " ".join(text.split()[:30]),
                )
            )
        elif d and d.group(2) == "copyright" and re.search(r"licen[cs]e", text, re.I):
            lic = LICENSE.search(text)
            licence.append(
                Question(
                    "license",
                    f"Question: Under which license is {d.group(1)} distributed?\nAnswer:",
                    title,
                    lic.group(1) if lic else " ".join(text.split()[:30]),
                )
            )
    seen, faqs = set(), []
    for title, q in faq:
        key = " ".join(q.lower().split())
        if key not in seen:
            seen.add(key)
            faqs.append(Question("doc", f"Question: {' '.join(q.split())}\nAnswer:", title, q))

    def pick(items: list[Question], n: int, salt: str) -> list[Question]:
        unique = list({q.prompt: q for q in sorted(items, key=lambda q: (q.prompt, q.title))}.values())
        random.Random(f"{seed}:{salt}").shuffle(unique)
        return unique[:n]

    faqs = pick(faqs, per_set // 2, "faq")
    sets = {
        "man": pick(man, per_set, "man"),
        "doc": faqs + pick(readme, per_set - len(faqs), "readme"),
        "license": pick(licence, per_set, "license"),
    }
    if not any(sets.values()):  # a KB of other text (the smoke test): ask about its documents
        titles = sorted(first)[:per_set]
        sets = {
            "passages": [
                Question("passages", f"Question: What does {t} say?\nAnswer:", t, first[t][:80]) for t in titles
            ]
        }
    return {k: v for k, v in sets.items() if v}


def interleaved(sets: dict[str, list[Question]]) -> list[Question]:
    """One question of each set in turn, so that any prefix (the ablation subset) spans every set."""
    out, lists = [], list(sets.values())
    for i in range(max((len(v) for v in lists), default=0)):
        out += [v[i] for v in lists if i < len(v)]
    return out

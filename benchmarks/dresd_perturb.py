"""Paraphrase-robustness evaluation set for DReSD (DReSD paper, §2.2.1).

DReSD retrieves drafts by dense similarity of the target's hidden states, REST by exact suffix
matching on tokens. The claim to test is that the dense lookup survives lexical perturbations
of the context that break an exact suffix match: renamed identifiers in code, synonyms and
reordered clauses in prose. This module builds such a set from datastore contexts:

1. each context (token ids whose target continuation is already recorded) is decoded,
   perturbed (``perturb_code`` / ``perturb_prose``, with at least one edit in the last 120
   characters so the context's trailing tokens change) and re-tokenized;
2. the target decodes ``check_tokens`` tokens greedily from the perturbed context, and the
   case is kept only if they equal the recorded continuation of the original context.

The target check matters: a paraphrase that changes the target's continuation would measure
the drafter against a different answer. The original continuation is what the datastore holds
after the original context, so a drafter that finds it for the perturbed context is right only
if the target still says the same thing. Kept cases pair a perturbed context (``prompt_ids``)
with that unchanged continuation; ``tail_overlap`` (the longest common token suffix of the
perturbed and the original context) says how much of an exact suffix match is left.
"""

from __future__ import annotations

import bisect
import builtins
import keyword
import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from benchmarks.harness.greedy import greedy_batches

TAIL_CHARS = 120  # at least one edit must touch this many trailing characters

# ---------------------------------------------------------------- code: consistent renames

_IDENT = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z_][A-Za-z0-9_]*")
_RESERVED = frozenset(keyword.kwlist) | frozenset(keyword.softkwlist) | frozenset(dir(builtins))
_CONVENTIONAL = frozenset({"self", "cls", "args", "kwargs"})
_IMPORT_LINE = re.compile(r"^[ \t]*(?:from|import)\b.*$", re.MULTILINE)
# String literals and comments, roughly (a snippet may start inside a docstring).
_STR_OR_COMMENT = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|#[^\n]*')

# Natural renames for common names; every other name gets a generic variant (``_name_variants``).
_NATURAL = {
    "count": ["total_count", "num_items"],
    "items": ["item_list", "entries"],
    "item": ["entry", "element"],
    "result": ["res", "outcome"],
    "results": ["result_list", "outcomes"],
    "value": ["val", "current_value"],
    "values": ["value_list", "vals"],
    "index": ["idx", "position"],
    "data": ["payload", "raw_data"],
    "name": ["label", "item_name"],
    "names": ["name_list", "labels"],
    "text": ["content", "body"],
    "line": ["row", "current_line"],
    "lines": ["rows", "line_list"],
    "path": ["file_path", "location"],
    "total": ["running_total", "grand_total"],
    "size": ["length", "total_size"],
    "key": ["map_key", "lookup_key"],
    "keys": ["key_list", "map_keys"],
    "word": ["token", "current_word"],
    "words": ["tokens", "word_list"],
    "node": ["vertex", "current_node"],
    "nodes": ["vertices", "node_list"],
    "buf": ["buffer", "chunk"],
    "buffer": ["buf", "chunk"],
    "msg": ["message", "text_msg"],
    "message": ["msg", "note"],
    "num": ["number", "amount"],
    "number": ["num", "amount"],
    "src": ["source", "origin"],
    "source": ["src", "origin"],
    "dst": ["dest", "target_path"],
    "tmp": ["temp", "scratch"],
    "temp": ["tmp", "scratch"],
    "obj": ["instance", "target_obj"],
    "res": ["result", "outcome"],
    "val": ["value", "current_val"],
    "idx": ["index", "position"],
    "err": ["error", "exc_info"],
    "error": ["err", "failure"],
    "func": ["callback", "handler"],
    "callback": ["func", "handler"],
    "config": ["settings", "options"],
    "params": ["options", "settings"],
    "response": ["reply", "resp"],
    "request": ["req", "query"],
    "elem": ["element", "entry"],
    "element": ["elem", "entry"],
    "pos": ["position", "offset"],
    "position": ["pos", "offset"],
    "files": ["file_list", "paths"],
    "filename": ["file_name", "fname"],
    "fname": ["file_name", "filename"],
    "counter": ["tally", "num_seen"],
    "start": ["begin", "first"],
    "end": ["stop", "last"],
}


def _camel_to_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _name_variants(name: str) -> list[str]:
    """Natural-looking new names for ``name`` (same leading underscores, same naming style)."""
    core = name.lstrip("_")
    lead = name[: len(name) - len(core)]
    if not core or core.startswith("__") or not core[0].isalpha():
        return []
    out: list[str] = []
    if core.isupper():  # CONSTANT
        out += [f"{core}_VALUE", f"DEFAULT_{core}"]
    elif core[0].isupper():  # CapWords class
        out += [f"My{core}", f"{core}Impl", f"Base{core}"]
    elif "_" in core:  # snake_case
        parts = [p for p in core.split("_") if p]
        out += [parts[0] + "".join(p.capitalize() for p in parts[1:]), f"my_{core}", f"{core}_val"]
    elif any(c.isupper() for c in core):  # camelCase
        out += [_camel_to_snake(core), f"my{core[0].upper()}{core[1:]}"]
    else:  # plain lowercase
        out += list(_NATURAL.get(core, ()))
        out += [f"{core}_val", f"new_{core}", f"my_{core}"]
        if core.endswith("s") and not core.endswith("ss") and len(core) > 3:
            out.append(f"{core[:-1]}_list")
    return [lead + v for v in out if v != core]


def _unsafe_code_names(text: str) -> set[str]:
    """Names whose rename could break what the text refers to, not just how it spells it:
    imported names, keyword arguments (``f(name=...)``) and names only ever used as
    ``name.attr`` (modules), plus attribute names (``x.attr``), which belong to another
    object's namespace."""
    unsafe: set[str] = set()
    for m in _IMPORT_LINE.finditer(text):
        unsafe.update(_IDENT.findall(m.group(0)))
    for m in re.finditer(r"[(,]\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)", text):
        unsafe.add(m.group(1))
    dotted_before: dict[str, bool] = {}
    for m in _IDENT.finditer(text):
        name = m.group(0)
        if m.start() > 0 and text[m.start() - 1] == ".":
            unsafe.add(name)
        before_dot = m.end() < len(text) and text[m.end()] == "."
        dotted_before[name] = dotted_before.get(name, True) and before_dot
    unsafe.update(n for n, only in dotted_before.items() if only)
    return unsafe


def perturb_code(text: str, rng: random.Random, *, tail_chars: int = TAIL_CHARS) -> tuple[str, list[str]] | None:
    """Rename 1-3 identifiers of ``text`` consistently (every occurrence, string literals and
    comments included), at least one of them occurring in the last 120 characters.

    Only names used at least once outside string literals and comments are renamed.
    Skipped: Python keywords and builtins, names shorter than 3 characters, dunders,
    ``self``/``cls``/``args``/``kwargs``, imported names, keyword arguments, attribute names and
    module-like names (``_unsafe_code_names``), and any name that touches the end of the text
    (it may be cut mid-identifier). New names follow the old one's style and collide with no
    name in the text. Returns ``(new_text, ["old->new", ...])``, or None when no renamable
    name occurs near the end."""
    matches = list(_IDENT.finditer(text))
    if not matches:
        return None
    present = {m.group(0) for m in matches}
    quoted = [(m.start(), m.end()) for m in _STR_OR_COMMENT.finditer(text)]
    starts = [a for a, _ in quoted]

    def in_code(m: re.Match) -> bool:
        j = bisect.bisect_right(starts, m.start()) - 1
        return j < 0 or m.start() >= quoted[j][1]

    used_in_code = {m.group(0) for m in matches if in_code(m)}
    excluded = set(_unsafe_code_names(text)) | _RESERVED | _CONVENTIONAL
    excluded |= {m.group(0) for m in matches if m.end() == len(text)}
    candidates = sorted(
        n for n in used_in_code if len(n) >= 3 and n not in excluded and not (n.startswith("__") and n.endswith("__"))
    )
    taken = set(present) | _RESERVED

    def pick(name: str) -> str | None:
        options = [v for v in _name_variants(name) if v not in taken and v.isidentifier()]
        return rng.choice(options) if options else None

    tail_start = len(text) - tail_chars
    in_tail = {m.group(0) for m in matches if m.end() > tail_start}
    tail_cands = [n for n in candidates if n in in_tail and any(v not in taken for v in _name_variants(n))]
    if not tail_cands:
        return None
    k = rng.randint(1, 3)
    first = rng.choice(tail_cands)
    others = [n for n in candidates if n != first]
    chosen = [first] + rng.sample(others, min(k - 1, len(others)))
    mapping: dict[str, str] = {}
    for name in chosen:
        new = pick(name)
        if new is not None:
            mapping[name] = new
            taken.add(new)
    if first not in mapping:
        return None
    new_text = _IDENT.sub(lambda m: mapping.get(m.group(0), m.group(0)), text)
    return new_text, [f"{old}->{new}" for old, new in mapping.items()]


# ---------------------------------------------------------------- prose: synonyms, clause swaps

_SYNONYM_PAIRS = """
big large; small little; huge enormous; begin start; begins starts; began started;
beginning starting; use utilize; uses utilizes; used utilized; using utilizing; show display;
shows displays; shown displayed; showing displaying; quick fast; quickly rapidly; help assist;
helps assists; helped assisted; need require; needs requires; needed required; end finish;
ended finished; finish complete; finished completed; try attempt; tried attempted;
tries attempts; get obtain; gets obtains; make create; makes creates; made created;
choose select; chooses selects; chosen selected; answer reply; answers replies; hard difficult;
easy simple; often frequently; maybe perhaps; enough sufficient; whole entire; main primary;
mostly largely; usually typically; correct right; wrong incorrect; error mistake;
errors mistakes; fix repair; fixed repaired; stop halt; stops halts; stopped halted;
allow permit; allows permits; allowed permitted; give provide; gives provides;
given provided; keep retain; keeps retains; kept retained; change modify; changes modifies;
changed modified; check verify; checks verifies; checked verified; find locate; finds locates;
remove delete; removes deletes; removed deleted; send transmit; sends transmits;
sent transmitted; say state; says states; said stated; tell inform; near close; far distant;
smart clever; happy glad; sad unhappy; afraid scared; rich wealthy; strong powerful;
weak feeble; important significant; clear obvious; certain sure; exact precise;
exactly precisely; almost nearly; idea notion; ideas notions; problem issue; problems issues;
task job; tasks jobs; goal aim; goals aims; part portion; parts portions; area region;
areas regions; place location; places locations; way method; ways methods; kind type;
kinds types; result outcome; results outcomes; example instance; examples instances;
option choice; options choices; car automobile; house home; street road; child kid;
children kids; friend companion; gift present; buy purchase; bought purchased;
understand comprehend; think believe; thinks believes; want wish; wants wishes; wanted wished;
seem appear; seems appears; seemed appeared; happen occur; happens occurs; happened occurred;
continue proceed; continues proceeds; build construct; builds constructs; built constructed;
save store; saves stores; saved stored; run execute; runs executes; call invoke; calls invokes;
contain include; contains includes; contained included; describe depict; describes depicts;
produce generate; produces generates; produced generated; reduce decrease; reduces decreases;
reduced decreased; improve enhance; improves enhances; improved enhanced; ensure guarantee;
ensures guarantees; handle manage; handles manages; handled managed; prevent stop;
prevents stops; previous prior; current present; currently presently; rare uncommon;
rarely seldom; especially particularly; specific particular; useful helpful;
many numerous; various diverse; appropriate suitable; completely entirely; very extremely;
really truly; therefore thus; thus hence; however nevertheless; quiet silent; loud noisy;
speak talk; speaks talks; beautiful lovely; final last; rule guideline; rules guidelines
"""


def _synonym_table() -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    for pair in _SYNONYM_PAIRS.split(";"):
        a, b = pair.split()
        table.setdefault(a, []).append(b)
        table.setdefault(b, []).append(a)
    return table


SYNONYMS = _synonym_table()
# A word in running text: not part of an identifier, path, #directive, <header> or compound.
_WORD = re.compile(r"(?<![A-Za-z0-9_'#/.<$@-])[A-Za-z]+(?![A-Za-z0-9_'/-]|\.[A-Za-z0-9])")
_SENT_END = re.compile(r"[.!?](?=\s)")
# First words that are lowercased when a clause stops starting its sentence (proper nouns and
# "I" are left alone by never swapping sentences that start with anything else).
_STARTERS = frozenset(
    "the a an this that these those it its they their there we our you your he his she her "
    "some many most all each every one in on at for when if as most such".split()
)


def _match_case(word: str, template: str) -> str:
    if len(template) > 1 and template.isupper():
        return word.upper()
    if template[0].isupper():
        return word[0].upper() + word[1:]
    return word


def _clause_swap(text: str, rng: random.Random) -> tuple[str, str] | None:
    """Swap the two clauses of one sentence split by ", and " or "; " (never the last
    sentence): ``"The file is read, and the output is printed."`` becomes ``"The output is
    printed, and the file is read."``. Returns the new text and the edit, or None."""
    bounds = [m.end() for m in _SENT_END.finditer(text)]
    eligible = []
    start = 0
    for end in bounds:
        s = start + (len(text[start:end]) - len(text[start:end].lstrip()))
        sentence = text[s:end]
        start = end
        if not text[end:].strip():  # the last sentence: the text's end stays as it is
            continue
        seps = [sep for sep in (", and ", "; ") if sentence.count(sep) == 1]
        if len(seps) != 1 or (", and " in sentence and "; " in sentence):
            continue
        first = sentence.split(None, 1)[0] if sentence.split() else ""
        if first.lower() not in _STARTERS or not first[:1].isupper():
            continue
        a, b = sentence[:-1].split(seps[0])
        if len(a.split()) < 3 or len(b.split()) < 3 or not b[:1].isalpha():
            continue
        eligible.append((s, end, a, b, seps[0], sentence[-1]))
    if not eligible:
        return None
    s, end, a, b, sep, punct = rng.choice(eligible)
    swapped = b[0].upper() + b[1:] + sep + a[0].lower() + a[1:] + punct
    edit = f"swap{sep.strip() or ','}: {a[:30]!r} <-> {b[:30]!r}"
    return text[:s] + swapped + text[end:], edit


def perturb_prose(text: str, rng: random.Random, *, tail_chars: int = TAIL_CHARS) -> tuple[str, list[str]] | None:
    """Replace 1-4 words of ``text`` with synonyms from ``SYNONYMS`` (keeping each word's
    capitalisation), at least one in the last 120 characters, and with probability 1/2 swap
    the clauses of one sentence (``_clause_swap``). A word touching the end of the text is
    never replaced (it may be cut). Returns ``(new_text, edits)`` or None when no listed word
    occurs near the end."""
    words = []
    for m in _WORD.finditer(text):
        w = m.group(0)
        low = w.lower()
        if m.end() == len(text) or low not in SYNONYMS or w not in (low, low.capitalize(), low.upper()):
            continue
        words.append(m)
    tail_start = len(text) - tail_chars
    tail = [m for m in words if m.end() > tail_start]
    if not tail:
        return None
    first = rng.choice(tail)
    rest = [m for m in words if m is not first]
    chosen = [first] + rng.sample(rest, min(rng.randint(1, 4) - 1, len(rest)))
    edits, out = [], text
    for m in sorted(chosen, key=lambda m: m.start(), reverse=True):  # right to left: offsets hold
        w = m.group(0)
        new = _match_case(rng.choice(SYNONYMS[w.lower()]), w)
        out = out[: m.start()] + new + out[m.end() :]
        edits.append(f"{w}->{new}")
    edits.reverse()
    if rng.random() < 0.5 and (swap := _clause_swap(out, rng)) is not None:
        out, edit = swap
        edits.append(edit)
    return out, edits


# ---------------------------------------------------------------- the set


@dataclass
class PerturbedCase:
    """One evaluation case: a perturbed context whose target continuation is unchanged."""

    domain: str
    prompt_ids: list[int]  # the perturbed context
    original_ids: list[int]  # the datastore context it was made from
    continuation: list[int]  # the target's recorded greedy continuation of ``original_ids``
    edits: list[str] = field(default_factory=list)
    tail_overlap: int = 0  # longest common token suffix of prompt_ids and original_ids


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common suffix of two token sequences."""
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def _expected(continuation: Sequence[int], check_tokens: int, eos: int | None) -> list[int]:
    want = list(continuation[:check_tokens])
    if eos is not None and eos in want:
        return want[: want.index(eos) + 1]
    if len(want) < check_tokens:
        raise ValueError(
            f"a recorded continuation has {len(want)} tokens and no EOS; need at least check_tokens={check_tokens}"
        )
    return want


def build_perturbed_set(
    target,
    tokenizer,
    cases: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    domain: str,
    check_tokens: int = 16,
    seed: int = 0,
    batch: int = 16,
    max_cases: int | None = None,
    progress: bool = True,
    tail_chars: int = TAIL_CHARS,
) -> tuple[list[PerturbedCase], dict]:
    """Perturb each ``(context_ids, continuation_ids)`` case and keep those whose target
    continuation is unchanged over ``check_tokens`` greedy tokens.

    ``continuation_ids`` must be the target's greedy continuation of ``context_ids`` (at least
    ``check_tokens`` long, or ending in EOS). Each case's perturbation is seeded by ``seed`` and
    its index, so a set is reproducible. Cases whose text has nothing to perturb near the end,
    or whose perturbed text tokenizes to the original ids, count as unperturbable. Stops once
    ``max_cases`` cases are kept (``candidates`` counts the cases examined). Stats:
    ``candidates``, ``perturbed``, ``kept``, ``dropped_changed_continuation``,
    ``dropped_unperturbable``, ``mean_tail_overlap`` (over kept cases; None if none) and
    ``check_tokens``. ``tail_chars`` is how near the end the first edit must be: smaller
    breaks more of an exact suffix match (see ``tail_overlap``)."""
    if domain not in ("code", "prose"):
        raise ValueError(f"domain must be 'code' or 'prose', not {domain!r}")
    if check_tokens < 1:
        raise ValueError(f"check_tokens must be >= 1, not {check_tokens}")
    perturb = perturb_code if domain == "code" else perturb_prose
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    eos = tokenizer.eos_token_id
    kept: list[PerturbedCase] = []
    stats = {"candidates": 0, "perturbed": 0, "dropped_changed_continuation": 0, "dropped_unperturbable": 0}
    pending: list[PerturbedCase] = []

    def check(pending: list[PerturbedCase]) -> None:
        # one left-padded batch in the given order, no EOS cut (``_expected`` cuts the recorded side)
        gens = greedy_batches(target, [c.prompt_ids for c in pending], check_tokens, pad, batch=None, by_length=False)
        for case, gen in zip(pending, gens, strict=True):
            want = _expected(case.continuation, check_tokens, eos)
            if gen[: len(want)] == want:
                kept.append(case)
            else:
                stats["dropped_changed_continuation"] += 1

    bar = tqdm(total=len(cases), desc=f"perturbed set ({domain}): target checks", unit="case", disable=not progress)
    for i, (context, continuation) in enumerate(cases):
        if max_cases is not None and len(kept) >= max_cases:
            break
        stats["candidates"] += 1
        bar.update(1)
        original = [int(t) for t in context]
        _expected(continuation, check_tokens, eos)  # fail early on a too-short recording
        text = tokenizer.decode(original, skip_special_tokens=False)
        result = perturb(text, random.Random(f"{seed}:{i}"), tail_chars=tail_chars)
        if result is None:
            stats["dropped_unperturbable"] += 1
            continue
        new_text, edits = result
        prompt = tokenizer(new_text, add_special_tokens=False)["input_ids"]
        if prompt == original or not prompt:
            stats["dropped_unperturbable"] += 1
            continue
        stats["perturbed"] += 1
        pending.append(
            PerturbedCase(
                domain=domain,
                prompt_ids=prompt,
                original_ids=original,
                continuation=[int(t) for t in continuation],
                edits=edits,
                tail_overlap=common_suffix(prompt, original),
            )
        )
        if len(pending) >= batch:
            check(pending)
            pending = []
    if pending and (max_cases is None or len(kept) < max_cases):
        check(pending)
    bar.close()
    if max_cases is not None:
        kept = kept[:max_cases]
    stats["kept"] = len(kept)
    stats["mean_tail_overlap"] = statistics.fmean(c.tail_overlap for c in kept) if kept else None
    stats["check_tokens"] = check_tokens
    return kept, stats

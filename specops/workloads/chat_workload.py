"""Production-shaped traffic for an Instruct target: chat requests in narrow domains.

The default target is SmolLM2-135M-*Instruct*: what it serves in production is
``/v1/chat/completions`` — a system message, a user message, the chat template, and an
answer in assistant style. This module builds such requests in three narrow domains that
the bootstrap corpus (the standard library's sources and English text under
``/usr/share``, ``specops.trainer.bootstrap.corpus``) does not contain, as the OSD paper's gains
come from traffic the draft has not seen (Spider, GSM8K, Python code search):

- ``sql``: text-to-SQL questions over one of 14 table schemas (the Spider shape): a
  ``CREATE TABLE`` statement and a question; the assistant answers with a query.
- ``math``: grade-school word problems (the GSM8K shape), solved step by step.
- ``api``: questions about a public function of a pinned scientific-Python package in the
  venv (numpy, scipy, pandas, scikit-learn, networkx, SQLAlchemy), given its signature and
  the first line of its docstring, read with ``ast`` from the installed sources (nothing
  is imported). These files live in ``site-packages``, which the bootstrap corpus never
  lists (``specops.trainer.bootstrap.corpus.EXCLUDED_DIRS``; ``tests/specops/workloads/test_chat_workload.py``
  checks it).

A fourth domain, ``docs`` (:data:`REAL_TEXT`; not in :data:`DOMAINS`, so a run asks for it),
is real text rather than templates: a documentation paragraph of a pinned package (transformers,
torch, sympy, mlflow, matplotlib, ...; :data:`DOCS_PACKAGES`, none of ``api``'s), read with
``ast`` from the docstrings in ``site-packages`` as installed, kept when it reads as prose, and
asked to be rewritten in plain words (:func:`doc_paragraphs`). The bootstrap corpus never lists
``site-packages`` either; its template-disjoint families are packages.

``sql`` and ``math`` come from templates and word lists (:mod:`specops.workloads.chat_templates`), with many slots
each. Prompts are **distinct**: no two have the same token ids, and no two are the same
up to their numbers (numbers masked) — a request that differs from another only by a
figure is not counted as new. Everything is seeded and deterministic for a given venv.

:func:`chat_workload` returns each domain's prompts as ``specops.workloads.prompts.Prompt`` (the
rendered chat's token ids, as the server tokenizes it) with the messages kept, split into
named disjoint parts (``router`` texts, ``served`` traffic, a held-out ``probe``, ...).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

from specops.paths import cache_dir
from specops.streams.local.files import write_json_atomic
from specops.workloads.chat_templates import SYSTEM, ChatPrompt, math_prompts, sql_prompts
from specops.workloads.prompts import Prompt

log = logging.getLogger(__name__)

DOMAINS = ("sql", "math", "api")
"""The default domains: two from templates, one from templated questions about real functions."""
REAL_TEXT = ("docs",)
"""Domains whose prompts are real text, not templates: ``docs`` (documentation paragraphs of
pinned packages to rewrite in plain words). Not in :data:`DOMAINS`: a run asks for them
(``benchmarks/osd.py --domains``)."""
ALL_DOMAINS = DOMAINS + REAL_TEXT

API_PACKAGES = ("numpy", "scipy", "pandas", "sklearn", "networkx", "sqlalchemy")
"""Pinned packages (``constraints.txt``) whose public functions the ``api`` domain asks about."""


# ------------------------------------------------------------------------------------- api
_QUESTIONS = (
    "What does `{qual}{sig}` do? {doc}",
    'Explain `{qual}{sig}` to me. Its docstring begins: "{first}"',
    "How do I use `{qual}`? The signature is `{name}{sig}`. {doc}",
    "When would I call `{qual}{sig}`, and what does it return? {doc}",
)


def api_functions(packages: tuple[str, ...] = API_PACKAGES) -> list[tuple[str, str, str, str]]:
    """(qualified name, signature, first docstring line, source file) of every public, documented,
    module-level function of ``packages`` as installed, read with ``ast`` (sorted; parsed once, then read from
    the disk cache while the sources are unchanged: :func:`_disk_cached`)."""
    return list(_api_functions(tuple(packages)))


@functools.lru_cache(maxsize=4)
def _api_functions(packages: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return _disk_cached("api", packages, _parse_api_functions)


def _parse_api_functions(packages: tuple[str, ...]) -> tuple[tuple[str, str, str, str], ...]:
    out = []
    for module, tree, file in parsed_modules(packages):
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node) or ""
            first = next((ln.strip() for ln in doc.splitlines() if ln.strip()), "")
            if len(first) < 12 or len(first) > 200:
                continue
            try:
                sig = "(" + ast.unparse(node.args) + ")"
            except Exception:  # noqa: BLE001 - an odd default value: skip the function
                continue
            if len(sig) > 160:
                continue
            out.append((f"{module}.{node.name}", sig, first, str(file)))
    return tuple(sorted(set(out)))


_CACHE_FORMAT = 1
"""Bumped when what :func:`_disk_cached` stores changes shape (this module's own source is in the key too)."""


def _disk_cached(
    kind: str, packages: tuple[str, ...], parse: Callable[[tuple[str, ...]], tuple[tuple[str, ...], ...]]
) -> tuple[tuple[str, ...], ...]:
    """``parse(packages)``, kept on disk under :func:`specops.paths.cache_dir` and keyed by what it
    reads: every source file's path, size and modification time, and this module's own source (a
    changed filter is a new key). Reading the ``docs`` packages' 100 MB of sources with ``ast``
    takes half a minute on one core; every later process (a test worker, a benchmark, the demo)
    reads the result in milliseconds. Processes that start together parse once: the others wait
    on a lock. A cache that cannot be written, or a file that is not a valid result, only costs
    the parse again; nothing in it is trusted beyond strings in rows of the expected width."""
    h = hashlib.sha256(f"{kind}\0{_CACHE_FORMAT}\0{','.join(packages)}\0".encode())
    h.update(Path(__file__).read_bytes())
    for f in source_files(packages):
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    path = cache_dir() / "chat_workload" / f"{kind}-{h.hexdigest()[:32]}.json"
    width = {"api": 4, "docs": 3}[kind]
    if (rows := _read_rows(path, width)) is not None:
        return rows
    with _locked(path.with_suffix(".lock")):
        if (rows := _read_rows(path, width)) is not None:  # another process parsed while this one waited
            return rows
        t0 = time.perf_counter()
        rows = parse(packages)
        log.info(
            "%s workload: read %d rows from %s in %.1fs", kind, len(rows), ", ".join(packages), time.perf_counter() - t0
        )
        try:
            write_json_atomic(path, {"kind": kind, "packages": list(packages), "rows": rows}, fsync=False)
        except OSError as exc:
            log.warning("%s workload not cached at %s (%s): the next process parses again", kind, path, exc)
        _prune(path.parent, kind, keep=path)
    return rows


_CACHE_KEEP = 4
"""Cache files kept per kind (the newest): one per venv and package set in use, not one per install ever made."""


def _prune(folder: Path, kind: str, keep: Path) -> None:
    """Delete all but the :data:`_CACHE_KEEP` newest cache files of ``kind`` (``keep`` always stays)."""
    try:
        files = sorted(folder.glob(f"{kind}-*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
        for f in [f for f in files if f != keep][_CACHE_KEEP - 1 :]:
            f.unlink(missing_ok=True)
            f.with_suffix(".lock").unlink(missing_ok=True)
    except OSError as exc:  # another process pruned first, or the folder is read-only: only disk space
        log.debug("workload cache not pruned: %s", exc)


def _read_rows(path: Path, width: int) -> tuple[tuple[str, ...], ...] | None:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(rows, list) or not all(
        isinstance(r, list) and len(r) == width and all(isinstance(x, str) for x in r) for r in rows
    ):
        log.warning("ignoring a malformed workload cache file %s", path)
        return None
    return tuple(tuple(r) for r in rows)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive ``flock`` on ``path`` while the block runs (none where the directory cannot be
    made or ``fcntl`` is missing: then two processes may both parse, which is only slower)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def parsed_modules(packages: tuple[str, ...]):
    """(module name, ``ast`` tree, file) of each of :func:`source_files`, read as installed
    (nothing is imported); a file that does not parse is left out."""
    for file in source_files(packages):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield _module_name(file), tree, file


def source_files(packages: tuple[str, ...] = API_PACKAGES) -> list[Path]:
    """The ``.py`` files the ``api`` domain reads: the installed packages' public modules
    (tests, private and vendored modules left out)."""
    files: list[Path] = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            for f in sorted(Path(root).rglob("*.py")):
                rel = f.relative_to(Path(root).parent).parts
                if any(p.startswith("_") or p in ("tests", "testing", "externals", "vendored") for p in rel[:-1]):
                    continue
                if f.name.startswith("_") or f.name.startswith("test"):
                    continue
                files.append(f)
    return files


def _module_name(file: Path) -> str:
    parts = list(file.with_suffix("").parts)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            parts = parts[i + 1 :]
            break
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _api_prompts(rng: random.Random, n: int) -> list[ChatPrompt]:
    funcs = api_functions()
    rng.shuffle(funcs)
    out = []
    for qual, sig, first, _file in funcs[:n]:
        t = rng.choice(_QUESTIONS)
        user = t.format(
            qual=qual, sig=sig, name=qual.rsplit(".", 1)[-1], first=first, doc=f"Its docstring says: {first}"
        )
        out.append(ChatPrompt("api", f"api:{qual}", (("system", SYSTEM["api"]), ("user", user))))
    return out


# ------------------------------------------------------------------------------------ docs
DOCS_PACKAGES = (
    "transformers",
    "torch",
    "matplotlib",
    "pydantic",
    "mlflow",
    "click",
    "jinja2",
    "rich",
    "requests",
    "flask",
    "werkzeug",
    "alembic",
    "sympy",
    "aiohttp",
)
"""Pinned packages (``constraints.txt``) whose documentation paragraphs the ``docs`` domain asks
to rewrite: none of :data:`API_PACKAGES`, so ``docs`` and ``api`` share no source."""

_DOCS_ASKS = (
    "Rewrite this paragraph from the {pkg} documentation in plain words:",
    "Explain this passage of the {pkg} docs in simple terms:",
    "I am new to {pkg}. What does this part of its documentation mean?",
    "Say this more simply, for someone who has never used {pkg}:",
)
_MARKUP = re.compile(r">>>|::|^\s*\.\.|\|\s|={3,}|-{3,}|:math:|\$\$|\\\\|\{\{|%\(|https?://", re.M)


def doc_paragraphs(packages: tuple[str, ...] = DOCS_PACKAGES) -> list[tuple[str, str, str]]:
    """(package, module, paragraph) of every prose paragraph in the docstrings (module, class and
    function, at any depth) of ``packages`` as installed, read with ``ast`` (nothing is imported).

    A paragraph is a block of a docstring between blank lines, whitespace collapsed, kept when it
    reads as prose: 200-700 characters, at least 30 words, ending a sentence, mostly letters, and
    free of doctest, reST directives, tables, formulas and links. Sorted; parsed once, then read
    from the disk cache while the sources are unchanged (:func:`_disk_cached`)."""
    return list(_doc_paragraphs(tuple(packages)))


@functools.lru_cache(maxsize=4)
def _doc_paragraphs(packages: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return _disk_cached("docs", packages, _parse_doc_paragraphs)


def _parse_doc_paragraphs(packages: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    out, keys = [], set()
    for module, tree, _file in parsed_modules(packages):
        pkg = module.split(".")[0]
        for node in _definitions(tree):
            doc = ast.get_docstring(node) or ""
            for block in re.split(r"\n\s*\n", doc):
                if _MARKUP.search(block):
                    continue
                para = " ".join(block.split())
                key = _near(para)
                if _is_prose(para) and key not in keys:  # once: the first file wins (sorted, deterministic)
                    keys.add(key)
                    out.append((pkg, module, para))
    return tuple(sorted(out))


_DEFINITIONS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_HOLDS_STATEMENTS = (ast.stmt, ast.excepthandler, ast.match_case)


def _definitions(tree: ast.AST):
    """The module, class and function nodes of ``tree`` in exactly ``ast.walk``'s order, visiting
    statements only: a definition is a statement, and a statement's parent is a statement, an
    ``except`` handler, a ``match`` case or the module, never an expression. Filtering the
    breadth-first queue keeps the kept nodes' order (and so which of two near-identical paragraphs
    :func:`_parse_doc_paragraphs` keeps), while skipping the expression nodes that are most of a
    tree (a third of the cold ``docs`` parse)."""
    todo = collections.deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, _HOLDS_STATEMENTS))
        if isinstance(node, _DEFINITIONS):
            yield node


def _near(para: str) -> tuple[str, str]:
    """Two paragraphs with this key are one copied with a few names changed (``transformers``
    repeats a docstring across dozens of models): their first and last 60 letters."""
    letters = re.sub(r"[^a-z]", "", para.lower())
    return letters[:60], letters[-60:]


_SECTIONS = ("Args", "Arguments", "Parameters", "Returns", "Raises", "Yields", "Example", "Attributes", "Note:")
_FIELD = re.compile(r"\b[a-z_][a-z0-9_]*: ")


def _is_prose(para: str) -> bool:
    if not 200 <= len(para) <= 700 or len(para.split()) < 30 or not para.endswith((".", ")")):
        return False
    if para.count("`") > 10 or para.count("_") > 8 or para.count("*") > 4 or para.startswith(_SECTIONS):
        return False
    if any(f" {s}:" in para for s in ("Args", "Returns", "Raises", "Parameters", "Example", "Examples")):
        return False
    if len(_FIELD.findall(para)) >= 2:  # a parameter list ("name: what it is. other: ..."), not prose
        return False
    letters = sum(c.isalpha() or c == " " for c in para)
    return letters / len(para) >= 0.85 and para[0].isupper()


def _docs_prompts(rng: random.Random, n: int) -> list[ChatPrompt]:
    paras = doc_paragraphs()
    rng.shuffle(paras)
    out = []
    for pkg, module, para in paras[:n]:
        user = rng.choice(_DOCS_ASKS).format(pkg=pkg) + "\n\n" + para
        out.append(ChatPrompt("docs", f"docs:{module}", (("system", SYSTEM["docs"]), ("user", user))))
    return out


_GENERATORS = {"sql": sql_prompts, "math": math_prompts, "api": _api_prompts, "docs": _docs_prompts}
_FINITE = {"api": api_functions, "docs": doc_paragraphs}
"""Domains drawn from a finite list of real items (every item in one draw, not sampled again)."""

FAMILIES = ("all", "seen", "held_out")
HELD_OUT = {
    "sql": frozenset({"flights", "patients", "songs"}),
    "math": frozenset({"t02", "t05", "t11", "t16"}),
    "api": frozenset({"sqlalchemy", "sklearn"}),
    "docs": frozenset({"flask", "jinja2", "rich", "click"}),
}
"""Per domain, the families (``sql``: table schemas, 3 of 14; ``math``: problem templates, 4 of
20; ``api``: packages, 2 of 6; ``docs``: packages, 4 of 14) that a template-disjoint probe draws from and served traffic
(``families="seen"``) never does: what a draft gains there it did not get by memorising a
template's phrasing, a schema or a package's names."""


def family(source: str) -> str:
    """A prompt's family from its ``source``: ``sql:flights`` -> ``flights``, ``math:t02`` ->
    ``t02``, ``api:numpy.linalg.norm`` -> ``numpy``, ``docs:flask.app`` -> ``flask``."""
    return source.split(":", 1)[1].split(".")[0]


# ------------------------------------------------------------------------------- workload
def chat_prompts(domain: str, n: int, *, seed: int = 0, families: str = "all") -> list[ChatPrompt]:
    """Up to ``n`` distinct chat prompts of ``domain`` (no two equal once their numbers are
    masked), in a seeded order. Fewer come back only when the domain has no more (``api``
    has as many as the pinned packages have documented functions). ``families``: ``all``,
    ``seen`` (none of :data:`HELD_OUT`'s) or ``held_out`` (only those); the prompts kept are
    those ``all`` gives, in the same order, less the others."""
    if domain not in _GENERATORS:
        raise ValueError(f"unknown chat domain {domain!r}; one of {ALL_DOMAINS}")
    if families not in FAMILIES:
        raise ValueError(f"families must be one of {FAMILIES}, got {families!r}")
    rng = random.Random(f"chat:{domain}:{seed}")
    seen: set[str] = set()
    out: list[ChatPrompt] = []
    for attempt in range(32):  # templates collide: draw more until n distinct ones (or the domain is exhausted)
        ask = max(n - len(out), 1) * (2 if attempt else 1) + 16
        if families != "all":  # a share of the draws is left out: draw more (api: every function, in one go)
            ask = len(_FINITE[domain]()) if domain in _FINITE else ask * 3
        for p in _GENERATORS[domain](rng, ask):
            if families != "all" and (family(p.source) in HELD_OUT[domain]) != (families == "held_out"):
                continue
            key = _shape(p.user)
            if key not in seen:
                seen.add(key)
                out.append(p)
                if len(out) == n:
                    return out
        if domain in _FINITE:  # every item was in the one draw
            break
    return out


def _shape(text: str) -> str:
    """The text with every number masked and spaces collapsed: two prompts of one shape differ by figures only."""
    return re.sub(r"\s+", " ", re.sub(r"\d+(\.\d+)?", "#", text)).strip().lower()


def chat_workload(
    tokenizer,
    sizes: dict[str, int],
    *,
    domains: tuple[str, ...] = DOMAINS,
    seed: int = 0,
    max_prompt_tokens: int = 384,
    families: str = "all",
) -> dict[str, dict[str, list[Prompt]]]:
    """Per domain, disjoint named parts of distinct chat prompts, rendered with the chat template
    as ``/v1/chat/completions`` renders them and tokenized without special tokens added.

    ``sizes`` maps a part name to its count per domain, in order (e.g. ``{"router": 100,
    "served": 1000, "probe": 100}``): the first part takes the first prompts of the seeded
    order, and so on, so a part keeps its prompts when a later part grows. Prompts longer
    than ``max_prompt_tokens`` are left out. Each ``Prompt`` keeps the user message as
    ``text`` and ``source`` names its origin; :func:`messages_of` gives its messages back.
    Raises ``ValueError`` when a domain has fewer distinct prompts than asked for.
    ``families``: as :func:`chat_prompts` (``seen`` for traffic, ``held_out`` for a template-disjoint probe)."""
    from specops.core.models import render_chat

    want = sum(sizes.values())
    out: dict[str, dict[str, list[Prompt]]] = {}
    for d in domains:
        kept: list[Prompt] = []
        seen_ids: set[tuple[int, ...]] = set()
        for cp in chat_prompts(d, int(want * 1.1) + 8, seed=seed, families=families):
            ids = tokenizer(render_chat(tokenizer, cp.as_messages()), add_special_tokens=False, verbose=False)[
                "input_ids"
            ]
            if len(ids) > max_prompt_tokens or tuple(ids) in seen_ids:
                continue
            seen_ids.add(tuple(ids))
            kept.append(Prompt(domain=d, source=cp.source, text=cp.user, token_ids=list(ids)))
            if len(kept) == want:
                break
        if len(kept) < want:
            raise ValueError(f"chat domain {d!r} has {len(kept)} distinct prompts here, {want} asked for")
        parts, start = {}, 0
        for name, count in sizes.items():
            parts[name], start = kept[start : start + count], start + count
        out[d] = parts
    return out


def messages_of(prompt: Prompt) -> list[dict[str, str]]:
    """The chat messages of a prompt :func:`chat_workload` made: the domain's system message and the user's."""
    return [{"role": "system", "content": SYSTEM[prompt.domain]}, {"role": "user", "content": prompt.text}]

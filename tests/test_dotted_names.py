"""Dotted names in prose are the importable ones (issue 59).

The top-level folders ``serving/``, ``trainer/``, ``registry/``, ``streams/`` and ``core/`` install
as ``specops.<folder>`` (pyproject.toml's package-dir), so a docstring that says ``serving.x``
names something no one can import. Two checks, over docstrings and comments of every Python file
and over code spans (between backticks) of every Markdown file:

- a dotted name that starts with one of those folders and, prefixed, names a real module or
  member is written with its ``specops.`` prefix;
- a ``specops.`` name resolves: each part is a module or package, then names a ``class``, ``def``
  or assignment in the module it reaches (a moved or renamed module shows up here).

Helm values and config keys such as ``serving.vllm.maxModelLen`` do not resolve to a module
member, so they are left alone; so are names in code (``trainer.clusters.get(...)`` is a
variable) and in strings that are not docstrings.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("serving", "trainer", "registry", "streams", "core")
# an unprefixed name starts a token (not after '.', '/', a word character or a template's '{')
BARE = re.compile(r"(?<![\w./\-:$@{\[])(?:" + "|".join(FOLDERS) + r")\.[a-z_]\w*(?:\.[A-Za-z_]\w*)*")
PREFIXED = re.compile(r"(?<![\w./\-])specops\.(?:" + "|".join(FOLDERS) + r")(?:\.[A-Za-z_]\w*)+")
CODE_SPAN = re.compile(r"`+([^`\n]+)`+")
SKIP = ("benchmarks/out/", "tests/test_dotted_names.py")
HELM_DOCS = ("deploy/helm/",)


@cache
def _source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _module_path(parts: list[str]) -> Path | None:
    p = ROOT.joinpath(*parts)
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return None


def _defines(path: Path, name: str, top: bool) -> bool:
    indent = "" if top else r"[ \t]*"
    pat = rf"^{indent}(?:(?:async\s+)?def|class)\s+{name}\b|^{indent}{name}\s*(?::[^=\n]*)?=|^{indent}{name}\s*:"
    if re.search(pat, _source(path), re.M):
        return True
    # re-exported or imported names count as defined at the top of a module
    return top and re.search(rf"^(?:from\s+\S+\s+)?import\s+[^\n]*\b{name}\b", _source(path), re.M) is not None


def resolves(dotted: str) -> bool:
    """Whether ``specops.a.b...`` (top folders mapped) is a module, or a module and its members."""
    parts = dotted.split(".")[1:]  # drop "specops"
    mod: Path | None = None
    i = 0
    while i < len(parts) and (found := _module_path(parts[: i + 1])) is not None:
        mod, i = found, i + 1
    if mod is None:
        return False
    for j, name in enumerate(parts[i:]):
        if not _defines(mod, name, top=j == 0):
            return False
    return True


def _docstring_and_comment_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of comments and docstrings (string statements) of Python source."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    spans, prev = [], tokenize.NEWLINE
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            a = starts[tok.start[0] - 1] + tok.start[1]
            b = starts[tok.end[0] - 1] + tok.end[1]
            if tok.type == tokenize.COMMENT or (
                tok.type == tokenize.STRING
                and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL)
            ):
                spans.append((a, b))
            if tok.type not in (tokenize.COMMENT, tokenize.NL):
                prev = tok.type
    except tokenize.TokenError:
        pass
    return spans


def _markdown_spans(text: str) -> list[tuple[int, int]]:
    # `serving.engine: vllm` and `serving.vllm.*` are Helm values, not modules
    return [m.span(1) for m in CODE_SPAN.finditer(text) if ":" not in m.group(1) and not m.group(1).endswith("*")]


def prose_spans(rel: str, text: str) -> list[tuple[int, int]]:
    if rel.startswith(HELM_DOCS):
        return []  # the chart's README documents values (`serving.engine`), which share module names
    return _docstring_and_comment_spans(text) if rel.endswith(".py") else _markdown_spans(text)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if f.endswith((".py", ".md")) and not f.startswith(SKIP) and (ROOT / f).is_file()]


@cache
def chart_values() -> frozenset[str]:
    """Every dotted key path of the Helm chart's values (``serving.config``, ``serving.vllm.k``)."""
    import yaml

    paths: set[str] = set()

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{prefix}.{key}" if prefix else str(key)
                paths.add(path)
                walk(value, path)

    walk(yaml.safe_load((ROOT / "deploy/helm/specops/values.yaml").read_text()), "")
    return frozenset(paths)


def bare_names(rel: str, text: str) -> list[tuple[int, int]]:
    """Spans of unprefixed names that, prefixed, would resolve: inside prose only. A name that is
    also a chart value (``serving.config``, ``serving.engine``) is ambiguous and left alone."""
    found = []
    for a, b in prose_spans(rel, text):
        for m in BARE.finditer(text, a, b):
            if m.group(0) not in chart_values() and resolves("specops." + m.group(0)):
                found.append(m.span())
    return found


def test_dotted_names_in_prose_carry_the_specops_prefix() -> None:
    bad = []
    for rel in tracked_files():
        text = _source(ROOT / rel)
        for a, b in bare_names(rel, text):
            line = text.count("\n", 0, a) + 1
            bad.append(f"{rel}:{line}: {text[a:b]} (write specops.{text[a:b]})")
    assert not bad, f"{len(bad)} dotted name(s) without the specops prefix:\n" + "\n".join(bad[:60])


def test_specops_names_in_prose_resolve() -> None:
    bad = []
    for rel in tracked_files():
        text = _source(ROOT / rel)
        for a, b in prose_spans(rel, text):
            for m in PREFIXED.finditer(text, a, b):
                name = m.group(0).rstrip(".")
                if not resolves(name):
                    bad.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not bad, f"{len(bad)} specops name(s) in prose that do not resolve:\n" + "\n".join(bad[:80])


def test_the_checks_catch_what_they_claim() -> None:
    assert resolves("specops.serving.engine.spec.SpecEngine")
    assert resolves("specops.streams.local.stream.LocalStream")
    assert not resolves("specops.streams.local_append")  # a module that moved
    assert not resolves("specops.serving.vllm.maxModelLen")  # a Helm value, not a member
    doc = '"""See ``serving.engine.spec`` and ``serving.vllm.maxModelLen``."""\nx = trainer.clusters.get(1)\n'
    assert [doc[a:b] for a, b in bare_names("m.py", doc)] == ["serving.engine.spec"]
    assert bare_names("m.md", "`serving.replicas` and `serving.http`") == [(24, 36)]

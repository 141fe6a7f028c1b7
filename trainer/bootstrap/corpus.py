"""Bootstrap corpus: text that exists on every machine, split at file level.

Two domains:

- ``code``: the Python standard library sources (``*.py`` under
  ``sysconfig.get_paths()["stdlib"]``, test suites and site-packages excluded).
- ``prose``: English text under ``/usr/share``: licenses, package copyright
  files, README-like files (plain or gzip) and man pages rendered to plain
  text by :func:`strip_roff` (no groff needed).

Everything is deterministic: listings are sorted, identical documents are kept
once (first path wins) so a held-out file never has a twin in train, and the
train/held-out split is a seeded shuffle of the files.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import random
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

DOMAINS = ("code", "prose")
MIN_CHARS = 200
"""Documents shorter than this (after rendering) are skipped."""
MAX_BYTES = 2_000_000
"""Files larger than this (raw bytes) are skipped: generated tables, not language."""

MAX_PAGES_PER_FAMILY = 30
"""At most this many man pages per name family (evenly spaced in sorted order)."""
_FAMILY_RE = re.compile(r"[_.-]")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
"""No file under a directory of these names is ever in the corpus, in either domain: installed
packages are where the chat workload's ``api`` domain reads its functions
(``specops.chat_workload``), traffic the bootstrap draft must not have seen."""
_SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", *EXCLUDED_DIRS}


def excluded(path: Path | str) -> bool:
    """``path`` lies under an :data:`EXCLUDED_DIRS` directory."""
    return any(part in EXCLUDED_DIRS for part in Path(path).parts)
_README_RE = re.compile(r"^README([._-][A-Za-z0-9_.-]*)?$")
_README_TEXT_EXT = {"", ".md", ".txt", ".rst", ".debian", ".source", ".markdown"}


class CorpusError(RuntimeError):
    """The machine does not have enough text for a domain."""


@dataclass
class Split:
    """Train / held-out file lists of one domain (absolute paths, sorted)."""

    train: list[str] = field(default_factory=list)
    heldout: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- listing


def _files(directory: Path) -> list[Path]:
    """Regular files directly in ``directory``, sorted by name (fast: no per-file stat)."""
    try:
        with os.scandir(directory) as it:
            names = sorted(e.name for e in it if e.is_file())
    except OSError:
        return []
    return [directory / n for n in names]


def list_code_files(stdlib: Path | None = None) -> list[Path]:
    """Standard library ``*.py`` files, test suites and third-party dirs excluded."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out += [Path(dirpath) / f for f in filenames
                if f.endswith(".py") and not f.startswith("test_")]
    return sorted(p for p in out if not excluded(p))


def _is_readme(name: str) -> bool:
    base = name[:-3] if name.endswith(".gz") else name
    if not _README_RE.match(base):
        return False
    ext = base[len("README"):].lower()
    ext = ext[ext.rfind("."):] if "." in ext else ""
    return ext in _README_TEXT_EXT


def list_prose_files(share: Path = Path("/usr/share"), max_pages_per_family: int = MAX_PAGES_PER_FAMILY,
                     ) -> list[Path]:
    """Licenses, copyright files, READMEs and man pages under ``share``.

    Man pages are capped per family (name up to the first ``_ . -``): one SDK can
    ship 16k near-identical pages (``gcloud_*``) that would otherwise be the corpus.
    """
    out: list[Path] = _files(share / "common-licenses")
    doc = share / "doc"
    if doc.is_dir():
        for pkg in sorted(os.listdir(doc)):
            out += [p for p in _files(doc / pkg) if p.name == "copyright" or _is_readme(p.name)]
    man = share / "man"
    if man.is_dir():
        pages = [p for sec in sorted(os.listdir(man)) if sec.startswith("man")
                 for p in _files(man / sec) if p.name.endswith(".gz")]
        families: dict[str, list[Path]] = {}
        for p in pages:
            families.setdefault(_FAMILY_RE.split(p.name, 1)[0].lower(), []).append(p)
        keep = {p for fam in families.values() for p in subsample(fam, max_pages_per_family)}
        out += [p for p in pages if p in keep]
    return [p for p in out if not excluded(p)]


# --------------------------------------------------------------------------- reading


def read_document(path: str | Path, domain: str) -> str | None:
    """Plain text of one file, or None when it is binary, non-UTF-8 or too short.

    Man pages (``/man*/`` paths) are rendered with :func:`strip_roff`.
    """
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            return None
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
            if len(raw) > 4 * MAX_BYTES:
                return None
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if domain == "prose" and path.parent.name.startswith("man") and path.parent.parent.name == "man":
        text = strip_roff(text)
    text = text.replace("\r\n", "\n").strip("\n")
    if len(text) < MIN_CHARS:
        return None
    return text + "\n"


# --------------------------------------------------------------------------- roff


_NAMED_CHARS = {
    "em": "--", "en": "-", "hy": "-", "mi": "-", "bu": "*", "lq": '"', "rq": '"',
    "oq": "'", "cq": "'", "aq": "'", "dq": '"', "co": "(c)", "rg": "(R)", "tm": "(TM)",
    "ha": "^", "ti": "~", "rs": "\\", "**": "*", "<=": "<=", ">=": ">=", "->": "->",
    "<-": "<-", "mu": "x", "de": "deg", "sc": "S", "ba": "|", "br": "|", "pl": "+",
    "eq": "=", "sl": "/", "at": "@", "sh": "#", "Do": "$", "ga": "`", "aa": "'",
}
# pod2man / man-pages string registers seen in practice
_NAMED_STRINGS = {"Aq": "'", "L\"": '"', "R\"": '"', "C`": '"', "C'": '"', "lq": '"',
                  "rq": '"', "R": "(R)", "Tm": "(TM)", "--": "--", "PI": "pi"}
_ESCAPE_RE = re.compile(
    r"""\\(?:
        f(?:\[[^\]]*\]|\(..|.)        # font change
      | s[+-]?(?:\(\d\d|\[\d*\]|\d)    # size change
      | \*(?:\[(?P<sb>[^\]]*)\]|\((?P<sp>..)|(?P<s1>.))   # string register
      | n[+-]?(?:\[[^\]]*\]|\(..|.)   # number register
      | \((?P<cp>..)                   # named char \(xx
      | \[(?P<cb>[^\]]*)\]             # named char \[xx]
      | [hvwlLoDbxHSZ]'[^']*'          # motions, widths, drawing: drop
      | (?P<one>.)                     # any other single-char escape
    )""",
    re.VERBOSE,
)
_ONE_CHAR = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "'",
             "`": "`", ".": ".", "t": "\t", "[": "[", "]": "]", "_": "_"}
# requests / macros that produce no text (or only layout)
_SILENT = {
    "TH", "PP", "P", "LP", "br", "sp", "RS", "RE", "nf", "fi", "in", "ti", "ad", "na",
    "ne", "ft", "fam", "hy", "nh", "ds", "nr", "rr", "so", "if", "ie", "el", "IX", "Vb",
    "Ve", "EX", "EE", "ll", "pl", "ps", "vs", "ta", "tr", "ss", "cs", "bp", "pc", "lf",
    "mso", "do", "ev", "ec", "eo", "cc", "c2", "ig", "am", "als", "rn", "rm", "ch",
    "wh", "it", "tm", "ab", "ex", "pso", "sy", "PD", "UE", "ME", "TS", "TE", "T&",
    "Dd", "Dt", "Os", "Bl", "El", "Bd", "Ed", "Pp", "Lp", "hw", "ns", "rs", "ce", "ul",
    "cu", "lg", "kern", "char", "schar", "fchar", "defcolor", "gcolor", "fcolor",
    "YS", "DT", "OP", "\\}", "}", "\\\"",
}
_HEADINGS = {"SH", "SS", "Sh", "Ss"}
_ALTERNATING = {"BR", "RB", "BI", "IB", "IR", "RI"}
_MDOC_CALLABLE = {"Fl", "Ar", "Op", "Oo", "Oc", "Xr", "Nm", "Pa", "Ql", "Dq", "Sq", "Em",
                  "Li", "Cm", "Ev", "Va", "Ic", "Sy", "No", "Ns", "Pq", "Bq", "Brq", "Ad",
                  "Ft", "Fn", "Fa", "Fo", "Fc", "Dv", "Er", "Cd", "Ms", "Tn", "Aq", "It",
                  "Nd", "Bk", "Ek", "Ux", "Bx", "At", "St", "Lk", "Mt", "Ta", "Sx", "Vt"}


def _escape_sub(m: re.Match) -> str:
    for key, table in (("sb", _NAMED_STRINGS), ("sp", _NAMED_STRINGS), ("s1", _NAMED_STRINGS),
                       ("cp", _NAMED_CHARS), ("cb", _NAMED_CHARS)):
        val = m.group(key)
        if val is not None:
            if key == "cb" and val.startswith("u") and len(val) in (5, 6):
                try:
                    return chr(int(val[1:], 16))
                except ValueError:
                    return ""
            return table.get(val, "")
    one = m.group("one")
    if one is not None:
        return _ONE_CHAR.get(one, "")
    return ""


def _inline(text: str) -> str:
    """Resolve inline escapes: fonts, named chars, strings; drop the rest."""
    i = text.find('\\"')
    if i >= 0:  # comment to end of line
        text = text[:i]
    return _ESCAPE_RE.sub(_escape_sub, text)


def _macro_args(rest: str) -> list[str]:
    """Split macro arguments the roff way: blanks separate, double quotes group."""
    args, cur, quoted, i = [], [], False, 0
    while i < len(rest):
        c = rest[i]
        if c == '"':
            if quoted and i + 1 < len(rest) and rest[i + 1] == '"':
                cur.append('"')
                i += 2
                continue
            quoted = not quoted
            if not quoted:
                args.append("".join(cur))
                cur = []
        elif c in " \t" and not quoted:
            if cur:
                args.append("".join(cur))
                cur = []
        elif c == "\\" and i + 1 < len(rest):
            cur.append(rest[i:i + 2])
            i += 2
            continue
        else:
            cur.append(c)
        i += 1
    if cur:
        args.append("".join(cur))
    return args


def strip_roff(src: str) -> str:
    """Render man(7)/mdoc(7) roff source to plain text, well enough to train on.

    Headings become their own line preceded by a blank line, paragraph macros a
    blank line, font macros their (joined) arguments, escapes their character;
    comments, macro definitions, conditionals and layout requests disappear.
    """
    out: list[str] = []
    in_def = False
    table_fmt = False

    def blank() -> None:
        if out and out[-1] != "":
            out.append("")

    for line in src.splitlines():
        if in_def:
            if line.strip() in ("..", ".."):
                in_def = False
            continue
        if table_fmt:
            if line.rstrip().endswith("."):
                table_fmt = False
            continue
        if line.startswith((".", "'")):
            body = line[1:].lstrip(" \t")
            if body.startswith(('\\"', "\\#")) or body == "":
                continue
            m = re.match(r"(\S+)\s*(.*)$", body)
            name, rest = m.group(1), m.group(2)
            if name in ("de", "de1", "ds1", "am1") or name == "ig":
                in_def = True
                continue
            if name == "TS":
                table_fmt = True
                continue
            if name.startswith(("\\}", "\\{")) or name in _SILENT:
                if name in ("PP", "P", "LP", "Pp", "Lp", "sp", "TS", "TE"):
                    blank()
                continue
            args = _macro_args(rest)
            if name in _HEADINGS:
                blank()
                out.append(_inline(" ".join(args)).strip())
                continue
            if name in ("IP", "HP", "TP", "It"):
                blank()
                if name == "IP" and args:
                    out.append(_inline(args[0]))
                elif name == "It" and args:
                    out.append(_inline(" ".join(a for a in args if a not in _MDOC_CALLABLE)))
                continue
            if name in _ALTERNATING:
                out.append(_inline("".join(args)))
                continue
            if name in ("B", "I", "SM", "SB", "UR", "MT", "Nm", "Nd", "Xr"):
                text = _inline(" ".join(args))
                if name == "Nd":
                    text = "- " + text
                if text:
                    out.append(text)
                continue
            # unknown macro (mdoc or custom): keep its words, drop mdoc callables
            words = [a for a in args if a not in _MDOC_CALLABLE]
            if words and len(name) <= 3 and name[:1].isupper():
                out.append(_inline(" ".join(words)))
            continue
        if line.endswith("\\") and not line.endswith("\\\\"):
            line = line[:-1]  # trailing backslash: line continuation
        text = _inline(line)
        if text.strip() == "" and out and out[-1] == "":
            continue
        out.append(text.rstrip())
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n" if out else ""


# --------------------------------------------------------------------------- split


def _num_heldout(n: int, frac: float, min_heldout: int) -> int:
    if n < 2:
        return 0
    k = max(round(frac * n), min(min_heldout, n // 5), 1)
    return min(k, n - 1)


def scan_domain(domain: str, paths: list[Path]) -> tuple[list[str], dict[str, str]]:
    """Read candidate files; returns kept absolute paths and a path -> text map."""
    kept: list[str] = []
    texts: dict[str, str] = {}
    seen: set[str] = set()
    for p in paths:
        text = read_document(p, domain)
        if text is None:
            continue
        digest = hashlib.sha1(text.encode("utf-8")).hexdigest()
        if digest in seen:  # identical twins (symlinked licenses, .so man pages)
            continue
        seen.add(digest)
        key = str(Path(p).absolute())
        kept.append(key)
        texts[key] = text
    return kept, texts


def split_files(paths: list[str], seed: int, *, frac: float = 0.1, min_heldout: int = 20) -> Split:
    """Seeded file-level split; ~``frac`` held out, at least ``min_heldout`` where possible."""
    order = sorted(paths)
    random.Random(f"split:{seed}").shuffle(order)
    k = _num_heldout(len(order), frac, min_heldout)
    return Split(train=sorted(order[k:]), heldout=sorted(order[:k]))


def subsample(paths: list[Path], max_files: int) -> list[Path]:
    """Evenly spaced deterministic subset (used by ``--tiny``)."""
    if len(paths) <= max_files:
        return paths
    step = len(paths) / max_files
    return [paths[int(i * step)] for i in range(max_files)]


def build_corpus(seed: int, *, max_files_per_domain: int | None = None,
                 stdlib: Path | None = None, share: Path = Path("/usr/share"),
                 ) -> tuple[dict[str, Split], dict[str, str]]:
    """Scan both domains and split them. Returns (splits, path -> text for all kept files)."""
    candidates = {"code": list_code_files(stdlib), "prose": list_prose_files(share)}
    splits: dict[str, Split] = {}
    texts: dict[str, str] = {}
    for domain in DOMAINS:
        paths = candidates[domain]
        if max_files_per_domain is not None:
            paths = subsample(paths, max_files_per_domain)
        kept, dom_texts = scan_domain(domain, paths)
        if len(kept) < 2:
            raise CorpusError(f"domain {domain!r}: only {len(kept)} usable files found "
                              f"(stdlib={stdlib or sysconfig.get_paths()['stdlib']}, share={share})")
        splits[domain] = split_files(kept, seed)
        texts.update(dom_texts)
        log.info("corpus %s: %d candidates, %d kept, %d train / %d heldout, %.1f MB",
                 domain, len(paths), len(kept), len(splits[domain].train),
                 len(splits[domain].heldout), sum(len(t) for t in dom_texts.values()) / 1e6)
    return splits, texts

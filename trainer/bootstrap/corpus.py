"""Bootstrap corpus: text that exists on every machine, split at file level.

Two domains:

- ``code``: the Python standard library sources (``*.py`` under
  ``sysconfig.get_paths()["stdlib"]``, test suites and site-packages excluded).
- ``prose``: English text under ``/usr/share``: licenses, package copyright
  files, README-like files (plain or gzip) and man pages rendered to plain
  text by :func:`~specops.trainer.bootstrap.roff.strip_roff` (no groff needed).

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

from .roff import strip_roff

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
(``specops.workloads.chat_workload``), traffic the bootstrap draft must not have seen."""
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
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py") and not f.startswith("test_")]
    return sorted(p for p in out if not excluded(p))


def _is_readme(name: str) -> bool:
    base = name[:-3] if name.endswith(".gz") else name
    if not _README_RE.match(base):
        return False
    ext = base[len("README") :].lower()
    ext = ext[ext.rfind(".") :] if "." in ext else ""
    return ext in _README_TEXT_EXT


def list_prose_files(
    share: Path = Path("/usr/share"),
    max_pages_per_family: int = MAX_PAGES_PER_FAMILY,
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
        pages = [
            p
            for sec in sorted(os.listdir(man))
            if sec.startswith("man")
            for p in _files(man / sec)
            if p.name.endswith(".gz")
        ]
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


def build_corpus(
    seed: int,
    *,
    max_files_per_domain: int | None = None,
    stdlib: Path | None = None,
    share: Path = Path("/usr/share"),
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
            raise CorpusError(
                f"domain {domain!r}: only {len(kept)} usable files found "
                f"(stdlib={stdlib or sysconfig.get_paths()['stdlib']}, share={share})"
            )
        splits[domain] = split_files(kept, seed)
        texts.update(dom_texts)
        log.info(
            "corpus %s: %d candidates, %d kept, %d train / %d heldout, %.1f MB",
            domain,
            len(paths),
            len(kept),
            len(splits[domain].train),
            len(splits[domain].heldout),
            sum(len(t) for t in dom_texts.values()) / 1e6,
        )
    return splits, texts

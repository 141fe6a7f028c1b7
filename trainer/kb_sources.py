"""Passages for a knowledge base from text on this machine: man pages and package docs.

A source is a directory (walked recursively) or a glob, where ``**`` matches any number of
directories (``DIR/**/*.md``: every ``.md`` file below ``DIR``, as shells with globstar do); a
source that matches no file is warned about. A file under a ``man<section>``
directory is a man page: roff (plain or gzip) rendered to text by the bootstrap's
:func:`~specops.trainer.bootstrap.corpus.strip_roff` and titled like ``ls(1)``; any other file is
text (plain or gzip) titled by its path below the source's root (``bash/README``). Binary,
non-UTF-8, huge (over ``MAX_BYTES``) and near-empty files are skipped, counted by reason in
:class:`SourceStats` and warned about. Each document is cut
into ~100-word passages by :func:`specops.core.passage.chunk_text`.

Man pages are capped per name family as the bootstrap caps them (``gcloud_*`` alone is
16,000 near-identical pages on this machine); ``max_pages_per_family=0`` keeps every page.

**Held-out text stays out.** The bootstrap evaluates its models on a held-out file split
of the same ``/usr/share`` prose; a KB holding those files would let retrieval hand a
model the very text it is tested on. :func:`bootstrap_heldout` gives that split: the
bootstrapped manifest's list when one exists, else the split recomputed the way the
bootstrap makes it (same listing, same de-duplication, seed 0, its default). A file is
excluded when its path is held out or its text equals a held-out document's (a copy under
another path).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specops.core.passage import CHUNK_WORDS, MAX_PASSAGE_TOKENS, Passage, chunk_text
from specops.trainer.bootstrap.corpus import (
    MAX_BYTES,
    MAX_PAGES_PER_FAMILY,
    list_prose_files,
    read_document,
    scan_domain,
    split_files,
    strip_roff,
    subsample,
)

log = logging.getLogger(__name__)

SHARE = Path("/usr/share")
MIN_CHARS = 100
"""Documents shorter than this after rendering are skipped (``.so`` redirects, stubs)."""
DOC_PATTERNS = ("README*", "*.txt", "*.txt.gz", "*.md", "*.md.gz", "copyright", "FAQ*", "NEWS", "NEWS.gz")
"""Package documentation kept by :func:`default_sources` (changelogs are left out: lists of versions)."""
_MAN_DIR_RE = re.compile(r"^man\d\w*$")
_FAMILY_RE = re.compile(r"[_.-]")


def default_sources(share: Path = SHARE) -> list[str]:
    """English man pages (sections 1-8; the language subdirectories are not matched) and
    package docs (READMEs, ``*.txt``, ``*.md``, copyright files, FAQs, NEWS)."""
    return [f"{share}/man/man[1-8]"] + [f"{share}/doc/*/{p}" for p in DOC_PATTERNS]


@dataclass(frozen=True)
class HeldOut:
    """Files the bootstrap holds out, by path and by text."""

    paths: frozenset[str] = frozenset()
    digests: frozenset[str] = frozenset()
    origin: str = ""

    def excludes(self, path: Path, text: str) -> bool:
        return str(path.absolute()) in self.paths or _digest(text) in self.digests


def _digest(text: str) -> str:
    return hashlib.sha1(" ".join(text.split()).encode("utf-8")).hexdigest()


def bootstrap_heldout(model_dir: Path | None = None, *, seed: int = 0, share: Path = SHARE) -> HeldOut:
    """The prose files the bootstrap holds out: from ``model_dir/manifest.json`` when it is
    bootstrapped, else recomputed like ``specops.trainer.bootstrap.corpus.build_corpus`` (seconds)."""
    paths: list[str] | None = None
    manifest = Path(model_dir) / "manifest.json" if model_dir is not None else None
    if manifest is not None and manifest.is_file():
        try:
            paths = list(json.loads(manifest.read_text())["domains"]["prose"]["heldout"])
            origin = f"the bootstrap manifest {manifest}"
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s has no prose held-out list (%s); recomputing the split", manifest, exc)
    if paths is None:
        kept, _ = scan_domain("prose", list_prose_files(share))
        paths = split_files(kept, seed).heldout
        origin = f"the bootstrap's split recomputed (seed {seed})"
    digests = {_digest(t) for p in paths if (t := read_document(p, "prose")) is not None}
    log.info("%d held-out prose files (%s)", len(paths), origin)
    return HeldOut(frozenset(paths), frozenset(digests), origin)


SKIP_REASONS = ("unreadable", "too large", "binary", "not UTF-8", "bad gzip", "too short")
"""Why :func:`read_source_file` skips a file, in the order summaries list them."""


@dataclass
class SourceStats:
    """What reading the sources did."""

    files_matched: int = 0
    """Distinct files the sources matched (directories walked, globs expanded)."""
    files_listed: int = 0
    """Of those, the files to read (man pages over the family cap left out)."""
    files_read: int = 0
    files_skipped: int = 0
    """Binary, non-UTF-8, huge or near-empty: by reason in ``skipped``."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Files skipped per reason of :data:`SKIP_REASONS`."""
    files_not_reached: int = 0
    """Files left unread because ``max_passages`` was reached first."""
    unmatched_sources: list[str] = field(default_factory=list)
    """Sources that matched no file."""
    heldout_excluded: int = 0
    man_pages_capped: int = 0
    """Man pages left out by the per-family cap."""
    passages: int = 0
    heldout_origin: str = ""
    sources: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
            for k, v in self.__dict__.items()
        }

    def skipped_summary(self) -> str:
        """``2 not UTF-8, 1 too large`` (empty when nothing was skipped)."""
        notes = {"too large": f"over {MAX_BYTES:,} bytes", "too short": f"under {MIN_CHARS} characters of text"}
        return ", ".join(
            f"{self.skipped[r]} {r}" + (f" ({notes[r]})" if r in notes else "")
            for r in SKIP_REASONS
            if self.skipped.get(r)
        )


def _is_man(path: Path) -> bool:
    return bool(_MAN_DIR_RE.match(path.parent.name))


def man_title(path: Path) -> str:
    """``ls.1.gz`` -> ``ls(1)``; ``openssl-x509.1ssl`` -> ``openssl-x509(1ssl)``."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    stem, _, section = name.rpartition(".")
    return f"{stem}({section})" if stem and section else name


def _glob_root(pattern: str) -> Path:
    """The directory above a glob's first wildcard: titles are paths below it."""
    parts = Path(pattern).parts
    first = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))
    return Path(*parts[:first]) if first else Path(".")


def list_source_files(
    sources: list[str], *, max_pages_per_family: int = MAX_PAGES_PER_FAMILY, stats: SourceStats | None = None
) -> list[tuple[Path, str]]:
    """(path, title) of every file of ``sources``, in source order then path order, each once."""
    found: list[tuple[Path, Path]] = []  # (path, root)
    for source in sources:
        magic = glob.has_magic(source)
        matches = sorted(glob.glob(source, recursive=True)) if magic else [source]  # ** at any depth
        root = _glob_root(source) if magic else Path(source)
        before = len(found)
        for m in map(Path, matches):
            if m.is_dir():
                for dirpath, dirnames, filenames in os.walk(m):
                    dirnames.sort()
                    found += [(Path(dirpath) / f, root) for f in sorted(filenames)]
            elif m.is_file():
                found.append((m, root.parent if m == root else root))
        if not any(p.is_file() for p, _ in found[before:]):
            why = "matches no file" if magic else "is no file or directory" if not root.exists() else "holds no file"
            log.warning("source %r %s", source, why)
            if stats is not None:
                stats.unmatched_sources.append(source)
    seen, files = set(), []
    for path, root in found:
        key = str(path.absolute())
        if key not in seen and path.is_file():
            seen.add(key)
            files.append((path, root))
    if stats is not None:
        stats.files_matched = len(files)
    man = [p for p, _ in files if _is_man(p)]
    keep = set(man)
    if max_pages_per_family > 0:
        families: dict[str, list[Path]] = {}
        for p in man:
            families.setdefault(_FAMILY_RE.split(p.name, 1)[0].lower(), []).append(p)
        keep = {p for fam in families.values() for p in subsample(fam, max_pages_per_family)}
    if stats is not None:
        stats.man_pages_capped = len(man) - len(keep)
    out = []
    for path, root in files:
        if _is_man(path):
            if path in keep:
                out.append((path, man_title(path)))
        else:
            rel = path.relative_to(root) if path.is_relative_to(root) else path
            out.append((path, str(rel)[:-3] if str(rel).endswith(".gz") else str(rel)))
    return out


def read_source_file(path: Path) -> str | None:
    """The text of one file (a man page rendered), or None when it is binary, not UTF-8,
    over ``MAX_BYTES``, or shorter than ``MIN_CHARS``."""
    return read_source_file_why(path)[0]


def read_source_file_why(path: Path) -> tuple[str | None, str]:
    """(text, "") of one file, or (None, why) with why one of :data:`SKIP_REASONS`."""
    try:
        if path.stat().st_size > MAX_BYTES:
            return None, "too large"
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
            if len(raw) > 4 * MAX_BYTES:
                return None, "too large"
        if b"\x00" in raw:
            return None, "binary"
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except (EOFError, gzip.BadGzipFile):
        return None, "bad gzip"
    except OSError:
        return None, "unreadable"
    if _is_man(path):
        text = strip_roff(text)
    text = text.replace("\r\n", "\n").strip()
    return (text + "\n", "") if len(text) >= MIN_CHARS else (None, "too short")


def passages_from_sources(
    sources: list[str],
    *,
    words: int = CHUNK_WORDS,
    max_tokens: int = MAX_PASSAGE_TOKENS,
    count_tokens: Callable[[str], int] | None = None,
    include_heldout: bool = False,
    heldout: HeldOut | None = None,
    model_dir: Path | None = None,
    max_passages: int | None = None,
    max_pages_per_family: int = MAX_PAGES_PER_FAMILY,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[Passage], SourceStats]:
    """Passages (ids in order, 0..) of every readable file of ``sources``, and what was read.

    Held-out files are excluded unless ``include_heldout``: ``heldout`` when given, else the
    bootstrap's (:func:`bootstrap_heldout` with ``model_dir``), computed only when a file
    lies under ``/usr/share``. ``max_passages`` reads files in a seeded random order until
    it has that many (so a quick build samples every source), then puts them back in order."""
    from tqdm import tqdm

    stats = SourceStats(sources=list(sources))
    files = list_source_files(sources, max_pages_per_family=max_pages_per_family, stats=stats)
    stats.files_listed = len(files)
    if not include_heldout and heldout is None and any(p.absolute().is_relative_to(SHARE) for p, _ in files):
        heldout = bootstrap_heldout(model_dir)
    if include_heldout:
        heldout = None
    stats.heldout_origin = (
        heldout.origin
        if heldout is not None
        else "none: held-out files included"
        if include_heldout
        else "none needed: no file under /usr/share"
    )
    order = list(range(len(files)))
    if max_passages is not None:
        random.Random(f"kb-sources:{seed}").shuffle(order)
    chunks: dict[int, list[str]] = {}
    total = visited = 0
    examples: list[str] = []
    with tqdm(order, unit="file", desc="reading + chunking", disable=not progress) as bar:
        for i in bar:
            visited += 1
            path, _ = files[i]
            text, why = read_source_file_why(path)
            if text is None:
                stats.files_skipped += 1
                stats.skipped[why] = stats.skipped.get(why, 0) + 1
                log.debug("skipped %s: %s", path, why)
                if len(examples) < 3:
                    examples.append(f"{path} ({why})")
                continue
            if heldout is not None and heldout.excludes(path, text):
                stats.heldout_excluded += 1
                continue
            stats.files_read += 1
            got = chunk_text(text, words, max_tokens=max_tokens, count_tokens=count_tokens)
            if max_passages is not None:
                got = got[: max_passages - total]
            chunks[i] = got
            total += len(got)
            bar.set_postfix(passages=total, refresh=False)
            if max_passages is not None and total >= max_passages:
                break
    stats.files_not_reached = len(files) - visited
    if stats.files_skipped:
        log.warning(
            "%d of %d files skipped: %s; e.g. %s",
            stats.files_skipped,
            len(files),
            stats.skipped_summary(),
            ", ".join(examples),
        )
    out = [
        Passage(id=-1, title=files[i][1], text=t, source=str(files[i][0].absolute()))
        for i in sorted(chunks)
        for t in chunks[i]
    ]
    out = [Passage(id=n, title=p.title, text=p.text, source=p.source) for n, p in enumerate(out)]
    stats.passages = len(out)
    log.info(
        "%d passages from %d of %d matched files (%d skipped, %d held out, %d man pages over the family cap)",
        len(out),
        stats.files_read,
        stats.files_matched,
        stats.files_skipped,
        stats.heldout_excluded,
        stats.man_pages_capped,
    )
    return out, stats

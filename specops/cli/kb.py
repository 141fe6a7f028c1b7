"""``specops kb build|ls|search``: knowledge bases for retrieval-augmented generation (RaLMSpec, kNN-LM)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from specops.cli.artifact import add_ls, add_registry_args, open_registry
from specops.paths import data_dir, models_dir

SNIPPET_CHARS = 160
MEMORY_RETRIEVERS = ("exact", "hnsw", "scann", "bm25")
MILVUS_RETRIEVERS = ("exact", "hnsw")


def _chunk_tokenizer(args: argparse.Namespace):
    """(tokenizer, what it is): --tokenizer, else the bootstrapped target's, else MiniLM's."""
    from specops.core.models import load_tokenizer, tokenizer_hash

    if args.tokenizer:
        tok, name = load_tokenizer(Path(args.tokenizer)), f"--tokenizer {args.tokenizer}"
    elif (Path(args.model_dir) / "target" / "tokenizer.json").is_file():
        tok, name = load_tokenizer(Path(args.model_dir) / "target"), f"the target's ({Path(args.model_dir) / 'target'})"
    else:
        from specops.core.embed import minilm_dir

        tok, name = load_tokenizer(minilm_dir()), "MiniLM's (no bootstrapped target found; the embedder's own limit)"
    return tok, {"tokenizer": name, "tokenizer_sha256": tokenizer_hash(tok)}


def cmd_build(args: argparse.Namespace) -> int:
    from specops.core.errors import KBError
    from specops.core.passage import token_counter
    from specops.serving.retrieval.kb import build_kb, register_kb
    from specops.trainer.kb_sources import default_sources, passages_from_sources

    retrievers = _retrievers(args)
    if args.milvus_uri and args.backend != "milvus":
        raise KBError("--milvus-uri names where a --backend milvus KB goes: add --backend milvus, or drop it")
    args.milvus_uri = args.milvus_uri or default_milvus_uri()
    if args.no_register and not args.out:
        raise KBError("--no-register without --out would build a knowledge base and throw it away: give --out DIR")
    sources = args.source or default_sources()
    tok, tok_info = _chunk_tokenizer(args)
    print(
        f"knowledge base {args.name!r}: reading {len(sources)} source(s), ~{args.words}-word passages of at most "
        f"{args.max_tokens} tokens of {tok_info['tokenizer']}"
    )
    passages, stats = passages_from_sources(
        sources,
        words=args.words,
        max_tokens=args.max_tokens,
        count_tokens=token_counter(tok),
        include_heldout=args.include_heldout,
        model_dir=Path(args.model_dir),
        max_passages=args.max_passages,
        max_pages_per_family=args.max_pages_per_family,
        progress=True,
    )
    print(_sources_summary(len(passages), stats))
    meta = {
        "sources": stats.to_dict(),
        "heldout_excluded": stats.heldout_excluded,
        "chunking": {"words": args.words, "max_tokens": args.max_tokens, **tok_info},
    }
    if args.backend == "milvus":
        kb = _build_milvus(args, passages, retrievers[0], meta)
    else:
        kb = build_kb(args.name, passages, embedder=args.embedder, retrievers=retrievers, progress=True, meta=meta)
        b = kb.meta["build_s"]
        print(
            f"{kb.num_passages} passages ({kb.meta['duplicates_dropped']} duplicates dropped), "
            f"{kb.bytes_per_passage:.0f} bytes/passage; embedding {b['embed']:.1f}s "
            f"({kb.meta['embed_passages_per_s']:.0f} passages/s, {args.embedder}), "
            + ", ".join(f"{k} {b[k]:.1f}s" for k in kb.retrievers if k != "exact")
            + f"; total {b['total']:.1f}s"
        )
    if args.out:
        kb.save(Path(args.out))
        print(f"saved to {args.out} (search it: specops kb search {args.name} QUERY --kb-dir {args.out})")
    if not args.no_register:
        v = register_kb(open_registry(args.registry, args.stream), kb, promote=not args.no_promote)
        print(f"registered kb-{args.name} version {v.version} ({', '.join(v.aliases) or 'no alias'})")
    return 0


def _sources_summary(n_passages: int, stats) -> str:
    """``N passages from R files read of M matched (S skipped: why, ...)``: every file the
    sources matched is read or counted under a reason it was not."""
    why = stats.skipped_summary()
    parts = [
        f"{stats.files_skipped} skipped" + (f": {why}" if why else ""),
        f"{stats.heldout_excluded} held out by the bootstrap",
        f"{stats.man_pages_capped} man pages over the family cap",
    ]
    if stats.files_not_reached:
        parts.append(f"{stats.files_not_reached} not reached: --max-passages")
    line = (
        f"{n_passages} passages from {stats.files_read} files read of {stats.files_matched} matched "
        f"({', '.join(parts)})"
    )
    if stats.unmatched_sources:
        line += f"; warning: no file matched {', '.join(map(repr, stats.unmatched_sources))}"
    return line


def _retrievers(args: argparse.Namespace) -> list[str]:
    """--retrievers, defaulted and checked per backend (Milvus builds exactly one dense index)."""
    from specops.core.errors import KBError

    default = MILVUS_RETRIEVERS[0] if args.backend == "milvus" else ",".join(MEMORY_RETRIEVERS)
    retrievers = [r.strip() for r in (args.retrievers or default).split(",") if r.strip()]
    if args.backend == "milvus" and (len(retrievers) != 1 or retrievers[0] not in MILVUS_RETRIEVERS):
        raise KBError(
            f"--retrievers {args.retrievers}: a Milvus KB has one dense index, so give exactly one of "
            f"{' or '.join(MILVUS_RETRIEVERS)} (bm25 needs corpus statistics a request's local cache cannot "
            "reproduce, scann is not a Milvus index: build those with --backend memory)"
        )
    return retrievers


def default_milvus_uri() -> str:
    """A Milvus Lite database under the data directory (one process at a time)."""
    return str((data_dir() / "milvus" / "kb.db").resolve())


def _build_milvus(args: argparse.Namespace, passages, retriever: str, meta: dict):
    from specops.serving.retrieval.milvus.build import build_milvus_kb
    from specops.serving.retrieval.milvus.service import TOKEN_ENV

    kb = build_milvus_kb(
        args.name,
        passages,
        uri=args.milvus_uri,
        embedder=args.embedder,
        retriever=retriever,
        progress=True,
        meta=meta,
        token=os.environ.get(TOKEN_ENV, ""),
    )
    b, m = kb.meta["build_s"], kb.meta["milvus"]
    done = "already built, reused" if m["reused"] else f"inserted in {b['insert']:.1f}s"
    print(
        f"{kb.num_passages} passages ({kb.meta['duplicates_dropped']} duplicates dropped); embedding "
        f"{b['embed']:.1f}s ({kb.meta['embed_passages_per_s']:.0f} passages/s, {args.embedder}); collection "
        f"{m['collection']} at {m['uri']} ({m['index']} index, {retriever}): {done} "
        f"({kb.meta['insert_passages_per_s']:.0f} passages/s), index {b['index']:.1f}s; total {b['total']:.1f}s"
    )
    return kb


def cmd_search(args: argparse.Namespace) -> int:
    from specops.core.errors import KBError
    from specops.serving.retrieval.kb import KnowledgeBase, load_kb_from_registry

    if args.kb_dir:
        kb = KnowledgeBase.load(Path(args.kb_dir))
        if kb.name != args.name:
            raise KBError(f"{args.kb_dir} holds knowledge base {kb.name!r}, not {args.name!r}")
    else:
        kb = load_kb_from_registry(
            open_registry(args.registry, None),
            args.name,
            args.alias,
            version=args.version,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        )
    retriever = kb.retriever(args.retriever)
    t0 = time.perf_counter()
    query = retriever.encode([args.query])
    t1 = time.perf_counter()
    ids, scores = retriever.search(query, args.k)
    t2 = time.perf_counter()
    found = [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
    where = f"version {kb.version}" if kb.version else args.kb_dir
    if getattr(kb, "backend", "memory") == "milvus":
        where += f", Milvus collection {kb.meta['milvus']['collection']} at {kb.uri}"
    print(
        f"kb {kb.name} ({where}, {kb.num_passages} passages), {args.retriever}: {len(found)} result(s); encode "
        f"{(t1 - t0) * 1000:.0f} ms, search {(t2 - t1) * 1000:.0f} ms (first use loads the embedder and index)"
    )
    for rank, (p, (_, score)) in enumerate(zip(kb.passages([i for i, _ in found]), found), 1):
        snippet = " ".join(p.text.split())
        snippet = snippet if len(snippet) <= SNIPPET_CHARS else snippet[:SNIPPET_CHARS] + "..."
        print(f"{rank:>2}. [{p.id}] {score:.4f}  {p.title}\n    {snippet}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "kb",
        help="knowledge bases for retrieval-augmented generation: build one from man pages and docs, list, search",
        description="A knowledge base (kb-NAME in the registry) holds ~100-word passages, their vectors and up to four "
        "retrievers: exact (exact inner product over the vectors), hnsw and scann (approximate indexes whose "
        "candidates are rescored exactly) and bm25 (sparse, over the whole KB's statistics). RaLMSpec and kNN-LM "
        "retrieve from its champion. With --backend milvus the passages and vectors live in a Milvus collection "
        "shared by every replica (exact or hnsw), and the registered artifact is a manifest naming it.",
    )
    ksub = p.add_subparsers(dest="kb_command", required=True, metavar="SUBCOMMAND")

    q = ksub.add_parser(
        "build",
        help="build a knowledge base from text files and register it",
        description="Reads the sources (man pages are rendered from roff), cuts them into passages of "
        "about --words words and at most --max-tokens target tokens, drops exact duplicates, embeds "
        "them, builds the retrievers, and registers kb-NAME (promoted to champion unless "
        "--no-promote) and/or saves it (--out). Files the bootstrap holds out for evaluation are "
        "left out unless --include-heldout. Prints how many files the sources matched and how many were "
        "read, and why any were skipped (unreadable, too large, binary, not UTF-8, bad gzip, too short). "
        "Progress bars show reading, embedding (rate and time left) and indexing; MiniLM embeds about 30 "
        "passages/s on 2 idle cores and fewer under load, the hash embedder thousands. With --backend milvus "
        "the passages and vectors are inserted into a new collection kb_NAME_<content sha> at --milvus-uri "
        "(a rebuild never overwrites the one the champion serves) and kb-NAME is a manifest naming it; "
        "--out then saves that manifest.",
    )
    add_registry_args(q)
    q.add_argument("--name", required=True, help="knowledge base name: registered as kb-NAME")
    q.add_argument(
        "--source",
        action="append",
        default=None,
        metavar="DIR|GLOB",
        help="a directory (walked) or a glob of files, ** matching any depth (quote it: 'DIR/**/*.md'); repeat "
        "for more; one that matches no file is warned about (default: English man pages "
        "under /usr/share/man/man[1-8] and READMEs, *.txt, *.md, copyright, FAQ and NEWS files of "
        "/usr/share/doc/*)",
    )
    q.add_argument(
        "--embedder",
        choices=("minilm", "hash"),
        default="minilm",
        help="minilm: all-MiniLM-L6-v2 sentence vectors (shipped, offline; better retrieval, but about 30 "
        "passages/s on 2 idle cores and slower under load: 10^4 passages take several minutes, 10^5 about an "
        "hour); hash: tf-idf of hashed words feature-hashed to 384 dims, fitted on the passages (thousands of "
        "passages/s: pick it for large sources, the 10^6-passage setting, or a quick first build). The "
        "embedding progress bar shows the rate and time left (default: %(default)s)",
    )
    q.add_argument(
        "--backend",
        choices=("memory", "milvus"),
        default="memory",
        help="memory: the passages, vectors and indexes are files of the registered artifact, loaded into each "
        "replica's memory; milvus: they go into a new collection of a Milvus service shared by every replica "
        "(--milvus-uri), and the registered artifact is a manifest naming it (default: %(default)s)",
    )
    q.add_argument(
        "--milvus-uri",
        default=None,
        metavar="URI",
        help="--backend milvus: a Milvus Lite database path ending in .db (embedded: one process at a time) or "
        "http://HOST:PORT of a Milvus server or `milvus-lite server`; recorded in the manifest, and serving may "
        "override it with SPECOPS_MILVUS_URI (token: SPECOPS_MILVUS_TOKEN, never recorded) "
        "(default: DATA_DIR/milvus/kb.db) (env: SPECOPS_MILVUS_URI, SPECOPS_DATA_DIR)",
    )
    q.add_argument(
        "--retrievers",
        default=None,
        help="comma-separated retrievers to build: exact, hnsw, scann, bm25 (default: all four); with --backend "
        "milvus exactly one of exact (FLAT index) or hnsw (HNSW index) (default: exact)",
    )
    q.add_argument(
        "--max-passages",
        type=int,
        default=None,
        metavar="N",
        help="stop at N passages (before exact duplicates are dropped), reading files in a seeded "
        "random order so every source is sampled (default: all)",
    )
    q.add_argument(
        "--max-pages-per-family",
        type=int,
        default=30,
        metavar="N",
        help="man pages kept per name family, evenly spaced (gcloud_* alone is thousands of "
        "near-identical pages), as the bootstrap's corpus does; 0 keeps all (default: %(default)s)",
    )
    q.add_argument(
        "--include-heldout",
        action="store_true",
        help="keep the prose files the bootstrap holds out for evaluation (default: excluded, so "
        "retrieval never hands a model its test text)",
    )
    q.add_argument("--words", type=int, default=100, help="words per passage (default: %(default)s)")
    q.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        help="most tokens per passage; longer chunks are split (default: %(default)s)",
    )
    q.add_argument(
        "--model-dir",
        default=str(models_dir()),
        help="bootstrap directory: its target's tokenizer counts --max-tokens and its manifest names the "
        "held-out files (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    q.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="count --max-tokens with this tokenizer instead (default: the bootstrapped target's, else MiniLM's)",
    )
    q.add_argument(
        "--out", default=None, metavar="DIR", help="also save the knowledge base (a Milvus KB's manifest) here"
    )
    q.add_argument("--no-register", action="store_true", help="do not register it (needs --out)")
    q.add_argument("--no-promote", action="store_true", help="register it as the challenger, leaving the champion")
    q.set_defaults(func=cmd_build)

    add_ls(
        ksub,
        "kb",
        key_flag="--name",
        archived=False,
        help="list knowledge base versions",
        description="One row per registered version: name, version, aliases, passages, retrievers built, bytes "
        "per passage (all files) and embedder.",
    )

    q = ksub.add_parser(
        "search",
        help="search a knowledge base",
        description="Encodes QUERY as the retriever does for RaLMSpec and prints the top -k passages: "
        "rank, passage id, score (inner product for dense retrievers, BM25 for bm25), title and a "
        "snippet. Loads the registered champion (or --version / --alias), verifying every file, or "
        "a saved directory (--kb-dir). A Milvus KB is searched in its collection, at the URI of its "
        "manifest or SPECOPS_MILVUS_URI.",
    )
    add_registry_args(q, events=False)
    q.add_argument("name", help="knowledge base name (kb-NAME)")
    q.add_argument("query", help="the text to search for")
    q.add_argument(
        "--retriever",
        choices=("exact", "hnsw", "scann", "bm25"),
        default="exact",
        help="which built retriever searches (default: %(default)s)",
    )
    q.add_argument("-k", type=int, default=5, help="passages to show (default: %(default)s)")
    q.add_argument("--kb-dir", default=None, metavar="DIR", help="a saved knowledge base instead of the registry's")
    q.add_argument("--alias", default="champion", help="registry alias to load (default: %(default)s)")
    q.add_argument("--version", default=None, help="registry version to load (default: the alias's)")
    q.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="keep fetched versions here and reuse them (default: fetch into a temporary directory)",
    )
    q.set_defaults(func=cmd_search)

"""``specops knnlm build|ls``: kNN-LM datastores (RaLMSpec §5.3), built and in the registry."""

from __future__ import annotations

import argparse
import glob
import random
from pathlib import Path

from specops.cli.artifact import add_ls, add_registry_args, open_registry
from specops.paths import models_dir


def source_files(sources: list[str]) -> list[Path]:
    """Files of ``sources`` (directories walked recursively, globs expanded), sorted, once each."""
    files: set[Path] = set()
    for src in sources:
        p = Path(src).expanduser()
        if p.is_dir():
            files.update(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            files.add(p)
        else:
            files.update(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    return sorted(files)


def bootstrap_prose_files(model_dir: Path) -> list[Path]:
    """The bootstrap's prose training files (never its held-out ones: the demo's prompts)."""
    from specops.trainer.bootstrap import load_manifest

    split = load_manifest(model_dir)["domains"]["prose"]
    heldout = set(split.get("heldout", ()))
    return [Path(p) for p in split["train"] if p not in heldout]


def read_documents(
    files: list[Path], tokenizer, *, max_tokens: int, seed: int, progress: bool = True
) -> list[list[int]]:
    """Token ids of the files, in a seeded shuffle, until ``max_tokens`` (the last one cut).
    Man pages are rendered and gzip files opened as the bootstrap reads them; binary or
    unreadable files are skipped."""
    from tqdm import tqdm

    from specops.trainer.bootstrap.corpus import read_document

    order = list(files)
    random.Random(seed).shuffle(order)
    docs, total = [], 0
    with tqdm(total=max_tokens, unit="tok", desc="tokenizing", disable=not progress) as bar:
        for path in order:
            text = read_document(path, "prose")
            if not text:
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_tokens - total]
            if len(ids) < 2:
                continue
            docs.append(ids)
            total += len(ids)
            bar.update(len(ids))
            if total >= max_tokens:
                break
    return docs


def cmd_build(args: argparse.Namespace) -> int:
    from specops.core.errors import DatastoreError
    from specops.core.models import load_model, load_tokenizer, tokenizer_hash
    from specops.serving.ralm.knnlm.store import (
        KnnBuildConfig,
        build_knnlm,
        register_knnlm,
    )

    model_dir = Path(args.model_dir)
    if args.source:
        files, source = source_files(args.source), "files:" + ",".join(args.source)
    else:
        files, source = bootstrap_prose_files(model_dir), "bootstrap-prose-train"
    if not files:
        raise DatastoreError(f"no file found in {args.source or model_dir}; give --source DIR or GLOB")
    target = load_model(model_dir / "target")
    tokenizer = load_tokenizer(model_dir / "target")
    docs = read_documents(files, tokenizer, max_tokens=args.max_tokens, seed=args.seed)
    cfg = KnnBuildConfig(
        index=args.index, key_dtype=args.key_dtype, max_doc_len=args.max_doc_len, nprobe=args.nprobe, seed=args.seed
    )
    total = sum(len(d) for d in docs)
    print(f"building a kNN-LM datastore from {len(docs)} documents ({total} tokens, {source}): {cfg.index} search")
    store = build_knnlm(target, docs, cfg=cfg, tokenizer_sha256=tokenizer_hash(tokenizer), meta={"source": source})
    st = store.build_stats
    print(
        f"{store.num_entries} entries, {store.bytes_per_entry:.0f} bytes/entry; keys at {st.embed_tokens_per_s:.0f} "
        f"tokens/s ({st.embed_s:.1f}s), index {st.index_s:.1f}s, total {st.total_s:.1f}s"
    )
    if args.out:
        store.save(Path(args.out))
        print(f"saved to {args.out}")
    if not args.no_register:
        reg = open_registry(args.registry, args.stream)
        v = register_knnlm(reg, args.name, store, tags={"source": source}, metrics={"build_s": st.total_s})
        print(f"registered knnlm-{args.name} version {v.version} (alias challenger)")
        if not args.no_promote:
            reg.artifact("knnlm").promote(args.name, v.version, reason="specops knnlm build")
            print(f"knnlm-{args.name}: champion -> {v.version}")
    return 0


def _registry_uri_alias(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--registry-uri", dest="registry", default=argparse.SUPPRESS, metavar="URI", help="same as --registry"
    )


def add_parser(sub) -> None:
    p = sub.add_parser(
        "knnlm",
        help="kNN-LM datastores: build one from text files, list versions",
        description="A kNN-LM datastore maps the target's hidden state at every position of a corpus (the input of "
        "its LM head) to the token that followed. kNN-LM decoding interpolates the target's distribution with one "
        "built from the nearest entries (Khandelwal et al.); RaLMSpec serves it speculatively from a per-request "
        "cache, verified in batches, with the same output. Registered as knnlm-NAME (alias champion is served).",
    )
    ksub = p.add_subparsers(dest="knnlm_command", required=True, metavar="SUBCOMMAND")

    q = ksub.add_parser(
        "build",
        help="build a datastore from text files and register it",
        description="Tokenizes the source files (a seeded shuffle, up to --max-tokens), runs the "
        "target over them in batches (a progress bar counts tokens), stores one entry per position "
        "(key: float16 hidden state, value: next token, its document), builds the searcher, and "
        "registers it as knnlm-NAME, promoted to champion unless --no-promote. Without --source it "
        "reads the bootstrap's prose training files (never its held-out ones).",
    )
    add_registry_args(q)
    _registry_uri_alias(q)
    q.add_argument("--name", required=True, help="registered as knnlm-NAME")
    q.add_argument(
        "--models",
        "--model-dir",
        dest="model_dir",
        default=str(models_dir()),
        metavar="DIR",
        help="bootstrap directory; its target/ makes the keys (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    q.add_argument(
        "--source",
        action="append",
        default=None,
        metavar="DIR|GLOB",
        help="text files (a directory, walked, or a glob; repeatable) (default: the bootstrap's prose training files)",
    )
    q.add_argument("--max-tokens", type=int, default=200_000, help="corpus tokens at most (default: %(default)s)")
    q.add_argument(
        "--index",
        choices=("exact", "ivfpq"),
        default="exact",
        help="exact: blocked matmul over every key; ivfpq: FAISS IVF-PQ (default: %(default)s)",
    )
    q.add_argument("--nprobe", type=int, default=16, help="ivfpq: lists searched per query (default: %(default)s)")
    q.add_argument(
        "--key-dtype",
        choices=("float16", "float32"),
        default="float16",
        help="exact: how keys are stored (default: %(default)s)",
    )
    q.add_argument(
        "--max-doc-len",
        type=int,
        default=1024,
        help="longer documents are split into windows of this many tokens (default: %(default)s)",
    )
    q.add_argument("--seed", type=int, default=0, help="file order and training sample seed (default: %(default)s)")
    q.add_argument("--out", default=None, metavar="DIR", help="also save the datastore here")
    q.add_argument("--no-promote", action="store_true", help="register without making it the champion")
    q.add_argument("--no-register", action="store_true", help="only build (and --out); leave the registry alone")
    q.set_defaults(func=cmd_build)

    q = add_ls(
        ksub,
        "knnlm",
        key_flag="--name",
        archived=False,
        help="list kNN-LM datastore versions",
        description="One row per version: name, aliases, searcher, entries, bytes per entry, build time, "
        "source, target fingerprint.",
    )
    _registry_uri_alias(q)

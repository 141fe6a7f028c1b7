"""``specops datastore build|ls|promote|inspect``: DReSD datastores, built and in the registry."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from specops.cli.artifact import add_ls, add_promote, add_registry_args, open_registry
from specops.paths import models_dir


def _read_documents(path: Path, tokenizer) -> tuple[list[list[int]], list[int]]:
    """JSON lines: ``{"token_ids": [...]}`` or ``{"prompt_ids": [...], "output_ids": [...]}`` or ``{"text": "..."}``.
    Returns the documents' token ids and where each one's output starts (``len(prompt_ids)``, else 0)."""
    from specops.core.errors import DatastoreError

    docs, starts = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            start = 0
            if "token_ids" in obj:
                ids = obj["token_ids"]
            elif "prompt_ids" in obj:
                ids, start = list(obj["prompt_ids"]) + list(obj.get("output_ids", [])), len(obj["prompt_ids"])
            else:
                ids = tokenizer(obj["text"], add_special_tokens=False)["input_ids"]
            if not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError("token ids must be non-negative integers")
        except (ValueError, KeyError, TypeError) as exc:
            raise DatastoreError(
                f"{path}:{n}: not a document ({exc}); each line is a JSON object with token_ids, "
                "prompt_ids (+ output_ids) or text"
            ) from None
        docs.append(ids)
        starts.append(start)
    return docs, starts


def heldout_split(n_docs: int, every: int, max_heldout: int = 200) -> tuple[list[int], list[int]]:
    """(build, held-out) document indices, as the rebuild job splits generations: every ``every``-th
    document is held out (at most ``max_heldout``; the rest of them are built on); with fewer than
    ``every`` documents, the last one. No held-out document when ``every`` is 0 or there are fewer than 2."""
    if every <= 0 or n_docs < 2:
        return list(range(n_docs)), []
    held = list(range(every - 1, n_docs, every))[:max_heldout] or [n_docs - 1]
    kept = set(held)
    return [i for i in range(n_docs) if i not in kept], held


NOT_MEASURED = "no measured draft shape: requests fall back to 3x10, which may serve slower than target-only"


def measure_shape(store, target, docs, starts, *, node_cost: float, max_len: int) -> dict:
    """The rebuild job's measurement on held-out documents (``choose_shape`` over ``SHAPES``, one target
    pass) plus the offline MAR at the rebuild's gate shape (3x10), as ``store.meta["shape"]`` holds it."""
    from specops.core.keys import target_hidden_states
    from specops.trainer.datastores import RebuildConfig, choose_shape, offline_mar

    docs = [list(d[:max_len]) for d in docs]
    hidden = dict(target_hidden_states(target, docs, max_len=max_len))
    (n, k), shapes = choose_shape(store, target, docs, starts, node_cost=node_cost, hidden=hidden)
    gate = RebuildConfig()
    mar = offline_mar(store, target, docs, starts, n_drafts=gate.n_drafts, k=gate.k, hidden=hidden).mar
    speed = shapes[f"{n}x{k}"]["speed_vs_target"]
    return {
        "n_drafts": n,
        "k": k,
        "node_cost": node_cost,
        "replayed": shapes,
        "mar": round(mar, 6),
        "mar_shape": f"{gate.n_drafts}x{gate.k}",
        "speed_vs_target": speed,
        "beats_target": speed >= 1.0,
        "heldout_docs": len(docs),
    }


def slower_warning(shape: dict) -> str:
    return (
        f"WARNING: no draft shape beats target-only on the held-out documents: the best, "
        f"{shape['n_drafts']}x{shape['k']}, replays at {shape['speed_vs_target']:.2f}x target-only speed at "
        f"node_cost {shape['node_cost']:.3f}; on this hardware and traffic target-only (or another method) "
        "serves this cluster faster"
    )


def cmd_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specops.core.datastore import Datastore, DatastoreConfig
    from specops.core.index import IndexConfig
    from specops.core.models import load_model, load_tokenizer
    from specops.core.models import tokenizer_hash as tokenizer_sha256

    model_dir = Path(args.model_dir)
    target = load_model(model_dir / "target")
    tokenizer = load_tokenizer(model_dir / "target")
    if args.documents:
        (docs, starts), source = _read_documents(Path(args.documents), tokenizer), f"file:{args.documents}"
    else:
        from specops.trainer.datastores import corpus_documents

        docs, source = (
            corpus_documents(model_dir, tokenizer, per_domain=args.per_domain, chars=args.chars, seed=args.seed),
            "bootstrap-corpus",
        )
        starts = [0] * len(docs)
    cfg = DatastoreConfig(
        dims=args.dims,
        value_len=args.value_len,
        max_doc_len=args.max_doc_len,
        index=IndexConfig(kind=args.index, quantizer=args.quantizer),
    )
    build_ix, held_ix = heldout_split(len(docs), args.heldout_every)
    held = ([docs[i] for i in held_ix], [starts[i] for i in held_ix])
    docs = [docs[i] for i in build_ix]
    total = sum(min(len(d), cfg.max_doc_len) for d in docs)
    print(
        f"building a datastore from {len(docs)} documents ({total} tokens, {source}; {len(held_ix)} more held out "
        f"to measure its draft shape): {cfg.index.kind} index, {cfg.dims} dims, values of {cfg.value_len} tokens"
    )
    with tqdm(total=total, unit="tok", desc="target hidden states") as bar:
        store, stats = Datastore.build(
            target,
            docs,
            cfg,
            progress=bar.update,
            meta={"source": source, "tokenizer_sha256": tokenizer_sha256(tokenizer)},
        )
    print(
        f"{store.num_entries} entries, {store.bytes_per_entry:.0f} bytes/entry; keys at "
        f"{stats.embed_tokens_per_s:.0f} tokens/s ({stats.embed_s:.1f}s), PCA {stats.fit_s:.1f}s, "
        f"index {stats.index_s:.1f}s; explained variance {float(store.projection.explained.sum()):.2f}"
    )
    shape = None
    if held_ix:
        shape = measure_shape(store, target, *held, node_cost=args.node_cost, max_len=cfg.max_doc_len)
        store.meta["shape"] = shape
        print(
            f"draft shape {shape['n_drafts']}x{shape['k']} (measured on {len(held_ix)} held-out documents at "
            f"node_cost {args.node_cost:g}): {shape['speed_vs_target']:.2f}x target-only speed; offline MAR "
            f"{shape['mar']:.3f} ({shape['mar_shape']})"
        )
        if not shape["beats_target"]:
            print(slower_warning(shape))
    elif args.heldout_every > 0:
        print(f"WARNING: {len(docs)} document(s): too few to hold one out and measure a draft shape; {NOT_MEASURED}")
    else:
        print(f"WARNING: --heldout-every 0: {NOT_MEASURED}")
    if args.out:
        store.save(Path(args.out))
        print(f"saved to {args.out} (serve it as the fallback: specops serve --datastore-dir {args.out})")
    if args.register:
        reg = open_registry(args.registry, args.stream)
        from specops.trainer.datastores import register_datastore

        tags, metrics = {"source": source}, {}
        if shape is not None:
            tags.update(mar=f"{shape['mar']:.6f}", shape=f"{shape['n_drafts']}x{shape['k']}")
            metrics = {"mar": shape["mar"], "shape_speed_vs_target": shape["speed_vs_target"]}
        v = register_datastore(reg, args.register, store, stats, tags=tags, metrics=metrics)
        print(f"registered datastore-{args.register} version {v.version} (alias challenger)")
        kind = reg.artifact("datastore")
        if args.promote or kind.by_alias(args.register) is None:
            kind.promote(args.register, v.version, reason="specops datastore build")
            print(f"datastore-{args.register}: champion -> {v.version}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from specops.core.datastore import Datastore
    from specops.core.errors import DatastoreError

    if args.path:
        info = Datastore.load(Path(args.path)).describe()
    else:
        kind = open_registry(args.registry, None).artifact("datastore")
        v = kind.get(args.cluster, args.version) if args.version else kind.by_alias(args.cluster)
        if v is None:
            raise DatastoreError(f"datastore-{args.cluster} has no champion; give --version or build one")
        with tempfile.TemporaryDirectory(prefix="specops-datastore-") as tmp:
            kind.fetch(v, Path(tmp) / "ds")
            info = {"version": v.version, "aliases": list(v.aliases), **Datastore.load(Path(tmp) / "ds").describe()}
    print(json.dumps(info, indent=1, sort_keys=True))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "datastore",
        help="DReSD datastores: build one (corpus or generations), list versions, promote, inspect",
        description="A DReSD datastore maps the target's hidden state at a position (z-normalised, PCA-reduced, unit "
        "length) to the tokens that followed it; the dresd method drafts from the cluster's datastore "
        "(datastore-<cluster>@champion, hot-swapped by serving). See docs/dresd.md.",
    )
    dsub = p.add_subparsers(dest="datastore_command", required=True, metavar="SUBCOMMAND")

    q = dsub.add_parser(
        "build",
        help="build a datastore from the bootstrap corpus or a file of documents",
        description="Runs the target over the documents in batches (a progress bar shows tokens), "
        "fits z-norm and PCA, builds the index, measures the fastest draft shape and the offline MAR on "
        "held-out documents (--heldout-every; warns when no shape beats target-only), and saves it (--out) "
        "and/or registers it as datastore-CLUSTER (--register; promoted when the cluster has no champion "
        "yet, or with --promote). Without --documents it uses snippets of the bootstrap's training text: the "
        "out-of-distribution fallback for clusters without a datastore of their own.",
    )
    add_registry_args(q)
    q.add_argument(
        "--model-dir",
        default=str(models_dir()),
        help="bootstrap directory (default: %(default)s) (env: SPECOPS_DATA_DIR)",
    )
    q.add_argument(
        "--documents",
        default=None,
        metavar="FILE.jsonl",
        help="JSON lines with token_ids, prompt_ids + output_ids, or text (default: the bootstrap corpus)",
    )
    q.add_argument("--per-domain", type=int, default=400, help="corpus snippets per domain (default: %(default)s)")
    q.add_argument("--chars", type=int, default=2000, help="characters per corpus snippet (default: %(default)s)")
    q.add_argument("--seed", type=int, default=0, help="corpus sampling seed (default: %(default)s)")
    q.add_argument("--dims", type=int, default=64, help="PCA dimensions of a key (default: %(default)s)")
    q.add_argument(
        "--value-len",
        type=int,
        default=21,
        help="tokens stored after each key: the first is matched, the rest drafted (default: %(default)s)",
    )
    q.add_argument("--max-doc-len", type=int, default=1024, help="tokens kept per document (default: %(default)s)")
    q.add_argument("--index", choices=("flat", "hnsw", "scann"), default="hnsw", help="index (default: %(default)s)")
    q.add_argument(
        "--quantizer", choices=("fp16", "sq8"), default="fp16", help="flat/HNSW key storage (default: %(default)s)"
    )
    q.add_argument(
        "--heldout-every",
        type=int,
        default=10,
        metavar="N",
        help="hold out every N-th document (at most 200; the last one when there are fewer than N) and "
        "measure the draft shape and offline MAR on them, as the rebuild job does; 0: build on all, "
        "measure nothing (default: %(default)s)",
    )
    q.add_argument(
        "--node-cost",
        type=float,
        default=0.15,
        help="cost of one drafted token in a verify pass, in one-token target passes, for the shape "
        "measurement (the rebuild's RebuildConfig.node_cost; near 0 on a GPU) (default: %(default)s)",
    )
    q.add_argument("--out", default=None, metavar="DIR", help="save the datastore here")
    q.add_argument("--register", default=None, metavar="CLUSTER", help="register it as datastore-CLUSTER")
    q.add_argument("--promote", action="store_true", help="with --register: make it the champion")
    q.set_defaults(func=cmd_build)

    add_ls(
        dsub,
        "datastore",
        key_flag="--cluster",
        archived=False,
        help="list datastore versions",
        description="One row per datastore version: cluster, aliases, entries, bytes per entry, offline MAR "
        "(measured on held-out documents by rebuilds and builds), live MAR served, draft shape and its replayed "
        "speed vs target-only, a note when no shape beats target-only or none was measured, source, config hash.",
    )
    add_promote(
        dsub,
        "datastore",
        key_name="cluster",
        reason="manual",
        help="make a version the cluster's champion",
        description="Points datastore-CLUSTER@champion at VERSION; serving swaps it in between requests.",
    )

    q = dsub.add_parser(
        "inspect",
        help="describe a datastore: sizes, index, projection, lineage",
        description="Loads a saved datastore (PATH) or a registered version (--cluster, --version; "
        "default the champion), verifying every checksum, and prints its description as JSON.",
    )
    add_registry_args(q, events=False)
    q.add_argument("path", nargs="?", default=None, help="a saved datastore directory")
    q.add_argument("--cluster", default="default", help="registered datastore's cluster (default: %(default)s)")
    q.add_argument("--version", default=None, help="version (default: the champion)")
    q.set_defaults(func=cmd_inspect)

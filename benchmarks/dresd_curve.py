"""Where dense retrieval pays: DReSD, REST and the hybrid ``retrieval`` method along datastore size.

``python benchmarks/dresd.py --curve`` runs this. The same documents feed every drafter:

- **Documents**: the first half of each bootstrap training file (code and prose), cut into
  chunks of ``--chunk-tokens`` tokens, each followed by the target's greedy continuation of
  ``--gen-tokens`` tokens (generated in batches): text of the target's own sources and the
  target's own words, as a datastore rebuilt from traffic holds. Datastores of growing size are
  nested prefixes of one shuffled document list; DReSD's keys are made once (the target over
  every document, in batches) and each size is built from its share of them.
- **Prompt sets** (greedy, ``--max-new-tokens``):
  ``id``: windows of the *second* halves of the same files (the same distribution, never in a
  datastore); ``chat``: production-shaped chat requests (``specops.workloads.chat_workload``: SQL, math, API
  questions), a different distribution; ``perturbed``: datastore contexts with renamed
  identifiers or synonyms near their end whose target continuation is unchanged
  (``benchmarks/dresd_perturb.py``), where exact suffix matching should fail and dense retrieval
  should not (DReSD §2.2.1).
- **Drafters**: REST through its own library (``draftretriever``, 64 trie nodes, rows of up to
  10 tokens), DReSD (10 x 10, the paper's), and the hybrid (REST's rule over the datastore's
  tokens with 64 nodes, DReSD's 10 x 10 rows where the exact suffix is shorter than
  ``dense_below`` tokens).

**Replay** (exact for greedy decoding): the target's greedy output for each prompt is computed
once; a drafter's step at committed length ``c`` proposes rows from the committed tokens (and
the target's hidden state before ``c``, which one target pass over prompt + output gives for
every position); the step accepts the longest row prefix that equals the output and emits one
more token. MAR (accepted / drafted per prompt, averaged), accepted tokens per step, the
fraction of steps that drafted anything, and tree nodes per step come from it. Tokens/s come
from **live** decoding with ``SpecEngine`` on a subset of prompts, arms interleaved, outputs
checked equal to target-only. The key layer (final normalised state vs a middle layer vs both)
and the hybrid's ``dense_below`` are swept by replay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.llma_tune import verify_cost
from benchmarks.rest_baseline import RestIndex
from benchmarks.retrieval_curve.arms import (  # noqa: F401  (some only re-exported: the names this module used to define)
    _GREEDY,
    ARMS,
    NODE_COST,
    REST_CHOICES,
    SHAPE,
    STEP_OVERHEAD,
    Replay,
    extrapolate,
    key_states_row,
    live_arms,
    proposers,
    replay,
    run_live,
    search_p50_ms,
    serving_hybrid,
    tune_hybrid,
)
from benchmarks.retrieval_curve.report import (  # noqa: F401  (some only re-exported: the names this module used to define)
    DOC_BEGIN,
    DOC_END,
    KEY_LAYER_MARGIN,
    markdown,
    pick_key_layer,
    plot,
    summary,
)
from specops.core.datastore import Datastore, DatastoreConfig

log = logging.getLogger("benchmarks.dresd_curve")
CACHE = Path(".specops/bench/dresd_curve")
SETS = ("id", "chat", "perturbed")


# ---------------------------------------------------------------- data
def _files(model_dir: Path, seed: int) -> list[tuple[str, str]]:
    from specops.trainer.bootstrap import load_manifest

    manifest = load_manifest(model_dir)
    out = []
    for domain, split in sorted(manifest["domains"].items()):
        heldout = set(split.get("heldout", ()))
        out += [(domain, p) for p in split["train"] if p not in heldout]
    random.Random(seed).shuffle(out)
    return out


def documents(pair, model_dir: Path, *, entries: int, chunk: int, gen: int, prompts: int, seed: int = 0):
    """(docs, id_prompts, gen_seconds, generated): datastore documents (chunk + the target's
    continuation) until ``entries`` entries, and up to ``prompts`` ID prompts (64-token windows of
    the files' second halves, one per file). Cached on disk by their parameters and the target."""
    from specops.trainer.bootstrap.corpus import read_document

    tok = pair.tokenizer
    key = hashlib.sha256(
        json.dumps([str(model_dir.resolve()), entries, chunk, gen, prompts, seed]).encode()
    ).hexdigest()[:12]
    path = CACHE / f"docs_{key}.json"
    if path.exists():
        data = json.loads(path.read_text())
        return data["docs"], data["id_prompts"], data["gen_s"], data["generated"]
    chunks, id_prompts, total = [], [], 0
    for domain, file in _files(model_dir, seed):
        text = read_document(file, domain)
        if not text or len(text) < 800:
            continue
        half = len(text) // 2
        head = tok(text[:half], add_special_tokens=False)["input_ids"]
        tail = tok(text[half:], add_special_tokens=False)["input_ids"]
        if len(id_prompts) < prompts and len(tail) >= 96:
            start = len(tail) // 3
            id_prompts.append({"domain": domain, "ids": tail[start : start + 64]})
        for s in range(0, len(head) - chunk // 2, chunk):
            if total >= entries:
                break
            piece = head[s : s + chunk]
            chunks.append({"domain": domain, "ids": piece})
            total += len(piece) + gen - 1
        if total >= entries and len(id_prompts) >= prompts:
            break
    docs, generated, t0 = [], 0, time.perf_counter()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    for ch, out in zip(chunks, greedy_batches(pair.target, [c["ids"] for c in chunks], gen, pad, "documents")):
        docs.append({"domain": ch["domain"], "ids": ch["ids"] + out, "split": len(ch["ids"])})
        generated += len(out)
    gen_s = time.perf_counter() - t0
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"docs": docs, "id_prompts": id_prompts, "gen_s": gen_s, "generated": generated}))
    return docs, id_prompts, gen_s, generated


@torch.no_grad()
def greedy_batches(target, prompts: list[list[int]], new_tokens: int, pad: int, what: str, batch: int = 64):
    """The target's greedy continuations (``new_tokens`` each, cut after an EOS), in batches of
    prompts of similar length (left padding, as HF ``generate`` wants): the harness's one loop."""
    from benchmarks.harness.greedy import generation_eos
    from benchmarks.harness.greedy import greedy_batches as batched

    eos = generation_eos(target)
    return batched(target, prompts, new_tokens, pad, batch=batch, eos=eos, desc=f"target generations ({what})")


@torch.no_grad()
def layer_states(target, seqs: list[list[int]], layers: tuple[int, ...], batch_tokens: int = 4096, desc: str = ""):
    """{layer: [per sequence [len, hidden] float32]} from one pass per batch (``output_hidden_states``:
    index 0 is the embeddings, the last the final normalised state)."""
    base = getattr(target, "model", target)
    out = {layer: [None] * len(seqs) for layer in layers}
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    for idx in tqdm(batches, desc=desc or "target hidden states", unit="batch"):
        width = max(len(seqs[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        hs = base(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for layer in layers:
            h = hs[layer].float().numpy()
            for r, i in enumerate(idx):
                out[layer][i] = np.ascontiguousarray(h[r, : len(seqs[i])])
    return out


def key_states(states: dict, key: str, i: int) -> np.ndarray:
    """Document ``i``'s key input for ``key``: ``final``, ``middle`` or ``concat`` (both)."""
    if key == "concat":
        return np.concatenate([states["middle"][i], states["final"][i]], axis=1)
    return states[key][i]


# ---------------------------------------------------------------- the run
def run(pair, model_dir: Path, args) -> dict:
    from benchmarks.dresd_perturb import build_perturbed_set
    from specops.serving.engine.spec import SpecEngine
    from specops.workloads.chat_workload import chat_workload

    tok, target = pair.tokenizer, pair.target
    sizes = sorted(args.sizes)
    n_layers = int(target.config.num_hidden_layers)
    layers = {"final": n_layers, "middle": n_layers // 2}
    t0 = time.perf_counter()
    docs, id_raw, gen_s, generated = documents(
        pair, model_dir, entries=sizes[-1], chunk=args.chunk_tokens, gen=args.gen_tokens, prompts=args.set_prompts
    )
    log.info("documents: %d (%d generated tokens in %.0fs)", len(docs), generated, gen_s)
    seqs = [d["ids"] for d in docs]

    # Keys: the target over every document once, final and middle layer.
    t = time.perf_counter()
    need = ("final", "middle") if args.key_layers else ("final",)
    raw = layer_states(target, seqs, tuple(layers[n] for n in need), desc="keys: target over the documents")
    doc_states = {n: raw[layers[n]] for n in need}
    keys_s = time.perf_counter() - t
    keys_tps = sum(len(s) for s in seqs) / keys_s

    # Prompt sets.
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    chat = chat_workload(tok, {"eval": args.set_prompts // 3 + 1}, seed=7)
    chat_prompts = [p.token_ids for d in chat.values() for p in d["eval"]][: args.set_prompts]
    # Perturbed contexts come from the documents of the second smallest datastore (the smallest
    # holds too few of them), so every size from there on holds their originals (context: the
    # chunk; continuation: the target's, which the document stores).
    pert_from = sizes[min(1, len(sizes) - 1)]
    small = _docs_for(docs, pert_from)
    perturbed, pstats = [], {}
    for domain in ("code", "prose"):
        sub = [(d["ids"][: d["split"]], d["ids"][d["split"] :]) for d in docs[:small] if d["domain"] == domain]
        kept, st = build_perturbed_set(
            target, tok, sub, domain=domain, check_tokens=args.check_tokens, seed=11, tail_chars=args.tail_chars
        )
        perturbed += [k for k in kept if k.tail_overlap < args.max_tail_overlap]
        pstats[domain] = st
    sets = {
        "id": [p["ids"] for p in id_raw][: args.set_prompts],
        "chat": chat_prompts,
        "perturbed": [list(k.prompt_ids) for k in perturbed][: args.set_prompts],
    }
    log.info("prompt sets: %s", {k: len(v) for k, v in sets.items()})

    # The target's greedy outputs and states along prompt + output, per set; the even-numbered
    # prompts of each set are the dev split (the hybrid's settings are chosen there), the
    # odd-numbered ones the test split (every arm is reported there).
    dev: dict[str, list[Replay]] = {}
    cases: dict[str, list[Replay]] = {}
    for name, prompts in sets.items():
        outs = greedy_batches(target, prompts, args.max_new_tokens, pad, name)
        full = [p + o for p, o in zip(prompts, outs)]
        st = layer_states(target, full, tuple(layers[n] for n in need), desc=f"states ({name})")
        every = [Replay(p, o, {n: st[layers[n]][i] for n in need}) for i, (p, o) in enumerate(zip(prompts, outs))]
        dev[name], cases[name] = every[0::2], every[1::2]
    test_prompts = {name: prompts[1::2] for name, prompts in sets.items()}
    cost = verify_cost(pair, int(np.median([len(p) for p in sets["id"]])), args.cost_reps)
    log.info("verify cost: %.1f ms + %.2f ms per token", 1e3 * cost[0], 1e3 * cost[1])

    # The sweeps, on the dev split at the second size: the key layer, and the hybrid's dense_below
    # and exact_nodes (its live shape), priced by the measured verify cost.
    engine = SpecEngine(pair)
    rng = random.Random(0)
    sweep_size = sizes[min(1, len(sizes) - 1)]
    part = seqs[: _docs_for(docs, sweep_size)]
    store, _ = Datastore.build(target, part, DatastoreConfig(value_len=21), hidden=lambda i: doc_states["final"][i])
    dev_sets = {n: cs for n, cs in dev.items() if cs}
    tuning = tune_hybrid(store, dev_sets, cost, args.dense_below, args.exact_nodes)
    args.dense_below, args.exact_nodes = tuning["chosen"]["dense_below"], tuning["chosen"]["exact_nodes"]
    log.info("hybrid chosen on the dev split: %s", tuning["chosen"])
    layer_sweep = key_layer_sweep(target, part, doc_states, dev_sets) if args.key_layers else {}
    del store

    curve = []
    for size in sizes:
        n_docs = _docs_for(docs, size)
        part = seqs[:n_docs]
        t = time.perf_counter()
        store, bst = Datastore.build(
            target, part, DatastoreConfig(value_len=21), hidden=lambda i: doc_states["final"][i]
        )
        build_s = time.perf_counter() - t
        t = time.perf_counter()
        rest = RestIndex(part, pair.vocab_size)
        rest_s = time.perf_counter() - t
        t = time.perf_counter()
        store.suffix_index()
        suffix_s = time.perf_counter() - t
        entries = store.num_entries
        point = {
            "entries": entries,
            "docs": n_docs,
            "tokens": int(len(store.tokens)),
            "build_s": {
                "keys_s": round(sum(len(s) for s in part) / keys_tps, 1),
                "fit_index_s": round(build_s, 1),
                "rest_s": round(rest_s, 1),
                "suffix_s": round(suffix_s, 2),
                "generate_s": round(gen_s * n_docs / max(1, len(docs)), 1),
            },
            "bytes_per_entry": {
                "dresd": round(store.bytes_per_entry, 1),
                "rest": round(rest.num_bytes / rest.num_tokens, 1),
                "hybrid": round((store.num_bytes + store.suffix_index().num_bytes) / entries, 1),
            },
        }
        props = proposers(store, rest, dense_below=args.dense_below)
        props["hybrid_live"] = serving_hybrid(store, dense_below=args.dense_below, exact_nodes=args.exact_nodes)
        point["sets"] = {}
        for name, cs in cases.items():
            if not cs or (name == "perturbed" and size < pert_from):
                continue
            point["sets"][name] = {a: replay(cs, props[a], cost=cost) for a in ARMS + ("hybrid_live",)}
        qs = [(c.seq[: len(c.prompt)], c.states["final"][len(c.prompt) - 1]) for c in cases["id"][:100]]
        point["search_p50_ms"] = search_p50_ms(store, rest, qs)
        arms = live_arms(store, rest, args.dense_below, args.exact_nodes)
        point["live"] = {}
        for name in ("id", "chat"):
            sub = rng.sample(test_prompts[name], min(args.live_prompts, len(test_prompts[name])))
            point["live"][name] = run_live(engine, arms, sub, args.max_new_tokens, f"live {name} @ {entries:,}")
        log.info("point %s: %s", entries, json.dumps({k: point[k] for k in ("sets", "live")}))
        curve.append(point)
        del store, rest
    return {
        "config": {
            "sizes": sizes,
            "chunk_tokens": args.chunk_tokens,
            "gen_tokens": args.gen_tokens,
            "perturbation_tail_chars": args.tail_chars,
            "perturbation_check_tokens": args.check_tokens,
            "perturbed_from_entries": pert_from,
            "perturbation_max_tail_overlap": args.max_tail_overlap,
            "max_new_tokens": args.max_new_tokens,
            "set_prompts": {k: len(v) for k, v in sets.items()},
            "live_prompts": args.live_prompts,
            "shape": f"{SHAPE[0]}x{SHAPE[1]}",
            "rest_choices": REST_CHOICES,
            "dense_below": args.dense_below,
            "exact_nodes": args.exact_nodes,
            "split": "test",
            "tuned_on": "dev",
            "split_prompts": {
                "dev": {k: len(v) for k, v in dev.items()},
                "test": {k: len(v) for k, v in cases.items()},
            },
            "sweep_entries": sweep_size,
            "verify_cost_ms": [round(1e3 * cost[0], 2), round(1e3 * cost[1], 3)],
        },
        "documents": {"docs": len(docs), "generated_tokens": generated, "generate_s": round(gen_s, 1)},
        "keys_tokens_per_s": round(keys_tps, 1),
        "perturbation": {**pstats, "kept_tail_overlap_below_8": len(perturbed)},
        "curve": curve,
        "extrapolation": {name: extrapolate(curve, name) for name in ("id", "chat", "perturbed") if cases.get(name)},
        "key_layer_sweep": layer_sweep,
        "hybrid_tuning": tuning,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _docs_for(docs: list[dict], entries: int) -> int:
    """How many of the first documents hold at least ``entries`` entries (all of them if fewer)."""
    total = 0
    for i, d in enumerate(docs):
        total += len(d["ids"]) - 1
        if total >= entries:
            return i + 1
    return len(docs)


def key_layer_sweep(target, part: list[list[int]], doc_states: dict, cases: dict) -> dict:
    """DReSD's accepted tokens per step with keys from the final state, the middle layer and both."""
    out = {}
    n, length = SHAPE
    for key in ("final", "middle", "concat"):
        store, _ = Datastore.build(
            target, part, DatastoreConfig(value_len=21), hidden=lambda i, key=key: key_states(doc_states, key, i)
        )

        def rows(ctx, hidden, store=store):
            return [] if hidden is None else store.drafts(hidden, int(ctx[-1]), n_drafts=n, length=length)

        out[key] = {name: replay(cs, rows, key=key)["al"] for name, cs in cases.items() if cs}
        del store
    return out


def main(argv=None) -> int:
    import argparse
    import sys

    from benchmarks.common import cpu_model, environment, finish_report
    from specops.core.models import load_model_dir

    ap = argparse.ArgumentParser(
        prog="dresd.py --curve",
        description="DReSD, REST and the hybrid retrieval drafter along datastore size (see the module docstring).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--curve", action="store_true", help="(this mode)")
    ap.add_argument("--quick", action="store_true", help="sizes 3k/10k, 12 prompts per set, 4 live prompts")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report (with a summary) here")
    ap.add_argument("--doc", type=Path, default=None, metavar="PATH", help="write the table into this markdown file")
    ap.add_argument(
        "--plot", type=Path, default=None, metavar="PNG", help="plot path (default: img/dresd_curve.png beside --doc)"
    )
    ap.add_argument("--model-dir", default=".specops/models", help="bootstrap directory (default: %(default)s)")
    ap.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="datastore sizes in entries (default 30k 100k 300k)"
    )
    ap.add_argument("--set-prompts", type=int, default=None, help="prompts per set (default 100)")
    ap.add_argument("--live-prompts", type=int, default=None, help="prompts per set timed live per size (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per completion (default: %(default)s)")
    ap.add_argument("--chunk-tokens", type=int, default=64, help="corpus tokens per document (default: %(default)s)")
    ap.add_argument("--check-tokens", type=int, default=8, help="perturbed: target tokens that must not change")
    ap.add_argument("--gen-tokens", type=int, default=16, help="target tokens after each chunk (default: %(default)s)")
    ap.add_argument(
        "--dense-below",
        type=int,
        default=None,
        help="hybrid: dense rows below this exact match (default: tuned on dev)",
    )
    ap.add_argument(
        "--exact-nodes", type=int, default=None, help="live hybrid: exact trie nodes (default: tuned on dev)"
    )
    ap.add_argument(
        "--cost-reps", type=int, default=7, help="reps of each verify-cost measurement (the fastest counts)"
    )
    ap.add_argument("--tail-chars", type=int, default=48, help="perturbations touch this many trailing characters")
    ap.add_argument(
        "--max-tail-overlap", type=int, default=8, help="keep perturbed contexts sharing fewer trailing tokens"
    )
    ap.add_argument("--no-key-layers", dest="key_layers", action="store_false", help="skip the key-layer sweep")
    ap.add_argument(
        "--replot", type=Path, default=None, metavar="JSON", help="redo summary, table and plot from a run's JSON"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.sizes = args.sizes or ([3_000, 10_000] if args.quick else [30_000, 100_000, 300_000])
    args.set_prompts = args.set_prompts or (12 if args.quick else 100)
    args.live_prompts = args.live_prompts if args.live_prompts is not None else (4 if args.quick else 16)
    if args.replot:
        report = json.loads(args.replot.read_text())
        report["extrapolation"] = {n: extrapolate(report["curve"], n) for n in SETS}
        report["extrapolation"] = {n: e for n, e in report["extrapolation"].items() if e}
        command = report.setdefault(
            "command", "python benchmarks/dresd.py --curve --json benchmarks/out/dresd.json --doc docs/benchmarks.md"
        )
    else:
        torch.manual_seed(0)
        model_dir = Path(args.model_dir)
        pair = load_model_dir(model_dir)
        report = run(pair, model_dir, args)
        report["environment"] = {**environment(), "cpu_model": cpu_model()}
        command = "python benchmarks/dresd.py " + " ".join(sys.argv[1:] if argv is None else argv)
        report["command"] = command
    finish_report(
        report,
        args,
        summary=summary,
        markdown=lambda r, rel: markdown(r, rel, command),
        plot=plot,
        png_name="dresd_curve.png",
        begin=DOC_BEGIN,
        end=DOC_END,
    )
    return 0

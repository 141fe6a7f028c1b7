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
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.rest_baseline import RestIndex, RestProposer
from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.suffix import MAX_N
from specops.serving.engine.types import DecodeState, SamplingParams
from specops.serving.proposers.retrieval import RetrievalProposer, merge_rows

log = logging.getLogger("benchmarks.dresd_curve")
CACHE = Path(".specops/bench/dresd_curve")
SHAPE = (10, 10)
"""DReSD's rows x tokens (the paper's 10 x 10) for every dense arm."""
REST_CHOICES = 64
NODE_COST, STEP_OVERHEAD = 0.15, 0.04
"""The rebuild job's cost model (``specops.trainer.datastores``): a verified tree node costs 0.15 of a
one-token target pass on 2 CPU cores, a step 4 % more than the pass."""
SETS = ("id", "chat", "perturbed")
ARMS = ("dresd", "rest", "rest_rule", "hybrid")
"""Replayed drafters: DReSD, REST through its library, REST's rule in our code, the hybrid."""


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
    prompts of similar length (left padding, as HF ``generate`` wants)."""
    eos = getattr(target.generation_config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    for b in tqdm(range(0, len(order), batch), desc=f"target generations ({what})", unit="batch"):
        idx = order[b : b + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        gen = target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad
        )
        for r, i in enumerate(idx):
            g = gen[r, width:].tolist()
            cut = next((j for j, t in enumerate(g) if t in eos), None)
            out[i] = g[: cut + 1] if cut is not None else g
    return out


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


# ---------------------------------------------------------------- replay
class Replay:
    """One prompt's greedy replay: its full sequence (prompt + the target's output) and key states."""

    def __init__(self, prompt: list[int], output: list[int], states: dict[str, np.ndarray]):
        self.prompt, self.seq, self.states = prompt, prompt + output, states


def replay(cases: list[Replay], propose, *, key: str = "final") -> dict:
    """``propose(context, hidden_or_None) -> rows`` over every case; the paper's MAR and the rest."""
    per_case, steps, accepted_total, drafted_steps, nodes = [], 0, 0, 0, 0
    for case in cases:
        if hasattr(propose, "start"):  # a per-request drafter (REST's library: a fresh reader)
            propose.start()
        seq, c = case.seq, len(case.prompt)
        drafted = accepted = 0
        first = True
        while c < len(seq):
            hidden = None if first else key_states_row(case.states, key, c - 2)
            rows = [r for r in propose(seq[:c], hidden) if r]
            best = 0
            for row in rows:
                n = 0
                while n < len(row) and c + n < len(seq) and row[n] == seq[c + n]:
                    n += 1
                best = max(best, n)
            if rows:
                drafted_steps += 1
                drafted += max(len(r) for r in rows)
                nodes += len({tuple(r[: j + 1]) for r in rows for j in range(len(r))})
            accepted += best
            steps += 1
            c += best + 1
            first = False
        accepted_total += accepted
        per_case.append(accepted / drafted if drafted else 0.0)
    return {
        "mar": round(float(np.mean(per_case)), 4) if per_case else 0.0,
        "al": round(accepted_total / steps, 4) if steps else 0.0,
        "drafted_fraction": round(drafted_steps / steps, 4) if steps else 0.0,
        "nodes_per_step": round(nodes / steps, 2) if steps else 0.0,
        "steps": steps,
        # tokens per unit of step time against target-only's 1, with a verified node costing
        # NODE_COST of a one-token pass (2 CPU cores, SmolLM2-135M; specops.trainer.datastores.choose_shape)
        "speed_model": round((accepted_total / steps + 1) / (1 + STEP_OVERHEAD + NODE_COST * nodes / steps), 3)
        if steps
        else 0.0,
    }


def key_states_row(states: dict, key: str, pos: int) -> np.ndarray:
    if key == "concat":
        return np.concatenate([states["middle"][pos], states["final"][pos]])
    return states[key][pos]


def proposers(store: Datastore, rest: RestIndex, *, dense_below: int, k: int = 10) -> dict:
    """name -> propose(context, hidden) for the replay."""
    n, length = SHAPE
    rest_p = RestProposer(rest, choices=REST_CHOICES)
    suffix = store.suffix_index()

    class RestRows:  # REST's library, a fresh reader per request (``rest_baseline``)
        def start(self):
            rest_p.start()

        def __call__(self, ctx, hidden):
            state = DecodeState(token_ids=list(ctx), num_prompt_tokens=len(ctx), params=_GREEDY)
            return rest_p.propose(state, k).rows()

    def rest_rule(ctx, hidden):  # REST's rule (16 down to 2 tokens) over the datastore's tokens, ours
        return suffix.lookup(ctx[-MAX_N:], k, max_nodes=REST_CHOICES).rows

    def dense_rows(ctx, hidden):
        return [] if hidden is None else store.drafts(hidden, int(ctx[-1]), n_drafts=n, length=length)

    def hybrid(below):
        def rows(ctx, hidden):
            exact = suffix.lookup(ctx[-MAX_N:], k, max_nodes=REST_CHOICES)
            dense = dense_rows(ctx, hidden) if exact.length < below else []
            return merge_rows(exact.rows, dense)

        return rows

    return {
        "rest": RestRows(),
        "rest_rule": rest_rule,
        "dresd": dense_rows,
        "hybrid": hybrid(dense_below),
        "_hybrid": hybrid,
    }


_GREEDY = SamplingParams(max_new_tokens=1)


# ---------------------------------------------------------------- live
def live_arms(store: Datastore, rest: RestIndex, dense_below: int) -> dict:
    """name -> (factory of a fresh proposer, k); None: target-only. REST at its native 64 nodes (the
    fastest REST arm on this hardware), DReSD at the 1 x 4 shape its rebuild replay picks on 2 CPU
    cores, the hybrid at serving's defaults with one dense row (the same CPU budget)."""
    from specops.serving.proposers.dresd import DReSDProposer
    from specops.serving.proposers.retrieval import EXACT_NODES

    return {
        "target": None,
        "rest": (lambda: RestProposer(rest, choices=REST_CHOICES), 10),
        "dresd": (lambda: DReSDProposer(store, n_drafts=1), 4),
        "hybrid": (
            lambda: RetrievalProposer(store, n_drafts=1, dense_below=dense_below, exact_nodes=EXACT_NODES),
            10,
        ),
    }


def run_live(engine, arms: dict, prompts: list[list[int]], new_tokens: int, desc: str) -> dict:
    """Median tokens/s per arm over ``prompts`` (arms rotated per prompt) and greedy equality."""
    tps = {a: [] for a in arms}
    identical = True
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        order = list(arms)
        order = order[i % len(order) :] + order[: i % len(order)]
        outs = {}
        for a in order:
            params = SamplingParams(max_new_tokens=new_tokens)
            if arms[a] is None:
                r = engine.generate(prompt, params, method="target")
            else:
                make, k = arms[a]
                r = engine.generate(prompt, params, proposer=make(), k=k)
            outs[a] = r.token_ids
            tps[a].append(r.stats.tokens_per_s)
        identical &= all(o == outs["target"] for o in outs.values())
    med = {a: round(statistics.median(v), 2) for a, v in tps.items()}
    return {
        "tokens_per_s": med,
        "vs_target": {a: round(v / med["target"], 3) for a, v in med.items()},
        "identical": identical,
    }


def search_p50_ms(store: Datastore, rest: RestIndex, queries: list[tuple[list[int], np.ndarray]]) -> dict:
    """Single-query search latency: DReSD's index, REST's suffix array, the hybrid's exact lookup."""
    rest_p = RestProposer(rest, choices=REST_CHOICES)
    suffix = store.suffix_index()
    out = {"dresd": [], "rest": [], "hybrid_exact": []}
    for ctx, hidden in queries:
        t = time.perf_counter()
        store.search(hidden.reshape(1, -1), 80)
        out["dresd"].append(time.perf_counter() - t)
        t = time.perf_counter()
        rest_p.propose(DecodeState(token_ids=list(ctx), num_prompt_tokens=len(ctx), params=_GREEDY), 10)
        out["rest"].append(time.perf_counter() - t)
        t = time.perf_counter()
        suffix.lookup(ctx[-MAX_N:], 10, max_nodes=REST_CHOICES)
        out["hybrid_exact"].append(time.perf_counter() - t)
    return {a: round(1000 * statistics.median(v), 3) for a, v in out.items()}


def extrapolate(curve: list[dict], set_name: str) -> dict:
    """A straight line of accepted tokens per step against log10(entries) per drafter, and where
    DReSD's would meet REST's (an extrapolation past the measured sizes, said as one)."""
    curve = [p for p in curve if set_name in p["sets"]]
    x = np.log10([p["entries"] for p in curve])
    if len(x) < 2:
        return {}
    fit = {}
    for arm in ("dresd", "rest"):
        y = np.array([p["sets"][set_name][arm]["al"] for p in curve])
        slope, icpt = np.polyfit(x, y, 1)
        fit[arm] = {"slope_per_decade": round(float(slope), 4), "intercept": round(float(icpt), 4)}
    ds, rs = fit["dresd"]["slope_per_decade"], fit["rest"]["slope_per_decade"]
    gap = fit["rest"]["intercept"] - fit["dresd"]["intercept"]
    cross, above = None, bool(gap < 0)  # above: DReSD's line is over REST's at 1 entry already
    if abs(ds - rs) > 1e-6:
        cross_log = gap / (ds - rs)
        if x.min() < cross_log < 15:  # past the smallest measured size, within reason
            cross = float(10**cross_log)
    if cross is None:
        above = bool(
            np.polyval([ds, fit["dresd"]["intercept"]], x.max()) > np.polyval([rs, fit["rest"]["intercept"]], x.max())
        )
    return {**fit, "crossing_entries": cross, "dresd_above_at_largest": above, "extrapolated": True}


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

    # The target's greedy outputs and states along prompt + output, per set.
    cases: dict[str, list[Replay]] = {}
    for name, prompts in sets.items():
        outs = greedy_batches(target, prompts, args.max_new_tokens, pad, name)
        full = [p + o for p, o in zip(prompts, outs)]
        st = layer_states(target, full, tuple(layers[n] for n in need), desc=f"states ({name})")
        cases[name] = [Replay(p, o, {n: st[layers[n]][i] for n in need}) for i, (p, o) in enumerate(zip(prompts, outs))]

    curve, layer_sweep, below_sweep = [], {}, {}
    engine = SpecEngine(pair)
    rng = random.Random(0)
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
        point["sets"] = {}
        for name, cs in cases.items():
            if not cs or (name == "perturbed" and size < pert_from):
                continue
            point["sets"][name] = {a: replay(cs, props[a]) for a in ARMS}
        if size == sizes[min(1, len(sizes) - 1)]:  # the sweeps at the second size
            below_sweep = {
                str(b): {name: replay(cases[name], props["_hybrid"](b))["al"] for name in point["sets"]}
                for b in (0, 2, 4, 6, 8, MAX_N + 1)
            }
            if args.key_layers:
                layer_sweep = key_layer_sweep(target, part, doc_states, {n: cases[n] for n in point["sets"]})
        qs = [(c.seq[: len(c.prompt)], c.states["final"][len(c.prompt) - 1]) for c in cases["id"][:100]]
        point["search_p50_ms"] = search_p50_ms(store, rest, qs)
        arms = live_arms(store, rest, args.dense_below)
        point["live"] = {}
        for name in ("id", "chat"):
            sub = rng.sample(sets[name], min(args.live_prompts, len(sets[name])))
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
        },
        "documents": {"docs": len(docs), "generated_tokens": generated, "generate_s": round(gen_s, 1)},
        "keys_tokens_per_s": round(keys_tps, 1),
        "perturbation": {**pstats, "kept_tail_overlap_below_8": len(perturbed)},
        "curve": curve,
        "extrapolation": {name: extrapolate(curve, name) for name in ("id", "chat", "perturbed") if cases.get(name)},
        "key_layer_sweep": layer_sweep,
        "dense_below_sweep": below_sweep,
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


# ---------------------------------------------------------------- report
def summary(report: dict) -> dict:
    """The summary keys issue 38 names, from the curve."""
    curve = report["curve"]
    points = []
    for p in curve:
        row = {"entries": p["entries"]}
        for set_name, arms in p["sets"].items():
            sfx = "" if set_name == "id" else f"_{set_name}"
            for arm in ARMS:
                row[f"mar_{arm}{sfx}"] = arms[arm]["mar"]
                row[f"al_{arm}{sfx}"] = arms[arm]["al"]
                row[f"drafted_fraction_{arm}{sfx}"] = arms[arm]["drafted_fraction"]
        row["tokens_per_s_vs_target"] = {s: live["vs_target"] for s, live in p["live"].items()}
        row["search_p50_ms"] = p["search_p50_ms"]
        row["bytes_per_entry"] = p["bytes_per_entry"]
        points.append(row)
    pert = [p["sets"]["perturbed"] for p in curve if "perturbed" in p["sets"]]
    ratios = [s["dresd"]["al"] / s["rest"]["al"] if s["rest"]["al"] else None for s in pert]
    hybrid_vs_best = [
        arms["hybrid"]["al"] / max(arms["dresd"]["al"], arms["rest"]["al"], arms.get("rest_rule", {}).get("al", 0))
        for p in curve
        for arms in p["sets"].values()
        if max(arms["dresd"]["al"], arms["rest"]["al"]) > 0
    ]
    key_layer, key_gain = pick_key_layer(report.get("key_layer_sweep") or {})
    return {
        "curve": points,
        "perturbed_al_ratio_vs_rest": round(min(r for r in ratios if r is not None), 3) if any(ratios) else None,
        "perturbed_al_ratio_vs_rest_by_size": [round(r, 3) if r is not None else None for r in ratios],
        "hybrid_al_vs_best": round(min(hybrid_vs_best), 3) if hybrid_vs_best else None,
        "hybrid_tokens_per_s_vs_target": min(p["live"]["id"]["vs_target"]["hybrid"] for p in curve),
        "key_layer": key_layer,
        "key_layer_gain_vs_final": key_gain,
        "greedy_identical": all(live["identical"] for p in curve for live in p["live"].values()),
        "crossing_entries_id": report["extrapolation"].get("id", {}).get("crossing_entries"),
        "largest_entries": curve[-1]["entries"] if curve else 0,
    }


KEY_LAYER_MARGIN = 1.05
"""Another key layer replaces the final state only if its accepted tokens per step, summed over the
prompt sets (so that a set where every layer accepts ~0.1 token per step cannot decide by noise),
are at least 5 % above the final state's: serving keys on the final state, which the verifier
returns with every verdict at no cost."""


def pick_key_layer(sweep: dict) -> tuple[str, float]:
    """The key layer to use and the best layer's pooled AL relative to the final state's."""
    if not sweep or "final" not in sweep:
        return "final", 1.0
    base = sum(sweep["final"].values())
    rel = {k: sum(sets.values()) / base if base else 1.0 for k, sets in sweep.items()}
    best = max(rel, key=rel.get)
    return (best if rel[best] >= KEY_LAYER_MARGIN else "final"), round(rel[best], 3)


def markdown(report: dict, plot_rel: str | None, command: str) -> str:
    from benchmarks.common import fmt

    s, cfg = report["summary"], report["config"]
    sizes = ", ".join(f"{p['entries']:,}" for p in report["curve"])
    lines = [
        DOC_BEGIN,
        "## Where dense retrieval pays: DReSD, REST and the hybrid along datastore size",
        "",
        f"`{command}`: datastores of {sizes} entries "
        f"(chunks of {cfg['chunk_tokens']} tokens of the bootstrap's training files plus the target's "
        f"{cfg['gen_tokens']}-token greedy continuation; DReSD and REST over the same documents), "
        f"prompt sets {cfg['set_prompts']} ({cfg['max_new_tokens']} new tokens, greedy). DReSD "
        f"{cfg['shape']}, REST {cfg['rest_choices']} trie nodes (through its library, a fresh reader per request, "
        f"and REST's rule in our code, `rest rule`), hybrid = REST's rule over the datastore's "
        f"tokens ({cfg['rest_choices']} nodes) plus DReSD's rows where the exact suffix is shorter than "
        f"{cfg['dense_below']} tokens. CPU: {report.get('environment', {}).get('cpu_model', 'unknown')}. Replayed: MAR, accepted tokens per step (AL), fraction of steps "
        f"that drafted; live ({cfg['live_prompts']} prompts per set, arms interleaved, the CPU budgets: REST "
        f"native, DReSD 1 x 4, the hybrid's exact trie of 24 nodes plus one dense row): tokens/s vs target-only.",
        "",
        "| entries | set | MAR dresd / rest / rest rule / hybrid | AL dresd / rest / rest rule / hybrid "
        "| drafted dresd / rest / rest rule / hybrid | tokens/s vs target dresd / rest / hybrid |",
        "|---|---|---|---|---|---|",
    ]
    for p in report["curve"]:
        for name, arms in p["sets"].items():
            live = p["live"].get(name, {}).get("vs_target")
            tps = " / ".join(fmt(live[a]) for a in ("dresd", "rest", "hybrid")) if live else "–"
            lines.append(
                f"| {p['entries']:,} | {name} | "
                + " | ".join(
                    " / ".join(fmt(arms[a][m], ".3f") if a in arms else "–" for a in ARMS)
                    for m in ("mar", "al", "drafted_fraction")
                )
                + f" | {tps} |"
            )
    lines += [
        "",
        "| entries | docs | keys s | generate s | index s | search p50 ms dresd / rest / exact | "
        "bytes/entry dresd / rest / hybrid |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in report["curve"]:
        b, q, by = p["build_s"], p["search_p50_ms"], p["bytes_per_entry"]
        lines.append(
            f"| {p['entries']:,} | {p['docs']:,} | {b['keys_s']} | {b['generate_s']} | {b['fit_index_s']} | "
            f"{q['dresd']} / {q['rest']} / {q['hybrid_exact']} | {by['dresd']} / {by['rest']} / {by['hybrid']} |"
        )
    ex = report["extrapolation"].get("id") or {}
    if ex:
        cross = ex.get("crossing_entries")
        lines += [
            "",
            f"Extrapolation (a straight line of AL against log10 entries, ID set): DReSD "
            f"{ex['dresd']['slope_per_decade']:+.3f} per decade, REST {ex['rest']['slope_per_decade']:+.3f}; "
            + (
                f"the lines would cross near {cross:,.0f} entries (an extrapolation past the measured sizes)."
                if cross is not None
                else "the lines do not cross past the measured sizes (DReSD "
                + ("stays above" if ex.get("dresd_above_at_largest") else "stays below")
                + " REST's line)."
            ),
        ]
    if report.get("key_layer_sweep"):
        lines += [
            "",
            "Key layer (DReSD AL per set, replayed at the second size): "
            + "; ".join(
                f"{k}: " + ", ".join(f"{n} {v:.3f}" for n, v in sets.items())
                for k, sets in report["key_layer_sweep"].items()
            ),
        ]
    if report.get("dense_below_sweep"):
        lines += [
            "",
            "Hybrid `dense_below` (AL per set, replayed at the second size): "
            + "; ".join(
                f"{b}: " + ", ".join(f"{n} {v:.3f}" for n, v in sets.items())
                for b, sets in report["dense_below_sweep"].items()
            ),
        ]
    if plot_rel:
        lines += ["", f"![DReSD, REST and the hybrid along datastore size]({plot_rel})"]
    lines += [
        "",
        "Summary: " + ", ".join(f"`{k}` {v}" for k, v in s.items() if k not in ("curve",)) + ".",
        "",
        DOC_END,
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from benchmarks.common import save_png

    curve = report["curve"]
    x = [p["entries"] for p in curve]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    colors = {"dresd": "tab:blue", "rest": "tab:orange", "rest_rule": "tab:red", "hybrid": "tab:green"}
    styles = {"id": "-", "chat": ":", "perturbed": "--"}
    for ax, (metric, title) in zip(
        axes.flat[:3], (("al", "accepted tokens per step"), ("mar", "MAR"), ("drafted_fraction", "steps that drafted"))
    ):
        for set_name, ls in styles.items():
            for arm, col in colors.items():
                ys = [p["sets"].get(set_name, {}).get(arm, {}).get(metric) for p in curve]
                if any(y is not None for y in ys):
                    ax.plot(x, ys, ls, color=col, marker="o", label=f"{arm} {set_name}")
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("datastore entries")
    axes.flat[0].legend(fontsize=7, ncol=3)
    ax = axes.flat[3]
    for set_name, ls in (("id", "-"), ("chat", ":")):
        for arm, col in colors.items():
            if arm in curve[0]["live"][set_name]["vs_target"]:
                ax.plot(x, [p["live"][set_name]["vs_target"][arm] for p in curve], ls, color=col, marker="o")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_title("tokens/s vs target-only (solid ID, dotted chat)")
    ax = axes.flat[4]
    for arm, key in (("dresd", "dresd"), ("rest", "rest"), ("hybrid", "hybrid_exact")):
        ax.plot(x, [p["search_p50_ms"][key] for p in curve], color=colors[arm], marker="o", label=arm)
    ax.set_xscale("log")
    ax.set_title("search p50 (ms)")
    ax.legend(fontsize=7)
    ax = axes.flat[5]
    for arm in ("dresd", "rest", "hybrid"):
        ax.plot(x, [p["bytes_per_entry"][arm] for p in curve], color=colors[arm], marker="o", label=arm)
    ax.set_xscale("log")
    ax.set_title("bytes per entry")
    ax.legend(fontsize=7)
    return save_png(fig, path)


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
        "--dense-below", type=int, default=None, help="hybrid: dense rows below this exact match (default: serving's)"
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
    from specops.serving.proposers.retrieval import DENSE_BELOW

    args.sizes = args.sizes or ([3_000, 10_000] if args.quick else [30_000, 100_000, 300_000])
    args.set_prompts = args.set_prompts or (12 if args.quick else 100)
    args.live_prompts = args.live_prompts if args.live_prompts is not None else (4 if args.quick else 16)
    args.dense_below = DENSE_BELOW if args.dense_below is None else args.dense_below
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


DOC_BEGIN = "<!-- BEGIN dresd-curve (written by benchmarks/dresd.py --curve; edits inside are overwritten) -->"
DOC_END = "<!-- END dresd-curve -->"

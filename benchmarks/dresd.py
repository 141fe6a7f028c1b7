"""DReSD against REST (its own library), prompt lookup and the draft model, on one verifier.

Every arm decodes the same held-out prompts greedily with ``SpecEngine`` and the same exact
token-tree verifier; only the drafts differ. Arms are interleaved per prompt.

Datastores (built by this script, the same documents for DReSD and REST):

- **OOD**: snippets of the bootstrap's training text (code and prose), the corpus;
- **ID** ("-I" in the paper): the target's own greedy generations for prompts cut from
  training text (never the held-out files the evaluation prompts come from). This is what a
  datastore rebuilt from served traffic holds (``trainer/datastores.py``).

Shapes: first the same for everyone, ``10 x 6`` (rows x tokens); then each method's own:
REST's native trie (up to 64 nodes, rows up to 10 tokens), DReSD ``3 x 20`` (the paper's
greedy best), prompt lookup a chain of 10, the draft model a chain of 3.

Reported per arm and domain: MAR (accepted / drafted per prompt, averaged over prompts, the
paper's), accepted tokens per verification step, tokens per target forward, tokens/s
(median over prompts) and greedy equality with target-only decoding; the same on the half of
the prompts whose target output repeats itself least (a 3-gram of the output seen earlier in
the context), so that loops do not decide the result. Then the PCA sweep (32/64/128 dims,
replayed offline on the target's outputs), and the budgets on a datastore scaled to 1M entries
(100k with --quick): bytes per entry, p50 search latency, index build time, and the target's
tokens/s making keys.

Usage: ``python benchmarks/dresd.py [--quick] [--json PATH] [--doc docs/benchmarks.md]``.
``--curve`` runs the scaling curve instead (``benchmarks/dresd_curve.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, write_doc_section  # noqa: E402
from benchmarks.harness.greedy import greedy_batches  # noqa: E402
from benchmarks.rest_baseline import RestIndex, RestProposer  # noqa: E402
from specops.core.datastore import Datastore, DatastoreConfig  # noqa: E402
from specops.core.index import IndexConfig, build_index  # noqa: E402
from specops.core.models import load_model_dir  # noqa: E402
from specops.serving.engine.spec import SpecEngine  # noqa: E402
from specops.serving.engine.types import SamplingParams  # noqa: E402
from specops.serving.plan import plain_generate
from specops.serving.proposers.catalogue import ProposerResources  # noqa: E402

log = logging.getLogger("benchmarks.dresd")
DOC_BEGIN = "<!-- BEGIN dresd (written by benchmarks/dresd.py; edits inside are overwritten) -->"
DOC_END = "<!-- END dresd -->"
DOMAINS = ("code", "prose")


# ---------------------------------------------------------------- data
def id_documents(
    pair, model_dir: Path, n: int, prompt_tokens: int, new_tokens: int, batch: int = 16
) -> tuple[list, float]:
    """The target's greedy outputs for ``n`` prompts per domain cut from training text; tokens/s."""
    from specops.trainer.router_fit import bootstrap_texts

    tok = pair.tokenizer
    texts = bootstrap_texts(model_dir, per_domain=n, chars=prompt_tokens * 8, per_doc=1, seed=1)
    prompts = [
        ids[:prompt_tokens]
        for d in DOMAINS
        for t in texts.get(d, [])
        if len(ids := tok(t, add_special_tokens=False)["input_ids"]) >= prompt_tokens // 2
    ]
    docs, made, t0 = [], 0, time.perf_counter()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    what = "ID datastore: target generations"
    gens = greedy_batches(
        pair.target, prompts, new_tokens, pad, batch=batch, by_length=False, eos=[tok.eos_token_id], desc=what
    )
    for p, gen in zip(prompts, gens):
        docs.append(p + gen)
        made += len(gen)
    return docs, made / (time.perf_counter() - t0)


def repetition(context: list[int], output: list[int], n: int = 3) -> float:
    """Fraction of output positions whose trailing n-gram occurred earlier in context + output."""
    seq, seen, hits = context + output, set(), 0
    for t in range(len(seq)):
        if t >= n:
            gram = tuple(seq[t - n : t])
            if t >= len(context) and gram in seen:
                hits += 1
            seen.add(gram)
    return hits / max(1, len(output))


def rebuilt_from_stream(pair, docs: list[list[int]], prompt_tokens: int = 64):
    """The ID datastore as serving would get it: the generations published as GenerationRecords
    to an embedded stream, one run of the datastore-rebuild job (``trainer/datastores.py``) into
    an embedded registry, and the promoted ``datastore-bench@champion`` fetched and loaded. The
    job holds out every 10th generation for its gate, so the datastore has 90% of ``docs``."""
    import tempfile

    from specops.registry import RegistryConfig, RegistryStore
    from specops.streams import OutMessage, StreamConfig, codec, open_stream
    from specops.streams.records import GenerationRecord
    from specops.trainer.datastores import DatastoreRebuilder, RebuildConfig

    tmp = Path(tempfile.mkdtemp(prefix="specops-bench-dresd-"))
    cfg = StreamConfig(url=f"local://{tmp / 'streams'}", fsync=False)
    msgs = []
    for i, d in enumerate(docs):
        rec = GenerationRecord(
            request_id=f"bench-{i}",
            cluster="bench",
            method="target",
            draft_model="",
            draft_version="",
            prompt_ids=np.asarray(d[:prompt_tokens], np.int32),
            output_ids=np.asarray(d[prompt_tokens:], np.int32),
            vocab_size=pair.vocab_size,
            finish_reason="length",
        )
        msgs.append(OutMessage(key=rec.key, value=codec.encode(rec)))
    with open_stream(cfg) as stream, stream.producer() as producer:
        producer.publish(cfg.topics.generations, msgs)
    reg = RegistryStore(RegistryConfig(uri=f"sqlite:///{tmp / 'mlflow.db'}", artifact_root=str(tmp / "artifacts")))
    every = 10 if len(docs) >= 20 else 2  # a tiny run still holds some out for the gate
    rebuilder = DatastoreRebuilder(
        cfg, reg, pair.target, cfg=RebuildConfig(min_new=1, heldout_every=every, poll_timeout_s=0.5)
    )
    try:
        result = rebuilder.run_once()
    finally:
        rebuilder.close()
    log.info("rebuild job: %s (held-out MAR %s)", result.clusters, result.mar)
    v = reg.artifact("datastore").by_alias("bench")
    reg.artifact("datastore").fetch(v, tmp / "ds")
    store = Datastore.load(tmp / "ds")
    from specops.core.datastore import BuildStats

    meta = store.meta
    stats = BuildStats(
        num_docs=meta["num_docs"],
        num_tokens=meta["num_tokens"],
        num_entries=meta["num_entries"],
        embed_s=meta["embed_s"],
        fit_s=meta["fit_s"],
        index_s=meta["index_s"],
    )
    return store, stats


# ---------------------------------------------------------------- arms
def arms(engine: SpecEngine, stores: dict, rests: dict, paper_shapes: bool = True) -> dict:
    """name -> (the method and its settings, or a proposer factory; k; resources)."""
    res = {name: ProposerResources(pair=engine.pair, datastore=ds) for name, ds in stores.items()}
    out = {
        "target": (dict(method="target"), 1, None),
        "pld": (dict(method="pld"), 10, None),
        "draft": (dict(method="draft"), 3, None),
    }
    for name in stores:
        out[f"rest-{name} 10x6"] = (lambda i=rests[name]: RestProposer(i, n_drafts=10), 6, None)
        out[f"dresd-{name} 10x6"] = (dict(method="dresd", n_drafts=10), 6, res[name])
    out["rest-id native"] = (lambda i=rests["id"]: RestProposer(i), 10, None)
    if paper_shapes:
        out["dresd-id 3x20"] = (dict(method="dresd", n_drafts=3), 20, res["id"])
        out["dresd-id 3x10"] = (dict(method="dresd", n_drafts=3), 10, res["id"])
    shape = stores["id"].meta.get("shape")
    if shape:  # what serving drafts by default: the shape the rebuild job measured fastest on held-out traffic
        out[f"dresd-id {shape['n_drafts']}x{shape['k']} (rebuild's)"] = (dict(method="dresd"), 20, res["id"])
    return out


def run_arm(engine, spec, prompt, max_new_tokens):
    cfg, k, resources = spec
    params = SamplingParams(max_new_tokens=max_new_tokens)
    if callable(cfg):
        return plain_generate(engine, prompt, params, proposer=cfg(), k=k)
    return plain_generate(engine, prompt, params, **cfg, k=k, resources=resources)


# ---------------------------------------------------------------- budgets
def scale_budgets(store: Datastore, entries: int, queries: int = 200) -> dict:
    """Index ``entries`` keys like ``store``'s (its keys resampled with noise) per index kind:
    build seconds, p50/p90 single-query search ms, bytes per entry (artifact: index + a token and
    a position per entry)."""
    rng = np.random.default_rng(0)
    base = store.index._impl.reconstruct_n(0, store.num_entries) if store.cfg.index.kind != "scann" else None
    if base is None:
        base = rng.standard_normal((store.num_entries, store.projection.dims)).astype(np.float32)
    keys = base[rng.integers(0, len(base), entries)] + 0.05 * rng.standard_normal((entries, base.shape[1])).astype(
        np.float32
    )
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    q = keys[rng.integers(0, entries, queries)] + 0.05 * rng.standard_normal((queries, base.shape[1])).astype(
        np.float32
    )
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    out = {}
    for kind in ("hnsw", "scann"):
        t0 = time.perf_counter()
        index = build_index(keys, IndexConfig(kind=kind))
        build_s = time.perf_counter() - t0
        lat = []
        for i in range(queries):
            t = time.perf_counter()
            index.search(q[i : i + 1], 64)
            lat.append((time.perf_counter() - t) * 1000)
        out[kind] = {
            "entries": entries,
            "build_s": round(build_s, 1),
            "search_p50_ms": round(statistics.median(lat), 3),
            "search_p90_ms": round(float(np.percentile(lat, 90)), 3),
            "bytes_per_entry": round((index.num_bytes + 8 * entries) / entries, 1),
        }
        del index
    return out


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    if "--curve" in (sys.argv[1:] if argv is None else argv):  # the scaling curve: its own options
        from benchmarks import dresd_curve

        return dresd_curve.main(argv)
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="8 prompts per domain, 100k entries for the budgets")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the report (with a summary) here")
    ap.add_argument("--doc", default=None, metavar="PATH", help="write the table into this markdown file")
    ap.add_argument("--model-dir", default=".specops/models", help="bootstrap directory (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts per domain (default 100, quick 8)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tokens per completion (default 64, quick 48)")
    ap.add_argument(
        "--id-prompts",
        type=int,
        default=None,
        help="training prompts per domain whose target outputs make the ID datastore (default 400, quick 64)",
    )
    ap.add_argument(
        "--id-new-tokens", type=int, default=128, help="tokens generated per ID prompt (default: %(default)s)"
    )
    ap.add_argument("--scale", type=int, default=None, help="entries for the budgets (default 1M, quick 100k)")
    ap.add_argument(
        "--no-paper-shapes",
        action="store_true",
        help="skip the dresd-id 3x20 and 3x10 arms (the rebuild job replays them offline anyway; its "
        "measured shape stays an arm): a third less time",
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help="instead: DReSD, REST and the hybrid along datastore size, paraphrase robustness and the key "
        "layer (`--curve --help` lists its options)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    n_prompts = args.prompts or (8 if args.quick else 100)
    new_tokens = args.max_new_tokens or (48 if args.quick else 64)
    id_prompts = args.id_prompts or (64 if args.quick else 400)
    scale = args.scale or (100_000 if args.quick else 1_000_000)
    model_dir = Path(args.model_dir)
    torch.manual_seed(0)

    pair = load_model_dir(model_dir)
    tok = pair.tokenizer
    from specops.trainer.datastores import corpus_documents, offline_mar
    from specops.workloads.prompts import distinct_prompts

    prompts = {
        d: [p.token_ids for p in distinct_prompts(model_dir, tok, d, n_prompts, num_tokens=64, seed=3)] for d in DOMAINS
    }

    # 1. Datastores: OOD (corpus) and ID (the target's own outputs), DReSD and REST over the same documents.
    ood_docs = corpus_documents(model_dir, tok, per_domain=id_prompts, chars=2000)
    id_docs, gen_tps = id_documents(pair, model_dir, id_prompts, prompt_tokens=64, new_tokens=args.id_new_tokens)
    stores, rests, builds = {}, {}, {}
    for name, docs in (("ood", ood_docs), ("id", id_docs)):
        if name == "id":  # through the real path: spec.generations -> the rebuild job -> the registry
            store, st = rebuilt_from_stream(pair, docs)
        else:
            store, st = Datastore.build(pair.target, docs, DatastoreConfig(value_len=21))
        # REST indexes exactly the documents the datastore holds (the rebuild holds some out).
        held = np.split(store.tokens, store.doc_ends[:-1])
        stores[name], rests[name] = store, RestIndex([h.tolist() for h in held], pair.vocab_size)
        builds[name] = {
            "docs": st.num_docs,
            "tokens": st.num_tokens,
            "entries": st.num_entries,
            "keys_tokens_per_s": round(st.embed_tokens_per_s),
            "fit_s": round(st.fit_s, 2),
            "index_s": round(st.index_s, 2),
            "bytes_per_entry": round(store.bytes_per_entry, 1),
            "rest_bytes_per_token": round(rests[name].num_bytes / rests[name].num_tokens, 1),
            "explained_variance": round(float(store.projection.explained.sum()), 3),
        }
        if store.meta.get("shape"):
            builds[name]["shape"] = store.meta["shape"]
        log.info("%s datastore: %s", name, builds[name])

    # 2. The arms, interleaved per prompt.
    engine = SpecEngine(pair)
    arm_specs = arms(engine, stores, rests, paper_shapes=not args.no_paper_shapes)
    for spec in arm_specs.values():  # warm-up
        run_arm(engine, spec, prompts["code"][0][:16], 4)
    rows: dict[str, dict[str, list]] = {a: {d: [] for d in DOMAINS} for a in arm_specs}
    total = len(arm_specs) * n_prompts * len(DOMAINS)
    with tqdm(total=total, desc="arms x prompts", unit="gen") as bar:
        for d in DOMAINS:
            for i, prompt in enumerate(prompts[d]):
                order = list(arm_specs)
                order = order[i % len(order) :] + order[: i % len(order)]  # rotate who goes first
                outs = {}
                for a in order:
                    outs[a] = run_arm(engine, arm_specs[a], prompt, new_tokens)
                    bar.update()
                ref = outs["target"].token_ids
                rep = repetition(prompt, ref)
                for a, r in outs.items():
                    s = r.stats
                    rows[a][d].append(
                        {
                            "mar": s.acceptance_rate,
                            "drafted": s.num_drafted,
                            "accepted": s.num_accepted,
                            "steps": s.num_verify_steps,
                            "tokens": s.num_generated,
                            "forwards": s.num_target_forwards,
                            "tps": s.tokens_per_s,
                            "identical": r.token_ids == ref,
                            "rep": rep,
                        }
                    )

    def agg(items: list[dict]) -> dict:
        if not items:
            return {}
        return {
            "prompts": len(items),
            "mar": round(float(np.mean([x["mar"] for x in items])), 4),
            "accepted_per_step": round(sum(x["accepted"] for x in items) / max(1, sum(x["steps"] for x in items)), 3),
            "tokens_per_forward": round(sum(x["tokens"] for x in items) / max(1, sum(x["forwards"] for x in items)), 3),
            "tokens_per_s": round(statistics.median(x["tps"] for x in items), 2),
            "greedy_identical": all(x["identical"] for x in items),
        }

    results = {}
    for a in arm_specs:
        both = rows[a]["code"] + rows[a]["prose"]
        reps = sorted(x["rep"] for x in rows["target"]["code"] + rows["target"]["prose"])
        cut = reps[len(reps) // 2] if reps else 0
        results[a] = {
            **{d: agg(rows[a][d]) for d in DOMAINS},
            "all": agg(both),
            "low_repetition": agg([x for x in both if x["rep"] <= cut]),
        }

    # 3. PCA sweep, replayed offline on the target's own outputs (greedy: exact accepted lengths).
    ref_docs, starts = [], []
    for d in DOMAINS:
        for p in prompts[d]:
            out = plain_generate(engine, p, SamplingParams(max_new_tokens=new_tokens), method="target").token_ids
            ref_docs.append(p + out)
            starts.append(len(p))
    sweep = {}
    for dims in (32, 64, 128):
        store, _ = Datastore.build(pair.target, id_docs, DatastoreConfig(dims=dims, value_len=21))
        m = offline_mar(store, pair.target, ref_docs, starts, n_drafts=10, k=6)
        sweep[dims] = {
            "mar": round(m.mar, 4),
            "accepted_per_step": round(m.accepted_per_step, 3),
            "explained_variance": round(float(store.projection.explained.sum()), 3),
        }
        log.info("PCA %d dims: %s", dims, sweep[dims])

    # 4. Budgets at scale.
    budgets = scale_budgets(stores["id"], scale)
    log.info("budgets at %d entries: %s", scale, budgets)

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = results[a]["all"].get(key), results[b]["all"].get(key)
        return round(x / y, 3) if x is not None and y else None

    best_dresd = max([a for a in results if a.startswith("dresd-id")], key=lambda a: results[a]["all"]["tokens_per_s"])
    best_rest = max(("rest-id native", "rest-id 10x6"), key=lambda a: results[a]["all"]["tokens_per_s"])
    summary = {
        "mar_ratio_vs_rest": ratio("dresd-id 10x6", "rest-id 10x6", "mar"),
        "accepted_length_ratio_vs_rest": ratio("dresd-id 10x6", "rest-id 10x6", "accepted_per_step"),
        "tokens_per_s_ratio_vs_rest": round(
            results[best_dresd]["all"]["tokens_per_s"] / results[best_rest]["all"]["tokens_per_s"], 3
        ),
        "live_vs_ood_mar_ratio": ratio("dresd-id 10x6", "dresd-ood 10x6", "mar"),
        "greedy_identical": all(r["all"]["greedy_identical"] for r in results.values()),
        "bytes_per_entry": budgets["hnsw"]["bytes_per_entry"],
        "search_p50_ms": budgets["hnsw"]["search_p50_ms"],
        "best_dresd": best_dresd,
        "best_rest": best_rest,
        "low_repetition_mar_ratio_vs_rest": round(
            results["dresd-id 10x6"]["low_repetition"]["mar"]
            / max(1e-9, results["rest-id 10x6"]["low_repetition"]["mar"]),
            3,
        ),
        "vs_target_tokens_per_s": round(
            results[best_dresd]["all"]["tokens_per_s"] / results["target"]["all"]["tokens_per_s"], 3
        ),
        "rebuild_shape": next((a.split()[1] for a in results if a.endswith("(rebuild's)")), None),
    }
    # The first step drafts nothing (no hidden state before the prefill): its share of a request's
    # target passes, and what drafting there at the arm's mean rate could at most have saved.
    first = {}
    for a in results:
        if a.startswith("dresd"):
            items = rows[a]["code"] + rows[a]["prose"]
            share = float(np.mean([1 / max(1, x["forwards"]) for x in items]))
            aps = results[a]["all"]["accepted_per_step"]
            first[a] = {
                "first_step_share_of_passes": round(share, 4),
                "passes_saved_at_most": round(share * aps / (1 + aps), 4),
            }
    summary["first_step_passes_saved_at_most"] = max((v["passes_saved_at_most"] for v in first.values()), default=None)
    command = " ".join(["python benchmarks/dresd.py", *(sys.argv[1:] if argv is None else argv)])
    report = {
        "command": command,
        "config": {
            "prompts_per_domain": n_prompts,
            "max_new_tokens": new_tokens,
            "id_prompts_per_domain": id_prompts,
            "scale_entries": scale,
            "id_generation_tokens_per_s": round(gen_tps),
        },
        "datastores": builds,
        "results": results,
        "first_step": first,
        "pca_sweep": sweep,
        "budgets": budgets,
        "summary": summary,
        "environment": environment(),
    }
    table = markdown(report)
    print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.doc:
        write_doc_section(Path(args.doc), DOC_BEGIN, DOC_END, doc_section(report))
    return 0


def doc_section(report: dict) -> str:
    """This benchmark's section of docs/benchmarks.md, markers included, from a report (a run's or its JSON's)."""
    return f"{DOC_BEGIN}\n{markdown(report)}\n{DOC_END}"


def markdown(report: dict) -> str:
    cfg, s = report["config"], report["summary"]
    lines = [
        "## DReSD vs REST, prompt lookup and the draft model\n",
        f"`{report['command']}`: {cfg['prompts_per_domain']} held-out prompts per domain (code, prose), "
        f"{cfg['max_new_tokens']} new tokens, greedy, arms interleaved per prompt, one verifier (exact token "
        f"trees). ID datastore: the target's outputs for {cfg['id_prompts_per_domain']} training prompts per "
        f"domain (generated at {cfg['id_generation_tokens_per_s']} tokens/s); OOD: corpus snippets.\n",
        "| arm | MAR code | MAR prose | MAR low-repetition half | accepted / step | tokens / target forward | "
        "tokens/s (median) | = target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a, r in report["results"].items():
        lines.append(
            f"| {a} | {r['code'].get('mar', 0):.3f} | {r['prose'].get('mar', 0):.3f} | "
            f"{r['low_repetition'].get('mar', 0):.3f} | {r['all']['accepted_per_step']:.2f} | "
            f"{r['all']['tokens_per_forward']:.2f} | {r['all']['tokens_per_s']:.1f} | "
            f"{'yes' if r['all']['greedy_identical'] else 'NO'} |"
        )
    lines.append(
        "\nDatastores: "
        + "; ".join(
            f"{n}: {b['docs']} docs, {b['entries']} entries, {b['bytes_per_entry']} B/entry (REST {b['rest_bytes_per_token']} "
            f"B/token), keys at {b['keys_tokens_per_s']} tokens/s, explained variance {b['explained_variance']}"
            for n, b in report["datastores"].items()
        )
        + "."
    )
    shape = report["datastores"].get("id", {}).get("shape")
    if shape:
        lines.append(
            f"\nDraft shape chosen by the rebuild job on its held-out generations (node_cost {shape['node_cost']}): "
            f"{shape['n_drafts']}x{shape['k']}; replayed: "
            + ", ".join(
                f"{k} {v['accepted_per_step']} accepted/step, {v['nodes_per_step']} nodes/step, {v['speed_vs_target']}x"
                for k, v in shape["replayed"].items()
            )
            + "."
        )
    if report.get("first_step"):
        worst = max(report["first_step"].items(), key=lambda kv: kv[1]["passes_saved_at_most"])
        lines.append(
            f"\nFirst step (the prefill, no drafts): {worst[1]['first_step_share_of_passes']:.1%} of a request's "
            f"target passes for {worst[0]}; drafting there at its mean rate would save at most "
            f"{worst[1]['passes_saved_at_most']:.2%} of them."
        )
    lines.append(
        "\nPCA sweep (ID datastore, 10x6, replayed on the target's outputs): "
        + ", ".join(
            f"{d} dims MAR {v['mar']:.3f} (explained {v['explained_variance']})" for d, v in report["pca_sweep"].items()
        )
        + "."
    )
    lines.append(
        "\nBudgets at "
        + ", ".join(
            f"{k}: {v['entries']} entries, build {v['build_s']} s, search p50 {v['search_p50_ms']} ms "
            f"(p90 {v['search_p90_ms']}), {v['bytes_per_entry']} B/entry"
            for k, v in report["budgets"].items()
        )
        + "."
    )
    lines.append("\nSummary: " + ", ".join(f"`{k}` {v}" for k, v in s.items()) + ".")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

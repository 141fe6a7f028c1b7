"""Speculative kNN-LM against kNN-LM (RaLMSpec §5.3) for ``benchmarks/ralm.py``: datastores of
the target's hidden states over the KB sources, exact and IVFPQ, at each of ``--knnlm-sizes``
(built once into ``--cache-dir``; how long each took is in the report).

``r`` is the baseline's share of time in datastore searches; the honest ceiling of any
speculation is ``1 / (1 - r)`` (it cannot remove the LM's forward passes), beside the older
``1 / ((1-r) + r/E[M])`` that uses the speculative arm's own E[M] (shown, labelled).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from specops.serving.engine.types import SamplingParams

log = logging.getLogger("benchmarks.ralm")


@contextlib.contextmanager
def _all_cores(args):
    """Every core the run was given (``--kb-cores`` pinned this process to the LM's), for a build."""
    import torch

    cores = (getattr(args, "lm_core_set", None) or set()) | (getattr(args, "kb_core_set", None) or set())
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def knnlm_stores(pair, tok, args, entries: int) -> dict:
    """Exact and IVFPQ datastores over the same keys (the target's hidden states over the KB's
    source text, documents whole), built once into the cache."""
    import faiss

    from specops.core.models import tokenizer_hash
    from specops.serving.ralm.knnlm.search import IvfpqSearcher, build_ivfpq
    from specops.serving.ralm.knnlm.store import KnnDatastore, build_knnlm
    from specops.trainer.kb_sources import default_sources, passages_from_sources

    base = Path(args.knnlm_dir) if args.knnlm_dir else Path(args.cache_dir) / f"knnlm-{entries}"
    tok_sha = tokenizer_hash(tok)
    if (base / "knnlm.json").exists():
        exact = KnnDatastore.load(base, target=pair.target, tokenizer_sha256=tok_sha)
    else:
        t_build = time.perf_counter()
        docs, total = [], 0
        passages, _ = passages_from_sources(
            args.source or default_sources(), model_dir=args.model_dir, max_passages=entries // 50 + 100
        )
        for p in passages:
            ids = tok.encode(p.text, add_special_tokens=False)
            if docs and docs[-1][0] == p.source:
                docs[-1][1].extend(ids)
            else:
                docs.append((p.source, ids))
            total += len(ids)
            if total >= entries:
                break
        with _all_cores(args):  # setup, not timed: on the LM's one pinned core it takes twice as long
            exact = build_knnlm(
                pair.target,
                [d for _, d in docs],
                tokenizer_sha256=tok_sha,
                meta={"source": "kb sources (benchmarks/ralm.py)", "tokens": total},
            )
        exact.meta["build_s"] = round(time.perf_counter() - t_build, 1)
        exact.save(base)
    stores = {"exact": exact}
    ivf_dir = base.with_name(base.name + "-ivfpq")
    if (ivf_dir / "knnlm.json").exists():
        stores["ivfpq"] = KnnDatastore.load(ivf_dir, target=pair.target, tokenizer_sha256=tok_sha)
    else:
        t0 = time.perf_counter()
        cfg = replace(exact.cfg, index="ivfpq")
        ivf = build_ivfpq(
            exact.stored_keys.float().numpy(),
            nlist=cfg.nlist,
            pq_m=cfg.pq_m,
            pq_bits=cfg.pq_bits,
            nprobe=cfg.nprobe,
            train_sample=cfg.train_sample,
            seed=cfg.seed,
        )
        blob = faiss.serialize_index(ivf).tobytes()
        meta = {**exact.meta, "index_s": round(time.perf_counter() - t0, 3)}
        stores["ivfpq"] = KnnDatastore(
            cfg,
            exact.values,
            exact.entry_doc,
            exact.hidden_size,
            IvfpqSearcher(ivf, cfg.nprobe),
            exact.target_sha256,
            exact.tokenizer_sha256,
            blob,
            meta,
        )
        stores["ivfpq"].save(ivf_dir)
    return stores


def knnlm_section(pair, tok, prompts: list[list[int]], args, ck=None) -> dict:
    """Per datastore size: baseline (a search per token) vs speculative kNN-LM (OS³), per
    searcher and k, interleaved per prompt; sizes the checkpoint ``ck`` holds are kept."""
    sizes = {}
    for n in args.knnlm_sizes:
        done = ck.knnlm(n) if ck is not None else None
        sizes[str(n)] = done if done is not None else knnlm_size(pair, tok, prompts, args, n)
        if ck is not None and done is None:
            ck.save_knnlm(n, sizes[str(n)])
    return {"sizes": sizes}


def knnlm_size(pair, tok, prompts: list[list[int]], args, entries: int) -> dict:
    from specops.serving.ralm.knnlm.decode import KnnConfig, KnnLM

    stores = knnlm_stores(pair, tok, args, entries)
    # every prompt runs its full length (the paper's fixed-length continuations): a question prompt's
    # answer ends in a token or two, which measures the first search and nothing of speculation
    params = SamplingParams(max_new_tokens=args.knnlm_new_tokens, ignore_eos=True)
    out = {
        "entries": stores["exact"].num_entries,
        "prompts": len(prompts),
        "new_tokens": args.knnlm_new_tokens,
        "ignore_eos": True,
        "build": {s: st.meta for s, st in stores.items()},
        "bytes_per_entry": {s: round(st.bytes_per_entry, 1) for s, st in stores.items()},
        "runs": {},
    }
    for searcher, store in stores.items():
        for k in args.knnlm_k:
            lm = {
                m: KnnLM(pair.target, store, KnnConfig(mode=m, k=k), eos_token_ids=pair.eos_token_ids)
                for m in ("baseline", "speculative")
            }
            for m in lm.values():  # warm-up
                m.generate(prompts[0], SamplingParams(max_new_tokens=4))
            rows = []
            for i, prompt in enumerate(tqdm(prompts, desc=f"knnlm {entries:,} {searcher} k={k}", unit="prompt")):
                order = ("baseline", "speculative") if i % 2 == 0 else ("speculative", "baseline")
                res = {m: lm[m].generate(prompt, params) for m in order}
                rows.append(
                    {
                        m: {
                            "total_s": r.stats.total_s,
                            "kb_search_s": r.stats.kb_search_s,
                            "searches": r.stats.kb_searches,
                            "tokens": r.stats.tokens,
                            "verified": r.stats.verified,
                            "mismatches": r.stats.mismatches,
                            "strides": r.stats.strides,
                            "unspeculated": r.stats.unspeculated,
                            "shadowed": r.stats.shadowed,
                        }
                        for m, r in res.items()
                    }
                )
                rows[-1]["identical"] = res["baseline"].token_ids == res["speculative"].token_ids
            out["runs"][f"{searcher} k={k}"] = {"searcher": searcher, "k": k, "rows": rows, **knn_summary(rows)}
            run = out["runs"][f"{searcher} k={k}"]
            log.info("knnlm %d %s k=%d: %.2fx (bound %.2fx)", entries, searcher, k, run["speedup"], run["bound"])
    return out


def knn_summary(rows: list[dict]) -> dict:
    b, s = [r["baseline"] for r in rows], [r["speculative"] for r in rows]
    bm, sm = statistics.median(x["total_s"] for x in b), statistics.median(x["total_s"] for x in s)
    r = sum(x["kb_search_s"] for x in b) / max(1e-9, sum(x["total_s"] for x in b))
    em = sum(x["tokens"] for x in s) / max(1, sum(x["searches"] for x in s))
    judged = sum(x["verified"] + x["mismatches"] for x in s)
    strides = [v for x in s for v in x["strides"]]
    hit = sum(x["verified"] for x in s) / max(1, judged)
    return {
        **model_ceiling(b, hit),
        "baseline_s": bm,
        "speculative_s": sm,
        "speedup": bm / max(sm, 1e-9),
        "speedup_median_of_ratios": statistics.median(x["total_s"] / max(y["total_s"], 1e-9) for x, y in zip(b, s)),
        "r": r,
        "em": em,
        "amdahl_bound": 1.0 / ((1 - r) + r / em),
        "bound": 1.0 / max(1.0 - r, 1e-9),
        "fraction_of_bound": (bm / max(sm, 1e-9)) * max(1.0 - r, 1e-9),
        "hit_rate": hit,
        "unspeculated_share": sum(x.get("unspeculated", 0) for x in s) / max(1, sum(x["tokens"] for x in s)),
        "full_length": all(x["tokens"] == y["tokens"] for x, y in zip(b, s)) and len({x["tokens"] for x in b}) <= 1,
        "mean_stride": statistics.fmean(strides) if strides else None,
        "searches": [sum(x["searches"] for x in b), sum(x["searches"] for x in s)],
        "identical": all(r["identical"] for r in rows),
    }


def model_ceiling(baseline: list[dict], gamma: float) -> dict:
    """What RaLMSpec's own model allows at the measured costs: a = the baseline's time per token
    outside the search, b = its time per search (flat in the batch: optimistic for IVFPQ), γ = the
    measured hit rate; the best stride (1..32) of the synchronous objective, as a speed-up over a
    search per token and as a fraction of 1 / (1 - r). It leaves out the cache's own cost and
    the forwards a mismatch throws away, so it is a ceiling: where it is under 0.8 of the bound,
    0.8 cannot be reached at this γ on this machine whatever the scheduler does."""
    from specops.serving.ralm.os3 import objective

    tokens = sum(x["tokens"] for x in baseline)
    search = sum(x["kb_search_s"] for x in baseline)
    a = (sum(x["total_s"] for x in baseline) - search) / max(1, tokens)
    b = search / max(1, sum(x["searches"] for x in baseline))
    g = min(max(gamma, 0.0), 0.999)
    if a <= 0 or b <= 0:
        return {"model_a_s": a, "model_b_s": b, "model_speedup": None, "model_fraction_of_bound": None}
    rate = max(objective(n, g, a, b, asynchronous=False) for n in range(1, 33))
    speedup = rate * (a + b)
    return {
        "model_a_s": a,
        "model_b_s": b,
        "model_speedup": speedup,
        "model_fraction_of_bound": speedup * a / (a + b),
    }

"""RaLMSpec against RaLMSeq (iterative retrieval-augmented generation), and speculative
kNN-LM against kNN-LM, on one target and one knowledge base per setting (RaLMSpec §5).

Every arm answers the same questions greedily with the same LM, KB, query window (the last
32 tokens), retrieval interval (4 tokens) and passage cut (256 tokens); arms are interleaved
per question (their order rotates), every question runs ``--runs`` times and its median run
is kept. Each arm's output is compared with RaLMSeq's token for token. Generation between
retrievals is target-only, so the arms differ only in how they retrieve.

Questions (``--questions`` per set, built deterministically from the KB's own documents, so
the answer is in the KB; the paper's "Question: ... Answer:" template):

- **man**: a man page of section 1 or 8 whose NAME line says what it does:
  "What does the `ls` command do?" (answer: the NAME line);
- **doc**: ``/usr/share/doc``: questions written in FAQ files, then "What is <package> and what
  is it for?" for packages with a README;
- **license**: "Under which license is <package> distributed?" for packages whose copyright
  file names a licence.

Settings:

- **realistic**: man pages and ``/usr/share/doc`` text in ~100-word passages of at most 256
  target tokens (``specops kb build``'s chunking), embedded with MiniLM, capped at
  ``--realistic-passages``; built once into ``--cache-dir``. Retrieval is cheap next to the
  LM here; the Amdahl bound says how little there is to win.
- **scale**: the same text cut into overlapping 100-word windows with a small word step
  (the largest that yields ``--scale-passages``, 10^6), embedded with the hashed TF-IDF
  embedder: cheap but real (MiniLM would take hours on 2 cores). Retrieval dominates here as
  in the paper. Labelled as such in every table.

Reported per setting and retriever: median latency per question of RaLMSeq and RaLMSpec with
prefetch, OS³ and asynchronous verification (PSA), the speed-up (ratio of the medians, and the
median of per-question ratios), the generation / retrieval split (the paper's Fig. 4: mean
wall time per request), ``r`` = RaLMSeq's retrieval share of its latency, ``E[M]`` = the mean
number of intervals per KB call of RaLMSpec PSA (retrievals the output needed / KB calls),
the Amdahl bound ``1 / ((1-r) + r/E[M])`` and the fraction of it reached, KB calls,
mismatches, the mean speculation stride, and the asynchronous overlap measured (KB time
hidden behind generation, wall clock) next to the paper's simulated figure (labelled).
Ablations (Table 1 and its complement) on a subset: RaLMSpec (s = 3, no P/S/A), +P, +S, +A,
PSA, and PSA without prefetch, without OS³ (s = 3), without async. kNN-LM: the
search-every-token baseline against the speculative loop over a datastore of the target's
hidden states, exact and IVFPQ, per k. Memory: bytes per passage per retriever, per kNN entry.

Usage: ``python benchmarks/ralm.py [--quick] [--json PATH] [--doc docs/benchmarks.md]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import re
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, finish_report, fmt, target_name  # noqa: E402
from specops.core.passage import Passage, indexed_text, token_counter  # noqa: E402
from specops.serving.engine.spec import SpecEngine  # noqa: E402
from specops.serving.engine.types import SamplingParams  # noqa: E402
from specops.serving.ralm.loop import RalmConfig, RalmGenerator  # noqa: E402
from specops.serving.retrieval.kb import KnowledgeBase, build_kb  # noqa: E402

log = logging.getLogger("benchmarks.ralm")
DOC_BEGIN = "<!-- BEGIN ralm (written by benchmarks/ralm.py; edits inside are overwritten) -->"
DOC_END = "<!-- END ralm -->"
SEQ, PSA = "RaLMSeq", "RaLMSpec+PSA"
MAIN_ARMS = {SEQ: RalmConfig(mode="ralmseq"), PSA: RalmConfig()}
BASE = RalmConfig(prefetch=1, speculation_stride=3, asynchronous=False)
ABLATION_ARMS = {
    "RaLMSpec (s=3)": BASE,
    "RaLMSpec+P": replace(BASE, prefetch=20),
    "RaLMSpec+S": replace(BASE, speculation_stride=0),
    "RaLMSpec+A": replace(BASE, asynchronous=True),
    "PSA no prefetch": replace(MAIN_ARMS[PSA], prefetch=1),
    "PSA no OS3 (s=3)": replace(MAIN_ARMS[PSA], speculation_stride=3),
    "PSA no async": replace(MAIN_ARMS[PSA], asynchronous=False),
    "PSA paper OS3 (never off)": replace(MAIN_ARMS[PSA], speculation_off=False),
}
ARMS = {**MAIN_ARMS, **ABLATION_ARMS}
ADR = ("hnsw", "scann")
LABELS = {
    "realistic": "realistic setting (MiniLM embeddings)",
    "scale": "scale setting (hashed TF-IDF embedder, overlapping 100-word windows)",
}
BARS = {"edr": 2.0, "adr": 1.0, "sr": 1.0, "knnlm": 3.0, "amdahl_fraction": 0.8}


# ---------------------------------------------------------------- questions
@dataclass(frozen=True)
class Question:
    set: str
    prompt: str
    title: str
    """The KB document that answers it."""
    answer: str
    """The text in that document that answers it (for the reader; never scored)."""


MAN_TITLE = re.compile(r"([A-Za-z0-9][\w.+-]{0,40})\(([18])[a-z]*\)")
NAME_LINE = re.compile(
    r"\bNAME\s+(.{1,80}?)\s+(?:-{1,2}|\u2013|\u2014)\s+(.{3,160}?)(?=\n|\s+SYNOPSIS\b|\s+DESCRIPTION\b|$)"
)
FAQ_QUESTION = re.compile(r"([A-Z][^?.!:\n]{14,150}\?)")
DOC_TITLE = re.compile(r"([\w.+-]+)/(README[\w.-]*|FAQ[\w.-]*|copyright)")
LICENSE = re.compile(r"License:\s*([^\n]{2,60}?)(?=\n|\s+(?:Files|Copyright|License|Comment):|$)")


def question_sets(kb: KnowledgeBase, per_set: int, seed: int = 0) -> dict[str, list[Question]]:
    """The man / doc / license sets from ``kb``'s own documents (deterministic for a KB)."""
    first: dict[str, str] = {}  # title -> its first passage
    faq: list[tuple[str, str]] = []
    for p in kb.passages(range(kb.num_passages)):
        first.setdefault(p.title, p.text)
        if "/FAQ" in p.title:
            faq += [(p.title, q) for q in FAQ_QUESTION.findall(p.text)]
    man, readme, licence = [], [], []
    for title, text in first.items():
        if (m := MAN_TITLE.fullmatch(title)) and (n := NAME_LINE.search(text)) and m.group(1) in n.group(1):
            man.append(
                Question(
                    "man",
                    f"Question: What does the `{m.group(1)}` command do?\nAnswer:",
                    title,
                    f"{n.group(1)} - {n.group(2)}",
                )
            )
        elif (d := DOC_TITLE.fullmatch(title)) and d.group(2).startswith("README"):
            readme.append(
                Question(
                    "doc",
                    f"Question: What is {d.group(1)} and what is it for?\nAnswer:",
                    title,
                    " ".join(text.split()[:30]),
                )
            )
        elif d and d.group(2) == "copyright" and re.search(r"licen[cs]e", text, re.I):
            lic = LICENSE.search(text)
            licence.append(
                Question(
                    "license",
                    f"Question: Under which license is {d.group(1)} distributed?\nAnswer:",
                    title,
                    lic.group(1) if lic else " ".join(text.split()[:30]),
                )
            )
    seen, faqs = set(), []
    for title, q in faq:
        key = " ".join(q.lower().split())
        if key not in seen:
            seen.add(key)
            faqs.append(Question("doc", f"Question: {' '.join(q.split())}\nAnswer:", title, q))

    def pick(items: list[Question], n: int, salt: str) -> list[Question]:
        unique = list({q.prompt: q for q in sorted(items, key=lambda q: (q.prompt, q.title))}.values())
        random.Random(f"{seed}:{salt}").shuffle(unique)
        return unique[:n]

    faqs = pick(faqs, per_set // 2, "faq")
    sets = {
        "man": pick(man, per_set, "man"),
        "doc": faqs + pick(readme, per_set - len(faqs), "readme"),
        "license": pick(licence, per_set, "license"),
    }
    if not any(sets.values()):  # a KB of other text (the smoke test): ask about its documents
        titles = sorted(first)[:per_set]
        sets = {
            "passages": [
                Question("passages", f"Question: What does {t} say?\nAnswer:", t, first[t][:80]) for t in titles
            ]
        }
    return {k: v for k, v in sets.items() if v}


def interleaved(sets: dict[str, list[Question]]) -> list[Question]:
    """One question of each set in turn, so that any prefix (the ablation subset) spans every set."""
    out, lists = [], list(sets.values())
    for i in range(max((len(v) for v in lists), default=0)):
        out += [v[i] for v in lists if i < len(v)]
    return out


# ---------------------------------------------------------------- knowledge bases
def cached_kb(path: Path, bench_meta: dict) -> KnowledgeBase | None:
    """The KB at ``path`` when it was built by this script with the same recipe, else None (removed)."""
    if not (path / "kb.json").exists():
        return None
    kb = KnowledgeBase.load(path)
    if kb.meta.get("bench") == bench_meta:
        return kb
    log.info("%s was built with another recipe (%s); rebuilding", path, kb.meta.get("bench"))
    shutil.rmtree(path)
    return None


def realistic_kb(args, tok) -> tuple[KnowledgeBase, Path]:
    from specops.trainer.kb_sources import default_sources, passages_from_sources

    if args.realistic_kb:
        return KnowledgeBase.load(Path(args.realistic_kb)), Path(args.realistic_kb)
    path = Path(args.cache_dir) / f"kb-realistic-{args.realistic_passages}"
    recipe = {
        "sources": args.source or default_sources(),
        "max_passages": args.realistic_passages,
        "embedder": "minilm",
        "retrievers": args.retrievers,
    }
    if kb := cached_kb(path, recipe):
        return kb, path
    t0 = time.perf_counter()
    passages, stats = passages_from_sources(
        recipe["sources"],
        count_tokens=token_counter(tok),
        max_passages=args.realistic_passages,
        model_dir=args.model_dir,
    )
    meta = {"bench": recipe, "sources": stats.to_dict(), "read_s": round(time.perf_counter() - t0, 1)}
    kb = build_kb("realistic", passages, embedder="minilm", retrievers=args.retrievers, meta=meta)
    kb.save(path)
    return kb, path


def windows(base: list[Passage], target: int, width: int = 100) -> tuple[list[Passage], int]:
    """Overlapping ``width``-word windows over each document of ``base`` (consecutive passages of
    one source): the largest word step giving at least ``target`` windows (1 if none does), then
    ``target`` of them evenly spaced. Returns the windows and the step."""
    docs: list[tuple[Passage, list[str]]] = []
    for p in base:
        if docs and docs[-1][0].source == p.source and docs[-1][0].title == p.title:
            docs[-1][1].extend(p.text.split())
        else:
            docs.append((p, p.text.split()))

    def starts(n_words: int, step: int) -> list[int]:
        last = max(n_words - width, 0)
        s = list(range(0, last + 1, step))
        return s + [last] if s[-1] != last else s

    count = lambda step: sum(len(starts(len(w), step)) for _, w in docs)  # noqa: E731
    step = next((s for s in range(width, 0, -1) if count(s) >= target), 1)
    spans = [(d, s) for d, (_, w) in enumerate(docs) for s in starts(len(w), step)]
    if len(spans) > target:
        spans = [spans[i * len(spans) // target] for i in range(target)]
    out = [
        Passage(i, docs[d][0].title, " ".join(docs[d][1][s : s + width]), docs[d][0].source)
        for i, (d, s) in enumerate(spans)
    ]
    return out, step


def scale_kb(args) -> tuple[KnowledgeBase, Path]:
    from specops.trainer.kb_sources import default_sources, passages_from_sources

    path = Path(args.cache_dir) / f"kb-scale-{args.scale_passages}"
    base_cap = max(50, args.scale_passages // 5) if args.quick else None
    recipe = {
        "sources": args.source or default_sources(),
        "windows": args.scale_passages,
        "width": 100,
        "base_cap": base_cap,
        "embedder": "hash",
        "retrievers": args.retrievers,
    }
    if kb := cached_kb(path, recipe):
        return kb, path
    t0 = time.perf_counter()
    base, stats = passages_from_sources(recipe["sources"], model_dir=args.model_dir, max_passages=base_cap)
    passages, step = windows(base, args.scale_passages)
    log.info("scale KB: %d windows of 100 words every %d words over %d passages", len(passages), step, len(base))
    meta = {
        "bench": recipe,
        "sources": stats.to_dict(),
        "window_step": step,
        "read_s": round(time.perf_counter() - t0, 1),
    }
    kb = build_kb("scale", passages, embedder="hash", retrievers=args.retrievers, meta=meta)
    kb.save(path)
    del passages, base
    return kb, path


def kb_memory(kb: KnowledgeBase, path: Path) -> dict:
    """Bytes per passage on disk that each retriever needs: the passages, plus the embeddings
    (dense: exact scores rank every candidate) and its index, or BM25's score matrix."""
    size = lambda name: (path / name).stat().st_size if (path / name).exists() else 0  # noqa: E731
    shared = size("passages.safetensors")
    dense = shared + size("embeddings.safetensors") + size("hash_embedder.safetensors")
    need = {
        "exact": dense,
        "hnsw": dense + size("hnsw.safetensors"),
        "scann": dense + size("scann.safetensors"),
        "bm25": shared + size("bm25.safetensors") + size("bm25.json"),
    }
    n = max(1, kb.num_passages)
    out = {k: round(v / n, 1) for k, v in need.items() if k in kb.retrievers}
    out["passages_only"] = round(shared / n, 1)
    return out


# ---------------------------------------------------------------- runs
def record(res) -> dict:
    st, t = res.stats, res.stats.time_s
    return {
        "total_s": t["total"],
        "generate_s": t["generate"],
        "retrieval_s": st.retrieval_s,
        "kb_search_s": t["kb_search"],
        "embed_s": t["embed"],
        "cache_s": t["cache"],
        "async_overlap_s": t["async_overlap"],
        "simulated_overlap_s": t["async_overlap_simulated"],
        "intervals": st.intervals,
        "kb_calls": st.kb_calls,
        "kb_queries": st.kb_queries,
        "mismatches": st.mismatches,
        "rolled_back": st.rolled_back_tokens,
        "strides": list(st.strides),
        "unspeculated": st.unspeculated,
        "tokens": len(res.token_ids),
    }


def run_retriever(
    name: str,
    kb: KnowledgeBase,
    kind: str,
    engine: SpecEngine,
    tok,
    questions: list[Question],
    args,
    pool: ThreadPoolExecutor,
) -> list[dict]:
    """Every arm on every question (ablations on the first ``--ablation-questions``), interleaved."""
    retriever = kb.retriever(kind)
    texts = lambda ids: [indexed_text(p) for p in kb.passages(ids)]  # noqa: E731
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    n_abl = 0 if args.no_ablations else args.ablation_questions
    prompts = [tok.encode(q.prompt, add_special_tokens=False) for q in questions]
    for arm in ARMS if n_abl else MAIN_ARMS:  # warm-up (the exact scorer's matrix, MiniLM, the KV path)
        RalmGenerator(engine, retriever, texts, tok, ARMS[arm], pool=pool).generate(
            prompts[0], SamplingParams(max_new_tokens=8)
        )
    rows = []
    with tqdm(total=len(questions) * args.runs, desc=f"{name}/{kind}", unit="q") as bar:
        for qi, (q, prompt) in enumerate(zip(questions, prompts)):
            arms = list(ARMS if qi < n_abl else MAIN_ARMS)
            runs: dict[str, list] = {a: [] for a in arms}
            for run in range(args.runs):
                shift = (qi + run) % len(arms)
                for arm in arms[shift:] + arms[:shift]:  # rotate who goes first
                    gen = RalmGenerator(engine, retriever, texts, tok, ARMS[arm], method="target", pool=pool)
                    runs[arm].append(gen.generate(prompt, params))
                bar.update(1)
            ref = runs[SEQ][0].token_ids
            row = {"q": qi, "set": q.set, "arms": {}}
            for arm, results in runs.items():
                med = sorted(results, key=lambda r: r.stats.time_s["total"])[len(results) // 2]
                row["arms"][arm] = {**record(med), "identical": all(r.token_ids == ref for r in results)}
            rows.append(row)
    return rows


def summarise(rows: list[dict]) -> dict:
    """Per arm: latency, speed-up over RaLMSeq on the same questions, G/R split, counts; then r,
    E[M], the Amdahl bound and the fraction of it PSA reached."""
    out: dict = {"arms": {}}
    for arm in ARMS:
        rs = [(r["arms"][SEQ], r["arms"][arm]) for r in rows if arm in r["arms"]]
        if not rs:
            continue
        a = [x for _, x in rs]
        seq_med, arm_med = statistics.median(s["total_s"] for s, _ in rs), statistics.median(x["total_s"] for x in a)
        strides = [s for x in a for s in x["strides"]]
        mean = lambda key: statistics.fmean(x[key] for x in a)  # noqa: E731
        out["arms"][arm] = {
            "questions": len(a),
            "median_s": arm_med,
            "ralmseq_median_s": seq_med,
            "speedup": seq_med / max(arm_med, 1e-9),
            "speedup_median_of_ratios": statistics.median(s["total_s"] / max(x["total_s"], 1e-9) for s, x in rs),
            "mean_s": mean("total_s"),
            "generate_s": mean("generate_s"),
            "retrieval_s": mean("retrieval_s"),
            "kb_search_s": mean("kb_search_s"),
            "kb_calls": mean("kb_calls"),
            "intervals": mean("intervals"),
            "mismatches": mean("mismatches"),
            "rolled_back_tokens": mean("rolled_back"),
            "unspeculated": statistics.fmean(x.get("unspeculated", 0) for x in a),
            "mean_stride": statistics.fmean(strides) if strides else None,
            "async_overlap_s": mean("async_overlap_s"),
            "simulated_overlap_s": mean("simulated_overlap_s"),
            "identical": all(x["identical"] for x in a),
        }
    seq = [r["arms"][SEQ] for r in rows]
    psa = [r["arms"][PSA] for r in rows]
    r = sum(x["retrieval_s"] for x in seq) / max(sum(x["total_s"] for x in seq), 1e-9)
    em = sum(x["intervals"] for x in psa) / max(1, sum(x["kb_calls"] for x in psa))
    bound = 1.0 / ((1 - r) + r / em)
    out.update(r=r, em=em, amdahl_bound=bound, amdahl_fraction=out["arms"][PSA]["speedup"] / bound)
    sub = [r for r in rows if len(r["arms"]) > len(MAIN_ARMS)]
    if sub:  # PSA on the ablation subset, for Table 1's row
        med = lambda arm: statistics.median(r["arms"][arm]["total_s"] for r in sub)  # noqa: E731
        out["psa_ablation_subset"] = {
            "questions": len(sub),
            "speedup": med(SEQ) / max(med(PSA), 1e-9),
            "identical": all(r["arms"][PSA]["identical"] for r in sub),
        }
    return out


def run_setting(name: str, kb: KnowledgeBase, path: Path, engine, tok, args, pool) -> dict:
    sets = question_sets(kb, args.questions)
    questions = interleaved(sets)
    emb = kb.meta.get("embedder", {})
    out = {
        "kb": {
            "path": str(path),
            "name": kb.name,
            "passages": kb.num_passages,
            "embedder": emb.get("kind"),
            "build_s": kb.meta.get("build_s"),
            "read_s": kb.meta.get("read_s"),
            "embed_passages_per_s": kb.meta.get("embed_passages_per_s"),
            "window_step": kb.meta.get("window_step"),
            "bytes_per_passage": kb_memory(kb, path),
        },
        "questions": {s: len(v) for s, v in sets.items()},
        "question_list": [asdict(q) for q in questions],
        "ablation_questions": 0 if args.no_ablations else min(args.ablation_questions, len(questions)),
        "retrievers": {},
    }
    log.info("%s: %d passages, %s questions", name, kb.num_passages, out["questions"])
    for kind in [k for k in args.retrievers if k in kb.retrievers]:
        rows = run_retriever(name, kb, kind, engine, tok, questions, args, pool)
        out["retrievers"][kind] = {"rows": rows, **summarise(rows)}
        s = out["retrievers"][kind]
        log.info(
            "%s/%s: PSA %.2fx (r %.2f, E[M] %.2f, bound %.2fx)",
            name,
            kind,
            s["arms"][PSA]["speedup"],
            s["r"],
            s["em"],
            s["amdahl_bound"],
        )
    return out


# ---------------------------------------------------------------- kNN-LM
def knnlm_stores(pair, tok, args) -> dict:
    """Exact and IVFPQ datastores over the same keys (the target's hidden states over the KB's
    source text, documents whole), built once into the cache."""
    import faiss

    from specops.core.models import tokenizer_hash
    from specops.serving.ralm.knnlm_search import IvfpqSearcher, build_ivfpq
    from specops.serving.ralm.knnlm_store import KnnDatastore, build_knnlm
    from specops.trainer.kb_sources import default_sources, passages_from_sources

    base = Path(args.knnlm_dir) if args.knnlm_dir else Path(args.cache_dir) / f"knnlm-{args.knnlm_tokens}"
    tok_sha = tokenizer_hash(tok)
    if (base / "knnlm.json").exists():
        exact = KnnDatastore.load(base, target=pair.target, tokenizer_sha256=tok_sha)
    else:
        docs, total = [], 0
        passages, _ = passages_from_sources(
            args.source or default_sources(), model_dir=args.model_dir, max_passages=args.knnlm_tokens // 50 + 100
        )
        for p in passages:
            ids = tok.encode(p.text, add_special_tokens=False)
            if docs and docs[-1][0] == p.source:
                docs[-1][1].extend(ids)
            else:
                docs.append((p.source, ids))
            total += len(ids)
            if total >= args.knnlm_tokens:
                break
        exact = build_knnlm(
            pair.target,
            [d for _, d in docs],
            tokenizer_sha256=tok_sha,
            meta={"source": "kb sources (benchmarks/ralm.py)", "tokens": total},
        )
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


def knnlm_section(pair, tok, prompts: list[list[int]], args) -> dict:
    """Baseline (a search per token) vs speculative kNN-LM (OS³), per searcher and k, interleaved per prompt."""
    from specops.serving.ralm.knnlm import KnnConfig, KnnLM

    stores = knnlm_stores(pair, tok, args)
    params = SamplingParams(max_new_tokens=args.knnlm_new_tokens)
    out = {
        "entries": stores["exact"].num_entries,
        "prompts": len(prompts),
        "new_tokens": args.knnlm_new_tokens,
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
            for i, prompt in enumerate(tqdm(prompts, desc=f"knnlm {searcher} k={k}", unit="prompt")):
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
                        }
                        for m, r in res.items()
                    }
                )
                rows[-1]["identical"] = res["baseline"].token_ids == res["speculative"].token_ids
            out["runs"][f"{searcher} k={k}"] = {"searcher": searcher, "k": k, "rows": rows, **knn_summary(rows)}
            log.info("knnlm %s k=%d: %.2fx", searcher, k, out["runs"][f"{searcher} k={k}"]["speedup"])
    return out


def knn_summary(rows: list[dict]) -> dict:
    b, s = [r["baseline"] for r in rows], [r["speculative"] for r in rows]
    bm, sm = statistics.median(x["total_s"] for x in b), statistics.median(x["total_s"] for x in s)
    r = sum(x["kb_search_s"] for x in b) / max(1e-9, sum(x["total_s"] for x in b))
    em = sum(x["tokens"] for x in s) / max(1, sum(x["searches"] for x in s))
    judged = sum(x["verified"] + x["mismatches"] for x in s)
    strides = [v for x in s for v in x["strides"]]
    return {
        "baseline_s": bm,
        "speculative_s": sm,
        "speedup": bm / max(sm, 1e-9),
        "speedup_median_of_ratios": statistics.median(x["total_s"] / max(y["total_s"], 1e-9) for x, y in zip(b, s)),
        "r": r,
        "em": em,
        "amdahl_bound": 1.0 / ((1 - r) + r / em),
        "hit_rate": sum(x["verified"] for x in s) / max(1, judged),
        "mean_stride": statistics.fmean(strides) if strides else None,
        "searches": [sum(x["searches"] for x in b), sum(x["searches"] for x in s)],
        "identical": all(r["identical"] for r in rows),
    }


# ---------------------------------------------------------------- report
def summary(report: dict) -> dict:
    """The issue's keys: RaLMSpec PSA over RaLMSeq in the scale setting (else the only one run)."""
    settings = report["settings"]
    main = settings.get("scale") or next(iter(settings.values()), {"retrievers": {}})
    rs = main["retrievers"]
    speed = lambda kind: rs[kind]["arms"][PSA]["speedup"] if kind in rs else None  # noqa: E731
    adr = [speed(k) for k in ADR if k in rs]
    fractions = [r["amdahl_fraction"] for s in settings.values() for r in s["retrievers"].values()]
    identical = all(
        a["identical"] for s in settings.values() for r in s["retrievers"].values() for a in r["arms"].values()
    )
    knn = report.get("knnlm", {}).get("runs", {})
    identical &= all(v["identical"] for v in knn.values())
    exact_knn = [v["speedup"] for v in knn.values() if v["searcher"] == "exact"] or [v["speedup"] for v in knn.values()]
    rnd = lambda x, n=3: None if x is None else round(x, n)  # noqa: E731
    return {
        "speedup_edr": rnd(speed("exact")),
        "speedup_adr": rnd(min(adr)) if adr else None,
        "speedup_sr": rnd(speed("bm25")),
        "retrieval_share_edr": rnd(rs["exact"]["r"], 4) if "exact" in rs else None,
        "amdahl_fraction_min": rnd(min(fractions)) if fractions else None,
        "speedup_knnlm": rnd(max(exact_knn)) if exact_knn else None,
        "outputs_identical": 1.0 if identical else 0.0,
        "async_overlap_s": rnd(rs["exact"]["arms"][PSA]["async_overlap_s"], 4) if "exact" in rs else None,
    }


def bars(report: dict) -> list[tuple[str, str, bool | None]]:
    """(bar, measured, met) for the issue's bars."""
    s, out = report["summary"], []
    scale = report["settings"].get("scale", {}).get("retrievers", {})
    out.append(
        (
            f"EDR PSA >= {BARS['edr']}x over RaLMSeq (scale)",
            fmt(s["speedup_edr"], ".2f", "x"),
            None if s["speedup_edr"] is None else s["speedup_edr"] >= BARS["edr"],
        )
    )
    for name, st in report["settings"].items():
        for kind, r in st["retrievers"].items():
            if kind != "exact":
                v = r["arms"][PSA]["speedup"]
                out.append((f"{kind} PSA >= 1.0x ({name})", f"{v:.2f}x", v >= 1.0))
        fr = [r["amdahl_fraction"] for r in st["retrievers"].values()]
        if fr:
            out.append(
                (
                    f"{name}: >= {BARS['amdahl_fraction']:.0%} of the Amdahl bound (every retriever)",
                    f"min {min(fr):.0%}",
                    min(fr) >= BARS["amdahl_fraction"],
                )
            )
    fixed = [
        f"{k} {r['arms']['RaLMSpec (s=3)']['speedup']:.2f}x" for k, r in scale.items() if "RaLMSpec (s=3)" in r["arms"]
    ]
    if fixed:
        out.append(("fixed s = 3, no P/S/A (may be < 1.0x, as in the paper; shown)", ", ".join(fixed), None))
    out.append(
        (
            f"kNN-LM speculative >= {BARS['knnlm']}x at its best k (exact)",
            fmt(s["speedup_knnlm"], ".2f", "x"),
            None if s["speedup_knnlm"] is None else s["speedup_knnlm"] >= BARS["knnlm"],
        )
    )
    out.append(
        (
            "identical outputs everywhere",
            "yes" if s["outputs_identical"] == 1.0 else "NO",
            s["outputs_identical"] == 1.0,
        )
    )
    return out


def markdown(report: dict, plot_rel: str | None) -> str:
    a, s = report["args"], report["summary"]
    n_q = {n: sum(st["questions"].values()) for n, st in report["settings"].items()}
    lines = [
        DOC_BEGIN,
        "## RaLMSpec vs RaLMSeq, and speculative kNN-LM",
        "",
        "```sh",
        report["command"],
        "```",
        "",
        f"Target {report['target']}; greedy; {a['max_new_tokens']} new tokens; a retrieval every 4 tokens on the "
        f"last 32 tokens, its passage (at most 256 tokens) put before the question; generation between retrievals "
        f"target-only; arms interleaved per question, {a['runs']} run(s) per question, the median run kept. "
        f"Questions: "
        + "; ".join(
            f"{n}: {n_q[n]} ({', '.join(f'{k} {v}' for k, v in st['questions'].items())})"
            for n, st in report["settings"].items()
        )
        + ". "
        f"Wall time {report['wall_s'] / 60:.0f} min on {report['environment']['cpu_count']} cores.",
        "",
        "Speed-up = RaLMSeq's median latency / the arm's, over the same questions (in brackets: the median of "
        "per-question ratios). G / R = mean generation / retrieval wall time per request (retrieval: query "
        "encoding, local-cache ranking and waiting for the KB). r = RaLMSeq's retrieval share of its latency; "
        "E[M] = the mean number of intervals per KB call of RaLMSpec PSA (retrievals the output needed / KB calls); "
        "Amdahl bound = 1 / ((1-r) + r/E[M]): what PSA could win if each KB call cost what one of RaLMSeq's does "
        "and nothing else changed (asynchronous verification can beat it by hiding KB time). Async overlap: KB "
        "time hidden behind generation, measured on the wall clock (the paper's simulated figure, "
        "Σ min(verification, speculation step), beside it).",
        "",
        "### Knowledge bases",
        "",
        "| setting | embedder | passages | read s | build s (embed / indexes) | passages/s embedded | bytes/passage: exact | hnsw | scann | bm25 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, st in report["settings"].items():
        kb, b = st["kb"], st["kb"]["build_s"] or {}
        idx = " + ".join(f"{k} {b[k]:.0f}" for k in ("hnsw", "scann", "bm25") if k in b)
        mem = kb["bytes_per_passage"]
        emb = kb["embedder"] + (f" (windows every {kb['window_step']} words)" if kb.get("window_step") else "")
        lines.append(
            f"| {name} | {emb} | "
            f"{kb['passages']:,} | {fmt(kb['read_s'], '.0f')} | {b.get('total', 0):.0f} ({b.get('embed', 0):.0f} / {idx}) | "
            f"{fmt(kb['embed_passages_per_s'], '.0f')} | "
            + " | ".join(fmt(mem.get(k), ".0f") for k in ("exact", "hnsw", "scann", "bm25"))
            + " |"
        )
    for name, st in report["settings"].items():
        lines += [
            "",
            f"### {LABELS.get(name, name)}",
            "",
            "| retriever | RaLMSeq s | PSA s | speed-up | RaLMSeq G / R s | PSA G / R s | r | E[M] | Amdahl bound | "
            "fraction | KB calls (Seq / PSA) | mismatches | mean stride | async overlap s (measured / simulated) | identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for kind, r in st["retrievers"].items():
            q, p = r["arms"][SEQ], r["arms"][PSA]
            lines.append(
                f"| {kind} | {q['median_s']:.2f} | {p['median_s']:.2f} | **{p['speedup']:.2f}x** ({p['speedup_median_of_ratios']:.2f}x) | "
                f"{q['generate_s']:.2f} / {q['retrieval_s']:.2f} | {p['generate_s']:.2f} / {p['retrieval_s']:.2f} | "
                f"{r['r']:.2f} | {r['em']:.2f} | {r['amdahl_bound']:.2f}x | {r['amdahl_fraction']:.0%} | "
                f"{q['kb_calls']:.1f} / {p['kb_calls']:.1f} | {p['mismatches']:.1f} | {fmt(p['mean_stride'])} | "
                f"{p['async_overlap_s']:.3f} / {p['simulated_overlap_s']:.3f} | {'yes' if q['identical'] and p['identical'] else 'NO'} |"
            )
        abl = [arm for arm in ABLATION_ARMS if any(arm in r["arms"] for r in st["retrievers"].values())]
        if abl:
            lines += [
                "",
                f"Ablations (Table 1 and its complement), speed-up over RaLMSeq on the first "
                f"{st['ablation_questions']} questions (every set):",
                "",
                "| retriever | " + " | ".join([*abl[:4], PSA, *abl[4:]]) + " |",
                "|---" * (len(abl) + 2) + "|",
            ]
            for kind, r in st["retrievers"].items():
                cells = []
                for arm in [*abl[:4], PSA, *abl[4:]]:
                    x = r["psa_ablation_subset"] if arm == PSA else r["arms"].get(arm)  # PSA: on the same subset
                    cells.append("–" if not x else f"{x['speedup']:.2f}x{'' if x['identical'] else ' (NOT identical)'}")
                lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    if report.get("knnlm"):
        k = report["knnlm"]
        lines += [
            "",
            "### kNN-LM (λ = 0.25, OS³ with γ ≤ 0.9, next 10 entries cached)",
            "",
            f"Datastore: the target's hidden states over {k['entries']:,} tokens of the KB's source text; bytes per "
            f"entry: " + ", ".join(f"{s} {v}" for s, v in k["bytes_per_entry"].items()) + f". {k['prompts']} prompts "
            f"(the questions above), {k['new_tokens']} new tokens, greedy, the two modes interleaved per prompt.",
            "",
            "| searcher | k | baseline s | speculative s | speed-up | r (baseline) | E[M] (tokens / search) | Amdahl bound | hit rate | mean stride | searches (base / spec) | identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v in k["runs"].values():
            lines.append(
                f"| {v['searcher']} | {v['k']} | {v['baseline_s']:.2f} | {v['speculative_s']:.2f} | **{v['speedup']:.2f}x** "
                f"({v['speedup_median_of_ratios']:.2f}x) | {v['r']:.2f} | {v['em']:.2f} | {v['amdahl_bound']:.2f}x | "
                f"{v['hit_rate']:.0%} | {fmt(v['mean_stride'])} | {v['searches'][0]} / {v['searches'][1]} | "
                f"{'yes' if v['identical'] else 'NO'} |"
            )
    if plot_rel:
        lines += ["", f"![generation / retrieval split per arm]({plot_rel})"]
    lines += ["", "Bars (issue 17):", "", "| bar | measured | met |", "|---|---|---|"]
    lines += [f"| {b} | {m} | {'–' if ok is None else 'yes' if ok else '**no**'} |" for b, m, ok in bars(report)]
    lines += [
        "",
        "Notes: RaLMSpec can only win what retrieval costs, so its ceiling is the Amdahl bound above; on a "
        "CPU the LM is slow and a 10^5-passage MiniLM KB is cheap to search, so the realistic setting has little to "
        "win. The scale setting's embedder is hashed TF-IDF (not MiniLM) so that 10^6 passages can be embedded here; "
        "its windows overlap, so neighbouring windows of one document compete for the top-1. Asynchronous "
        "verification runs for real in a second thread: on 2 cores it competes with generation for the same cores "
        "(the measured overlap is what was won anyway). Numbers come from one machine that other work may share.",
        "",
        "Summary: " + ", ".join(f"`{k}` {v}" for k, v in s.items()),
        "",
        DOC_END,
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    """Stacked bars of mean generation / retrieval / other time per request (the paper's Fig. 4);
    False when no setting ran a retriever (nothing drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(n, st) for n, st in report["settings"].items() if st["retrievers"]]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, (name, st) in zip(axes[0], panels):
        labels, g, r, o = [], [], [], []
        for kind, rr in st["retrievers"].items():
            for arm, short in ((SEQ, "Seq"), (PSA, "PSA")):
                x = rr["arms"][arm]
                labels.append(f"{kind}\n{short}")
                g.append(x["generate_s"])
                r.append(x["retrieval_s"])
                o.append(max(0.0, x["mean_s"] - x["generate_s"] - x["retrieval_s"]))
        pos = range(len(labels))
        ax.bar(pos, g, label="G (generation)", color="#4c72b0")
        ax.bar(pos, r, bottom=g, label="R (retrieval)", color="#dd8452")
        ax.bar(pos, o, bottom=[a + b for a, b in zip(g, r)], label="other", color="#bbbbbb")
        ax.set_xticks(list(pos), labels, fontsize=8)
        ax.set_title(LABELS.get(name, name), fontsize=9)
        ax.set_ylabel("mean seconds per request")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- main
def parse(argv) -> argparse.Namespace:
    from specops.paths import models_dir

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="5 questions per set, 32 tokens, small KBs, 1 run")
    p.add_argument("--json", type=Path, help="write the results (with a `summary`) here")
    p.add_argument("--doc", type=Path, help="write the tables into this markdown file (docs/benchmarks.md)")
    p.add_argument(
        "--plot", type=Path, help="PNG of the G/R split (default: img/ralm.png beside --doc, else beside --json)"
    )
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="re-derive summary, table, plot and doc from a saved --json; runs nothing",
    )
    p.add_argument(
        "--model-dir", default=str(models_dir()), help="bootstrap-style target/ + draft/ (default: %(default)s)"
    )
    p.add_argument(
        "--cache-dir", default=".specops/bench/ralm", help="KBs and datastores are built here once and reused"
    )
    p.add_argument("--source", action="append", help="text sources for the KBs (default: man pages + /usr/share/doc)")
    p.add_argument("--settings", default="realistic,scale", help="comma-separated: realistic, scale")
    p.add_argument("--retrievers", default="exact,hnsw,scann,bm25", help="comma-separated retrievers (built and run)")
    p.add_argument("--questions", type=int, default=None, help="questions per set, 3 sets (default 100, quick 5)")
    p.add_argument(
        "--ablation-questions",
        type=int,
        default=None,
        help="questions (the first, every set) that also run the ablation arms (default 30, quick 3)",
    )
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128, quick 32")
    p.add_argument("--runs", type=int, default=None, help="runs per question, the median kept (default 3, quick 1)")
    p.add_argument(
        "--realistic-passages", type=int, default=None, help="passages of the MiniLM KB (default 100000, quick 300)"
    )
    p.add_argument(
        "--realistic-kb",
        default=None,
        metavar="DIR",
        help="use this saved KB (`specops kb build --out`) as the realistic one",
    )
    p.add_argument(
        "--scale-passages", type=int, default=None, help="windows of the hashed TF-IDF KB (default 1000000, quick 3000)"
    )
    p.add_argument("--no-knnlm", action="store_true")
    p.add_argument(
        "--knnlm-tokens", type=int, default=None, help="kNN-LM datastore entries (default 1000000, quick 3000)"
    )
    p.add_argument("--knnlm-dir", default=None, metavar="DIR", help="use this saved exact kNN-LM datastore")
    p.add_argument("--knnlm-k", default=None, help="comma-separated k (default 1,16,256,1024, quick 1,16)")
    p.add_argument(
        "--knnlm-prompts", type=int, default=None, help="prompts (the first questions) (default 10, quick 2)"
    )
    p.add_argument("--knnlm-new-tokens", type=int, default=None, help="default: --max-new-tokens")
    args = p.parse_args(argv)
    full = {
        "questions": 100,
        "ablation_questions": 30,
        "max_new_tokens": 128,
        "runs": 3,
        "realistic_passages": 100_000,
        "scale_passages": 1_000_000,
        "knnlm_tokens": 1_000_000,
        "knnlm_k": "1,16,256,1024",
        "knnlm_prompts": 10,
    }
    quick = {
        "questions": 5,
        "ablation_questions": 3,
        "max_new_tokens": 32,
        "runs": 1,
        "realistic_passages": 300,
        "scale_passages": 3000,
        "knnlm_tokens": 3000,
        "knnlm_k": "1,16",
        "knnlm_prompts": 2,
    }
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.knnlm_new_tokens = args.knnlm_new_tokens or args.max_new_tokens
    args.retrievers = [r for r in args.retrievers.split(",") if r]
    args.knnlm_k = [int(k) for k in str(args.knnlm_k).split(",") if k]
    args.cache_dir = str(Path(args.cache_dir) / ("quick" if args.quick else "full"))
    return args


def finish(report: dict, args) -> None:
    """Summary, table, plot, JSON and doc section of a finished (or reloaded) run."""
    finish_report(
        report, args, summary=summary, markdown=markdown, plot=plot, png_name="ralm.png", begin=DOC_BEGIN, end=DOC_END
    )


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replot:
        report = json.loads(args.replot.read_text())
        args.json = args.json or args.replot
        finish(report, args)
        return 0
    from specops.core.models import load_model_dir

    pair = load_model_dir(Path(args.model_dir))
    tok, engine = pair.tokenizer, SpecEngine(pair)
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/ralm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {
        "command": command,
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "doc", "plot", "replot")},
        "target": target_name(Path(args.model_dir)),
        "settings": {},
    }
    t0 = time.perf_counter()
    prompts: list[list[int]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="ralm-verify") as pool:
        for setting in [s for s in args.settings.split(",") if s]:
            if setting not in LABELS:
                raise SystemExit(f"--settings: unknown setting {setting!r} (realistic, scale)")
            kb, path = realistic_kb(args, tok) if setting == "realistic" else scale_kb(args)
            report["settings"][setting] = run_setting(setting, kb, path, engine, tok, args, pool)
            prompts = prompts or [
                tok.encode(q["prompt"], add_special_tokens=False)
                for q in report["settings"][setting]["question_list"][: args.knnlm_prompts]
            ]
            del kb
            gc.collect()
    if not args.no_knnlm:
        prompts = prompts or [tok.encode("Question: What does the `ls` command do?\nAnswer:", add_special_tokens=False)]
        report["knnlm"] = knnlm_section(pair, tok, prompts, args)
    report["wall_s"] = time.perf_counter() - t0
    report["environment"] = environment()
    finish(report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

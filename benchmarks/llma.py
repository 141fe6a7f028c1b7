"""LLMA (copy drafting from references) against target-only, prompt lookup, HF prompt lookup
and the draft model, on three sets built from text on this machine (the LLMA paper, §3).

Sets (``--cases`` each, deterministic for a machine):

- **rag**: a question about a man page, a package README or a copyright file (the
  questions of ``benchmarks/ralm.py``), its top-5 passages from a BM25 knowledge base of man
  pages and ``/usr/share/doc`` (held-out files excluded), and the answer generated with them
  in the paper's template (Figure 6: ``docs: ... query: ... answer:``). References: the 5
  passages (they are in the prompt too, so prompt lookup can copy them as well).
- **cag** (cache-assisted): the prompt is the query alone (``query: ... answer:``); the
  references are the target's own greedy answers to 3 slightly different wordings of the
  same question (the paper's setting, with our target's outputs instead of another model's).
  They are generated once and cached in ``--cache-dir``.
- **overlap** (natural overlap): a ``/usr/share/doc/*/copyright`` file cut where it starts
  quoting a licence; the target continues it. References: every text of
  ``/usr/share/common-licenses`` (one index, built once and shared, like the past-sessions
  source in serving).

Arms, interleaved per case (the order rotates): ``hf_target`` and ``target`` (target-only,
HF's loop and ours; the speed-up's baseline is the faster of the two per set),
``hf_pld`` (HF prompt lookup, ``prompt_lookup_num_tokens``), ``pld`` (our prompt lookup
at the same k, ``--pld-k``), ``draft`` (the bootstrapped draft model at its default k),
``llma`` (serving's rule, ``serving/proposers/llma.py`` ``frequency_rows``: copy ``1 + match``
tokens, at most ``--k``, of the continuation most of the longest matches share, ranked by
frequency as SuffixDecoding ranks its tree's paths, cut before the first token whose share of
the matches that agree so far is below half, or where the path's probability falls below 0.1) and ``suffix`` (SuffixDecoding from
``arctic-inference``, when it imports; ``benchmarks/llma_suffix.py``).
A subset also runs LLMA with the paper's rule (copy k at every match) at every k of
``--sweep``, and the target and LLMA at temperature 0.7 (the
sampled outputs are not compared: the one-hot rule is exact in distribution, tested by the
chi-square test in ``tests/serving/proposers/test_llma.py``).

Reported per set and arm: total and median wall time, speed-up over target-only (ratio of
total times, the paper's Table 3/4 measure, and the median of per-case ratios), tokens per
target forward, acceptance (accepted / drafted), greedy outputs identical to target-only,
and LLMA's matching cost per step (µs) and index build time. The summary's bars: speed-up over
target-only >= 2.0x on RAG and CAG, LLMA >= 1.0x HF prompt lookup on every set
(``min_ratio_vs_hf_pld``, also as ``ratio_vs_hf_pld_min``) and >= 1.0x SuffixDecoding on RAG and
CAG (``ratio_vs_suffix_rag``, ``ratio_vs_suffix_cag``: suffix's total time over llma's, the
speed-up's measure; None when the suffix arm did not run); ``cpu_model`` names the CPU. Usage:

    .venv/bin/python benchmarks/llma.py --quick
    .venv/bin/python benchmarks/llma.py --json benchmarks/out/llma.json --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import environment, finish_report, fmt, save_png, target_name  # noqa: E402
from benchmarks.specbench.methods import ForwardCounter, Outcome, hf_method  # noqa: E402
from specops.core.sessions.ngram import NgramIndex  # noqa: E402
from specops.serving.engine.spec import DEFAULT_K, ProposerConfig, SpecEngine  # noqa: E402
from specops.serving.engine.types import SamplingParams  # noqa: E402
from specops.serving.proposers.catalogue import LLMA_MAX_N  # noqa: E402
from specops.serving.proposers.llma import (  # noqa: E402
    COPY_FACTOR,
    COPY_OFFSET,
    MIN_AGREEMENT,
    MIN_PATH,
    SERVING_RULE,
    LLMAProposer,
    ReferenceSet,
)

log = logging.getLogger("benchmarks.llma")
DOC_BEGIN = "<!-- BEGIN llma (written by benchmarks/llma.py; edits inside are overwritten) -->"
DOC_END = "<!-- END llma -->"
SETS = ("rag", "cag", "overlap")
SET_LABELS = {
    "rag": "RAG (top-5 BM25 passages in the prompt)",
    "cag": "cache-assisted (own answers to 3 rewordings)",
    "overlap": "natural overlap (copyright files quoting a licence)",
}
RAG_TEMPLATE = "docs:\n{docs}\nquery: {query}\nanswer:"
"""The paper's Figure 6."""
CAG_TEMPLATE = "query: {query}\nanswer:"
TARGETS = ("hf_target", "target")
GREEDY_ARMS = ("hf_target", "target", "hf_pld", "pld", "draft", "llma", "suffix")
SAMPLING_T = 0.7
SUMMARY_KEYS = (
    "speedup_rag",
    "speedup_cag",
    "speedup_overlap",
    "min_ratio_vs_hf_pld",
    "ratio_vs_hf_pld_min",
    "ratio_vs_suffix_rag",
    "ratio_vs_suffix_cag",
    "speedup_sampling",
    "greedy_identical",
    "cpu_model",
)
BARS = {
    "speedup_rag": 2.0,
    "speedup_cag": 2.0,
    "min_ratio_vs_hf_pld": 1.0,
    "ratio_vs_hf_pld_min": 1.0,
    "ratio_vs_suffix_rag": 1.0,
    "ratio_vs_suffix_cag": 1.0,
    "speedup_sampling": 1.0,
}
OPTIONAL_ARM_KEYS = {"ratio_vs_suffix_rag": "suffix", "ratio_vs_suffix_cag": "suffix"}
"""Summary keys that need an arm that may not run (None then, and the bar is not judged)."""


@dataclass
class Case:
    set: str
    name: str
    prompt: str
    references: list[str] = field(default_factory=list)
    """Per-request references (indexed per request, inside the timed call)."""
    shared: bool = False
    """Copies from the set's shared index instead (built once, outside the timed calls)."""


# ---------------------------------------------------------------- the sets
def rag_cases(args, tok, n: int) -> list[Case]:
    from benchmarks import ralm_kbs, ralm_questions
    from specops.core.passage import token_counter
    from specops.serving.retrieval.kb import build_kb
    from specops.trainer.kb_sources import default_sources, passages_from_sources

    path = Path(args.cache_dir) / f"kb-llma-{args.kb_passages}"
    recipe = {"sources": args.source or default_sources(), "max_passages": args.kb_passages, "retrievers": ["bm25"]}
    kb = ralm_kbs.cached_kb(path, recipe)
    if kb is None:
        passages, stats = passages_from_sources(
            recipe["sources"], count_tokens=token_counter(tok), max_passages=args.kb_passages, model_dir=args.model_dir
        )
        kb = build_kb("llma-rag", passages, embedder="hash", retrievers=["bm25"], meta={"bench": recipe})
        kb.save(path)
    per = -(-n // 3) + 2
    questions = ralm_questions.interleaved(ralm_questions.question_sets(kb, per, seed=args.seed))
    bm25 = kb.retriever("bm25")
    cases = []
    for q in questions:
        query = q.prompt.removeprefix("Question: ").removesuffix("\nAnswer:").strip()
        ids, _ = bm25.search(bm25.encode([query]), 5)
        docs = [p.text for p in kb.passages(i for i in ids[0] if i >= 0)]
        if docs:
            prompt = RAG_TEMPLATE.format(docs="\n".join(" ".join(d.split()) for d in docs), query=query)
            cases.append(Case("rag", q.title, prompt, docs))
        if len(cases) == n:
            break
    return cases


REWORDINGS = [
    (
        re.compile(r"What does the `(.+)` command do\?"),
        [
            "What is the `{0}` command used for?",
            "Explain what the `{0}` command does.",
            "What does the command `{0}` do?",
        ],
    ),
    (
        re.compile(r"What is (.+) and what is it for\?"),
        ["What is {0} used for?", "Describe {0} and what it is for.", "What is the {0} package?"],
    ),
    (
        re.compile(r"Under which license is (.+) distributed\?"),
        ["What license does {0} use?", "Which license covers {0}?", "Under what license is {0} released?"],
    ),
    (re.compile(r"(.+)"), ["{0} Answer briefly.", "Tell me: {0}", "A user asks: {0}"]),  # FAQs and others
]


def cag_questions(args, n: int) -> list[tuple[str, str, list[str]]]:
    """(title, question, 3 rewordings): reworded by a pattern for man / README / licence
    questions, by a prefix or suffix for the others (FAQs)."""
    from benchmarks import ralm_questions
    from specops.serving.retrieval.kb import KnowledgeBase

    kb = KnowledgeBase.load(Path(args.cache_dir) / f"kb-llma-{args.kb_passages}")
    out = []
    for q in ralm_questions.interleaved(ralm_questions.question_sets(kb, 2 * n, seed=args.seed + 1)):
        query = q.prompt.removeprefix("Question: ").removesuffix("\nAnswer:").strip()
        for pattern, forms in REWORDINGS:
            if m := pattern.fullmatch(query):
                out.append((q.title, query, [f.format(m.group(1)) for f in forms]))
                break
    rng = random.Random(args.seed)
    rng.shuffle(out)
    return out[:n]


def cag_cases(args, pair, n: int) -> list[Case]:
    """The target's greedy answers to the rewordings are its references (cached per model and length)."""
    from transformers import GenerationConfig

    tok = pair.tokenizer
    questions = cag_questions(args, n)
    key = hashlib.sha256(json.dumps([pair.tokenizer_sha256, args.model_dir, args.max_new_tokens]).encode()).hexdigest()[
        :12
    ]
    cache_path = Path(args.cache_dir) / f"cag-answers-{key}.json"
    answers: dict[str, str] = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    todo = sorted({CAG_TEMPLATE.format(query=r) for _, _, rs in questions for r in rs} - set(answers))
    if todo:
        tok.padding_side = "left"
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        gen = GenerationConfig(
            max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=tok.eos_token_id
        )
        for i in tqdm(range(0, len(todo), 8), desc="cag: the target answers the rewordings", unit="batch"):
            batch = todo[i : i + 8]
            enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = pair.target.generate(**enc, generation_config=gen)
            for prompt, row in zip(batch, out[:, enc["input_ids"].shape[1] :]):
                answers[prompt] = tok.decode(row, skip_special_tokens=True)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(answers, indent=0))
    return [
        Case("cag", title, CAG_TEMPLATE.format(query=q), [answers[CAG_TEMPLATE.format(query=r)] for r in rs])
        for title, q, rs in questions
    ]


def licence_texts(licenses_dir: Path) -> dict[str, str]:
    texts, seen = {}, set()
    for p in sorted(licenses_dir.iterdir()):
        if p.is_file():
            t = p.read_text(errors="replace")
            if t not in seen:
                seen.add(t)
                texts[p.name] = t
    return texts


def _norm(s: str) -> str:
    return " ".join(s.split())


def overlap_cases(args, n: int, licences: dict[str, str]) -> list[Case]:
    """Copyright files cut after the first line that starts a licence quote (that line and the
    next one both occur in a licence text), keeping the last ``prompt_chars`` before the cut."""
    corpus = "\n".join(_norm(t) for t in licences.values())
    found: dict[str, Case] = {}
    for path in sorted(Path("/").glob(args.copyright_glob.lstrip("/"))):
        try:
            lines = path.read_text(errors="replace").splitlines(keepends=True)
        except OSError:
            continue
        for i in range(len(lines) - 2):
            a, b = _norm(lines[i]), _norm(lines[i + 1])
            if len(a.split()) >= 6 and len(b.split()) >= 4 and a in corpus and b in corpus:
                prompt = "".join(lines[: i + 1])[-args.prompt_chars :]
                found.setdefault(prompt[-400:], Case("overlap", str(path), prompt, shared=True))
                break
    cases = sorted(found.values(), key=lambda c: c.name)
    random.Random(args.seed).shuffle(cases)
    return cases[:n]


# ---------------------------------------------------------------- arms
class TimedLLMA(LLMAProposer):
    """LLMA with its matching time per step recorded."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.propose_s = 0.0

    def propose(self, state, k):
        t0 = time.perf_counter()
        try:
            return super().propose(state, k)
        finally:
            self.propose_s += time.perf_counter() - t0


def suffix_decoding_available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except Exception:  # not installed, or its extension does not load on this machine
        return False
    return True


class Runner:
    """Runs one arm on one case; our arms through ``SpecEngine``, HF's through ``generate``."""

    def __init__(self, pair, args, shared: dict[str, NgramIndex], shared_docs: dict[str, list[list[int]]]) -> None:
        self.pair, self.args, self.shared, self.shared_docs = pair, args, shared, shared_docs
        self.engine = SpecEngine(pair)
        self.counter = ForwardCounter(pair.target)
        self.hf = {
            "hf_target": hf_method("hf_target", pair, self.counter),
            "hf_pld": hf_method("hf_pld", pair, self.counter, prompt_lookup_num_tokens=args.pld_k),
        }
        self.tok = pair.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def run(self, arm: str, case: Case, prompt_ids: list[int], temperature: float = 0.0, k: int | None = None) -> dict:
        a = self.args
        if arm in self.hf:
            o = self.hf[arm].run(prompt_ids, temperature, a.max_new_tokens, a.seed)
            return outcome_row(o)
        params = SamplingParams(temperature=temperature, max_new_tokens=a.max_new_tokens, seed=a.seed)
        extra: dict = {}
        t0 = time.perf_counter()
        if arm.startswith("llma"):
            # the headline arm copies as serving does (the length grows with the match, at most
            # k); the sweep arms (k given) copy k at every match, the paper's rule
            rule = {} if k is not None else SERVING_RULE
            k = k or a.k
            t_index = time.perf_counter()
            if case.shared:
                refs = ReferenceSet([self.shared[case.set]], ["request"])
            else:
                refs = ReferenceSet.from_docs([self.encode(r) for r in case.references], max_n=LLMA_MAX_N)
            extra["index_s"] = time.perf_counter() - t_index
            prop = TimedLLMA(refs, min_n=a.n, max_n=LLMA_MAX_N, **rule)
            res = self.engine.generate(prompt_ids, params, proposer=prop, k=k)
            extra["propose_us_per_step"] = 1e6 * prop.propose_s / max(1, prop.num_steps)
            extra["hit_rate"] = prop.num_hits / max(1, prop.num_steps)
        elif arm == "suffix":
            from benchmarks.llma_suffix import SuffixProposer

            docs = self.shared_docs[case.set] if case.shared else [self.encode(r) for r in case.references]
            prop = SuffixProposer(docs, k=a.k)
            res = self.engine.generate(prompt_ids, params, proposer=prop, k=a.k)
        else:
            method = {"target": "target", "pld": "pld", "draft": "draft"}[arm]
            k = {"pld": a.pld_k, "draft": DEFAULT_K["draft"]}.get(arm)
            res = self.engine.generate(prompt_ids, params, proposer_cfg=ProposerConfig(method=method), k=k)
        wall = time.perf_counter() - t0
        s = res.stats
        spec = arm != "target"
        return {
            **outcome_row(
                Outcome(
                    list(res.token_ids),
                    wall,
                    s.num_target_forwards,
                    s.num_drafted if spec else None,
                    s.num_accepted if spec else None,
                    s.num_verify_steps if spec else None,
                )
            ),
            **extra,
        }


def outcome_row(o: Outcome) -> dict:
    return {
        "tokens": o.token_ids,
        "wall_s": o.wall_s,
        "forwards": o.num_target_forwards,
        "drafted": o.num_drafted,
        "accepted": o.num_accepted,
    }


# ---------------------------------------------------------------- aggregation
def arm_stats(rows: list[dict], ref: list[list[int]] | None) -> dict:
    walls = [r["wall_s"] for r in rows]
    toks = sum(len(r["tokens"]) for r in rows)
    drafted = sum(r["drafted"] or 0 for r in rows)
    out = {
        "cases": len(rows),
        "total_s": sum(walls),
        "median_s": statistics.median(walls),
        "tokens": toks,
        "tokens_per_s": toks / max(1e-9, sum(walls)),
        "tokens_per_forward": toks / max(1, sum(r["forwards"] for r in rows)),
        "acceptance": (sum(r["accepted"] or 0 for r in rows) / drafted) if drafted else None,
    }
    if ref is not None:
        out["identical"] = sum(r["tokens"] == t for r, t in zip(rows, ref)) / len(rows)
    for key in ("propose_us_per_step", "index_s", "hit_rate"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[key] = statistics.median(vals)
    return out


def set_report(rows: dict[str, list[dict]], sweep: dict[int, list[dict]], sampled: dict[str, list[dict]]) -> dict:
    """Per-arm stats, speed-ups over the faster target-only loop, the k sweep and sampling."""
    arms = {}
    for arm, rs in rows.items():
        ref = rows["hf_target" if arm.startswith("hf_") else "target"]
        arms[arm] = arm_stats(rs, [r["tokens"] for r in ref])
    base = min(TARGETS, key=lambda a: arms[a]["total_s"])
    for arm, st in arms.items():
        st["speedup"] = arms[base]["total_s"] / st["total_s"]
        st["median_case_speedup"] = statistics.median(b["wall_s"] / r["wall_s"] for b, r in zip(rows[base], rows[arm]))
    out = {"baseline": base, "arms": arms, "cases": len(rows["target"])}
    if sweep:
        n = len(next(iter(sweep.values())))
        t_sub = sum(r["wall_s"] for r in rows[base][:n])
        out["sweep"] = {
            k: {
                **arm_stats(rs, [r["tokens"] for r in rows["target"][:n]]),
                "speedup": t_sub / sum(r["wall_s"] for r in rs),
            }
            for k, rs in sorted(sweep.items())
        }
        out["sweep_llma_speedup"] = t_sub / sum(r["wall_s"] for r in rows["llma"][:n])  # serving's rule, same cases
    if sampled:
        t, lm = sampled["target"], sampled["llma"]
        out["sampling"] = {
            "cases": len(t),
            "target": arm_stats(t, None),
            "llma": arm_stats(lm, None),
            "speedup": sum(r["wall_s"] for r in t) / sum(r["wall_s"] for r in lm),
        }
    return out


def summary(report: dict) -> dict:
    sets = report["sets"]
    sp = {s: sets[s]["arms"]["llma"]["speedup"] if s in sets else None for s in SETS}
    vs_hf = [st["arms"]["hf_pld"]["total_s"] / st["arms"]["llma"]["total_s"] for st in sets.values()]
    sampled = [st["sampling"] for st in sets.values() if "sampling" in st]
    t = sum(x["target"]["total_s"] for x in sampled)
    lm = sum(x["llma"]["total_s"] for x in sampled)
    ident = [st["arms"][a]["identical"] for st in sets.values() for a in st["arms"]]

    def vs_suffix(name: str) -> float | None:
        """LLMA's speed over SuffixDecoding's on set ``name``: total times, suffix / llma."""
        arms = sets.get(name, {}).get("arms", {})
        return arms["suffix"]["total_s"] / arms["llma"]["total_s"] if "suffix" in arms else None

    return {
        "speedup_rag": sp["rag"],
        "speedup_cag": sp["cag"],
        "speedup_overlap": sp["overlap"],
        "min_ratio_vs_hf_pld": min(vs_hf) if vs_hf else None,
        "ratio_vs_hf_pld_min": min(vs_hf) if vs_hf else None,  # the same number, under issue 39's name
        "ratio_vs_suffix_rag": vs_suffix("rag"),
        "ratio_vs_suffix_cag": vs_suffix("cag"),
        "speedup_sampling": t / lm if sampled and lm else None,
        "greedy_identical": bool(ident) and all(x == 1.0 for x in ident),
        "cpu_model": report.get("environment", {}).get("cpu_model"),  # None in a JSON from before it was recorded
    }


# ---------------------------------------------------------------- report
def markdown(report: dict, plot_rel: str | None) -> str:
    s, a = report["summary"], report["args"]
    lines = [
        DOC_BEGIN,
        "## LLMA",
        "",
        f"Command: `{report['command']}`  ",
        f"Target {report['target']}, {a['threads']} threads, "
        f"{a['max_new_tokens']} new tokens, CPU {s.get('cpu_model') or 'not recorded'}; `llma`: n = {a['n']}, "
        f"copies {a.get('copy_rule', '1 + match/2')} tokens, at most k = {a['k']}, of the continuation most of "
        "the longest matches share (frequency ranking, SuffixDecoding's rule), cut where "
        f"{a.get('cut_rule', 'the top token share falls below half')}; "
        f"`suffix`: SuffixDecoding ({'run' if a.get('suffix') else 'not run: arctic-inference does not import'}); "
        f"`pld` and `hf_pld`: k = {a.get('pld_k', a['k'])}; `draft`: k = "
        f"{DEFAULT_K['draft']}. Cases interleaved, arms rotated per case. Speed-up = total time of the faster target-only loop / the arm's (the paper's measure); "
        "`med` = median of per-case ratios. Identical = greedy output equal to target-only.",
        "",
    ]
    for name, st in report["sets"].items():
        lines += [
            f"### {SET_LABELS.get(name, name)}: {st['cases']} cases (baseline {st['baseline']})",
            "",
            "| arm | speed-up | med | tokens/s | tokens/forward | acceptance | identical | match µs/step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for arm, x in st["arms"].items():
            lines.append(
                f"| {arm} | {x['speedup']:.2f}x | {x['median_case_speedup']:.2f}x | {x['tokens_per_s']:.1f} | "
                f"{x['tokens_per_forward']:.2f} | {fmt(x['acceptance'])} | {x['identical']:.2f} | "
                f"{fmt(x.get('propose_us_per_step'), '.0f')} |"
            )
        if "sweep" in st:
            n = next(iter(st["sweep"].values()))["cases"]
            lines += [
                "",
                f"LLMA with the paper's rule (copy k at every match), k sweep ({n} cases): "
                + ", ".join(
                    f"k={k} {x['speedup']:.2f}x ({x['tokens_per_forward']:.2f} tok/fwd)" for k, x in st["sweep"].items()
                )
                + f"; serving's rule on the same cases: {st['sweep_llma_speedup']:.2f}x",
            ]
        if "sampling" in st:
            x = st["sampling"]
            lines += [
                "",
                f"T = {SAMPLING_T} ({x['cases']} cases): LLMA {x['speedup']:.2f}x target-only, "
                f"{x['llma']['tokens_per_forward']:.2f} tokens/forward",
            ]
        lines.append("")
    if plot_rel:
        lines += [f"![LLMA speed-up against k]({plot_rel})", ""]
    lines += ["| summary key | value | bar | met |", "|---|---|---|---|"]
    for key in SUMMARY_KEYS:
        v, bar = s.get(key), BARS.get(key)
        shown = str(v) if isinstance(v, bool | str) or v is None else f"{v:.2f}"
        if key == "greedy_identical":
            bar_text, met = "true", v is True
        elif key in OPTIONAL_ARM_KEYS and v is None:
            shown, bar_text, met = f"{OPTIONAL_ARM_KEYS[key]} arm not run", f">= {bar}", None
        elif key == "speedup_sampling":
            bar_text, met = f"> {bar}", v is not None and v > bar
        elif bar is not None:
            bar_text, met = f">= {bar}", v is not None and v >= bar
        else:
            bar_text, met = "", None
        lines.append(f"| `{key}` | {shown} | {bar_text} | {'' if met is None else ('yes' if met else '**no**')} |")
    lines += ["", f"Run took {report['wall_s'] / 60:.1f} min.", DOC_END]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = {n: st for n, st in report["sets"].items() if st.get("sweep")}
    if not sets:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, st in sets.items():
        sw = st["sweep"]
        ks = sorted(sw, key=int)
        line = ax.plot(
            [int(k) for k in ks], [sw[k]["speedup"] for k in ks], marker="o", label=f"{name}: copy k (paper)"
        )
        if "sweep_llma_speedup" in st:
            ax.axhline(
                st["sweep_llma_speedup"],
                color=line[0].get_color(),
                ls="--",
                lw=1,
                label=f"{name}: {report['args'].get('copy_rule', '1 + match/2')}, at most {report['args']['k']}",
            )
    ax.axhline(1.0, color="#888888", lw=0.8)
    ax.set_xlabel("copy length k")
    ax.set_ylabel("speed-up over target-only")
    ax.set_title("LLMA: speed-up against the copy length (greedy)", fontsize=10)
    ax.legend(fontsize=7)
    return save_png(fig, path)


# ---------------------------------------------------------------- main
def parse(argv) -> argparse.Namespace:
    from specops.paths import models_dir

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Sets, arms and measures: see the module docstring (benchmarks/llma.py).",
    )
    p.add_argument("--quick", action="store_true", help="4 cases per set, 32 new tokens, 2-case sweep and sampling")
    p.add_argument("--json", type=Path, help="write the results (with a `summary`) here")
    p.add_argument("--doc", type=Path, help="write the tables into this markdown file (docs/benchmarks.md)")
    p.add_argument("--plot", type=Path, help="PNG of speed-up against k (default: img/llma.png beside --doc)")
    p.add_argument(
        "--replot", type=Path, metavar="JSON", help="re-derive summary, table, plot and doc from a saved --json"
    )
    p.add_argument(
        "--model-dir", default=str(models_dir()), help="bootstrap-style target/ + draft/ (default: %(default)s)"
    )
    p.add_argument("--cache-dir", default=".specops/bench/llma", help="the RAG KB and the cag answers are kept here")
    p.add_argument("--sets", default=",".join(SETS), help="comma-separated: rag, cag, overlap")
    p.add_argument("--cases", type=int, default=None, help="cases per set (default 100, quick 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128, quick 32")
    p.add_argument(
        "--k",
        type=int,
        default=DEFAULT_K["llma"],
        help=f"LLMA's longest copy (serving's rule: {COPY_OFFSET:g} + {COPY_FACTOR:g} x match tokens, at most k)",
    )
    p.add_argument(
        "--pld-k",
        type=int,
        default=DEFAULT_K["pld"],
        help="prompt lookup's copy length, ours and HF's (HF's default prompt_lookup_num_tokens)",
    )
    p.add_argument("--n", type=int, default=1, help="LLMA's shortest match (the paper's best: 1)")
    p.add_argument("--sweep", default="4,8,12,16,20", help="LLMA k values run on the sweep subset")
    p.add_argument(
        "--sweep-cases", type=int, default=None, help="cases per set that run the sweep (default 20, quick 2)"
    )
    p.add_argument("--sampling-cases", type=int, default=None, help="cases per set run at T=0.7 (default 20, quick 2)")
    p.add_argument("--no-draft", action="store_true", help="skip the draft-model arm")
    p.add_argument("--kb-passages", type=int, default=None, help="passages of the RAG KB (default 20000, quick 2000)")
    p.add_argument("--source", action="append", help="text sources of the RAG KB (default: man pages + /usr/share/doc)")
    p.add_argument("--licenses-dir", type=Path, default=Path("/usr/share/common-licenses"), help="overlap references")
    p.add_argument("--copyright-glob", default="/usr/share/doc/*/copyright", help="overlap prompts")
    p.add_argument("--prompt-chars", type=int, default=3000, help="overlap: characters kept before the cut")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    full = {"cases": 100, "max_new_tokens": 128, "sweep_cases": 20, "sampling_cases": 20, "kb_passages": 20000}
    quick = {"cases": 4, "max_new_tokens": 32, "sweep_cases": 2, "sampling_cases": 2, "kb_passages": 2000}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sweep = [int(k) for k in str(args.sweep).split(",") if k]
    args.sets = [s for s in args.sets.split(",") if s]
    if unknown := set(args.sets) - set(SETS):
        p.error(f"--sets: unknown {sorted(unknown)} (choose from {', '.join(SETS)})")
    return args


def run_set(name: str, cases: list[Case], runner: Runner, args) -> tuple[dict, list[dict]]:
    arms = [a for a in GREEDY_ARMS if not (a == "draft" and args.no_draft) and not (a == "suffix" and not args.suffix)]
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    sweep: dict[int, list[dict]] = {k: [] for k in args.sweep} if args.sweep_cases else {}
    sampled: dict[str, list[dict]] = {"target": [], "llma": []} if args.sampling_cases else {}
    examples = []
    for i, case in enumerate(tqdm(cases, desc=f"{name}: cases", unit="case")):
        ids = runner.encode(case.prompt)
        jobs = [(a, 0.0, None) for a in arms]
        if i < args.sweep_cases:
            jobs += [(f"llma_k{k}", 0.0, k) for k in args.sweep]
        if i < args.sampling_cases:
            jobs += [("target", SAMPLING_T, None), ("llma", SAMPLING_T, None)]
        r = i % len(jobs)
        for arm, temp, k in jobs[r:] + jobs[:r]:  # rotate the order per case
            row = runner.run(arm, case, ids, temp, k)
            if temp:
                sampled[arm].append(row)
            elif k is not None:
                sweep[k].append(row)
            else:
                rows[arm].append(row)
        if i < 2:
            examples.append(
                {
                    "case": case.name,
                    "prompt_tail": case.prompt[-300:],
                    "output": runner.tok.decode(rows["target"][-1]["tokens"]),
                }
            )
    rep = set_report(rows, sweep, sampled)
    rep["prompt_tokens_median"] = statistics.median(len(runner.encode(c.prompt)) for c in cases)
    rep["reference_tokens_median"] = statistics.median(
        sum(len(runner.encode(r)) for r in c.references) if not c.shared else len(runner.shared[name]) for c in cases
    )
    rep["examples"] = examples
    return rep, [{"case": c.name, **{a: round(rows[a][j]["wall_s"], 4) for a in rows}} for j, c in enumerate(cases)]


def finish(report: dict, args) -> None:
    finish_report(
        report, args, summary=summary, markdown=markdown, plot=plot, png_name="llma.png", begin=DOC_BEGIN, end=DOC_END
    )


def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.replot:
        report = json.loads(args.replot.read_text())
        args.json = args.json or args.replot
        finish(report, args)
        return 0
    from specops.core.models import load_model_dir

    torch.set_num_threads(args.threads)
    args.suffix = suffix_decoding_available()
    log.info(
        "SuffixDecoding (arctic-inference): %s", "available" if args.suffix else "not importable here; arm skipped"
    )
    pair = load_model_dir(Path(args.model_dir))
    tok = pair.tokenizer
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    licences = licence_texts(args.licenses_dir)
    cases: dict[str, list[Case]] = {}
    shared: dict[str, NgramIndex] = {}
    shared_docs: dict[str, list[list[int]]] = {}
    if "rag" in args.sets or "cag" in args.sets:
        rag = rag_cases(args, tok, args.cases)
        if "rag" in args.sets:
            cases["rag"] = rag
    if "cag" in args.sets:
        cases["cag"] = cag_cases(args, pair, args.cases)
    if "overlap" in args.sets:
        cases["overlap"] = overlap_cases(args, args.cases, licences)
        t_index = time.perf_counter()
        index = NgramIndex(max_n=LLMA_MAX_N)
        shared_docs["overlap"] = [tok.encode(text, add_special_tokens=False) for text in licences.values()]
        for doc in shared_docs["overlap"]:
            index.add(doc)
        shared["overlap"] = index
        log.info(
            "overlap: %d licence texts, %d tokens indexed in %.2fs",
            len(licences),
            len(index),
            time.perf_counter() - t_index,
        )
    for name, cs in cases.items():
        log.info("%s: %d cases", name, len(cs))
    runner = Runner(pair, args, shared, shared_docs)
    warm = runner.encode("query: warm up\nanswer:")
    for arm in (
        "hf_target",
        "target",
        "hf_pld",
        "pld",
        "llma",
        *(() if args.no_draft else ("draft",)),
        *(("suffix",) if args.suffix else ()),
    ):
        runner.run(arm, Case("warm", "warm", "", ["warm up"]), warm)
    command = ".venv/bin/python benchmarks/llma.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {
        "command": command,
        "target": target_name(Path(args.model_dir)),
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("json", "doc", "plot", "replot")
        }
        | {
            "copy_rule": f"{COPY_OFFSET:g} + {COPY_FACTOR:g} x match",
            "cut_rule": f"the top token's share falls below {MIN_AGREEMENT:g} or the path's probability below {MIN_PATH:g}",
        },
        "sets": {},
        "per_case": {},
    }
    if "overlap" in shared:
        report["overlap_index"] = {"licences": len(licences), "tokens": len(shared["overlap"])}
    for name, cs in cases.items():
        if cs:
            report["sets"][name], report["per_case"][name] = run_set(name, cs, runner, args)
            if args.json:  # a run cut off later still leaves the finished sets (``--replot`` it)
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({**report, "partial": True}, indent=1, default=str))
    report["wall_s"] = time.perf_counter() - t0
    report["environment"] = environment()
    finish(report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

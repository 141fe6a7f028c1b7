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
``llma`` (serving's rule, ``serving/proposers/llma.py`` ``scored_rows``: every match length up
to 64 scored by how often its continuations recur, SuffixDecoding's rule, with the copy length
and probability floor tuned on the dev split by ``benchmarks/llma_tune.py``) and ``suffix`` (SuffixDecoding from
``arctic-inference``, when it imports; ``benchmarks/llma_suffix.py``).
``--split dev|test`` takes disjoint halves of each set's first 2 x ``--cases`` cases: rules are
tuned on dev (``benchmarks/llma_tune.py``) and reported on test. A subset also runs LLMA with the
paper's rule (copy k at every match) at every k of ``--sweep``, and the target and LLMA at temperature 0.7 (the
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

from benchmarks.common import environment, finish_report, target_name  # noqa: E402
from benchmarks.llma_report import (  # noqa: E402, F401  (some only re-exported: the names this module used to define)
    BARS,
    DOC_BEGIN,
    DOC_END,
    OPTIONAL_ARM_KEYS,
    SAMPLING_T,
    SET_LABELS,
    SETS,
    SPLITS,
    SUMMARY_KEYS,
    TARGETS,
    arm_stats,
    built,
    markdown,
    plot,
    set_report,
    split_cases,
    summary,
)
from benchmarks.specbench.methods import ForwardCounter, Outcome, hf_method  # noqa: E402
from specops.core.sessions.ngram import NgramIndex  # noqa: E402
from specops.serving.engine.spec import SpecEngine  # noqa: E402
from specops.serving.engine.types import SamplingParams  # noqa: E402
from specops.serving.plan import plain_generate
from specops.serving.proposers.catalogue import (
    DEFAULT_K,  # noqa: E402
    LLMA_MAX_N,  # noqa: E402
)
from specops.serving.proposers.llma import (  # noqa: E402
    COPY_FACTOR,
    COPY_OFFSET,
    MIN_PROB,
    SERVING_RULE,
    LLMAProposer,
    ReferenceSet,
)

log = logging.getLogger("benchmarks.llma")
RAG_TEMPLATE = "docs:\n{docs}\nquery: {query}\nanswer:"
"""The paper's Figure 6."""
CAG_TEMPLATE = "query: {query}\nanswer:"
GREEDY_ARMS = ("hf_target", "target", "hf_pld", "pld", "draft", "llma", "suffix")


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
def _split(args) -> str:
    """The split to build (adaptive.py and vllm_path.py build sets with Namespaces of their own: all)."""
    return getattr(args, "split", "all")


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
    per = -(-built(n, _split(args)) // 3) + 2
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
        if len(cases) == built(n, _split(args)):
            break
    return split_cases(cases, n, _split(args))


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
    return split_cases(out[: built(n, _split(args))], n, _split(args))


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
    return split_cases(cases[: built(n, _split(args))], n, _split(args))


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
            res = plain_generate(self.engine, prompt_ids, params, proposer=prop, k=k)
            extra["propose_us_per_step"] = 1e6 * prop.propose_s / max(1, prop.num_steps)
            extra["hit_rate"] = prop.num_hits / max(1, prop.num_steps)
        elif arm == "suffix":
            from benchmarks.llma_suffix import SuffixProposer

            docs = self.shared_docs[case.set] if case.shared else [self.encode(r) for r in case.references]
            prop = SuffixProposer(docs, k=a.k)
            res = plain_generate(self.engine, prompt_ids, params, proposer=prop, k=a.k)
        else:
            method = {"target": "target", "pld": "pld", "draft": "draft"}[arm]
            k = {"pld": a.pld_k, "draft": DEFAULT_K["draft"]}.get(arm)
            res = plain_generate(self.engine, prompt_ids, params, method=method, k=k)
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


# ---------------------------------------------------------------- main
def add_set_args(p: argparse.ArgumentParser) -> None:
    """The options that build the sets (this script's and ``benchmarks/llma_tune.py``'s)."""
    p.add_argument("--kb-passages", type=int, default=None, help="passages of the RAG KB (default 20000, quick 2000)")
    p.add_argument("--source", action="append", help="text sources of the RAG KB (default: man pages + /usr/share/doc)")
    p.add_argument("--licenses-dir", type=Path, default=Path("/usr/share/common-licenses"), help="overlap references")
    p.add_argument("--copyright-glob", default="/usr/share/doc/*/copyright", help="overlap prompts")
    p.add_argument("--prompt-chars", type=int, default=3000, help="overlap: characters kept before the cut")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)


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
        help=f"LLMA's longest copy (serving's rule: {COPY_FACTOR:g} x match + {COPY_OFFSET:g} tokens, at most k)",
    )
    p.add_argument(
        "--pld-k",
        type=int,
        default=DEFAULT_K["pld"],
        help="prompt lookup's copy length, ours and HF's (HF's default prompt_lookup_num_tokens)",
    )
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="all",
        help="which cases of each set: dev (tune on these) or test (report on these), disjoint halves of "
        "the first 2 x --cases; all: the first --cases (default: %(default)s)",
    )
    p.add_argument(
        "--arms",
        default=",".join(a for a in GREEDY_ARMS if a != "suffix"),
        help="comma-separated greedy arms (suffix runs whenever arctic-inference imports; hf_pld needs hf_target) "
        "(default: %(default)s)",
    )
    p.add_argument("--n", type=int, default=1, help="LLMA's shortest match (the paper's best: 1)")
    p.add_argument("--sweep", default="4,8,12,16,20", help="LLMA k values run on the sweep subset")
    p.add_argument(
        "--sweep-cases", type=int, default=None, help="cases per set that run the sweep (default 20, quick 2)"
    )
    p.add_argument("--sampling-cases", type=int, default=None, help="cases per set run at T=0.7 (default 20, quick 2)")
    p.add_argument("--no-draft", action="store_true", help="skip the draft-model arm")
    add_set_args(p)
    args = p.parse_args(argv)
    full = {"cases": 100, "max_new_tokens": 128, "sweep_cases": 20, "sampling_cases": 20, "kb_passages": 20000}
    quick = {"cases": 4, "max_new_tokens": 32, "sweep_cases": 2, "sampling_cases": 2, "kb_passages": 2000}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.sweep = [int(k) for k in str(args.sweep).split(",") if k]
    args.sets = [s for s in args.sets.split(",") if s]
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := set(args.arms) - set(GREEDY_ARMS):
        p.error(f"--arms: unknown {sorted(unknown)} (choose from {', '.join(GREEDY_ARMS)})")
    if "target" not in args.arms or ("hf_pld" in args.arms and "hf_target" not in args.arms):
        p.error("--arms: target is needed (every arm is compared with it), and hf_pld needs hf_target")
    if unknown := set(args.sets) - set(SETS):
        p.error(f"--sets: unknown {sorted(unknown)} (choose from {', '.join(SETS)})")
    return args


def run_set(name: str, cases: list[Case], runner: Runner, args) -> tuple[dict, list[dict]]:
    arms = [
        a
        for a in GREEDY_ARMS
        if (a in args.arms or a == "suffix")
        and not (a == "draft" and args.no_draft)
        and not (a == "suffix" and not args.suffix)
    ]
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
    for arm in GREEDY_ARMS:
        if (arm in args.arms and not (arm == "draft" and args.no_draft)) or (arm == "suffix" and args.suffix):
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
            "copy_rule": f"{COPY_FACTOR:g} x match + {COPY_OFFSET:g}",
            "cut_rule": f"the path's probability falls below {MIN_PROB:g}, the match length scored (SuffixDecoding's rule)",
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

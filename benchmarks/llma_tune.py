"""LLMA's copy rule tuned on the dev split (``benchmarks/llma.py --split dev``'s cases), by
replaying the target's greedy outputs: the LLMA paper tunes n and k on dev cases and reports on
test cases; ``benchmarks/llma.py --split test`` is the report.

Greedy verification is deterministic: the target emits the same tokens whatever is drafted, so a
rule's steps, drafted and accepted tokens on a case follow from the target-only output alone. Each
rule is replayed on every dev case (its proposer drafts, the longest draft prefix equal to the
output is accepted, plus the target's own token) and priced by the target's measured verify cost
``a + b * t`` for a pass over t tokens (``specops.core.cost.step_ms`` at the set's median prompt
length, fastest of a few reps) plus the proposer's own measured time. The simulated speed-up
is target-only's decode time (one token per pass) over the rule's; prefill, the same in every
arm, is left out, so it overstates what the wall clock shows (the test run measures that).

Rules replayed (``--k`` caps every copy):

- ``scored``: SuffixDecoding's rule over our indexes (``serving/proposers/llma.py``
  ``scored_rows``) on a grid of copy factor, copy offset, ``min_prob`` and n (the shortest match);
- ``frequency``: serving's rule before issue 60 (``frequency_rows``: 1 + match tokens, cut below
  agreement 0.5 or path probability 0.1);
- ``paper``: the paper's rule (copy k at every match of at least n tokens) for every k of
  ``--sweep`` and n of ``--paper-n``;
- ``suffix``: SuffixDecoding itself (``arctic-inference``, when it imports), its defaults.

The winner is the scored rule with the highest geometric mean of the sets' simulated speed-ups.
Usage:

    .venv/bin/python benchmarks/llma_tune.py --quick
    .venv/bin/python benchmarks/llma_tune.py --json benchmarks/out/llma_tune.json --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks import llma  # noqa: E402
from benchmarks.common import environment, finish_report, fmt, save_png, target_name  # noqa: E402
from specops.serving.engine.types import DecodeState, Proposals, SamplingParams  # noqa: E402
from specops.serving.proposers.catalogue import DEFAULT_K, LLMA_MAX_N  # noqa: E402
from specops.serving.proposers.llma import FREQUENCY_RULE, LLMAProposer, ReferenceSet  # noqa: E402

log = logging.getLogger("benchmarks.llma_tune")
DOC_BEGIN = "<!-- BEGIN llma-tune (written by benchmarks/llma_tune.py; edits inside are overwritten) -->"
DOC_END = "<!-- END llma-tune -->"
SUMMARY_KEYS = (
    "split",
    "cases_per_set",
    "best_rule",
    "best_sim_speedup_rag",
    "best_sim_speedup_cag",
    "best_vs_suffix_sim_rag",
    "best_vs_suffix_sim_cag",
    "best_vs_frequency_sim",
    "cpu_model",
)


# ---------------------------------------------------------------- replay
def replay(proposer, prompt: list[int], output: list[int], k: int, max_new_tokens: int | None = None) -> dict:
    """Steps, drafted and accepted tokens and proposer seconds of ``proposer`` on one case whose
    target-only output is ``output`` (of a request for ``max_new_tokens``, default its length):
    each step drafts at most ``k`` and never past the request's end, as the engine's session."""
    state = DecodeState(token_ids=list(prompt), num_prompt_tokens=len(prompt), params=SamplingParams())
    proposer.start(state)
    limit = len(output) if max_new_tokens is None else max_new_tokens
    pos = steps = drafted = verified = accepted = 0
    spent = 0.0
    while pos < len(output):
        k_step = min(k, limit - pos - 1)
        t0 = time.perf_counter()
        p = proposer.propose(state, k_step) if k_step > 0 else Proposals.empty()
        spent += time.perf_counter() - t0
        rows = p.tokens.tolist()
        lengths = p.lengths or [len(r) for r in rows]
        rows = [r[:n] for r, n in zip(rows, lengths)]
        nodes = {tuple(r[: j + 1]) for r in rows for j in range(len(r))}  # the tree verified in one pass
        acc = 0
        for r in rows:
            j = 0
            while j < len(r) and pos + j < len(output) and r[j] == output[pos + j]:
                j += 1
            acc = max(acc, j)
        steps += 1
        drafted += max(map(len, rows), default=0)  # the engine's count: the tree's depth
        verified += len(nodes)
        accepted += acc
        state.token_ids.extend(output[pos : pos + acc + 1])
        pos += acc + 1
    return {
        "steps": steps,
        "drafted": drafted,
        "verified": verified,
        "accepted": accepted,
        "propose_s": spent,
        "tokens": len(output),
    }


def priced(totals: dict, cost: tuple[float, float]) -> dict:
    """Simulated decode seconds of a rule and of target-only, and the speed-up."""
    a, b = cost
    rule_s = totals["steps"] * a + b * (totals["steps"] + totals["verified"]) + totals["propose_s"]
    target_s = totals["tokens"] * (a + b)
    return {
        **totals,
        "sim_s": rule_s,
        "target_sim_s": target_s,
        "sim_speedup": target_s / rule_s,
        "tokens_per_step": totals["tokens"] / max(1, totals["steps"]),
        "acceptance": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        "propose_us_per_step": 1e6 * totals["propose_s"] / max(1, totals["steps"]),
    }


def rules(args) -> list[tuple[str, str, dict]]:
    """(name, family, LLMAProposer keywords or {} for suffix)."""
    out = []
    for f, o, p, n in itertools.product(args.factors, args.offsets, args.min_probs, args.ns):
        out.append(
            (f"scored f={f:g} o={o:g} p={p:g} n={n}", "scored", dict(copy_factor=f, copy_offset=o, min_prob=p, min_n=n))
        )
    out.append(
        (
            "frequency (before issue 60)",
            "frequency",
            {**FREQUENCY_RULE, "min_n": 1},
        )
    )
    for k, n in itertools.product(args.sweep, args.paper_n):
        out.append((f"paper k={k} n={n}", "paper", dict(min_n=n, k=k)))
    if args.suffix:
        out.append(("suffix (arctic-inference)", "suffix", {}))
    return out


def make(family: str, kw: dict, refs: list[list[int]], k: int):
    if family == "suffix":
        from benchmarks.llma_suffix import SuffixProposer

        return SuffixProposer(refs, k=k)
    kw = {key: v for key, v in kw.items() if key != "k"}
    return LLMAProposer(ReferenceSet.from_docs(refs, max_n=LLMA_MAX_N), max_n=LLMA_MAX_N, **kw)


# ---------------------------------------------------------------- data
def target_outputs(pair, cases: list, args, encode) -> list[list[int]]:
    """The target's greedy output of each case (cached per model, length and prompt)."""
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.plan import plain_generate

    key = hashlib.sha256(json.dumps([pair.tokenizer_sha256, args.max_new_tokens]).encode()).hexdigest()[:12]
    path = Path(args.cache_dir) / f"tune-outputs-{key}.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    engine = SpecEngine(pair)
    out = []
    for case in tqdm(cases, desc="target-only outputs", unit="case"):
        h = hashlib.sha256(case.prompt.encode()).hexdigest()
        if h not in cache:
            params = SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed)
            cache[h] = list(plain_generate(engine, encode(case.prompt), params, method="target").token_ids)
            path.write_text(json.dumps(cache))
        out.append(cache[h])
    return out


def verify_cost(pair, context_len: int, reps: int) -> tuple[float, float]:
    """(a, b) seconds: a target pass over t tokens costs a + b * t after ``context_len`` tokens
    (``specops.core.cost.step_ms`` at t = 1 and 17, the fastest of ``reps``)."""
    from specops.core.cost import step_ms

    vocab = min(5000, pair.target.config.vocab_size - 10)  # token ids every target has
    ctx = [(i * 7919) % vocab + 10 for i in range(context_len)]
    v1 = step_ms(pair.target, ctx, 1, reps=reps, warmup=2, best=True)
    v17 = step_ms(pair.target, ctx, 17, reps=reps, warmup=2, best=True)
    b = max((v17 - v1) / 16.0, 0.0)
    return (max(v1 - b, 1e-3) / 1000.0, b / 1000.0)


# ---------------------------------------------------------------- report
def summary(report: dict) -> dict:
    sets = list(report["sets"])
    res = report["results"]

    def gmean(name: str) -> float:
        return math.exp(statistics.fmean(math.log(res[name][s]["sim_speedup"]) for s in sets))

    scored = [r for r in res if res[r]["family"] == "scored"]
    best = max(scored, key=gmean)
    suffix = next((r for r in res if res[r]["family"] == "suffix"), None)
    freq = next(r for r in res if res[r]["family"] == "frequency")
    out = {
        "split": report["args"]["split"],
        "cases_per_set": min(report["cases"].values()),
        "best_rule": best,
        "best_params": res[best]["params"],
    }
    for s in ("rag", "cag"):
        out[f"best_sim_speedup_{s}"] = res[best][s]["sim_speedup"] if s in sets else None
        out[f"best_vs_suffix_sim_{s}"] = (
            res[suffix][s]["sim_s"] / res[best][s]["sim_s"] if suffix and s in sets else None
        )
    out["best_vs_frequency_sim"] = gmean(best) / gmean(freq)
    out["cpu_model"] = report.get("environment", {}).get("cpu_model")
    return out


def markdown(report: dict, plot_rel: str | None) -> str:
    s, a, res = report["summary"], report["args"], report["results"]
    sets = list(report["sets"])
    lines = [
        DOC_BEGIN,
        "## LLMA: the copy rule tuned on the dev split",
        "",
        f"Command: `{report['command']}`  ",
        f"Target {report['target']}, {a['max_new_tokens']} new tokens, k = {a['k']}, CPU {s.get('cpu_model')}; "
        f"split `{s['split']}`, "
        + ", ".join(f"{n} {report['cases'][n]} cases" for n in sets)
        + ". Each rule replayed on the target's greedy outputs, priced by the measured verify cost "
        + "; ".join(f"{n}: {1e3 * c[0]:.1f} ms + {1e3 * c[1]:.2f} ms/token" for n, c in report["cost"].items())
        + " plus the proposer's time; speed-up = target-only decode / the rule's (prefill left out).",
        "",
        "| rule | " + " | ".join(f"{n} speed-up | {n} tok/step | {n} acceptance" for n in sets) + " | µs/step |",
        "|---|" + "---|---|---|" * len(sets) + "---|",
    ]
    ranked = sorted(
        res,
        key=lambda r: -math.exp(statistics.fmean(math.log(res[r][n]["sim_speedup"]) for n in sets)),
    )
    shown = [r for r in ranked if res[r]["family"] == "scored"][: a["show"]]
    shown += [r for r in ranked if res[r]["family"] != "scored" and r not in shown]
    for r in shown:
        cells = " | ".join(
            f"{res[r][n]['sim_speedup']:.2f}x | {res[r][n]['tokens_per_step']:.2f} | {fmt(res[r][n]['acceptance'])}"
            for n in sets
        )
        us = statistics.fmean(res[r][n]["propose_us_per_step"] for n in sets)
        lines.append(f"| {'**' + r + '**' if r == s['best_rule'] else r} | {cells} | {us:.0f} |")
    lines += [
        "",
        f"{len([r for r in res if res[r]['family'] == 'scored'])} scored rules replayed; the best "
        f"{a['show']} shown, then every other family.",
        "",
    ]
    if plot_rel:
        lines += [f"![LLMA rules replayed on the dev split]({plot_rel})", ""]
    lines += ["| summary key | value |", "|---|---|"]
    for key in SUMMARY_KEYS:
        v = s.get(key)
        lines.append(f"| `{key}` | {v if isinstance(v, str | int | bool) or v is None else f'{v:.3f}'} |")
    lines += ["", f"Run took {report['wall_s'] / 60:.1f} min.", DOC_END]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, best = report["results"], report["summary"]["best_rule"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name in report["sets"]:
        paper = sorted(
            (
                (res[r]["params"]["k"], res[r][name]["sim_speedup"])
                for r in res
                if res[r]["family"] == "paper" and res[r]["params"]["min_n"] == 1
            ),
        )
        line = ax.plot([k for k, _ in paper], [v for _, v in paper], marker="o", label=f"{name}: paper, copy k (n = 1)")
        c = line[0].get_color()
        ax.axhline(res[best][name]["sim_speedup"], color=c, ls="--", lw=1.2, label=f"{name}: {best}")
        for r in res:
            if res[r]["family"] == "suffix":
                ax.axhline(res[r][name]["sim_speedup"], color=c, ls=":", lw=1, label=f"{name}: SuffixDecoding")
    ax.axhline(1.0, color="#888888", lw=0.8)
    ax.set_xlabel("copy length k (the paper's rule)")
    ax.set_ylabel("simulated decode speed-up")
    ax.set_title("LLMA rules replayed on the dev split (greedy)", fontsize=10)
    ax.legend(fontsize=6)
    return save_png(fig, path)


# ---------------------------------------------------------------- main
def parse(argv) -> argparse.Namespace:
    from specops.paths import models_dir

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--quick", action="store_true", help="3 cases per set, 32 new tokens, a small grid")
    p.add_argument("--json", type=Path, help="write the results (with a `summary`) here")
    p.add_argument("--doc", type=Path, help="write the table into this markdown file (docs/benchmarks.md)")
    p.add_argument("--plot", type=Path, help="PNG of the rules (default: img/llma_tune.png beside --doc)")
    p.add_argument(
        "--replot", type=Path, metavar="JSON", help="re-derive summary, table, plot and doc from a saved --json"
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap-style target/ (default: %(default)s)")
    p.add_argument("--cache-dir", default=".specops/bench/llma", help="the RAG KB, cag answers and target outputs")
    p.add_argument("--sets", default="rag,cag", help="comma-separated: rag, cag, overlap (default: %(default)s)")
    p.add_argument("--split", choices=llma.SPLITS, default="dev", help="the cases tuned on (default: %(default)s)")
    p.add_argument("--cases", type=int, default=None, help="cases per set (default 25, quick 3)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128, quick 32")
    p.add_argument("--k", type=int, default=DEFAULT_K["llma"], help="the longest copy (default: %(default)s)")
    p.add_argument("--factors", default="0.5,1,2,4", help="scored: copy factors")
    p.add_argument("--offsets", default="0,1,2", help="scored: copy offsets")
    p.add_argument("--min-probs", default="0.05,0.1,0.2,0.3,0.5", help="scored: path probability floors")
    p.add_argument("--ns", default="1,2", help="scored: shortest matches (the paper's n)")
    p.add_argument("--sweep", default="4,8,12,16,20", help="paper's rule: copy lengths k")
    p.add_argument("--paper-n", default="1,2,3", help="paper's rule: shortest matches n")
    p.add_argument("--show", type=int, default=10, help="scored rules shown in the table")
    p.add_argument("--cost-reps", type=int, default=7, help="reps of each verify-cost measurement (the fastest counts)")
    llma.add_set_args(p)
    args = p.parse_args(argv)
    full = {"cases": 25, "max_new_tokens": 128, "kb_passages": 20000}
    quick = {"cases": 3, "max_new_tokens": 32, "kb_passages": 2000}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.factors, args.offsets, args.min_probs, args.ns, args.sweep, args.paper_n = (
            "1",
            "1",
            "0.1,0.3",
            "1",
            "8,16",
            "1",
        )
    args.factors = [float(x) for x in args.factors.split(",")]
    args.offsets = [float(x) for x in args.offsets.split(",")]
    args.min_probs = [float(x) for x in args.min_probs.split(",")]
    args.ns = [int(x) for x in args.ns.split(",")]
    args.sweep = [int(x) for x in args.sweep.split(",")]
    args.paper_n = [int(x) for x in args.paper_n.split(",")]
    args.sets = [s for s in args.sets.split(",") if s]
    if unknown := set(args.sets) - set(llma.SETS):
        p.error(f"--sets: unknown {sorted(unknown)} (choose from {', '.join(llma.SETS)})")
    if bad := [n for n in args.ns + args.paper_n if not 1 <= n <= LLMA_MAX_N]:
        p.error(f"--ns/--paper-n: {bad} outside 1..{LLMA_MAX_N}")
    return args


def finish(report: dict, args) -> None:
    finish_report(
        report,
        args,
        summary=summary,
        markdown=markdown,
        plot=plot,
        png_name="llma_tune.png",
        begin=DOC_BEGIN,
        end=DOC_END,
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

    torch.set_num_threads(args.threads)
    args.suffix = llma.suffix_decoding_available()
    pair = load_model_dir(Path(args.model_dir))
    tok = pair.tokenizer

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cases: dict[str, list] = {}
    if "rag" in args.sets or "cag" in args.sets:
        rag = llma.rag_cases(args, tok, args.cases)
        if "rag" in args.sets:
            cases["rag"] = rag
    if "cag" in args.sets:
        cases["cag"] = llma.cag_cases(args, pair, args.cases)
    shared_docs: dict[str, list[list[int]]] = {}
    if "overlap" in args.sets:
        licences = llma.licence_texts(args.licenses_dir)
        cases["overlap"] = llma.overlap_cases(args, args.cases, licences)
        shared_docs["overlap"] = [encode(t) for t in licences.values()]
    data = {}
    cost = {}
    for name, cs in cases.items():
        outputs = target_outputs(pair, cs, args, encode)
        prompts = [encode(c.prompt) for c in cs]
        refs = [shared_docs[name] if c.shared else [encode(r) for r in c.references] for c in cs]
        data[name] = list(zip(prompts, outputs, refs))
        cost[name] = verify_cost(pair, int(statistics.median(map(len, prompts))), args.cost_reps)
        log.info(
            "%s: %d cases, verify %.1f ms + %.2f ms/token", name, len(cs), 1e3 * cost[name][0], 1e3 * cost[name][1]
        )
    results: dict[str, dict] = {}
    for rule, family, kw in tqdm(rules(args), desc="replaying rules", unit="rule"):
        k = kw.get("k", args.k)
        results[rule] = {"family": family, "params": {**kw, "k": k}}
        for name, rows in data.items():
            tot = {"steps": 0, "drafted": 0, "verified": 0, "accepted": 0, "propose_s": 0.0, "tokens": 0}
            for prompt, output, refs in rows:
                r = replay(make(family, kw, refs, k), prompt, output, k, args.max_new_tokens)
                for key in tot:
                    tot[key] += r[key]
            results[rule][name] = priced(tot, cost[name])
    report = {
        "command": ".venv/bin/python benchmarks/llma_tune.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "target": target_name(Path(args.model_dir)),
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("json", "doc", "plot", "replot")
        },
        "sets": {name: [c.name for c in cs] for name, cs in cases.items()},
        "cases": {name: len(cs) for name, cs in cases.items()},
        "cost": cost,
        "results": results,
        "wall_s": time.perf_counter() - t0,
        "environment": environment(),
    }
    finish(report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The vLLM path carrying the whole product: ``auto`` choosing a vLLM server per request, against
each single-method server, on a mixed workload, through ``specops serve --engine vllm``.

One front door (``specops serve --engine vllm --vllm-speculation draft,ngram,copy,none``, a
subprocess) runs four vLLM servers: the bootstrap draft (``draft``), vLLM's n-gram lookup
(``pld``), our copy proposer with each request's references (``llma``,
``serving/vllm/plugin``) and target-only (``target``). Every arm sends the same prompts, as
token ids, greedy, streamed, through the same front door; a request names its arm's method:

- ``target``, ``pld``, ``draft``: the prompt alone (these methods cannot use references);
- ``llma``: the prompt and its references;
- ``auto``: the prompt and its references; the front door picks a server per request
  (``serving/vllm/choice.py``).

**The mixed workload**, distinct prompts, interleaved (``chat``, ``rag``, ``cag``, ...):

- ``chat``: held-out chat requests of the chat workload's sql, math and api domains, rendered
  with the chat template (``benchmarks/engines_learn.py``);
- ``rag``: a question, its top-5 BM25 passages of man pages and ``/usr/share/doc`` in the
  LLMA paper's template; references: the passages (``benchmarks/llma.py``'s rag set);
- ``cag`` (repeated sessions): the question alone; references: the target's own answers to
  three rewordings of it, as a returning user's earlier sessions (``benchmarks/llma.py``'s
  cag set). They travel as ``references``, not through the session cache: every arm
  serves every prompt, and a shared cache would let an arm copy an earlier arm's answer.

Each kind is split in two: the first half warms the front door up, untimed, at every
concurrency (``auto`` tries each server and learns its acceptance and cost there); the
second half is measured, in ``--repeats`` rounds. At concurrency 1 a round serves the cases
one by one, every arm on a case back to back, the arms' order taken in turn from a Williams
design (each arm right after each other equally often): a slow spell of the machine, or what
one arm leaves behind, falls on every arm's copy of the same case, and ``auto`` ÷ the best arm
gets a 95 % bootstrap interval over the cases (``paired_c1``). At higher concurrencies the
arms run one after another, their order rotated by one per round and per concurrency.
Reported per arm: tokens/s (generated tokens ÷ wall time of the arm's runs, all rounds; at
concurrency 1 the sum of its latencies) and each round's, per kind at concurrency 1 (Σ tokens ÷ Σ request latency), p50
latency, the per-token α from each response (vLLM's own per-request counts), and whether
every greedy output equals target-only's, by token ids (``return_token_ids``).

**Swaps** (``--parts swap``): ``benchmarks/vllm_swap.py``'s run on this pair (its report
whole, under ``swap``): ``--swaps`` promotions of cluster ``chat`` under two clients, the
first into the standby draft server, the others into that server in place, then cluster
``code``'s first champion right after ``chat``'s first (a new server: the cold start). **Memory** (``--parts
rss``): the front door's own RSS after 4 requests, over vLLM (the models' configs only)
against a front door holding the weights (``specops serve --engine specops``, same pair).
**The draft's vocabulary** (``--parts vocab``): the ``draft`` arm on the measured cases at each
concurrency through a front door with the draft server alone, scoring the draft's own
vocabulary (``draft_vocab.json``: our model class in vLLM, ``serving/vllm/vocab.py``) and
then vLLM's full LM head (``--no-vllm-draft-vocab``), one front door at a time; outputs by
token ids against each other.

Summary: ``auto_vs_best_single`` (per concurrency: ``auto`` ÷ the best single-method arm;
bar ≥ 1) with ``auto_vs_best_single_rounds`` (the same ratio per round: the spread) and
``auto_vs_best_single_c1_ci95`` (concurrency 1's interval), ``llma_refs_vs_vllm_target`` (the rag set at concurrency 1: ``llma`` ÷ ``target``;
bar ≥ 1.5), ``identical_outputs``, ``alpha_token_per_request`` (every drafting response carried
a per-token α), ``swap_window_s`` (the longer of the standby and in-place windows; bar ≤ 10 s)
with ``swap_window_cold_s`` beside it, ``swap_failed``, ``front_door_rss_ratio`` (bar ≤ 1/3).
``cpu_model`` names the CPU. ``--parts`` runs some parts and keeps the others' results in an
existing ``--json``; ``parts_cpu`` names the CPU each part ran on.

    .venv/bin/python benchmarks/vllm_path.py --json benchmarks/out/vllm_path.json
    .venv/bin/python benchmarks/vllm_path.py --parts swap,rss --json benchmarks/out/vllm_path.json
    .venv/bin/python benchmarks/vllm_path.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


from benchmarks.common import cpu_model, environment, target_name, write_doc_section  # noqa: E402
from benchmarks.vllm_path_run import (  # noqa: E402, F401  (some only re-exported: the names this module used to define)
    ARMS,
    COPIES,
    KINDS,
    SINGLE,
    FrontDoor,
    _vllm_version,
    _vocab_size,
    arm_row,
    balanced_orders,
    measure_rss,
    measure_speed,
    measure_swap,
    measure_vocab,
    paired_ratio,
    request,
    run_arm,
    run_interleaved,
)

log = logging.getLogger("bench.vllm_path")

DOC_BEGIN, DOC_END = "<!-- vllm-path:begin -->", "<!-- vllm-path:end -->"
BARS = {
    "auto_vs_best_single": 1.0,
    "llma_refs_vs_vllm_target": 1.5,
    "swap_window_s": 10.0,
    "front_door_rss_ratio": 1 / 3,
}
PARTS = ("speed", "swap", "rss", "vocab")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from specops.paths import models_dir

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arms, workload and measures: see the module docstring (benchmarks/vllm_path.py).",
    )
    p.add_argument("--quick", action="store_true", help="tiny random pair, 2 cases per kind, 16 tokens")
    p.add_argument("--json", type=Path, help="write the results (with a `summary`) here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown file to update")
    p.add_argument("--no-doc", action="store_true", help="do not update the doc")
    p.add_argument("--model-dir", type=Path, default=None, help=f"target/ + draft/ (default: {models_dir()})")
    p.add_argument("--cases", type=int, default=None, help="measured cases per kind (default 8, quick 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64, quick 16)")
    p.add_argument("--concurrency", default="1,4", help="comma-separated client concurrencies")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="rounds of every arm at each concurrency in the speed part, the arms' order rotated each round; "
        "tokens/s is over all rounds (default 3, quick 1)",
    )
    p.add_argument("--k", type=int, default=3, help="vllm_k: tokens the draft and n-gram servers draft per step")
    p.add_argument("--copy-k", type=int, default=8, help="vllm_copy_k: tokens the copy server drafts per step at most")
    p.add_argument(
        "--vllm-args", default=None, help="more vLLM arguments (default none; quick: --enforce-eager, no compile)"
    )
    p.add_argument("--cache-dir", default=".specops/bench/llma", help="the RAG KB and the cag answers (llma.py's)")
    p.add_argument("--kb-passages", type=int, default=None, help="passages of the RAG KB (default 20000, quick 2000)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the front door (tokenizer, recounts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--parts",
        default="speed,swap,rss,vocab",
        help="comma-separated: speed (auto against each single server), swap (promotions under load), rss (a front "
        "door holding the target, for the RSS ratio), vocab (the draft server over the draft's own vocabulary against "
        "vLLM's full LM head); with fewer than all and an existing --json, the other parts' results there are kept",
    )
    p.add_argument("--swap-tokens", type=int, default=16, help="tokens per request in the swap and rss parts")
    p.add_argument("--swaps", type=int, default=5, help="promotions of cluster chat in the swap part (then one cold)")
    args = p.parse_args(argv)
    defaults = {"cases": (2, 8), "max_tokens": (16, 64), "kb_passages": (2000, 20000), "repeats": (1, 3)}
    for key, (quick, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.vllm_args is None:
        args.vllm_args = "--enforce-eager" if args.quick else ""
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    args.parts = [x.strip() for x in str(args.parts).split(",") if x.strip()]
    if not args.parts or set(args.parts) - set(PARTS):
        p.error(f"--parts: choose from {', '.join(PARTS)}")
    return args


# ---------------------------------------------------------------- the workload
def workload(args, model_dir: Path) -> list[dict]:
    """``2 * cases`` cases per kind, interleaved chat, rag, cag, ...: {kind, prompt (ids), references}."""
    from benchmarks import llma
    from specops.core.models import load_pair
    from specops.workloads.chat_workload import chat_workload

    pair = load_pair(model_dir / "target", model_dir / "draft")
    tok = pair.tokenizer
    n = 2 * args.cases
    per = -(-n // 3)
    parts = chat_workload(tok, {"heldout": max(per, 8)}, domains=("sql", "math", "api"), seed=args.seed)
    chat = [parts[d]["heldout"][i].token_ids for i in range(per) for d in ("sql", "math", "api")][:n]
    ns = argparse.Namespace(
        cache_dir=args.cache_dir,
        kb_passages=args.kb_passages,
        source=None,
        seed=args.seed,
        model_dir=str(model_dir),
        max_new_tokens=args.max_tokens,
    )
    rag = llma.rag_cases(ns, tok, n)
    cag = llma.cag_cases(ns, pair, n)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    kinds = {
        "chat": [{"kind": "chat", "prompt": list(p), "references": []} for p in chat],
        "rag": [{"kind": "rag", "prompt": ids(c.prompt), "references": c.references} for c in rag],
        "cag": [{"kind": "cag", "prompt": ids(c.prompt), "references": c.references} for c in cag],
    }
    for kind, cases in kinds.items():
        if len(cases) < n:
            raise SystemExit(f"{kind}: {len(cases)} cases on this machine, {n} needed (--cases {args.cases})")
    return [kinds[k][i] for i in range(n) for k in KINDS]


# ---------------------------------------------------------------- the report
def summarise(report: dict) -> dict:
    by_c = report.get("by_concurrency") or {}
    auto_vs = {}
    for c, rows in by_c.items():
        best = max(SINGLE, key=lambda a: rows[a]["tok_s"])
        auto_vs[c] = {"ratio": round(rows["auto"]["tok_s"] / rows[best]["tok_s"], 3), "best_single": best}
        rounds = zip(rows["auto"].get("tok_s_rounds") or [], rows[best].get("tok_s_rounds") or [])
        auto_vs[c]["rounds"] = [round(a / b, 3) for a, b in rounds if b]
    c1 = by_c.get("1") or next(iter(by_c.values()), {})
    rag = {a: c1.get(a, {}).get("per_kind", {}).get("rag", {}).get("tok_s") for a in ("llma", "target")}
    llma_vs = round(rag["llma"] / rag["target"], 3) if rag["llma"] and rag["target"] else None
    swap = (report.get("swap") or {}).get("summary") or {}
    window, failed = swap.get("swap_window_s"), swap.get("swap_failed")
    rss = report.get("rss") or {}
    ratio = rss.get("ratio")
    return {
        "auto_vs_best_single": {c: v["ratio"] for c, v in auto_vs.items()},
        "best_single": {c: v["best_single"] for c, v in auto_vs.items()},
        "auto_vs_best_single_rounds": {c: v["rounds"] for c, v in auto_vs.items()},
        "auto_vs_best_single_c1_ci95": (report.get("paired_c1") or {}).get("ci95"),
        "llma_refs_vs_vllm_target": llma_vs,
        "identical_outputs": report.get("identical_outputs"),
        "alpha_token_per_request": report.get("alpha_token_per_request"),
        "swap_window_s": window,
        "swap_window_cold_s": swap.get("swap_window_cold_s"),
        "swap_how": swap.get("how"),
        "swap_failed": failed,
        "front_door_rss_ratio": ratio,
        "draft_vocab_vs_full_head": (report.get("vocab") or {}).get("speedup"),
        "draft_vocab_identical_outputs": (report.get("vocab") or {}).get("identical_outputs"),
        "front_door_rss_mb": (rss.get("over_vllm") or {}).get("rss_mb"),
        "front_door_with_weights_rss_mb": (rss.get("with_weights") or {}).get("rss_mb"),
        "bars": {
            "auto_vs_best_single": bool(auto_vs)
            and all(v["ratio"] >= BARS["auto_vs_best_single"] for v in auto_vs.values()),
            "llma_refs_vs_vllm_target": llma_vs is not None and llma_vs >= BARS["llma_refs_vs_vllm_target"],
            "swap_window_s": window is not None and window <= BARS["swap_window_s"] and failed == 0,
            "front_door_rss_ratio": ratio is not None and ratio <= BARS["front_door_rss_ratio"],
        },
        "cpu_model": report["environment"].get("cpu_model"),
        "parts_cpu": report.get("parts_cpu") or {},
    }


def markdown(report: dict, command: str) -> str:
    s = report["summary"]
    env = report["environment"]
    lines = [
        f"Target {report['target']}, {env.get('cpu_model')}, {env.get('cpu_count')} cores, {report['vllm_version']}.",
    ]
    cpus = report.get("parts_cpu") or {}
    if len(set(cpus.values())) > 1:
        lines[0] += " The parts ran on different machines: " + ", ".join(f"{p} on {c}" for p, c in cpus.items()) + "."
    if report.get("by_concurrency"):
        lines += [
            "",
            f"**Speed**: {report['cases_per_kind']} measured cases per kind (chat, rag, cag), {report['max_tokens']} "
            f"tokens, greedy, k = {report['k']} (copy server: up to {report.get('copy_k', report['k'])}); one front door "
            f"with four vLLM servers; {report.get('repeats', 1)} round(s) of every arm per concurrency, tokens/s over "
            "all rounds; at concurrency 1 every case is served by all arms back to back, in balanced orders "
            "(tokens/s: Σ tokens ÷ Σ latency).",
            "",
            "| concurrency | arm | tokens/s | chat tok/s (c=1 kinds) | rag | cag | p50 latency s | per-token α |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c, rows in report["by_concurrency"].items():
            for arm in ARMS:
                r = rows[arm]
                kinds = [r["per_kind"].get(k, {}).get("tok_s") for k in KINDS]
                alpha = "–" if r["alpha_token"] is None else f"{r['alpha_token']:.3f}"
                lines.append(
                    f"| {c} | {arm} | {r['tok_s']:.1f} | "
                    + " | ".join("–" if x is None else f"{x:.1f}" for x in kinds)
                    + f" | {r['p50_latency_s']:.2f} | {alpha} |"
                )
        auto_methods = {c: rows["auto"]["per_kind"] for c, rows in report["by_concurrency"].items() if "auto" in rows}
        lines += ["", "`auto`'s choices per kind (requests per server, and why):", ""]
        for c, per in auto_methods.items():
            lines.append(
                f"- concurrency {c}: "
                + "; ".join(
                    f"{k} {v['methods']}" + (f" {v['reasons']}" if v.get("reasons") else "") for k, v in per.items()
                )
            )
        lines += [
            "",
            f"`auto` ÷ best single-method arm: {s['auto_vs_best_single']} (bar ≥ 1; best: {s['best_single']}; per "
            f"round: {s.get('auto_vs_best_single_rounds')}; concurrency 1, the arms served case by case: 95 % "
            f"bootstrap interval over cases {s.get('auto_vs_best_single_c1_ci95')}); "
            f"LLMA with references ÷ target-only on the rag set at concurrency 1: {s['llma_refs_vs_vllm_target']} "
            f"(bar ≥ 1.5); greedy outputs identical to target-only's by token ids: {s['identical_outputs']}; every "
            f"drafting response carried a per-token α: {s['alpha_token_per_request']}.",
        ]
    swap = report.get("swap")
    if swap:
        from benchmarks import vllm_swap

        a = swap["args"]
        lines += [
            "",
            f"**Swaps under load** (`benchmarks/vllm_swap.py`'s run): `--vllm-standby 1`, MLflow on SQLite, the local "
            f"stream; {a['clients']} clients without pause, {a['max_tokens']} tokens per request; base server ready in "
            f"{swap['summary']['base_ready_s']} s, its standby in {swap['summary']['standby_ready_s']} s.",
            "",
            vllm_swap.table(swap),
            "",
            f"Swap window (standby or in place): {s['swap_window_s']} s (bar ≤ 10 s with 0 failed: "
            f"{s['bars']['swap_window_s']}).",
        ]
    rss = report.get("rss")
    if rss:
        lines += [
            "",
            f"**Front door memory** (its own RSS, not its vLLM servers', after 4 requests): "
            f"{s['front_door_rss_mb']} MB over vLLM (the models' configs only) against "
            f"{s['front_door_with_weights_rss_mb']} MB holding the weights (`--engine specops`, the same pair): "
            f"ratio {s['front_door_rss_ratio']} (bar ≤ 1/3).",
        ]
    vocab = report.get("vocab")
    if vocab:
        lines += [
            "",
            f"**The draft's vocabulary in vLLM** (the draft server alone, the measured cases, greedy): scoring its own "
            f"{vocab['vocab_size']} tokens (`draft_vocab.json`) against vLLM's full LM head; outputs identical: "
            f"{vocab['identical_outputs']}.",
            "",
            "| concurrency | LM head | tokens/s | p50 latency s | per-token α |",
            "|---:|---|---:|---:|---:|",
        ]
        for c, rows in vocab["by_concurrency"].items():
            for head, row in rows.items():
                lines.append(
                    f"| {c} | {head.replace('_', ' ')} | {row['tok_s']} | {row['p50_latency_s']} | {row['alpha_token']} |"
                )
        lines += [
            "",
            "Own vocabulary ÷ full head, tokens/s: " + ", ".join(f"c={c}: {v}×" for c, v in vocab["speedup"].items()),
        ]
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specops.serving.vllm.process import vllm_python

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-path-"))
    if args.quick and args.model_dir is None:
        from specops.trainer.bootstrap import run as bootstrap

        args.model_dir = tmp / "models"
        bootstrap(args.model_dir, tiny=True)
    elif args.model_dir is None:
        from specops.paths import models_dir

        args.model_dir = models_dir()
    model_dir = Path(args.model_dir)
    report: dict = {}
    if args.json and args.json.exists() and set(args.parts) != set(PARTS):
        report = json.loads(args.json.read_text())  # the other parts' results are kept
        report.pop("summary", None)
    kept_cpu = (report.get("environment") or {}).get("cpu_model")
    parts_cpu = report.get("parts_cpu") or {
        part: kept_cpu
        for part, key in (("speed", "by_concurrency"), ("swap", "swap"), ("rss", "rss"), ("vocab", "vocab"))
        if key in report
    }
    parts_cpu.update({part: cpu_model() for part in args.parts})  # a kept part may come from another machine
    cases = workload(args, model_dir)
    longest = max(len(c["prompt"]) for c in cases)
    max_len = min(2048, longest + args.max_tokens + max(args.k, args.copy_k) + 16)
    chat = [c["prompt"] for c in cases if c["kind"] == "chat"]
    if "speed" in args.parts:
        report.update(measure_speed(args, model_dir, tmp, cases, max_len))
    if "swap" in args.parts:
        report["swap"] = measure_swap(args, model_dir)
    if "rss" in args.parts:
        report["rss"] = measure_rss(args, model_dir, tmp, max_len, chat)
    if "vocab" in args.parts:
        report["vocab"] = measure_vocab(args, model_dir, tmp, cases, max_len)
    report.update(
        {
            "benchmark": "vllm_path",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "target": target_name(model_dir),
            "quick": args.quick,
            "vllm_version": _vllm_version(vllm_python()),
            "vllm_args": args.vllm_args,
            "parts_run": args.parts,
            "parts_cpu": parts_cpu,
            "environment": {**environment(), "cpu_model": cpu_model()},
        }
    )
    report["summary"] = summarise(report)
    command = "python benchmarks/vllm_path.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(report, command.strip())
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if not args.no_doc and not args.quick:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report, command.strip()))
    return 0


def doc_section(report: dict, command: str) -> str:
    """This benchmark's section of docs/benchmarks.md, markers included (``command``: the line that ran it)."""
    return f"{DOC_BEGIN}\n{markdown(report, command)}\n{DOC_END}"


if __name__ == "__main__":
    raise SystemExit(main())

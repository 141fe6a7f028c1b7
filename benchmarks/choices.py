"""``n`` choices: what sharing the prompt's prefill between a request's choices saves.

A request with ``n`` sampled choices over a long prompt (a held-out passage of ``--prompt-tokens``
tokens, never trained on, never served before, with a request to continue it) is decoded as the
API decodes it: its ``n`` choices on threads, their target passes batched by one
``TargetBatcher`` (``serving/engine/batching.py``, as ``specops serve`` runs it). Two arms per
method, side by side in one run: ``shared`` (choice 0 prefills, the others load its keys and
values, ``serving/engine/prefix.py``) and ``own`` (every choice prefills the prompt, as before).
Requests run one at a time, each case through both arms back to back in alternating order, so a
slow spell lands on both.

Per method and arm: the request's median wall time (all ``n`` choices done), its median time to
the first step of the last choice to get one, tokens/s over all choices, and whether the outputs
agree with the other arm's: choice 0 must be identical (it decodes exactly as the request
alone does); a later choice scores its prompt's last token in a shorter pass, so a sampled
choice may differ where a draw falls within a float's rounding (the table counts them).

    .venv/bin/python benchmarks/choices.py --json benchmarks/out/choices.json
    .venv/bin/python benchmarks/choices.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from tqdm import tqdm

from benchmarks.common import environment, finish_report, fmt, save_png
from specops.core.models import load_model_dir
from specops.paths import models_dir
from specops.serving.engine.batching import TargetBatcher
from specops.serving.engine.prefix import SharedPrefix
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.workloads.prompts import heldout_prompts

DOC_BEGIN = "<!-- BEGIN choices (written by benchmarks/choices.py; edits inside are overwritten) -->"
DOC_END = "<!-- END choices -->"
ARMS = ("shared", "own")
METHODS = ("target", "draft")


def _cases(pair, model_dir: Path, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """Held-out prose and code passages in a chat prompt asking to continue them."""
    tok, out = pair.tokenizer, []
    for domain in ("prose", "code"):
        for p in heldout_prompts(model_dir, tok, domain, (n + 1) // 2, num_tokens=prompt_tokens, seed=seed):
            msgs = [{"role": "user", "content": "Continue this:\n\n" + tok.decode(p.token_ids)}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out[:n]


def _request(engine, batcher, ids, params, method: str, n: int, shared: bool) -> dict:
    """One request's ``n`` choices, seeded ``seed + i``, on threads; its wall time and outputs."""
    group = SharedPrefix(wait_s=600) if shared else None
    out: list = [None] * n
    first: list[float] = [0.0] * n
    t0 = time.perf_counter()

    def run(i: int) -> None:
        batcher.begin()
        try:
            p = replace(params, seed=params.seed + i)

            def on_step(_emitted) -> None:
                if not first[i]:
                    first[i] = time.perf_counter() - t0

            out[i] = plain_generate(
                engine,
                ids,
                p,
                method=method,
                on_step=on_step,
                prefix_share=group.handle(lead=i == 0) if group is not None else None,
            )
        finally:
            batcher.end()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 4),
        "last_first_step_s": round(max(first), 4),
        "tokens": sum(r.stats.num_generated for r in out),
        "shared_tokens": sum(r.stats.num_prefill_shared for r in out),
        "ids": [list(r.token_ids) for r in out],
    }


def run(args) -> dict:
    torch.manual_seed(0)
    model_dir = args.models or models_dir()
    pair = load_model_dir(model_dir)
    cases = _cases(pair, model_dir, args.cases, args.prompt_tokens, args.seed)
    batcher = TargetBatcher(pair.target, max_batch=args.n, window_s=0.002)
    engine = SpecEngine(pair, target_lm=batcher.lm)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, seed=args.seed)
    rows: list[dict] = []
    try:
        _request(engine, batcher, cases[0], params, "target", args.n, True)  # warm-up, not counted
        with tqdm(total=len(cases) * len(METHODS) * len(ARMS), desc="choices", unit="req") as bar:
            for c, ids in enumerate(cases):
                for method in METHODS:
                    order = ARMS if c % 2 == 0 else ARMS[::-1]
                    for arm in order:
                        r = _request(engine, batcher, ids, params, method, args.n, arm == "shared")
                        rows.append({"case": c, "prompt_tokens": len(ids), "method": method, "arm": arm, **r})
                        bar.update()
    finally:
        batcher.close()
    return {
        "benchmark": "choices",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "environment": environment(),
        "config": {
            "cases": len(cases),
            "n": args.n,
            "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 0.8,
            "seed": args.seed,
        },
        "rows": rows,
    }


def summary(report: dict) -> dict:
    rows, out = report["rows"], {}
    for method in METHODS:
        out[method] = {}
        for arm in ARMS:
            rs = [r for r in rows if r["method"] == method and r["arm"] == arm]
            out[method][arm] = {
                "median_wall_s": round(statistics.median(r["wall_s"] for r in rs), 3),
                "median_last_first_step_s": round(statistics.median(r["last_first_step_s"] for r in rs), 3),
                "tok_s": round(sum(r["tokens"] for r in rs) / max(sum(r["wall_s"] for r in rs), 1e-9), 2),
                "shared_tokens": sum(r["shared_tokens"] for r in rs),
            }
        pairs = [
            (a, b)
            for a in rows
            for b in rows
            if a["method"] == b["method"] == method and a["case"] == b["case"] and (a["arm"], b["arm"]) == ARMS
        ]
        out[method]["choice0_identical"] = all(a["ids"][0] == b["ids"][0] for a, b in pairs)
        later = [(x, y) for a, b in pairs for x, y in zip(a["ids"][1:], b["ids"][1:])]
        out[method]["later_identical"] = f"{sum(x == y for x, y in later)}/{len(later)}"
        own, shared = out[method]["own"], out[method]["shared"]
        out[method]["speedup_wall"] = round(own["median_wall_s"] / shared["median_wall_s"], 3)
        out[method]["speedup_tok_s"] = round(shared["tok_s"] / own["tok_s"], 3)
    return {
        "n": report["config"]["n"],
        "prompt_tokens": report["config"]["prompt_tokens"],
        "target_speedup_tok_s": out["target"]["speedup_tok_s"],
        "draft_speedup_tok_s": out["draft"]["speedup_tok_s"],
        "choice0_identical": all(out[m]["choice0_identical"] for m in METHODS),
        "methods": out,
    }


def markdown(report: dict, plot_rel: str | None) -> str:
    s, cfg, env = report["summary"], report["config"], report["environment"]
    lines = [
        DOC_BEGIN,
        "## `n` choices sharing the prompt's prefill",
        "",
        f"`{report['command']}` · {cfg['cases']} held-out passages (prose and code, about {cfg['prompt_tokens']} "
        f"tokens) in a chat prompt, n = {cfg['n']} choices at temperature {cfg['temperature']}, "
        f"{cfg['max_new_tokens']} tokens each, choices batched by one target batcher · "
        f"{env.get('cpu_model', '?')} · {report['created']}",
        "",
        "| method | arm | median request s | median s to the last choice's first step | tok/s | prompt tokens loaded |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for m in METHODS:
        for arm in ARMS:
            a = s["methods"][m][arm]
            lines.append(
                f"| {m} | {arm} | {fmt(a['median_wall_s'], '.3f')} | {fmt(a['median_last_first_step_s'], '.3f')} | "
                f"{fmt(a['tok_s'])} | {a['shared_tokens']} |"
            )
    lines += [""]
    for m in METHODS:
        v = s["methods"][m]
        lines.append(
            f"- {m}: shared is **{v['speedup_tok_s']}×** the tokens/s of own prefills ({v['speedup_wall']}× by "
            f"median request time); choice 0 identical in both arms: {'yes' if v['choice0_identical'] else 'NO'}; "
            f"later choices identical: {v['later_identical']}."
        )
    if plot_rel:
        lines += ["", f"![request time, shared and own prefills]({plot_rel})"]
    lines.append(DOC_END)
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]["methods"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(METHODS))
    for j, arm in enumerate(ARMS):
        ax.bar([i + (j - 0.5) * 0.4 for i in x], [s[m][arm]["median_wall_s"] for m in METHODS], width=0.4, label=arm)
    ax.set_xticks(list(x), METHODS)
    ax.set_ylabel("median request seconds")
    ax.set_title(f"n = {report['config']['n']} choices: shared vs own prefills")
    ax.legend()
    return save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="2 cases, 200-token prompts, 8 tokens: a smoke run")
    ap.add_argument("--cases", type=int, default=8, help="passages (half prose, half code)")
    ap.add_argument("--n", type=int, default=4, help="choices per request")
    ap.add_argument("--prompt-tokens", type=int, default=480, help="passage length in tokens")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="output budget per choice")
    ap.add_argument("--seed", type=int, default=7, help="which held-out passages; choice i is seeded seed + i")
    ap.add_argument("--models", type=Path, default=None, help="model dir (default: the bootstrapped pair)")
    ap.add_argument("--json", type=Path, default=None, help="write the report here (with a summary)")
    ap.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="doc to update")
    ap.add_argument("--no-doc", action="store_true", help="do not touch the doc")
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: docs/img/choices.png)")
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.prompt_tokens, args.max_new_tokens = 2, 200, 8
    if args.no_doc:
        args.doc = None
    report = run(args)
    finish_report(
        report,
        args,
        summary=summary,
        markdown=markdown,
        plot=plot,
        png_name="choices.png",
        begin=DOC_BEGIN,
        end=DOC_END,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Structured output: what speculation keeps of its speed-up under a JSON schema.

A JSON-mode workload shaped as production traffic: chat requests that hand the model a held-out
passage (never trained on, never served before) and ask for a JSON object following one schema
(a topic, a sentence quoted from the passage, up to three names). Every arm decodes every case
greedily with our engine in this process, once under the schema (``response_format``
``json_schema``: the grammar masks the target at every verified row and prunes drafts,
``serving/engine/grammar.py``) and once free, so the table shows each method's speed-up over
target-only with the grammar and without it. Arms: ``target`` (target-only), ``draft`` (the
cluster's draft model), ``pld`` (prompt lookup), ``llma`` (copying from the passage, given as a
reference) and ``auto`` (chooses per request among them). Cases run one at a time; each case is
served by every arm back to back in a rotated order, so a slow spell lands on every arm.

Per arm and mode: tokens/s (Σ tokens ÷ Σ wall time over the same cases), its ratio to
target-only of the same mode, α (accepted ÷ drafted), the share of outputs that parse as JSON and
follow the schema (constrained mode; a case cut by ``--max-new-tokens`` does not), and whether
every output equals target-only's of the same mode (it must). The bar: ``auto`` ≥ 1.0× target-only
under the schema.

    .venv/bin/python benchmarks/structured.py --json benchmarks/out/structured.json
    .venv/bin/python benchmarks/structured.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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
from specops.serving.engine.grammar import GrammarSpec
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.plan import plain_generate
from specops.workloads.prompts import heldout_prompts

DOC_BEGIN = "<!-- BEGIN structured (written by benchmarks/structured.py; edits inside are overwritten) -->"
DOC_END = "<!-- END structured -->"
ARMS = ("target", "draft", "pld", "llma", "auto")
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 60},
        "quote": {"type": "string", "maxLength": 300},
        "names": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["topic", "quote", "names"],
    "additionalProperties": False,
}
ASK = (
    'Read the passage and answer with a JSON object: "topic" (a short phrase), "quote" (one sentence '
    'copied word for word from the passage) and "names" (people, places or things it names, at most three).'
    "\n\nPassage:\n{passage}"
)


def _cases(pair, model_dir: Path, n: int, seed: int) -> list[dict]:
    """Held-out prose and code passages in a chat prompt asking for the JSON object."""
    tok, out = pair.tokenizer, []
    for domain in ("prose", "code"):
        for p in heldout_prompts(model_dir, tok, domain, (n + 1) // 2, num_tokens=160, seed=seed):
            passage = tok.decode(p.token_ids)
            msgs = [{"role": "user", "content": ASK.format(passage=passage)}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            out.append(
                {"domain": domain, "prompt_ids": ids, "reference": tok(passage, add_special_tokens=False)["input_ids"]}
            )
    return out[:n]


def _valid(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(v, dict)
        and set(v) == set(SCHEMA["required"])
        and isinstance(v["topic"], str)
        and isinstance(v["quote"], str)
        and isinstance(v["names"], list)
        and len(v["names"]) <= 3
    )


def run(args) -> dict:
    from specops.core.auto_policy import AutoPolicy
    from specops.serving.proposers.catalogue import ProposerResources

    torch.manual_seed(0)
    model_dir = args.models or models_dir()
    pair = load_model_dir(model_dir)
    engine = SpecEngine(pair)
    cases = _cases(pair, model_dir, args.cases, args.seed)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema")
    modes = {"schema": spec, "free": None}
    policy = AutoPolicy(seed=args.seed)
    rows: list[dict] = []
    total = len(cases) * len(ARMS) * len(modes)
    with tqdm(total=total, desc="structured", unit="req") as bar:
        for i, case in enumerate(cases):
            for mode, grammar in modes.items():
                params = SamplingParams(max_new_tokens=args.max_new_tokens, grammar=grammar)
                order = ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]
                for arm in order:
                    refs = (tuple(case["reference"]),) if arm in ("llma", "auto") else ()
                    res = ProposerResources(pair=pair, references=refs, policy=policy)
                    t0 = time.perf_counter()
                    out = plain_generate(engine, case["prompt_ids"], params, method=arm, resources=res)
                    wall = time.perf_counter() - t0
                    s = out.stats
                    text = pair.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                    rows.append(
                        {
                            "case": i,
                            "domain": case["domain"],
                            "mode": mode,
                            "arm": arm,
                            "tokens": s.num_generated,
                            "wall_s": round(wall, 4),
                            "drafted": s.num_drafted,
                            "accepted": s.num_accepted,
                            "finish": s.finish_reason,
                            "valid": _valid(text) if mode == "schema" else None,
                            "ids": list(out.token_ids),
                            "policy": {m: v["steps"] for m, v in s.policy["methods"].items()} if s.policy else None,
                        }
                    )
                    bar.update()
    return {
        "benchmark": "structured",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "environment": environment(),
        "config": {"cases": len(cases), "max_new_tokens": args.max_new_tokens, "seed": args.seed, "schema": SCHEMA},
        "rows": rows,
    }


def arms_table(report: dict) -> dict:
    """Per mode and arm: tokens/s, the ratio to target-only, α, validity and identity."""
    rows, out = report["rows"], {}
    ref = {(r["case"], r["mode"]): r["ids"] for r in rows if r["arm"] == "target"}
    for mode in ("schema", "free"):
        out[mode] = {}
        for arm in ARMS:
            rs = [r for r in rows if r["mode"] == mode and r["arm"] == arm]
            if not rs:
                continue
            tps = sum(r["tokens"] for r in rs) / max(sum(r["wall_s"] for r in rs), 1e-9)
            drafted = sum(r["drafted"] for r in rs)
            out[mode][arm] = {
                "tok_s": round(tps, 2),
                "alpha": round(sum(r["accepted"] for r in rs) / drafted, 3) if drafted else None,
                "valid": round(sum(bool(r["valid"]) for r in rs) / len(rs), 3) if mode == "schema" else None,
                "closed": round(sum(r["finish"] in ("stop", "eos") for r in rs) / len(rs), 3),
                "identical": all(r["ids"] == ref[(r["case"], mode)] for r in rs),
            }
        base = out[mode]["target"]["tok_s"]
        for v in out[mode].values():
            v["vs_target"] = round(v["tok_s"] / base, 3)
    return out


def summary(report: dict) -> dict:
    t = arms_table(report)
    best = max((a for a in ARMS if a not in ("target", "auto")), key=lambda a: t["schema"][a]["tok_s"])
    return {
        "auto_vs_target_schema": t["schema"]["auto"]["vs_target"],
        "auto_vs_target_free": t["free"]["auto"]["vs_target"],
        "best_fixed_schema": best,
        "best_fixed_vs_target_schema": t["schema"][best]["vs_target"],
        "identical_outputs": all(v["identical"] for m in t.values() for v in m.values()),
        "valid_schema_outputs": t["schema"]["target"]["valid"],
        "bar_auto_ge_target_schema": t["schema"]["auto"]["vs_target"] >= 1.0,
        "arms": t,
    }


def markdown(report: dict, plot_rel: str | None) -> str:
    s, env = report["summary"], report["environment"]
    lines = [
        DOC_BEGIN,
        "## Structured output (JSON schema)",
        "",
        f"`{report['command']}` · {report['config']['cases']} held-out passages (prose and code) in a chat prompt "
        f"asking for a JSON object, greedy, {report['config']['max_new_tokens']} tokens at most · "
        f"{env.get('cpu_model', '?')} · {report['created']}",
        "",
        "| arm | tok/s with the schema | × target | α | valid JSON | tok/s free | × target | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for arm in ARMS:
        a, b = s["arms"]["schema"].get(arm), s["arms"]["free"].get(arm)
        if a is None or b is None:
            continue
        lines.append(
            f"| {arm} | {fmt(a['tok_s'])} | {fmt(a['vs_target'])} | {fmt(a['alpha'], '.3f')} | "
            f"{fmt(a['valid'] * 100, '.0f', ' %')} | {fmt(b['tok_s'])} | {fmt(b['vs_target'])} | "
            f"{'yes' if a['identical'] and b['identical'] else 'NO'} |"
        )
    lines += [
        "",
        f"`auto` under the schema: **{s['auto_vs_target_schema']}×** target-only (free: {s['auto_vs_target_free']}×); "
        f"bar ≥ 1.0×: {'met' if s['bar_auto_ge_target_schema'] else 'NOT met'}. Best fixed method under the schema: "
        f"{s['best_fixed_schema']} ({s['best_fixed_vs_target_schema']}×).",
    ]
    if plot_rel:
        lines += ["", f"![tokens/s per arm, with the schema and free]({plot_rel})"]
    lines.append(DOC_END)
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = report["summary"]["arms"]
    arms = [a for a in ARMS if a in t["schema"] and a in t["free"]]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    x = range(len(arms))
    ax.bar([i - 0.2 for i in x], [t["schema"][a]["tok_s"] for a in arms], width=0.4, label="JSON schema")
    ax.bar([i + 0.2 for i in x], [t["free"][a]["tok_s"] for a in arms], width=0.4, label="free")
    ax.set_xticks(list(x), arms)
    ax.set_ylabel("tokens/s")
    ax.set_title("Speculation under a JSON schema (greedy, one request at a time)")
    ax.legend()
    return save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="4 cases, 64 tokens: a smoke run of minutes")
    ap.add_argument("--cases", type=int, default=8, help="passages (half prose, half code)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="output budget per request")
    ap.add_argument("--seed", type=int, default=7, help="which held-out passages")
    ap.add_argument("--models", type=Path, default=None, help="model dir (default: the bootstrapped pair)")
    ap.add_argument("--json", type=Path, default=None, help="write the report here (with a summary)")
    ap.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="doc to update")
    ap.add_argument("--no-doc", action="store_true", help="do not touch the doc")
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: docs/img/structured.png)")
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.max_new_tokens = 4, 64
    if args.no_doc:
        args.doc = None
    report = run(args)
    finish_report(
        report,
        args,
        summary=summary,
        markdown=markdown,
        plot=plot,
        png_name="structured.png",
        begin=DOC_BEGIN,
        end=DOC_END,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Engine pass benchmark: what one packed target pass costs, by linear route and pass kind, and where it goes.

Issue 54 asked why an 8-row pass costs what it does. On the served target (float32, the
threads set up as ``specops serve`` sets them: one OpenMP team, on the thread that runs the
passes) this times one packed pass (``serving/engine/ragged.py``) of

- ``R`` decode rows (1, 8, 16), each request with ``--past`` cached positions;
- 7 decode rows beside a 100-token prefill (a request joining a batch);

by each linear route of ``core/cpu_linear.py`` (``stock``: ``nn.Linear``; ``wx``: ``W @ xᵀ``
for 1-16 rows; ``auto``: the routes the load-time calibration chose, oneDNN on prepacked
weights where it won) through Hugging Face's modules (``hf``), and the lean pass
(``serving/engine/lean.py``: fused q/k/v and gate/up products on prepacked weights). Each
median is over ``--reps`` passes after a warm-up. The 16-row lean pass is then profiled by
operator (linear products, attention, KV stores, the rest).

Last, the batcher in process, without HTTP: ``--prompts`` held-out prompts of the engines
benchmark decoded target-only by ``c`` decode threads through one ``TargetBatcher`` (as a
serving replica runs them, minus the API and the streaming), tokens/s and the batcher
thread's shares. Set beside ``benchmarks/out/engines_load.json`` (the same engine behind
HTTP), it tells what the HTTP path costs.

    .venv/bin/python benchmarks/engine_pass.py --json benchmarks/out/engine_pass.json
    .venv/bin/python benchmarks/engine_pass.py --quick
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.common import environment, fmt, target_name, write_doc_section  # noqa: E402
from specops.core import cpu_linear, threads  # noqa: E402
from specops.paths import models_dir  # noqa: E402
from specops.serving.plan import plain_generate

log = logging.getLogger("bench.engine_pass")
DOC_BEGIN = "<!-- BEGIN engine-pass (written by benchmarks/engine_pass.py; edits inside are overwritten) -->"
DOC_END = "<!-- END engine-pass -->"
ROUTES = ("stock", "wx", "auto")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model-dir", type=Path, default=models_dir(), help="bootstrap dir with target/")
    p.add_argument("--past", type=int, default=150, help="cached positions of each decode row")
    p.add_argument("--reps", type=int, default=None, help="timed passes per cell (default 15; 3 with --quick)")
    p.add_argument("--prompts", type=int, default=None, help="prompts of the in-process run (default 32; 4 quick)")
    p.add_argument("--concurrency", default=None, help="decode threads of the in-process run (default 8,16; 2 quick)")
    p.add_argument("--quick", action="store_true", help="the tiny bootstrap, few reps (the plumbing, not the numbers)")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    args = p.parse_args(argv)
    for name, full, quick in (("reps", 15, 3), ("prompts", 32, 4), ("concurrency", "8,16", "2")):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    return args


def set_route(modules: list, route: str) -> None:
    """Every linear of the target by ``route`` (``auto``: measured again, as at load)."""
    if route == "stock":
        for m in modules:
            m.set_routes(frozenset(), frozenset(), False)
    elif route == "wx":
        for m in modules:
            m.set_routes(cpu_linear.ALL_ROWS, frozenset(), False)
    else:
        cpu_linear.calibrate(modules)


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1000.0 * times[len(times) // 2]


def pass_cells(model, args) -> tuple[list[dict], dict]:
    """Median ms of each pass kind by route and path; the 16-row lean pass's operator profile."""
    from specops.serving.engine import lean, ragged
    from specops.serving.engine.slots import SlotPool

    cfg = model.config
    modules = [m for m in model.modules() if isinstance(m, cpu_linear.SmallBatchLinear)]
    pool = SlotPool(model, slots=16, capacity=max(256, args.past + 128))
    gen = torch.Generator().manual_seed(0)
    for layer in range(pool.num_layers):  # some earlier context in every slot
        pool.keys[layer].normal_(generator=gen)
        pool.values[layer].normal_(generator=gen)
    kinds = {
        "1 decode row": [1],
        "8 decode rows": [1] * 8,
        "16 decode rows": [1] * 16,
        "7 decode rows + a 100-token prefill": [1] * 7 + [100],
    }
    cells = []
    fused = None
    for route in ROUTES:
        set_route(modules, route)
        fused = lean.install(model) if route == "auto" else None
        for kind, new in kinds.items():
            past = [args.past] * (len(new) - 1) + ([0] if new[-1] > 1 else [args.past])
            rows = ragged.Rows.build(list(range(len(new))), past, new, "cpu")
            ids = torch.randint(0, int(cfg.vocab_size), (sum(new),), generator=gen)
            kept = torch.tensor([o + n - 1 for o, n in zip(rows.offsets, new)])

            def hf(ids=ids, rows=rows, kept=kept):
                return model(
                    input_ids=ids[None],
                    position_ids=rows.positions,
                    attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool),
                    past_key_values=ragged.PackedCache(pool, rows),
                    use_cache=True,
                    specops_rows=rows,
                    logits_to_keep=kept,
                ).logits

            with torch.inference_mode():
                cells.append({"route": route, "path": "hf", "pass": kind, "ms": median_ms(hf, args.reps)})
                if fused is not None:

                    def lean_pass(ids=ids, rows=rows, kept=kept):
                        return model.get_output_embeddings()(fused.hidden_states(ids, rows, pool)[kept])

                    cells.append({"route": route, "path": "lean", "pass": kind, "ms": median_ms(lean_pass, args.reps)})
            log.warning("%s %s: %s", route, kind, ", ".join(f"{c['path']} {c['ms']:.1f} ms" for c in cells[-2:]))
    profile = {}
    if fused is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        rows = ragged.Rows.build(list(range(16)), [args.past] * 16, [1] * 16, "cpu")
        ids = torch.randint(0, int(cfg.vocab_size), (16,), generator=gen)
        with torch.inference_mode():
            for _ in range(2):
                model.get_output_embeddings()(fused.hidden_states(ids, rows, pool))
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.reps):
                    model.get_output_embeddings()(fused.hidden_states(ids, rows, pool))
        groups = {"linear products": 0.0, "attention": 0.0, "KV stores": 0.0, "other operators": 0.0}
        for ev in prof.key_averages():
            name = ev.key
            what = (
                "linear products"
                if "linear" in name or name in ("aten::mm", "aten::addmm", "aten::bmm")
                else "attention"
                if "scaled_dot_product" in name
                else "KV stores"
                if name in ("aten::index_copy_", "aten::index_put_", "aten::_index_put_impl_")
                else "other operators"
            )
            groups[what] += ev.self_cpu_time_total / 1000.0 / args.reps
        profile = {"pass": "16 decode rows, lean, auto routes", "ms_by_operator_group": groups}
    return cells, profile


def in_process(model, tokenizer, model_dir: Path, args) -> list[dict]:
    """Target-only decoding of the engines benchmark's prompts by ``c`` threads through one batcher."""
    from benchmarks.engines_learn import workload_prompts
    from specops.core.models import ModelPair
    from specops.serving.engine.batching import PASS_SECONDS, TargetBatcher
    from specops.serving.engine.spec import SpecEngine
    from specops.serving.engine.types import SamplingParams

    prompts = [p.token_ids for p in workload_prompts(tokenizer, model_dir, args.prompts, 0, "mixed")]
    out = []
    for c in args.concurrency:
        batcher = TargetBatcher(model, max_batch=max(16, c), window_s=0.002)
        engine = SpecEngine(ModelPair(target=model, draft=None, tokenizer=tokenizer), target_lm=batcher.lm)

        def one(prompt, batcher=batcher, engine=engine):
            batcher.begin()
            try:
                return len(plain_generate(engine, prompt, SamplingParams(max_new_tokens=64), method="target").token_ids)
            finally:
                batcher.end()

        def shares():
            return {w: PASS_SECONDS.labels(w)._value.get() for w in ("forward", "gather", "idle")}

        try:
            with ThreadPoolExecutor(c) as pool:  # warm-up
                list(pool.map(one, prompts[:c]))
            s0, n0 = shares(), (batcher.num_batches, batcher.num_steps)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                tokens = sum(pool.map(one, prompts))
            wall = time.perf_counter() - t0
            s1 = shares()
            passes = batcher.num_batches - n0[0]
            out.append(
                {
                    "concurrency": c,
                    "tokens": tokens,
                    "wall_s": wall,
                    "tokens_per_s": tokens / wall,
                    "batcher_shares": {w: (s1[w] - s0[w]) / wall for w in s0},
                    "rows_per_pass": (batcher.num_steps - n0[1]) / passes if passes else None,
                    "ms_per_pass": 1000.0 * (s1["forward"] - s0["forward"]) / passes if passes else None,
                }
            )
            log.warning("in process, c=%d: %.1f tokens/s", c, tokens / wall)
        finally:
            batcher.close()
    return out


def markdown(report: dict) -> str:
    cells = report["passes"]
    kinds = list(dict.fromkeys(c["pass"] for c in cells))
    cols = [(r, "hf") for r in ROUTES] + [("auto", "lean")]
    lines = [
        "| pass | " + " | ".join(f"{r} ({p}) ms" for r, p in cols) + " | lean ÷ stock (hf) |",
        "|---|" + "---:|" * (len(cols) + 1),
    ]
    for k in kinds:
        got = {(c["route"], c["path"]): c["ms"] for c in cells if c["pass"] == k}
        ratio = got.get(("auto", "lean"), 0) / got[("stock", "hf")] if got.get(("stock", "hf")) else None
        lines.append(f"| {k} | " + " | ".join(fmt(got.get(col), ".1f") for col in cols) + f" | {fmt(ratio, '.2f')} |")
    prof = report.get("profile") or {}
    if prof:
        g = prof["ms_by_operator_group"]
        total = sum(g.values())
        lines += [
            "",
            f"{prof['pass']}: " + ", ".join(f"{k} {v:.1f} ms ({v / total:.0%})" for k, v in g.items()) + ".",
        ]
    if report.get("in_process"):
        lines += [
            "",
            "| in process, no HTTP | tokens/s | batcher: passes | gather | idle | rows/pass | ms/pass |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in report["in_process"]:
            b = r["batcher_shares"]
            lines.append(
                f"| concurrency {r['concurrency']} | {r['tokens_per_s']:.1f} | {b['forward']:.0%} | {b['gather']:.0%} | "
                f"{b['idle']:.0%} | {fmt(r['rows_per_pass'], '.2f')} | {fmt(r['ms_per_pass'], '.1f')} |"
            )
    return "\n".join(lines)


def summarise(report: dict) -> dict:
    cells = {(c["route"], c["path"], c["pass"]): c["ms"] for c in report["passes"]}
    eight = "8 decode rows"
    return {
        "cpu_model": report["environment"].get("cpu_model"),
        "ms_8_rows": {
            f"{r}/{p}": cells.get((r, p, eight)) for r, p in [*((r, "hf") for r in ROUTES), ("auto", "lean")]
        },
        "lean_vs_stock_8_rows": (cells.get(("auto", "lean", eight)) or 0) / cells[("stock", "hf", eight)]
        if cells.get(("stock", "hf", eight))
        else None,
        "profile_16_rows_ms": (report.get("profile") or {}).get("ms_by_operator_group"),
        "in_process_tokens_per_s": {str(r["concurrency"]): r["tokens_per_s"] for r in report.get("in_process", [])},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads.reserve_for_compute(torch.get_num_threads())  # as specops serve: one team, on the compute thread
    result: dict = {}

    def passes() -> None:  # on a thread of its own that takes the OpenMP team, and ends before the batcher starts
        threads.compute_thread()
        try:
            from transformers import AutoModelForCausalLM

            from specops.core.models import load_tokenizer, prepare_for_decoding
            from specops.serving.engine import ragged

            model = AutoModelForCausalLM.from_pretrained(
                result["model_dir"] / "target", dtype=torch.float32, attn_implementation="sdpa"
            ).eval()
            prepare_for_decoding(model)
            ragged.install(model)
            result.update(model=model, tokenizer=load_tokenizer(result["model_dir"] / "target"))
            result["target"] = target_name(result["model_dir"])
            result["passes"], result["profile"] = pass_cells(model, args)
        except BaseException as exc:  # reported by the main thread
            result["error"] = exc

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specops-engine-pass-") as tmp:
        result["model_dir"] = Path(args.model_dir)
        if args.quick:
            from specops.trainer.bootstrap import run as bootstrap

            result["model_dir"] = Path(tmp) / "models"
            bootstrap(result["model_dir"], tiny=True)
        worker = threading.Thread(target=passes, name="engine-pass")
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        # the batcher's thread takes the team now (a second live team would make every parallel region
        # wake its threads through the kernel: core/threads.py); this thread and the decode threads stay single
        result["in_process"] = in_process(result["model"], result["tokenizer"], result["model_dir"], args)
    report = {
        "command": " ".join(
            [".venv/bin/python", "benchmarks/engine_pass.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": environment(),
        "config": {
            "past": args.past,
            "reps": args.reps,
            "prompts": args.prompts,
            "concurrency": args.concurrency,
            "quick": args.quick,
            "target": result["target"],
        },
        "passes": result["passes"],
        "profile": result["profile"],
        "in_process": result["in_process"],
        "elapsed_s": time.perf_counter() - started,
    }
    report["summary"] = summarise(report)
    table = markdown(report)
    print(table)
    print(json.dumps(report["summary"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if not args.no_doc:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report))
    return 0


def doc_section(report: dict) -> str:
    """This benchmark's section of docs/benchmarks.md, markers included, from a report (a run's or its JSON's)."""
    env, cfg = report["environment"], report["config"]
    return "\n".join(
        [
            DOC_BEGIN,
            "## One packed target pass, by linear route and path (`benchmarks/engine_pass.py`)",
            "",
            "Command:",
            "",
            f"    {report['command']}",
            "",
            f"Date {report['date'][:10]}; CPU {env.get('cpu_model')}, {env.get('cpu_count')} cores; target "
            f"{cfg['target']} in float32; decode rows with {cfg['past']} cached positions; median of "
            f"{cfg['reps']} passes. `hf`: Hugging Face's modules over the packed pass; `lean`: "
            "`serving/engine/lean.py` (fused q/k/v and gate/up on prepacked oneDNN weights).",
            "",
            markdown(report),
            DOC_END,
        ]
    )


if __name__ == "__main__":
    sys.exit(main())

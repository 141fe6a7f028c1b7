"""HTTP API benchmark: what the API costs over the engine, and what cross-request batching buys.

On the bootstrapped pair, the same held-out prompts (code and prose, greedy, the same
``--max-new-tokens``) are decoded by each arm in one run, side by side:

- ``engine target`` / ``engine draft``: ``SpecEngine`` in this process, one request at a
  time (no HTTP): the reference;
- ``api draft c=1``: through ``specops serve``'s app (uvicorn, real HTTP, the ``openai``
  client), one client: the API's own overhead;
- ``api target c=N`` / ``api draft c=N, batching off`` / ``api draft c=N, batching on``:
  ``--concurrency`` clients against a server decoding N requests at once, with
  ``batch_max_size`` 1 (each request its own target forwards) or N (concurrent requests
  share target forward passes, ``serving/batching.py``).

Per arm: throughput (generated tokens ÷ wall time of the arm), median request latency,
and whether every output equals the engine's target-only output. Ratios are against
``engine target`` in the same run. Writes JSON (``--json``), a table, and the api section
of ``docs/benchmarks.md`` (``--no-doc`` skips that).

    .venv/bin/python benchmarks/api.py --json benchmarks/out/api.json
    .venv/bin/python benchmarks/api.py --quick --no-doc
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from benchmarks.common import environment, fmt, write_doc_section
from serving.engine import SpecEngine
from serving.models import load_model_dir
from serving.types import SamplingParams
from specops.paths import models_dir
from specops.prompts import heldout_prompts

DOC_BEGIN = "<!-- BEGIN api (written by benchmarks/api.py; edits inside are overwritten) -->"
DOC_END = "<!-- END api -->"


def engine_arm(pair, prompts, method: str, params: SamplingParams) -> dict:
    engine = SpecEngine(pair)
    t0 = time.perf_counter()
    outs = [engine.generate(p.token_ids, params, method=method) for p in tqdm(prompts, desc=f"engine {method}", leave=False)]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": sum(o.stats.num_generated for o in outs),
            "latencies": [o.stats.time_s["total"] for o in outs], "outputs": [o.token_ids for o in outs],
            "acceptance": sum(o.stats.num_accepted for o in outs) / max(1, sum(o.stats.num_drafted for o in outs))
            if method == "draft" else None}  # fmt: skip


def api_arm(model_dir: Path, prompts, method: str, params: SamplingParams, *, clients: int, batch: int,
            root: Path) -> dict:  # fmt: skip
    import openai

    from serving.config import ServeConfig
    from specops.serve import Server

    cfg = ServeConfig(model_dir=str(model_dir), port=0, stream="none", registry="none", router="none",
                      max_concurrency=clients, batch_max_size=batch, max_queue=len(prompts))  # fmt: skip
    server = Server(cfg, root=root).start()
    try:
        server.wait_ready(300)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0, timeout=600)
        client.completions.create(model="specops", prompt=prompts[0].token_ids, max_tokens=4, temperature=0)  # warm-up
        results: list = [None] * len(prompts)
        todo = iter(range(len(prompts)))
        lock = threading.Lock()
        bar = tqdm(total=len(prompts), desc=f"api {method} c={clients} batch={batch}", leave=False)

        def worker() -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                t = time.perf_counter()
                r = client.completions.create(model="specops", prompt=prompts[i].token_ids, temperature=0,
                                              max_tokens=params.max_new_tokens,
                                              extra_body={"speculation": {"method": method}})  # fmt: skip
                results[i] = (r, time.perf_counter() - t)
                bar.update()

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        bar.close()
        batches = server.state.batcher
        spec = [r.model_extra["speculation"] for r, _ in results]
        tok = server.state.pair.tokenizer
        return {"wall_s": wall, "tokens": sum(r.usage.completion_tokens for r, _ in results),
                "latencies": [lat for _, lat in results],
                "outputs": [tok(r.choices[0].text, add_special_tokens=False)["input_ids"] for r, _ in results],
                "texts": [r.choices[0].text for r, _ in results],
                "acceptance": sum(s["accepted"] for s in spec) / max(1, sum(s["drafted"] for s in spec))
                if method == "draft" else None,
                "mean_batch": batches.num_steps / batches.num_batches if batches and batches.num_batches else 1.0}  # fmt: skip
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrapped models (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per domain (default 16; 4 with --quick)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per request (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4, help="clients, and requests decoded at once (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="4 prompts per domain (about a minute)")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    args = p.parse_args(argv)
    n = args.prompts or (4 if args.quick else 16)
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("httpx", "httpx2", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    pair = load_model_dir(model_dir)
    prompts = [q for d in ("code", "prose") for q in heldout_prompts(model_dir, pair.tokenizer, d, n,
                                                                     num_tokens=args.prompt_tokens, seed=5)]  # fmt: skip
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    started = time.perf_counter()
    c = args.concurrency
    arms: dict[str, dict] = {}
    arms["engine target"] = engine_arm(pair, prompts, "target", params)
    arms["engine draft"] = engine_arm(pair, prompts, "draft", params)
    with tempfile.TemporaryDirectory(prefix="specops-bench-api-") as tmp:
        arms["api draft c=1"] = api_arm(model_dir, prompts, "draft", params, clients=1, batch=1, root=Path(tmp))
        arms[f"api target c={c}"] = api_arm(model_dir, prompts, "target", params, clients=c, batch=1, root=Path(tmp))
        arms[f"api draft c={c}, batching off"] = api_arm(model_dir, prompts, "draft", params, clients=c, batch=1,
                                                         root=Path(tmp))  # fmt: skip
        arms[f"api draft c={c}, batching on"] = api_arm(model_dir, prompts, "draft", params, clients=c, batch=c,
                                                        root=Path(tmp))  # fmt: skip
    ref = arms["engine target"]
    ref_tps = ref["tokens"] / ref["wall_s"]
    ref_texts = [pair.tokenizer.decode(o, skip_special_tokens=True) for o in ref["outputs"]]
    rows = []
    for name, a in arms.items():
        tps = a["tokens"] / a["wall_s"]
        same = a["texts"] == ref_texts if "texts" in a else a["outputs"] == ref["outputs"]
        rows.append({"arm": name, "throughput_tok_s": round(tps, 1), "vs_engine_target": round(tps / ref_tps, 3),
                     "latency_p50_s": round(statistics.median(a["latencies"]), 3),
                     "acceptance": None if a["acceptance"] is None else round(a["acceptance"], 3),
                     "mean_batch": round(a.get("mean_batch", 1.0), 2), "identical_to_target": same})  # fmt: skip
    by = {r["arm"]: r for r in rows}
    summary = {
        "api_overhead_c1": round(by["engine draft"]["throughput_tok_s"] / by["api draft c=1"]["throughput_tok_s"], 3),
        "batching_gain": round(by[f"api draft c={c}, batching on"]["throughput_tok_s"]
                               / by[f"api draft c={c}, batching off"]["throughput_tok_s"], 3),
        "all_identical": all(r["identical_to_target"] for r in rows),
    }  # fmt: skip
    argv_s = argv if argv is not None else sys.argv[1:]
    report = {"command": " ".join([".venv/bin/python", "benchmarks/api.py", *map(shlex.quote, argv_s)]),
              "date": datetime.now(UTC).isoformat(timespec="seconds"),
              "config": {"prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
                         "concurrency": c, "threads": args.threads},
              "summary": summary, "arms": rows, "environment": environment(),
              "elapsed_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    table = Table(title=f"HTTP API, {len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, greedy")
    for col in ("arm", "tokens/s", "vs engine target", "p50 latency", "acceptance", "mean batch", "identical"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for r in rows:
        table.add_row(r["arm"], f"{r['throughput_tok_s']:.1f}", f"{r['vs_engine_target']:.2f}x",
                      f"{r['latency_p50_s']:.2f}s", fmt(r["acceptance"], ".3f"), f"{r['mean_batch']:.2f}",
                      "yes" if r["identical_to_target"] else "NO")  # fmt: skip
    Console().print(table)
    print(json.dumps(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if not args.no_doc:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report))
    return 0


def doc_section(report: dict) -> str:
    s = report["summary"]
    lines = [DOC_BEGIN, "## HTTP API (`benchmarks/api.py`)", "", "    " + report["command"], "",
             f"{report['date']}; {report['config']['prompts']} held-out prompts (code and prose), "
             f"{report['config']['max_new_tokens']} new tokens, greedy; {report['environment']['cpu_count']} CPUs, "
             f"{report['config']['threads']} torch threads. Throughput = generated tokens ÷ the arm's wall time.", "",
             "| arm | tokens/s | vs engine target | p50 latency | acceptance | mean batch | identical to target |",
             "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in report["arms"]:
        lines.append(f"| {r['arm']} | {r['throughput_tok_s']:.1f} | {r['vs_engine_target']:.2f}x | "
                     f"{r['latency_p50_s']:.2f} s | {fmt(r['acceptance'], '.3f')} | {r['mean_batch']:.2f} | "
                     f"{'yes' if r['identical_to_target'] else 'NO'} |")  # fmt: skip
    lines += ["", f"API overhead at one client (engine draft ÷ API draft throughput): {s['api_overhead_c1']:.2f}x. "
              f"Cross-request batching at c={report['config']['concurrency']}: {s['batching_gain']:.2f}x the "
              f"throughput without it. Every output identical to target-only: {s['all_identical']}.", "", DOC_END]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Cross-request batching: the slot-pool batcher against the copy-per-step batcher it replaced.

N client threads (4 and 8) decode in lock-step through one ``TargetBatcher``: each prefills a
context of C tokens, then runs verification steps of 4 tokens (k = 3 drafts + the last
committed token) and rolls back 2 of them, as a speculative request rejecting half its drafts
does. Arms, interleaved per repetition: ``before`` (``benchmarks/batching_baseline.py``: every
batched step copies each request's whole cache into a new padded cache and appends back by
concatenation) and ``after`` (``serving/engine/batching.py``: a preallocated slot pool written
in place, attended over as a view).

Reported per (N, C): the median milliseconds per batched step over the decode phase, the
tokens per second it implies (4 tokens per request per step), and the after/before ratio.
Both arms compute the same logits (checked on the first step of each case).

Usage: ``python benchmarks/batching.py [--quick] [--json PATH] [--doc docs/benchmarks.md]``.
The target is the bootstrapped one (``.specops/models/target``) when present, else a random
model of SmolLM2-135M's shape (no download).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.batching_baseline import TargetBatcher as Before  # noqa: E402
from benchmarks.common import environment, write_doc_section  # noqa: E402
from specops.serving.engine.batching import TargetBatcher as After  # noqa: E402

DOC_BEGIN = "<!-- BEGIN batching (written by benchmarks/batching.py; edits inside are overwritten) -->"
DOC_END = "<!-- END batching -->"
STEP_TOKENS, ROLLBACK = 4, 2


def load_target(model_dir: Path):
    if (model_dir / "target" / "config.json").is_file():
        from specops.core.models import load_model

        return load_model(model_dir / "target"), "bootstrapped SmolLM2-135M target"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
    )
    return LlamaForCausalLM(cfg).eval(), "random model of SmolLM2-135M's shape"


def run_case(batcher_cls, model, clients: int, context: int, steps: int, seed: int) -> tuple[float, list]:
    """Median ms per batched decode step, and the first step's logits of request 0."""
    batcher = batcher_cls(model, max_batch=clients, window_s=0.05)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist() for _ in range(clients)]
    feeds = [
        torch.randint(0, model.config.vocab_size, (steps, STEP_TOKENS), generator=gen).tolist() for _ in range(clients)
    ]
    lms = [batcher.lm() for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)
    first: list = [None]
    times: list[float] = []

    def client(i: int) -> None:
        lm = lms[i]
        lm.forward(prompts[i], logits_to_keep=1)  # prefill, batched with the others'
        barrier.wait()
        for s in range(steps):
            logits, _ = lm.forward(feeds[i][s], logits_to_keep=STEP_TOKENS)
            if i == 0 and s == 0:
                first[0] = logits
            lm.rollback(lm.num_cached - ROLLBACK)
        barrier.wait()

    for _ in range(clients):
        batcher.begin()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    try:
        for t in threads:
            t.start()
        barrier.wait()  # every prefill done
        n0, t0 = batcher.num_batches, time.perf_counter()
        barrier.wait()  # every decode step done
        elapsed = time.perf_counter() - t0
        batches = batcher.num_batches - n0
        times.append(elapsed / max(1, batches) * 1e3)
    finally:
        for t in threads:
            t.join(120)
        batcher.close()
        for lm in lms:
            getattr(lm, "close", lambda: None)()
    return times[0], [first[0], batches]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description="Batching: the slot-pool target batcher against the copy-per-step one "
        "it replaced, at 4 and 8 concurrent clients and several context lengths."
    )
    ap.add_argument("--quick", action="store_true", help="contexts 128 and 512, 2 repetitions, 6 steps (a minute)")
    ap.add_argument(
        "--model-dir", type=Path, default=Path(".specops/models"), help="bootstrap dir (default: %(default)s)"
    )
    ap.add_argument("--json", type=Path, help="write the results and a summary here")
    ap.add_argument("--doc", type=Path, help="rewrite this file's batching section (docs/benchmarks.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, model_name = load_target(args.model_dir)
    contexts = (128, 512) if args.quick else (128, 512, 1024)
    reps, steps = (2, 6) if args.quick else (3, 12)
    rows, results = [], {}
    with torch.inference_mode():
        for clients in (4, 8):
            for context in contexts:
                ms = {"before": [], "after": []}
                same = True
                for rep in range(reps):
                    order = ("before", "after") if rep % 2 == 0 else ("after", "before")  # interleaved arms
                    firsts = {}
                    for arm in order:
                        t, (logits, _) = run_case(
                            Before if arm == "before" else After, model, clients, context, steps, seed=rep
                        )
                        ms[arm].append(t)
                        firsts[arm] = logits
                    same &= bool(torch.allclose(firsts["before"], firsts["after"], atol=1e-3, rtol=1e-3))
                before, after = statistics.median(ms["before"]), statistics.median(ms["after"])
                key = f"c{clients}_ctx{context}"
                results[key] = {
                    "clients": clients,
                    "context": context,
                    "ms_per_step_before": round(before, 2),
                    "ms_per_step_after": round(after, 2),
                    "ratio_after_over_before": round(after / before, 3),
                    "tok_s_before": round(clients * STEP_TOKENS / before * 1e3, 1),
                    "tok_s_after": round(clients * STEP_TOKENS / after * 1e3, 1),
                    "same_logits": same,
                    "runs": {k: [round(x, 2) for x in v] for k, v in ms.items()},
                }
                rows.append(results[key])
                print(
                    f"clients {clients} context {context}: {before:.1f} -> {after:.1f} ms/step ({after / before:.2f}x)",
                    file=sys.stderr,
                )
    summary = {
        "model": model_name,
        "ratio_median": round(statistics.median(r["ratio_after_over_before"] for r in rows), 3),
        "ratio_at_longest_context": {
            str(r["clients"]): r["ratio_after_over_before"] for r in rows if r["context"] == contexts[-1]
        },
        "same_logits": all(r["same_logits"] for r in rows),
        "repetitions": reps,
        "decode_steps": steps,
    }
    report = {
        "summary": summary,
        "results": results,
        "environment": environment(),
        "command": " ".join(["python", "benchmarks/batching.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    print(markdown(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.doc:
        write_doc_section(args.doc, DOC_BEGIN, DOC_END, doc_section(report))
    return report


def markdown(report: dict) -> str:
    """The table of ``report["results"]``: one row per (clients, context), in the order they ran."""
    table = [
        "| clients | context | ms/step before | ms/step after | after/before | tok/s before | tok/s after | same logits |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in report["results"].values():
        table.append(
            f"| {r['clients']} | {r['context']} | {r['ms_per_step_before']} | {r['ms_per_step_after']} | "
            f"{r['ratio_after_over_before']} | {r['tok_s_before']} | {r['tok_s_after']} | "
            f"{'yes' if r['same_logits'] else 'NO'} |"
        )
    return "\n".join(table)


def doc_section(report: dict) -> str:
    """The batching section of docs/benchmarks.md, markers included, from a report (a run's or its JSON's)."""
    s = report["summary"]
    return "\n".join(
        [
            DOC_BEGIN,
            "## Batching: slot pool vs copy-per-step",
            "",
            f"`{report['command']}` ({s['model']}, {s['repetitions']} repetitions interleaved, {s['decode_steps']} "
            f"decode steps of {STEP_TOKENS} tokens with {ROLLBACK} rolled back; medians; a shared 2-core CPU, so read "
            "the ratios):",
            "",
            markdown(report),
            "",
            "`before` copies every request's whole cache into a new padded cache on each batched step and appends "
            "back by concatenation; `after` writes new keys/values in place into a preallocated slot pool and attends "
            "over a view of it (`serving/engine/batching.py`).",
            DOC_END,
        ]
    )


if __name__ == "__main__":
    main()

"""``specops demo``: bootstrap if needed, decode held-out prompts with each method, print a table."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

log = logging.getLogger(__name__)

DOMAINS = ("code", "prose")
METHODS = ("target", "draft", "pld")


def run_demo(
    model_dir: Path, *, num_prompts: int = 3, max_new_tokens: int = 64, k: int | None = None, stream: str | None = None
) -> int:
    from tqdm import tqdm

    from serving.engine import SpecEngine
    from serving.models import load_model_dir
    from serving.types import SamplingParams
    from specops.prompts import heldout_prompts
    from trainer.bootstrap import is_bootstrapped, run

    console = Console()
    if is_bootstrapped(model_dir):
        log.info("using cached models in %s", model_dir)
    else:
        console.print(f"[bold]No bootstrapped models in {model_dir}: training them now (about 10-15 minutes).[/]")
        run(model_dir)
    pair = load_model_dir(model_dir)
    logger = None
    if stream:
        from serving.stream_logger import StreamLogger

        logger = StreamLogger(stream, vocab_size=pair.vocab_size)
    engine = SpecEngine(pair, logger=logger)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)

    rows = []
    samples = {}
    work = [(d, p) for d in DOMAINS for p in heldout_prompts(model_dir, pair.tokenizer, d, num_prompts, seed=1)]
    # Warm-up so the first measured request does not pay one-off allocation costs.
    SpecEngine(pair).generate(work[0][1].token_ids, SamplingParams(max_new_tokens=4), method="draft", k=k)
    results: dict[tuple[str, str], list] = {}
    from serving.stream_logger import RequestMeta

    for domain, prompt in tqdm(work, desc="demo", unit="prompt"):
        ref = None
        for method in METHODS:
            out = engine.generate(prompt.token_ids, params, method=method, k=k, meta=RequestMeta(cluster=domain))
            if method == "target":
                ref = out.token_ids
            results.setdefault((domain, method), []).append((out, out.token_ids == ref))
            samples.setdefault(domain, (prompt.text, ref and pair.tokenizer.decode(ref)))

    k_text = f"k={k}" if k else "default k: draft 4, pld 10"
    table = Table(title=f"Greedy decoding of held-out prompts ({num_prompts} per domain, {max_new_tokens} new tokens, {k_text})")
    for col in ("domain", "method", "tokens/s", "speedup", "acceptance", "tokens/fwd", "identical"):
        table.add_column(col, justify="right" if col not in ("domain", "method") else "left")
    for domain in DOMAINS:
        base = statistics.median(o.stats.tokens_per_s for o, _ in results[(domain, "target")])
        for method in METHODS:
            outs = results[(domain, method)]
            tps = statistics.median(o.stats.tokens_per_s for o, _ in outs)
            acc = statistics.mean(o.stats.acceptance_rate for o, _ in outs) if method != "target" else None
            tpf = statistics.mean(o.stats.tokens_per_target_forward for o, _ in outs)
            same = sum(ok for _, ok in outs)
            table.add_row(
                domain, method, f"{tps:.1f}", f"{tps / base:.2f}x", "-" if acc is None else f"{acc:.2f}",
                f"{tpf:.2f}", f"{same}/{len(outs)}",
            )
            rows.append((domain, method, same == len(outs)))
    for domain, (prompt_text, completion) in samples.items():
        console.rule(f"{domain}: a held-out prompt and the target's greedy completion")
        console.print(prompt_text[-300:], style="dim", end="")
        console.print(completion or "", style="bold green")
    console.print(table)
    if logger is not None:
        _report_stream(console, logger, stream, results)
    if not all(ok for *_, ok in rows):
        console.print("[bold red]Some outputs differ from target-only decoding: this is a bug.[/]")
        return 1
    console.print("Every method's output is identical to target-only greedy decoding.")
    return 0


def _report_stream(console: Console, logger, url: str, results: dict) -> None:
    """Flush the logger and say what went to the stream."""
    logger.close(timeout_s=30)
    rejected = sum(len(o.rejections) for outs in results.values() for o, _ in outs)
    st = logger.stats
    if st.num_dropped:
        console.print(f"[yellow]Stream {url}: {st.num_dropped} record(s) could not be published ({st.dropped}).[/]")
    console.print(
        f"Logged {st.logged_requests} requests to {url} ({st.published} records: one MissRecord with the target's "
        f"distribution at each of {rejected} rejected positions, and one GenerationRecord, per request). "
        f"See them with: specops streams inspect {url} spec.misses"
    )

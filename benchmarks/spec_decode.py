"""Speculative-decoding benchmark: our engine next to Hugging Face, in one run.

On the bootstrapped target/draft pair, over held-out prompts of each domain, greedy and
at temperature 0.7, it times side by side (methods interleaved per prompt):

- ``hf_target``: ``target.generate`` target-only, the reference and the speedup baseline;
- ``hf_assisted``: HF assisted generation with the same draft (``assistant_model=draft``,
  HF's default assistant settings, recorded in the JSON);
- ``hf_pld``: HF prompt lookup (``prompt_lookup_num_tokens=10``, HF's default n-gram size);
- ``target``, ``draft``, ``pld``: our ``SpecEngine``; ``draft`` at the headline k (the
  engine's default draft k, a fixed rule; pld at its own default k) plus, unless ``--quick``, a sweep over k and one
  adaptive-k run;
- ``auto``: our engine's ``auto`` method as a replica runs it (one ``AutoPolicy`` for the run,
  calibrated at load, picking each step's method and k), always, so its numbers sit beside the
  fixed methods' whichever method serving defaults to;
- serving's default method (``ServeConfig.default_method``, read at run time): the arm of that
  name when it has one (``draft``, ``pld``, ``auto``), else ``our_method`` at its default k.

The draft runs in serving's default precision (``auto``: float32 and bfloat16 timed at load, the
faster kept); the JSON records the dtype it resolved to (``summary.draft_dtype``, from the loaded
model) next to the one asked for.

It also measures c (a cached 1-token draft forward over a cached 1-token target forward)
and the per-token acceptance α, and compares the measured speedup with OSD Eq. 2,
``E[speedup] = (1 - α^(k+1)) / ((1 - α)(k c + 1))``.

Writes JSON (``--json``), prints a markdown table, and replaces the spec_decode section
of ``docs/benchmarks.md`` (``--doc``; ``--no-doc`` skips it).

    .venv/bin/python benchmarks/spec_decode.py --json benchmarks/out/spec_decode.json
    .venv/bin/python benchmarks/spec_decode.py --quick

The bars of issue 39, per domain and on both (the worse domain counts): serving's default
method >= 1.0x our target-only loop (``default_vs_target_min``; per domain ``default_vs_target``,
with ``auto_vs_target`` beside it) and our target-only loop >= 1.0x ``hf_target``
(``target_vs_hf_target_min``, ``target_vs_hf_target_by_domain``); greedy, median of per-prompt
ratios. ``cpu_model`` says which CPU the numbers come from.

The summary also carries the token-tree verifier's exactness checks
(``benchmarks/tree_check.py``): ``tree_greedy_identical``, ``tree_chi2_p`` and
``biased_rule_chi2_p`` (the negative control's p-value, which must be tiny).

The parts live in ``benchmarks/specbench/``: ``config`` (settings), ``methods`` (the arms),
``costs`` (c and Eq. 2), ``run`` (interleaved timing, aggregation, summary) and ``report``
(table and docs). This file is the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, specops/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import transformers  # noqa: E402

from benchmarks import tree_check  # noqa: E402
from benchmarks.specbench.config import (  # noqa: E402,F401  (the names tests and tools read here)
    DOC_BEGIN,
    DOC_END,
    DOMAINS,
    HEADLINE_K,
    K_SWEEP,
    MODES,
    SUMMARY_KEYS,
    BenchConfig,
)
from benchmarks.specbench.costs import alpha_from_tokens_per_step, eq2_speedup, expected_tokens  # noqa: E402,F401
from benchmarks.specbench.report import doc_section, markdown, write_doc  # noqa: E402,F401
from benchmarks.specbench.run import run_benchmark  # noqa: E402
from specops.core.models import DEFAULT_DRAFT_DTYPE, DRAFT_DTYPE_NAMES  # noqa: E402
from specops.paths import models_dir  # noqa: E402

log = logging.getLogger("benchmarks.spec_decode")


# ---------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model-dir", default=str(models_dir()), help="bootstrap dir with target/, draft/, manifest.json")
    p.add_argument("--prompts", type=int, default=None, help="prompts per domain (default 8; 2 with --quick)")
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="new tokens per request (default 128; 48 with --quick)"
    )
    p.add_argument("--prompt-tokens", type=int, default=96, help="tokens per prompt")
    p.add_argument("--k", type=int, default=HEADLINE_K, help="headline draft k (the engine's default)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="prompt selection and sampling seed")
    p.add_argument(
        "--cost-reps", type=int, default=None, help="timed forwards per model for c (default 200; 50 with --quick)"
    )
    p.add_argument(
        "--min-cpu-share",
        type=float,
        default=0.6,
        help="measure a prompt again when a run got less CPU than this share of its wall time (0 = off)",
    )
    p.add_argument(
        "--draft-dtype",
        choices=DRAFT_DTYPE_NAMES,
        default=DEFAULT_DRAFT_DTYPE,
        help="precision the draft runs in, ours and HF's assistant alike (serving's default: %(default)s; auto: "
        "float32 and bfloat16 timed at load, the faster kept; the JSON records the choice)",
    )
    p.add_argument(
        "--no-float32-arm",
        action="store_true",
        help="with a bfloat16 draft, skip the side-by-side draft_float32 arm (the same draft in float32)",
    )
    p.add_argument("--quick", action="store_true", help="2 prompts/domain, 48 new tokens, no k sweep (< 3 min)")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument("--doc", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="markdown doc to update")
    p.add_argument("--no-doc", action="store_true", help="do not write the doc")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    quick = args.quick
    return BenchConfig(
        model_dir=str(args.model_dir),
        prompts=args.prompts if args.prompts is not None else (2 if quick else 8),
        prompt_tokens=args.prompt_tokens,
        max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else (48 if quick else 128),
        k=args.k,
        sweep=() if quick else K_SWEEP,
        adaptive=not quick,
        threads=args.threads,
        seed=args.seed,
        cost_reps=args.cost_reps if args.cost_reps is not None else (50 if quick else 200),
        draft_dtype=args.draft_dtype,
        float32_arm=not args.no_float32_arm,
        quick=quick,
        min_cpu_share=args.min_cpu_share,
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the report (also written to --json and the doc)."""
    args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    cfg = config_from_args(args)
    command = [".venv/bin/python", "benchmarks/spec_decode.py", *(sys.argv[1:] if argv is None else argv)]
    report = run_benchmark(cfg, command)
    report["summary"].update(tree_check.run(quick=cfg.quick))  # exactness of the multi-draft verifier
    table = markdown(report)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        log.info("wrote %s", args.json)
    if not args.no_doc:
        write_doc(args.doc, doc_section(report, table))
        log.info("updated %s", args.doc)
    return report


if __name__ == "__main__":
    main()

"""The CUDA path measured in one short run, whenever a GPU is lent (issue 41).

Every other number in ``docs/benchmarks.md`` comes from 2 CPU cores, where verifying k tokens
costs far more than verifying one. This script, run on one GPU with that machine's own Python
(torch, transformers, safetensors, numpy and pytest; none of this project's other pins, no
network, no weights), writes one JSON and prints one table:

1. **CUDA tests**: ``pytest -m cuda`` in a subprocess (greedy equality of every drafter on the
   device, token trees, exact sampling with its negative control, batched requests, a GKD update
   step, a hot-swap; ``tests/cuda_support.py``), counted.
2. **Timings**, bfloat16, on randomly initialised models of real shapes (SmolLM2-135M's config
   for the target and the bootstrap's 2-layer draft of it with its 8,192-token head; a
   1.7B-shaped target if time allows): one cached target pass over 1, 2, 4, 5, 8, 16 tokens and
   over 10x6 and 3x20 token trees; the draft's cost ratio c; our target-only loop against HF
   ``generate``; target-only throughput at 1, 4 and 16 concurrent sequences through serving's
   ``TargetBatcher``.
3. **Projected speed-ups** per method: the acceptance each method had on the CPU (the committed
   ``benchmarks/out/spec_decode.json`` and ``llma.json``) with the GPU's costs, by Eq. 2
   generalised as ``auto`` prices a step (``specops.core.auto_policy``: ``E / (P + V(n))`` against
   ``1 / V(1)``), beside the same formula with the CPU's costs and the CPU's measured speed-up;
   for the draft model also at the k ``auto`` would pick at the GPU's costs (:func:`best_k`).

The timings are in ``benchmarks/gpu_timings.py``; this file is the command. Each section has a time cap, and the whole run a budget (5.5 minutes by default); a section
that would not fit is skipped and the reason recorded, so the run ends in time on one H100.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --json benchmarks/out/gpu_check.json   # make gpu-check
    PYTHONPATH=. python3 benchmarks/gpu_check.py --dry-run                              # the same code on CPU

``--dry-run`` runs the same code on the CPU with tiny shapes in seconds (the CUDA tests skip
there: "no CUDA GPU"); ``make test`` runs it (``tests/benchmarks/test_gpu_check.py``).

Summary keys: ``device``, ``cuda_tests_passed``, ``cuda_tests_failed``, ``verify_cost_ratio_k4``
(a target pass over 5 tokens / over 1), ``c``, ``target_vs_hf_target`` (our target-only loop's
tokens/s over HF ``generate``'s), ``projected_speedup`` (method -> median over its domains of
the projected speed-up over target-only), ``projected_llma_vs_suffix`` (domain -> LLMA's projected
speed over SuffixDecoding's, both from ``llma.json``, priced with the largest shape's pass costs),
``wall_s``. ``--reproject JSON`` re-prices a saved run's timings with today's CPU JSONs (no GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make serving/, specops/ importable
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks import gpu_compat  # noqa: E402  (stand-ins for the pins the GPU machine lacks, before specops)
from benchmarks.common import cpu_model, environment, fmt  # noqa: E402
from benchmarks.gpu_projection import best_k, copy_ratios, cpu_rows, interp, projected, projections  # noqa: E402,F401
from benchmarks.gpu_timings import (  # noqa: E402,F401  (names the tests read here)
    CONCURRENCY,
    DRY_RUN_SETTINGS,
    DRY_SHAPES,
    RUN_SETTINGS,
    SHAPES,
    TREES,
    VERIFY_TOKENS,
    OutOfTime,
    _check,
    attempt,
    batched_throughput,
    time_shape,
)

log = logging.getLogger("benchmarks.gpu_check")

SUMMARY_KEYS = (
    "device",
    "cuda_tests_passed",
    "cuda_tests_failed",
    "verify_cost_ratio_k4",
    "c",
    "target_vs_hf_target",
    "projected_speedup",
    "projected_llma_vs_suffix",
    "wall_s",
)
LARGEST = "smollm2-1.7b"
"""The shape whose pass costs price the LLMA / SuffixDecoding projection (the 135M shape's are noisy:
its 5- to 16-token passes timed cheaper than its 1-token pass on the first run)."""

CUDA_TEST_FILES = (
    "tests/serving/engine/test_cuda.py",
    "tests/trainer/test_cuda.py",
    "tests/serving/fleet/test_cuda.py",
)
"""The ``pytest -m cuda`` tests (run with ``--noconftest``: ``tests/conftest.py`` loads MLflow fixtures)."""

DEFAULT_BUDGET_S = 330.0

CAPS = {"cuda_tests": 150.0, "timings": 70.0, "batched": 45.0, "large": 45.0}
"""Seconds each section may take at most (a real run); the budget cuts them further."""
DRY_CAPS = {"cuda_tests": 60.0, "timings": 20.0, "batched": 10.0, "large": 10.0}


# ---------------------------------------------------------------- budget
class Budget:
    """The run's deadline, and each section's share of what is left."""

    def __init__(self, total_s: float) -> None:
        self.t0 = time.perf_counter()
        self.total_s = total_s

    def left(self) -> float:
        return self.total_s - (time.perf_counter() - self.t0)

    def cap(self, section_cap: float) -> float:
        return max(0.0, min(section_cap, self.left()))


# ---------------------------------------------------------------- 1. CUDA tests
def run_cuda_tests(timeout_s: float) -> dict:
    """``pytest -m cuda`` over :data:`CUDA_TEST_FILES` in a subprocess of this Python; counts from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "cuda",
            "--noconftest",
            "-p",
            "benchmarks.gpu_compat",
            "-p",
            "no:cacheprovider",
            "-v",
            f"--junitxml={xml_path}",
            *CUDA_TEST_FILES,
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            counts = {
                o.lower(): sum(f" {o}" in line for line in text.splitlines()) for o in ("PASSED", "FAILED", "SKIPPED")
            }
            counts["failed"] += sum(" ERROR" in line for line in text.splitlines())
            return {
                "command": " ".join(cmd[1:]),
                **counts,  # the tests that finished (pytest -v's lines)
                "timed_out": True,
                "reason": f"pytest ran past its {timeout_s:.0f}s cap; counts are of the tests that finished",
                "output_tail": text[-3000:],
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        out = {
            "command": "python " + " ".join(cmd[1:]).replace(str(xml_path), "JUNIT.xml"),
            "returncode": proc.returncode,
            "wall_s": round(time.perf_counter() - t0, 1),
            "output_tail": (proc.stdout + proc.stderr)[-3000:],
        }
        out.update(_junit_counts(xml_path))
    return out


def _junit_counts(path: Path) -> dict:
    """passed / failed / skipped and the failed tests' names and messages (failed includes errors)."""
    if not path.exists():
        return {"passed": 0, "failed": None, "skipped": 0, "reason": "pytest wrote no report (see output_tail)"}
    root = ET.parse(path).getroot()
    failures, skips, passed = [], [], 0
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            failures.append({"test": name, "message": (bad.get("message") or "")[:300]})
        elif case.find("skipped") is not None:
            skips.append((case.find("skipped").get("message") or "")[:120])
        else:
            passed += 1
    return {
        "passed": passed,
        "failed": len(failures),
        "skipped": len(skips),
        "skip_reasons": sorted(set(skips)),
        "failures": failures,
    }


# ---------------------------------------------------------------- 3. projections
# ---------------------------------------------------------------- report
def summary(report: dict) -> dict:
    tests, timing = report["cuda_tests"], report.get("timings", {}).get("smollm2-135m", {})
    ratio = timing.get("verify", {}).get("ratio", {})
    return {
        "device": report["device"],
        "cuda_tests_passed": tests.get("passed"),
        "cuda_tests_failed": tests.get("failed"),
        "verify_cost_ratio_k4": ratio.get("5"),
        "c": timing.get("c"),
        "target_vs_hf_target": timing.get("loop", {}).get("target_vs_hf_target"),
        "projected_speedup": report["projected"].get("by_method", {}),
        "projected_llma_vs_suffix": {
            domain: r.get(LARGEST, r.get("smollm2-135m"))
            for domain, r in report["projected"].get("llma_vs_suffix", {}).items()
        },
        "wall_s": report["wall_s"],
    }


def markdown(report: dict) -> str:
    s = report["summary"]
    t = report["cuda_tests"]
    lines = [
        f"GPU check on **{s['device']}** ({'dry run, tiny shapes' if report['dry_run'] else 'bf16, real shapes'}; "
        f"torch {report['environment']['torch']}, transformers {report['environment']['transformers']}; "
        f"{s['wall_s']:.0f} s).",
        "",
        f"CUDA tests (`pytest -m cuda`): {t.get('passed')} passed, {t.get('failed')} failed, {t.get('skipped')} skipped"
        + (f" ({'; '.join(t.get('skip_reasons', []))})" if t.get("skip_reasons") else "")
        + (f" — {t['reason']}" if t.get("reason") else ""),
        "",
    ]
    for name, tm in report.get("timings", {}).items():
        if "verify" not in tm:
            continue
        v = tm["verify"]
        lines += [
            f"Target pass cost, {name} shape ({tm['params']['target'] / 1e6:.1f}M params, {tm['context_tokens']} tokens "
            "cached), ms and x the 1-token pass:",
            "",
            "| tokens | " + " | ".join(v["ms"]) + " | " + " | ".join(f"tree {n}" for n in v["tree_ms"]) + " |",
            "|---" * (1 + len(v["ms"]) + len(v["tree_ms"])) + "|",
            "| ms | "
            + " | ".join(fmt(x) for x in v["ms"].values())
            + " | "
            + " | ".join(fmt(x) for x in v["tree_ms"].values())
            + " |",
            "| x 1 token | "
            + " | ".join(fmt(x) for x in v["ratio"].values())
            + " | "
            + " | ".join(fmt(x) for x in v["tree_ratio"].values())
            + " |",
            "",
        ]
        if "c" in tm:
            lines.append(
                f"Draft (2 layers, {tm['draft_vocab_rows']}-row head): {fmt(tm['draft_1_ms'])} ms, c = {fmt(tm['c'], '.3f')}."
            )
        if "loop" in tm:
            lp = tm["loop"]
            lines.append(
                f"Target-only, {lp['new_tokens']} tokens: ours {fmt(lp['tokens_per_s']['ours'], '.1f')} tok/s, HF generate "
                f"{fmt(lp['tokens_per_s']['hf'], '.1f')} tok/s: **{fmt(lp['target_vs_hf_target'])}x** "
                f"(identical output: {lp['identical']})."
            )
        lines.append("")
    b = report.get("batched")  # None when it failed
    if b:
        lines += [
            "Target-only throughput through the `TargetBatcher` (smollm2-135m shape):",
            "",
            "| sequences | tokens/s | per sequence | x one sequence | mean batch |",
            "|---|---|---|---|---|",
        ]
        for conc, r in b.items():
            lines.append(
                f"| {conc} | {fmt(r['tokens_per_s'], '.1f')} | {fmt(r['per_sequence_tokens_per_s'], '.1f')} | "
                f"{fmt(r['vs_one'])} | {fmt(r['mean_batch'], '.1f')} |"
            )
        lines.append("")
    p = report["projected"]
    if p.get("rows"):
        lines += [
            "Projected speed-up over target-only (greedy; acceptance from "
            + ", ".join(f"`benchmarks/out/{x}`" for x in p["sources"])
            + "):",
            "",
            "| method | domain | k | tokens/step | drafts/step | CPU measured | CPU Eq. 2 | GPU projected | GPU at best k |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in p["rows"]:
            lines.append(
                f"| {r['method']} | {r['domain']} | {r['k']} | {fmt(r['tokens_per_step'])} | {fmt(r['drafted_per_step'], '.1f')} | "
                f"{fmt(r['cpu_measured'])} | {fmt(r['cpu_eq2'])} | {fmt(r['gpu_projected'])} | "
                + (f"{fmt(r['gpu_projected_best_k'])} (k = {r['gpu_best_k']})" if r.get("gpu_best_k") else "–")
                + " |"
            )
        lines.append("")
    for domain, r in p.get("llma_vs_suffix", {}).items():
        shapes = ", ".join(f"{fmt(x)} at the {k} shape's costs" for k, x in r.items() if k != "cpu_measured")
        lines.append(f"LLMA / SuffixDecoding, {domain}: {fmt(r['cpu_measured'])} measured on the CPU; {shapes}.")
    if p.get("llma_vs_suffix"):
        lines.append("")
    for section, reason in report["skipped"].items():
        lines.append(f"Skipped {section}: {reason}.")
    for section, error in report["errors"].items():
        lines.append(f"Failed {section}: `{error}`.")
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- main
def reproject(args: argparse.Namespace) -> dict:
    """A saved run's projections, summary and table again from its timings and today's CPU JSONs."""
    report = json.loads(args.reproject.read_text())
    report.pop("table", None)
    timings = report.get("timings", {})
    report["projected"] = projections(timings.get("smollm2-135m"), args.cpu_results, timings)
    report["reprojected"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["summary"] = summary(report)
    table = markdown(report)
    print(table)
    out = args.json or args.reproject
    out.write_text(json.dumps({**report, "table": table}, indent=1, default=str) + "\n")
    log.info("wrote %s", out)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the same code on the CPU with tiny shapes (seconds)")
    p.add_argument("--device", default=None, help="cuda (default) or cuda:N; --dry-run: cpu")
    p.add_argument(
        "--budget-s", type=float, default=None, help=f"the whole run's time budget (default {DEFAULT_BUDGET_S:.0f})"
    )
    p.add_argument(
        "--cap-scale",
        type=float,
        default=1.0,
        help="multiply each section's time cap by this (a slow or shared machine: the test suite's dry run uses 4)",
    )
    p.add_argument("--no-tests", action="store_true", help="skip the pytest subprocess")
    p.add_argument("--cpu-results", type=Path, default=REPO_ROOT / "benchmarks" / "out", help="where the CPU JSONs are")
    p.add_argument("--json", type=Path, default=None, help="write the full results here")
    p.add_argument(
        "--reproject",
        type=Path,
        metavar="JSON",
        help="re-price a saved run's GPU timings with the CPU JSONs of --cpu-results (no GPU; writes --json, default JSON)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
    transformers.logging.set_verbosity_error()
    if args.reproject:
        return reproject(args)
    dry = args.dry_run
    device = torch.device(args.device or ("cpu" if dry else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA GPU visible (torch {torch.__version__}, CUDA {torch.version.cuda}): use --dry-run")
    budget = Budget(args.budget_s or (60.0 if dry else DEFAULT_BUDGET_S))
    caps, s = (DRY_CAPS, DRY_RUN_SETTINGS) if dry else (CAPS, RUN_SETTINGS)
    if not args.cap_scale > 0:
        raise SystemExit(f"--cap-scale must be > 0, got {args.cap_scale}")
    caps = {section: cap * args.cap_scale for section, cap in caps.items()}
    shapes = DRY_SHAPES if dry else SHAPES
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_model()}"
    report: dict = {
        "benchmark": "gpu_check",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "dry_run": dry,
        "device": name,
        "dtype": "bfloat16",
        "settings": s,
        "caps_s": caps,
        "budget_s": budget.total_s,
        "stubbed_modules": gpu_compat.STUBS_INSTALLED,
        "repository_mapped": gpu_compat.REPOSITORY_MAPPED,
        "skipped": {},
        "errors": {},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        report["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
        }

    # 1. the CUDA tests
    if args.no_tests:
        report["cuda_tests"] = {"passed": None, "failed": None, "skipped": None, "reason": "--no-tests"}
        report["skipped"]["cuda_tests"] = "--no-tests"
    else:
        log.info("1/4 CUDA tests (cap %.0fs)", budget.cap(caps["cuda_tests"]))
        report["cuda_tests"] = run_cuda_tests(max(1.0, budget.cap(caps["cuda_tests"])))
        if report["cuda_tests"].get("timed_out"):
            report["skipped"]["cuda_tests (rest)"] = report["cuda_tests"]["reason"]

    # 2. timings, SmolLM2-135M shape (then batched), then the 1.7B shape if time allows
    errors: dict[str, str] = report["errors"]
    report["timings"] = {}
    small = None
    if budget.left() > 10:
        log.info("2/4 timings, smollm2-135m shape (cap %.0fs)", budget.cap(caps["timings"]))
        deadline = time.perf_counter() + budget.cap(caps["timings"])
        small = time_shape("smollm2-135m", shapes["smollm2-135m"], device, dtype, s, deadline, errors, loop=True)
        target, _ = small.pop("_models", (None, None))
        report["timings"]["smollm2-135m"] = small
        if "incomplete" in small:
            report["skipped"]["timings (rest)"] = small["incomplete"]
        if target is not None and budget.left() > 10:
            log.info("3/4 batched throughput (cap %.0fs)", budget.cap(caps["batched"]))
            deadline = time.perf_counter() + budget.cap(caps["batched"])
            try:
                report["batched"] = attempt(
                    errors, "batched throughput", lambda: batched_throughput(target, s, deadline)
                )
            except OutOfTime as exc:
                report["skipped"]["batched"] = str(exc)
        elif target is not None:
            report["skipped"]["batched"] = f"out of time ({budget.left():.0f}s left)"
        del target
    else:
        report["skipped"]["timings"] = f"out of time ({budget.left():.0f}s left)"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if budget.left() > 20:
        log.info("4/4 timings, smollm2-1.7b shape (cap %.0fs)", budget.cap(caps["large"]))
        deadline = time.perf_counter() + budget.cap(caps["large"])
        large = time_shape("smollm2-1.7b", shapes["smollm2-1.7b"], device, dtype, s, deadline, errors, loop=False)
        large.pop("_models", None)
        report["timings"]["smollm2-1.7b"] = large
        if "incomplete" in large:
            report["skipped"]["smollm2-1.7b (rest)"] = large["incomplete"]
    else:
        report["skipped"]["smollm2-1.7b"] = f"out of time ({budget.left():.0f}s left)"

    # 3. projected speed-ups
    report["projected"] = (
        attempt(errors, "projections", lambda: projections(small, args.cpu_results, report["timings"])) or {}
    )
    report["environment"] = environment()
    report["wall_s"] = round(time.perf_counter() - budget.t0, 1)
    report["summary"] = summary(report)
    table = markdown(report)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**report, "table": table}, indent=1, default=str) + "\n")
        log.info("wrote %s", args.json)
    return report


if __name__ == "__main__":
    main()

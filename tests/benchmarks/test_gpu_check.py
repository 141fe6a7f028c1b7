"""``benchmarks/gpu_check.py --dry-run``: the GPU check's code on the CPU with tiny shapes, in a
process where this project's pins that the GPU machine lacks cannot be imported (so the real
run cannot rot, nor start to need them). Speed is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.common import REPO_ROOT

pytestmark = pytest.mark.slow  # a benchmark script end to end (about 15 s)

ABSENT_ON_GPU_MACHINE = (
    "mlflow,kafka,pydantic,pydantic_settings,apscheduler,sqlalchemy,psycopg2,fastapi,uvicorn,scipy,rich,msgpack,"
    "zstandard,crc32c,prometheus_client,tenacity,matplotlib,deepspeed,openai,gguf,faiss,scann,bm25s,pymilvus,"
    "milvus_lite,boto3,sklearn,specops-install"
)
"""The pins the GPU machine does not have (it has torch, transformers and their dependencies,
safetensors, numpy and pytest), made unimportable in the dry run and its pytest subprocess; and no
install of this project (``specops-install``: the editable install's finder set aside), so
``specops.serving`` and the rest come from ``benchmarks.gpu_compat``'s mapping of the folders."""

RUN = """
import runpy, sys
for name in {absent!r}.split(","):
    sys.modules[name] = None  # as if not installed: an import raises, find_spec gives None
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.argv = ["benchmarks/gpu_check.py", *sys.argv[1:]]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""


DEADLINES = ("--budget-s", "240", "--cap-scale", "4")
"""Room for a loaded 2-core CI machine: the dry run's own 60 s budget and 20 s timing cap once left no time for the
loop round these tests read (CI, stop 69). The work is the same; only the cut-offs move."""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SPECOPS_SIMULATE_ABSENT": ABSENT_ON_GPU_MACHINE}
    # One torch thread in the dry run and its pytest subprocess: the tiny shapes gain nothing from two, and
    # two threads beside a second xdist worker on a 2-core machine spin at every barrier (several times slower).
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-c", RUN.format(absent=ABSENT_ON_GPU_MACHINE), "--dry-run", *DEADLINES, "--json", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(out).read_text()), proc.stdout


def test_summary_has_exactly_the_issue_keys(dry_run):
    report, _ = dry_run
    s = report["summary"]
    assert tuple(s) == gpu_check.SUMMARY_KEYS
    assert s["device"].startswith("CPU")
    assert s["verify_cost_ratio_k4"] > 0 and s["c"] > 0 and s["target_vs_hf_target"] > 0
    assert s["wall_s"] > 0
    assert report["dry_run"] is True and report["skipped"] == {} and report["errors"] == {}


def test_the_cuda_tests_ran_in_a_subprocess_and_skipped_without_a_gpu(dry_run):
    report, _ = dry_run
    tests = report["cuda_tests"]
    assert report["summary"]["cuda_tests_failed"] == 0 and report["summary"]["cuda_tests_passed"] == 0
    assert tests["skipped"] >= 15  # collected (so importable without the absent pins), then skipped
    assert tests["skip_reasons"] == ["no CUDA GPU"]
    assert sorted(report["stubbed_modules"]) == ["prometheus_client", "pydantic", "tenacity"]
    assert report["repository_mapped"] is True  # specops.* came from the folders, as with PYTHONPATH=. there


def test_timings_cover_the_curve_trees_and_concurrency(dry_run):
    report, _ = dry_run
    small = report["timings"]["smollm2-135m"]
    assert list(small["verify"]["ms"]) == [str(n) for n in gpu_check.VERIFY_TOKENS]
    assert set(small["verify"]["tree_ms"]) == set(gpu_check.TREES)
    assert small["loop"]["identical"] is True  # our loop and HF generate: the same greedy tokens
    assert small["draft_vocab_rows"] == gpu_check.DRY_RUN_SETTINGS["draft_vocab"]
    assert "verify" in report["timings"]["smollm2-1.7b"]
    assert list(report["batched"]) == [str(n) for n in gpu_check.CONCURRENCY]
    assert report["batched"]["16"]["mean_batch"] > 1  # sixteen sequences really shared passes


def test_projections_price_the_cpu_acceptance_with_the_measured_costs(dry_run):
    report, _ = dry_run
    proj = report["projected"]
    assert set(report["summary"]["projected_speedup"]) == {"draft", "pld", "llma", "suffix"}
    assert proj["sources"] == ["llma.json", "spec_decode.json"]
    for row in proj["rows"]:
        assert row["gpu_projected"] > 0 and row["cpu_eq2"] > 0 and row["cpu_measured"] > 0
        assert (row["gpu_best_k"] is not None) == (row["method"] == "draft")
    # LLMA over SuffixDecoding per domain: the rows' own projections, and the largest shape's in the summary
    ratios = proj["llma_vs_suffix"]
    assert set(ratios) == {"rag", "cag"} == set(report["summary"]["projected_llma_vs_suffix"])
    for domain, r in ratios.items():
        row = {x["method"]: x for x in proj["rows"] if x["domain"] == domain and x["source"] == "llma.json"}
        assert r["smollm2-135m"] == pytest.approx(row["llma"]["gpu_projected"] / row["suffix"]["gpu_projected"])
        assert r["cpu_measured"] == pytest.approx(row["llma"]["cpu_measured"] / row["suffix"]["cpu_measured"])
        assert report["summary"]["projected_llma_vs_suffix"][domain] == r[gpu_check.LARGEST]


def test_reproject_reprices_a_saved_run_without_a_gpu(dry_run, tmp_path):
    report, _ = dry_run
    saved, out = tmp_path / "saved.json", tmp_path / "again.json"
    saved.write_text(json.dumps({**report, "projected": {}, "summary": {}}))
    again = gpu_check.main(["--reproject", str(saved), "--json", str(out)])
    for domain, r in report["projected"]["llma_vs_suffix"].items():
        assert again["projected"]["llma_vs_suffix"][domain] == pytest.approx(r)
    assert tuple(again["summary"]) == gpu_check.SUMMARY_KEYS and "reprojected" in again
    assert json.loads(out.read_text())["table"].startswith("GPU check on")


def test_the_table_names_the_device_and_every_section(dry_run):
    report, stdout = dry_run
    table = report["table"]
    assert table in stdout
    assert report["summary"]["device"] in table
    for heading in ("CUDA tests", "Target pass cost", "TargetBatcher", "Projected speed-up", "| tree 10x6 |"):
        assert heading in table


def test_interp_and_projection_formula():
    v = {1.0: 10.0, 2.0: 12.0, 4.0: 16.0}
    assert gpu_check.interp(v, 3.0) == 14.0
    assert gpu_check.interp(v, 6.0) == 20.0  # extrapolated from the last segment
    # a draft emitting 2 tokens per step from 2 drafts at c = 0.1: 2 / (2 * 1 + V(3)) * V(1)
    assert gpu_check.projected("draft", 2.0, 2.0, 0.0, v, 1.0) == pytest.approx(2.0 / (2.0 + 14.0) * 10.0)
    assert gpu_check.projected("pld", 2.0, 2.0, 0.5, v, None) == pytest.approx(2.0 / (0.5 + 14.0) * 10.0)


def test_a_failing_part_is_recorded_and_the_rest_runs():
    errors: dict = {}
    assert gpu_check.attempt(errors, "batched throughput", lambda: 1 / 0) is None
    assert errors == {"batched throughput": "ZeroDivisionError: division by zero"}
    with pytest.raises(gpu_check.OutOfTime):  # running out of time is not an error: the section stops there
        gpu_check.attempt(errors, "x", lambda: gpu_check._check(0.0, "x"))


def test_best_k_grows_when_verifying_is_free():
    flat = {1.0: 10.0, 16.0: 10.0}  # a GPU-like curve: 17 tokens cost what one does
    steep = {1.0: 10.0, 2.0: 20.0}  # a pass per token: nothing pays
    assert gpu_check.best_k(0.9, flat, 0.1)[1] >= 8
    speedup, k = gpu_check.best_k(0.9, steep, 0.1)
    assert k == 1 and speedup < 1.0

"""Helpers shared by the benchmark scripts: the environment record and the doc writer.

They live in ``benchmarks.harness`` (``env``, ``report``) now; this module re-exports them so
the scripts that import them from here keep working."""

from __future__ import annotations

from benchmarks.harness.env import REPO_ROOT, cpu_model, environment, target_name
from benchmarks.harness.report import finish_report, fmt, save_png, write_doc_section, write_json

__all__ = [
    "REPO_ROOT",
    "cpu_model",
    "environment",
    "finish_report",
    "fmt",
    "save_png",
    "target_name",
    "write_doc_section",
    "write_json",
]

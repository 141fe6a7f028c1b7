"""Every generated block of docs/benchmarks.md is its committed JSON's rendering (issue 60).

A benchmark script writes its section of docs/benchmarks.md between markers
(``<!-- BEGIN name (written by benchmarks/<script>.py ...) -->`` ... ``<!-- END name -->``;
vllm_path.py's are ``<!-- vllm-path:begin -->`` ... ``<!-- vllm-path:end -->``) and its report
to a JSON under benchmarks/out/. ``BLOCKS`` names, for each block, the committed JSON it was
written from and the script's own function that renders it; the tests re-render every block
from its JSON and compare it with the doc, so a number edited by hand inside a block, or a JSON
overwritten by a later run without its doc, fails here. A block the doc gains must be added to
``BLOCKS``. The tables re-render from the JSONs alone: no model is loaded.

Docs/api.md's ``methods`` block is the method catalogue's and is checked in
tests/serving/proposers/test_catalogue.py.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
OUT = ROOT / "benchmarks" / "out"
# a block from its begin marker's line to its end marker, as write_doc_section replaces it
BLOCK = re.compile(
    r"^<!-- BEGIN (?P<name>\S+) \(written by [^\n]*?\) -->\n.*?^<!-- END (?P=name) -->"
    r"|^<!-- (?P<short>[\w-]+):begin -->\n.*?^<!-- (?P=short):end -->",
    re.M | re.S,
)
BEGIN_LINE = re.compile(r"^<!-- (?:BEGIN (\S+) |([\w-]+):begin -->)", re.M)
NUMBER = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


@dataclass(frozen=True)
class Block:
    json: str
    """The committed report it was written from, under benchmarks/out/."""
    render: Callable[[dict], str]
    """The script's own rendering of the block, markers included, from that report."""
    exact: bool = True
    """False: the block cannot be re-rendered as it stands (the reason is at its entry); every number
    in it must then be one the current rendering of the JSON prints or one the JSON holds."""


# ---------------------------------------------------------------- the scripts' renderings
# Imported when called: each script's module pulls in what its run needs, and only these tests pay.
def _spec_decode(r: dict) -> str:
    from benchmarks.specbench import report

    return report.doc_section(r, report.markdown(r))


def _streams(r: dict) -> str:
    from benchmarks import streams

    return streams.doc_section(r, streams.markdown(r))


def _osd(r: dict) -> str:
    from benchmarks.distill import doc, tables

    return doc.doc_section(r, tables.markdown(r), "img/osd.png")


def _osd_grid(r: dict) -> str:
    from benchmarks.distill import doc, grid

    return doc.grid_doc_section(r, grid.grid_markdown(r))


def _osd_teacher(r: dict) -> str:
    from benchmarks import osd_teacher

    return osd_teacher.doc_section(r, osd_teacher.markdown(r))


def _osd_average(r: dict) -> str:
    from benchmarks import osd_average

    return osd_average.doc_section(r, osd_average.markdown(r))


def _hotswap(r: dict) -> str:
    from benchmarks import hotswap

    return hotswap.doc_section(r, hotswap.tables(r)[1])


def _api(r: dict) -> str:
    from benchmarks import api

    return api.doc_section(r)


def _faults(r: dict) -> str:
    from benchmarks.soak import report

    return report.doc_section(r, report.tables(r)[1])


def _batching(r: dict) -> str:
    from benchmarks import batching

    return batching.doc_section(r)


def _dresd(r: dict) -> str:
    from benchmarks import dresd

    return dresd.doc_section(r)


def _dresd_curve(r: dict) -> str:
    from benchmarks.retrieval_curve import report

    return report.markdown(r, "img/dresd_curve.png", r["command"])


def _ralm(r: dict) -> str:
    from benchmarks import ralm_report

    return ralm_report.markdown(r, "img/ralm.png")


def _ralm_knnlm(r: dict) -> str:
    from benchmarks import ralm_report

    return ralm_report.markdown(r, "img/ralm_knnlm.png")


def _llma(r: dict) -> str:
    from benchmarks import llma_report

    swept = any(st.get("sweep") for st in r["sets"].values())  # the plot is of the k sweep
    return llma_report.markdown(r, "img/llma.png" if swept else None)


def _llma_tune(r: dict) -> str:
    from benchmarks import llma_tune

    return llma_tune.markdown(r, "img/llma_tune.png")


def _adaptive(r: dict) -> str:
    from benchmarks import adaptive_report

    return adaptive_report.markdown(r, "img/adaptive.png")


def _engines(section: str) -> Callable[[dict], str]:
    def render(r: dict) -> str:
        from benchmarks import engines

        return engines.doc_text(r, section)

    return render


def _engine_pass(r: dict) -> str:
    from benchmarks import engine_pass

    return engine_pass.doc_section(r)


def _structured(r: dict) -> str:
    from benchmarks import structured

    return structured.markdown(r, "img/structured.png")


def _choices(r: dict) -> str:
    from benchmarks import choices

    return choices.markdown(r, "img/choices.png")


VLLM_PATH_COMMAND = "python benchmarks/vllm_path.py --parts speed --json benchmarks/out/vllm_path.json"
"""vllm_path.json does not record its command line; this is the run that wrote the block."""


def _vllm_path(r: dict) -> str:
    from benchmarks import vllm_path

    return vllm_path.doc_section(r, VLLM_PATH_COMMAND)


BLOCKS: dict[str, Block] = {
    "spec_decode": Block("spec_decode.json", _spec_decode),
    # the quick run of 2026-11-23 (its JSON's own name); streams.json is the older full run of 2026-11-21
    "streams": Block("streams_smollm2_quick.json", _streams),
    # merged by `osd.py --merge` from the parts' JSONs; osd.json holds the merge and each part's command
    "osd": Block("osd.json", _osd),
    "osd-grid": Block("osd_grid.json", _osd_grid),
    "osd-teacher": Block("osd_teacher.json", _osd_teacher),
    "osd_average": Block("osd_average.json", _osd_average),
    "hotswap": Block("hotswap.json", _hotswap),
    "vllm-path": Block("vllm_path.json", _vllm_path),
    "api": Block("api.json", _api),
    "faults": Block("faults.json", _faults),
    "batching": Block("batching.json", _batching),
    # its command wrote benchmarks/out/dresd.json, committed under this name (dresd.json is the curve's)
    "dresd": Block("dresd_vs_rest.json", _dresd),
    "dresd-curve": Block("dresd.json", _dresd_curve),
    "ralm": Block("ralm.json", _ralm),
    "ralm-knnlm": Block("ralm_knnlm.json", _ralm_knnlm),
    "llma": Block("llma.json", _llma),
    "llma-tune": Block("llma_tune.json", _llma_tune),
    "adaptive": Block("adaptive.json", _adaptive),
    # Written on 2026-11-26 by engines.py as it was before issue 54; the renderer has changed since
    # (a TTFT column, issue 54's summary columns, the protocol sentence) and no longer prints this
    # run's idle-CPU shares or its rounds per concurrency, so the block cannot be re-rendered from
    # its JSON without losing what it says. Its numbers are checked instead.
    "engines": Block("engines.json", _engines("engines"), exact=False),
    "engines-load": Block("engines_load.json", _engines("engines-load")),
    "engine-pass": Block("engine_pass.json", _engine_pass),
    "structured": Block("structured.json", _structured),
    "choices": Block("choices.json", _choices),
}


# ---------------------------------------------------------------- the checks
def blocks_in(text: str) -> dict[str, str]:
    """Each generated block of a doc by name, from its begin marker's line to its end marker."""
    out: dict[str, str] = {}
    for m in BLOCK.finditer(text):
        name = m.group("name") or m.group("short")
        assert name not in out, f"block {name!r} appears twice"
        out[name] = m.group(0)
    return out


@cache
def report(name: str) -> str:
    return (OUT / name).read_text()


@cache
def rendered(name: str) -> str:
    block = BLOCKS[name]
    return block.render(json.loads(report(block.json)))


def numbers(text: str) -> list[str]:
    return [n.replace("−", "-").replace(",", "") for n in NUMBER.findall(text)]


def json_numbers(obj) -> list[float]:
    """Every number a report holds (booleans excluded), at any depth."""
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in json_numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in json_numbers(v)]
    return [float(obj)] if isinstance(obj, int | float) and not isinstance(obj, bool) else []


def untraced(block: str, render: str, held: list[float]) -> list[str]:
    """The numbers of ``block`` that ``render`` does not print and no number of ``held`` (as is, or as a
    percentage) rounds to at the precision the block prints them."""
    printed = set(numbers(render))
    missing = []
    for n in numbers(block):
        if n in printed:
            continue
        places = len(n.split(".")[1]) if "." in n and "e" not in n else 0
        value = float(n)
        if not any(round(x, places) == value or round(x * 100, places) == value for x in held):
            missing.append(n)
    return missing


def check(name: str, block: str) -> None:
    """``block`` (the doc's text of the block ``name``) is its JSON's rendering, or (``exact=False``)
    prints no number its JSON does not hold."""
    entry = BLOCKS[name]
    want = rendered(name)
    if entry.exact:
        diff = "".join(
            difflib.unified_diff(
                block.splitlines(True), want.splitlines(True), "docs/benchmarks.md", f"{entry.json} rendered", n=0
            )
        )
        assert block == want, (
            f"docs/benchmarks.md's {name!r} block is not benchmarks/out/{entry.json} as its script renders it "
            f"(re-run the script's doc writing on that JSON, or fix the JSON):\n{diff[:4000]}"
        )
    else:
        missing = untraced(block, want, json_numbers(json.loads(report(entry.json))))
        assert not missing, f"{name!r}: numbers in the doc that benchmarks/out/{entry.json} does not hold: {missing}"


@cache
def doc_blocks() -> dict[str, str]:
    return blocks_in(DOC.read_text())


def test_every_generated_block_is_registered():
    """A new generated block names its JSON and its rendering in ``BLOCKS``; a removed one leaves it."""
    text = DOC.read_text()
    begun = {a or b for a, b in BEGIN_LINE.findall(text)}
    found = set(doc_blocks())
    assert begun == found, f"begin markers without a matching end marker: {sorted(begun - found)}"
    assert found - set(BLOCKS) == set(), (
        f"blocks of docs/benchmarks.md missing from BLOCKS: {sorted(found - set(BLOCKS))}"
    )
    assert set(BLOCKS) - found == set(), f"BLOCKS names blocks docs/benchmarks.md lacks: {sorted(set(BLOCKS) - found)}"
    for name, block in BLOCKS.items():
        assert (OUT / block.json).is_file(), f"{name}: benchmarks/out/{block.json} is missing"


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_is_its_committed_json_rendered(name):
    check(name, doc_blocks()[name])


def _alter_one_digit(block: str, number: str) -> str:
    """``block`` with the first digit of the table cell ``| number |`` changed."""
    cell = f"| {number} |"
    assert cell in block, f"no cell {cell!r} to alter"
    digit = next(c for c in number if c.isdigit())
    changed = number.replace(digit, str((int(digit) + 1) % 10), 1)
    return block.replace(cell, f"| {changed} |", 1)


@pytest.mark.parametrize(("name", "number"), [("hotswap", "46"), ("batching", "185.71"), ("engines", "1.68x")])
def test_one_altered_digit_fails_the_check(name, number):
    """The negative control, on an in-memory copy of the doc: one digit of one number changed inside
    a block is caught, by the exact comparison and by the numbers-only one."""
    doc = DOC.read_text()
    block = doc_blocks()[name]
    altered = blocks_in(doc.replace(block, _alter_one_digit(block, number)))[name]
    assert altered != block
    check(name, block)
    with pytest.raises(AssertionError, match=name):
        check(name, altered)

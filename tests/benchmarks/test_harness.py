"""The benchmark harness (``benchmarks.harness``): the one batched greedy loop gives each prompt the
tokens it gets alone, the arms' rotation and the streams' mix are what the scripts relied on, and
the doc writer and the server's command line are what they wrote and ran before."""

from __future__ import annotations

import pytest
import torch

from benchmarks import common
from benchmarks.harness.greedy import generation_eos, greedy_batches
from benchmarks.harness.interleave import mix_streams, rotated
from benchmarks.harness.report import write_doc_section
from benchmarks.harness.servers import SPECOPS_URL_VARS, serve_env, specops_serve_argv
from tests.conftest import random_prompts


def greedy_alone(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy for one prompt, no padding and no KV cache: full recompute every token."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


PROMPTS = random_prompts(9, seed=21, lo=2, hi=20)


@pytest.mark.parametrize(
    ("batch", "by_length"),
    [(64, True), (4, True), (3, False), (None, False)],
    ids=["one-sorted-batch", "sorted-batches-of-4", "batches-of-3-in-order", "one-batch-in-order"],
)
def test_batched_greedy_equals_each_prompt_alone(close_pair, batch, by_length):
    target = close_pair.target
    want = [greedy_alone(target, p, 12) for p in PROMPTS]
    got = greedy_batches(target, PROMPTS, 12, pad=0, batch=batch, by_length=by_length)
    assert got == want


def test_greedy_cuts_after_the_first_eos(close_pair):
    target = close_pair.target
    alone = [greedy_alone(target, p, 12) for p in PROMPTS]
    eos = alone[0][4]  # a token the first prompt emits at its fifth step
    got = greedy_batches(target, PROMPTS, 12, pad=0, batch=4, eos=[eos, None])
    for out, ref in zip(got, alone):
        assert out == (ref[: ref.index(eos) + 1] if eos in ref else ref)
    assert got[0][-1] == eos and len(got[0]) <= 5
    assert generation_eos(target) == set()  # the tiny models have no EOS: nothing cut by default


def test_rotated_and_mixed_streams():
    assert [rotated("abc", i) for i in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert rotated([], 3) == []
    streams = {"x": [1, 2, 3], "y": [10, 20], "z": []}
    mixed = mix_streams(streams, seed=0)
    assert sorted(mixed) == [1, 2, 3, 10, 20]
    assert [m for m in mixed if m < 10] == [1, 2, 3] and [m for m in mixed if m >= 10] == [10, 20]
    assert mixed == mix_streams(streams, seed=0) and streams["x"] == [1, 2, 3]


def test_doc_section_is_replaced_between_its_markers(tmp_path):
    doc = tmp_path / "bench.md"
    write_doc_section(doc, "<!-- B -->", "<!-- E -->", "<!-- B -->\none\n<!-- E -->")
    assert doc.read_text().startswith("# Benchmarks") and "one" in doc.read_text()
    write_doc_section(doc, "<!-- B -->", "<!-- E -->", "<!-- B -->\ntwo\n<!-- E -->")
    assert "two" in doc.read_text() and "one" not in doc.read_text()
    assert common.write_doc_section is write_doc_section  # the old name still imports


def test_serve_command_and_environment(monkeypatch, tmp_path):
    argv = specops_serve_argv(2, {"--port": 8123, "--no-vllm-draft-vocab": True, "--x": None, "--a": "--b"})
    assert argv[1:] == [
        "-m",
        "specops.cli.main",
        "--threads",
        "2",
        "serve",
        "--port=8123",
        "--no-vllm-draft-vocab",
        "--a=--b",
    ]
    for var in SPECOPS_URL_VARS:
        monkeypatch.setenv(var, "operator's")
    env = serve_env(tmp_path, EXTRA="1")
    assert env["SPECOPS_DATA_DIR"] == str(tmp_path) and env["EXTRA"] == "1" and env["TQDM_DISABLE"] == "1"
    assert not set(SPECOPS_URL_VARS) & set(env)

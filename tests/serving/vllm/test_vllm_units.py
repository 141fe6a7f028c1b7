"""The parts of the vLLM engine that need no vLLM: its command line, its metrics, its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specops.serving.vllm.metrics import SpecCounters, parse
from specops.serving.vllm.process import ServerSpec, VLLMError, speculative_config, vllm_python

PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 4.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="target"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="target"} 2.0
"""


def test_metrics_page_gives_the_papers_per_token_alpha():
    c = parse(PAGE)
    assert (c.requests, c.drafts, c.draft_tokens, c.accepted) == (5.0, 10.0, 30.0, 18.0)
    assert c.accepted_per_pos == (8.0, 6.0, 4.0)
    # 10 drafts, 4 of them fully accepted: 6 steps ended in a rejection; alpha = 18 / (18 + 6)
    assert c.alpha_token == pytest.approx(0.75)
    assert c.acceptance_rate == pytest.approx(0.6)
    delta = c - SpecCounters(requests=1, drafts=2, draft_tokens=6, accepted=6, accepted_per_pos=(2, 2, 2))
    assert (delta.requests, delta.drafts, delta.accepted, delta.accepted_per_pos) == (4, 8, 12, (6, 4, 2))
    assert delta.alpha_token == pytest.approx(12 / (12 + 6))
    assert parse("").alpha_token == 0.0


def test_server_command_line(tmp_path):
    spec = ServerSpec(tmp_path / "target", "draft", tmp_path / "draft", k=4, served_name="t", dtype="float32")
    argv = spec.argv(Path("/py"), 8123)
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--port") + 1] == "8123"
    sc = json.loads(argv[argv.index("--speculative-config") + 1])
    assert sc == {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 4}
    assert "--speculative-config" not in ServerSpec(tmp_path, "none").argv(Path("/py"), 1)
    assert "--no-enable-prefix-caching" in argv  # no cache shared across tenants unless the operator says so
    opted = ServerSpec(tmp_path, "none", extra_args=("--enable-prefix-caching",)).argv(Path("/py"), 1)
    assert opted.index("--enable-prefix-caching") > opted.index("--no-enable-prefix-caching")  # the later flag wins
    assert speculative_config("ngram", 3, None)["method"] == "ngram"
    with pytest.raises(ValueError, match="draft model directory"):
        speculative_config("draft", 3, None)


def test_missing_vllm_venv_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOPS_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(VLLMError, match="make vllm-venv"):
        vllm_python()

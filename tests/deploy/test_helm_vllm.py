"""The Helm chart with ``specops.serving.engine: vllm``: the serving-vllm image, serve.toml's engine and vllm_* keys, the
probes and rollout deadline that cover a vLLM server's start, and a schema that tracks ServeConfig.

The CPU build is rendered from default-values.yaml with ``specops.serving.engine: vllm``; the GPU one is
ci/vllm-values.yaml (linted and validated with the other ci/ files by test_helm.py).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import tempfile
from pathlib import Path

import pytest

from specops.serving.http.config import ServeConfig, ServeKeys
from tests.deploy import helm_support as hs

CI = {path.name: path for path in hs.ci_value_files()}
DEFAULT = CI["default-values.yaml"]
VLLM = CI["vllm-values.yaml"]
CPU_VLLM = {"serving": {"engine": "vllm"}}


def _tool():
    spec = importlib.util.spec_from_file_location("config_schema", hs.REPO / "deploy/helm/tools/config_schema.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _values(values_file=None, set_values=None) -> dict:
    """The values the chart renders with: its values.yaml under the file's and the --set ones."""
    return hs._merge(hs.load_values(hs.CHART_DIR / "values.yaml"), hs.load_values(values_file, set_values))


def _serving(values_file, set_values=None) -> tuple[dict, dict, ServeConfig]:
    """(the serving Deployment, its container, serve.toml loaded as ``specops serve --config`` loads it)."""
    objects = hs.render(values_file, set_values)
    deployment = hs.one(objects, "Deployment", "serving")
    c = hs.container(deployment, "serving")
    toml = hs.one(objects, "ConfigMap", "serving")["data"]["serve.toml"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "serve.toml"
        path.write_text(toml)
        cfg = ServeConfig.load(path, env=hs.literal_env(c))
    return deployment, c, cfg


def _startup_budget_s(c: dict) -> int:
    probe = c["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_default_engine_is_ours_with_the_serving_image():
    deployment, c, cfg = _serving(DEFAULT)
    assert cfg.engine.kind == "specops" and c["image"].startswith("ghcr.io/specops/specops-serving:")
    assert "progressDeadlineSeconds" not in deployment["spec"]
    assert _values()["serving"]["engine"] == "specops"


def test_cpu_vllm_renders_the_serving_vllm_image_and_the_vllm_fields():
    values = _values(DEFAULT, CPU_VLLM)["serving"]["vllm"]
    deployment, c, cfg = _serving(DEFAULT, CPU_VLLM)
    assert c["image"] == "ghcr.io/specops/specops-serving-vllm:0.1.0"  # the CPU build: no -cuda
    assert c["args"] == ["specops", "serve", "--config", "/etc/specops/serve.toml"]
    assert cfg.engine.kind == "vllm" and cfg.engine.device == "cpu"
    assert (cfg.vllm.speculation, cfg.vllm.k, cfg.vllm.max_model_len, cfg.vllm.kv_cache_gb) == (
        values["speculation"],
        values["k"],
        values["maxModelLen"],
        values["kvCacheGb"],
    )
    assert cfg.vllm.args == "" and cfg.vllm.start_timeout_s == values["startTimeoutS"]
    assert (cfg.vllm.copy_k, cfg.vllm.standby) == (values["copyK"], values["standby"])
    assert cfg.vllm.max_model_len >= cfg.admission.max_prompt_tokens + cfg.admission.max_tokens_limit
    assert not cfg.vllm.python, "the image's SPECOPS_VLLM_PYTHON names vLLM's Python"
    for obj in hs.render(DEFAULT, CPU_VLLM):
        hs.validate_object(obj)


def test_vllm_start_lengthens_the_startup_probe_and_the_rollout_deadline():
    """The startup probe waits for /readyz, which with vLLM comes after the first server's start (minutes on a
    CPU): its budget and the rollout's deadline grow by vllm_start_timeout_s."""
    _, plain, _ = _serving(DEFAULT)
    for set_values in (CPU_VLLM, {"serving": {"engine": "vllm", "vllm": {"startTimeoutS": 1234.5}}}):
        deployment, c, cfg = _serving(DEFAULT, set_values)
        assert c["startupProbe"]["httpGet"]["path"] == "/readyz"
        assert _startup_budget_s(c) >= _startup_budget_s(plain) + math.ceil(cfg.vllm.start_timeout_s)
        assert deployment["spec"]["progressDeadlineSeconds"] > _startup_budget_s(c)
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_gpu_vllm_values_file():
    deployment, c, cfg = _serving(VLLM)
    values = _values(VLLM)["serving"]
    assert c["image"] == "ghcr.io/specops/specops-serving-vllm:0.1.0-cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
    assert cfg.engine.kind == "vllm" and cfg.engine.device == "cpu", (
        "the GPU is the vLLM servers': the front door stays off it"
    )
    argv = shlex.split(cfg.vllm.args)
    share = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert share == values["vllm"]["gpuMemoryUtilization"] and 2 * share < 1, "two servers fit during a swap"
    assert argv[-2:] == shlex.split(values["vllm"]["args"]), "the values' args come last: they win"
    assert (cfg.vllm.k, cfg.vllm.max_model_len) == (values["vllm"]["k"], values["vllm"]["maxModelLen"])
    assert deployment["spec"]["progressDeadlineSeconds"] > _startup_budget_s(c)
    notes = hs.notes(VLLM)
    assert "vLLM" in notes and "specops-serving-vllm:0.1.0-cuda" in notes


def test_vllm_image_tag_follows_the_chart_tag_unless_set():
    _, c, _ = _serving(DEFAULT, {"image": {"tag": "1.2.3"}, **CPU_VLLM})
    assert c["image"] == "ghcr.io/specops/specops-serving-vllm:1.2.3"
    _, c, _ = _serving(VLLM, {"serving": {"vllm": {"image": {"repository": "r.example/vllm", "tag": "9"}}}})
    assert c["image"] == "r.example/vllm:9-cuda"


def test_values_defaults_are_serve_configs():
    """specops.serving.vllm's defaults are ServeConfig's, but maxModelLen, which must hold the longest request the API takes."""
    tool = _tool()
    values = _values()["serving"]["vllm"]
    defaults = ServeConfig()
    for value, field in tool.VLLM_VALUES.items():
        if value != "maxModelLen":
            assert values[value] == defaults.flat()[field], value
    assert values["maxModelLen"] == defaults.admission.max_prompt_tokens + defaults.admission.max_tokens_limit
    # the template's fallbacks when serving.config does not set them
    helpers = (hs.CHART_DIR / "templates" / "_helpers.tpl").read_text()
    assert f"default {defaults.admission.max_prompt_tokens} $c.max_prompt_tokens" in helpers
    assert f"default {defaults.admission.max_tokens_limit} $c.max_tokens_limit" in helpers


def test_schema_engine_and_vllm_fields_track_serve_config():
    tool = _tool()
    schema = json.loads((hs.CHART_DIR / "values.schema.json").read_text())["properties"]["serving"]["properties"]
    fix = "out of date: run python deploy/helm/tools/config_schema.py"
    assert schema["engine"] == tool.serve_field_schema("engine"), fix
    assert schema["engine"]["enum"] == list(ServeKeys.model_json_schema()["properties"]["engine"]["enum"])
    for value, field in tool.VLLM_VALUES.items():
        assert schema["vllm"]["properties"][value] == tool.serve_field_schema(field), fix
    assert set(tool.VLLM_VALUES.values()) | {"vllm_python"} == {f for f in ServeKeys.model_fields if "vllm" in f}
    assert not {"engine", *tool.VLLM_VALUES.values()} & set(schema["config"]["properties"])


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"serving": {"engine": "tgi"}}, "/serving/engine"),
        ({"serving": {"vllm": {"speculation": "eagle"}}}, "/serving/vllm/speculation"),
        ({"serving": {"vllm": {"k": 17}}}, "/serving/vllm/k"),
        ({"serving": {"vllm": {"startTimeoutS": 0}}}, "/serving/vllm/startTimeoutS"),
        ({"serving": {"vllm": {"gpuMemoryUtilization": 0.5}}}, "/serving/vllm/gpuMemoryUtilization"),
        ({"serving": {"vllm": {"kvCacheGB": 2}}}, "kvCacheGB"),
        ({"serving": {"config": {"engine": "vllm"}}}, "'engine'"),
        ({"serving": {"config": {"vllm_k": 4}}}, "'vllm_k'"),
    ],
    ids=[
        "bad-engine",
        "bad-speculation",
        "k-too-large",
        "zero-timeout",
        "gpu-share-too-large",
        "typo",
        "owned-engine",
        "owned-vllm-k",
    ],
)
def test_invalid_vllm_values_are_refused_naming_the_field(values, field):
    with pytest.raises(hs.RenderError) as caught:
        hs.render(DEFAULT, values)
    assert field in str(caught.value)


def test_max_model_len_must_hold_the_longest_request():
    with pytest.raises(hs.RenderError, match=r"serving.vllm.maxModelLen \(2048\) is below .* \(3072\)"):
        hs.render(DEFAULT, {"serving": {"engine": "vllm", "vllm": {"maxModelLen": 2048}}})
    limits = {"max_prompt_tokens": 1536, "max_tokens_limit": 512}
    _, _, cfg = _serving(DEFAULT, {"serving": {"engine": "vllm", "vllm": {"maxModelLen": 2048}, "config": limits}})
    assert cfg.vllm.max_model_len == 2048 == cfg.admission.max_prompt_tokens + cfg.admission.max_tokens_limit
    hs.render(DEFAULT, {"serving": {"vllm": {"maxModelLen": 2048}}})  # engine specops: not checked

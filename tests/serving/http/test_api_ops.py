"""Operating the API: bearer keys, readiness while loading (or failing to), the serve config's
sources and errors, ``specops serve --help``, and what a served request logs to the stream."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
import requests

from specops.core.errors import ModelConfigError
from specops.serving.http.config import ServeConfig, ServeKeys
from specops.serving.http.server import ServingState
from specops.streams import StreamConfig, codec, open_stream
from specops.streams.records import GenerationRecord, MissRecord
from tests.serving.http.api_support import MODEL, assert_error, running, serve_config, wait_until

KEY = "test-key-123456"
REPO = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- bearer keys
@pytest.fixture(scope="module")
def keyed(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models, api_keys=[KEY, "second-key-789"]), tmp_path_factory.mktemp("keyed")) as srv:
        yield srv


def test_api_keys_guard_v1_but_not_the_probes(keyed):
    url = keyed.url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = requests.post(url + "/v1/completions", json=body)
    assert_error(r, 401, "missing_api_key")
    assert r.headers["WWW-Authenticate"] == "Bearer" and r.json()["error"]["type"] == "authentication_error"
    assert_error(
        requests.post(url + "/v1/completions", json=body, headers={"Authorization": "Basic " + KEY}),
        401,
        "missing_api_key",
    )
    r = requests.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong-key-999"})
    assert_error(r, 403, "invalid_api_key")
    assert r.json()["error"]["type"] == "permission_error"
    assert_error(requests.get(url + "/v1/models"), 401, "missing_api_key")
    for key in (KEY, "second-key-789"):
        r = requests.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert requests.get(url + "/healthz").json() == {"status": "ok"}
    assert requests.get(url + "/readyz").status_code == 200
    metrics = requests.get(url + "/metrics")  # auth_metrics is off
    assert metrics.status_code == 200 and "specops_api_requests_total" in metrics.text


def test_the_openai_client_sends_its_key(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    # greedy: at the default temperature 1 the tiny model samples its EOS within 3 tokens about once in 400
    done = good.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert done.usage.completion_tokens == 3
    with pytest.raises(openai.PermissionDeniedError) as exc:
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="not-the-key", max_retries=0).models.list()
    assert exc.value.status_code == 403 and exc.value.code == "invalid_api_key"


def test_auth_metrics_puts_metrics_behind_the_key(tiny_models, tmp_path):
    with running(serve_config(tiny_models, api_keys=[KEY], auth_metrics=True), tmp_path) as srv:
        assert_error(requests.get(srv.url + "/metrics"), 401, "missing_api_key")
        ok = requests.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and "# HELP specops_api_requests_total" in ok.text
        assert requests.get(srv.url + "/healthz").status_code == 200


# ---------------------------------------------------------------- readiness
def gated_state(cfg, models: Path, cache_dir: Path, gate: threading.Event) -> ServingState:
    """A serving state whose replica loads only when the test opens the gate."""
    state = ServingState(cfg, target_dir=models / "target", draft_dir=models / "draft", cache_dir=cache_dir)
    replica, load_steps = state.replica, state.replica._load_steps

    def gated() -> None:
        replica.loading_step = "waiting for the test"
        assert gate.wait(60)
        load_steps()

    replica._load_steps = gated
    return state


def test_readyz_is_503_while_loading_and_200_once_loaded(tiny_models, tmp_path):
    cfg = serve_config(tiny_models)
    gate = threading.Event()
    state = gated_state(cfg, tiny_models, tmp_path / "cache", gate)
    with running(cfg, tmp_path, state=state, ready=False) as srv:
        url = srv.url
        try:
            assert requests.get(url + "/healthz").status_code == 200
            r = requests.get(url + "/readyz")
            assert r.status_code == 503 and "error" not in r.json()
            assert (r.json()["ready"], r.json()["step"]) == (False, "waiting for the test")
            r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            err = assert_error(r, 503, "not_ready")
            assert "waiting for the test" in err["message"] and r.headers["Retry-After"] == "1"
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            assert_error(requests.post(url + "/v1/chat/completions", json=chat), 503, "not_ready")
            assert requests.get(url + "/v1/models").status_code == 200
        finally:
            gate.set()
        srv.wait_ready(60)
        r = requests.get(url + "/readyz")
        assert r.status_code == 200 and r.json()["ready"] is True and r.json()["step"] == "ready"
        assert "drafts" not in r.json()  # cluster names are on /v1/clusters, behind the key
        assert requests.get(url + "/v1/clusters").json()["drafts"] == {}  # no cluster served yet
        r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert requests.get(url + "/v1/clusters").json()["drafts"] == {"default": "base"}


def test_a_server_that_cannot_load_says_why(tiny_models, tmp_path):
    cfg = serve_config(tiny_models, target=str(tmp_path / "no-such-target"))
    with running(cfg, tmp_path, ready=False) as srv:
        assert wait_until(lambda: srv.state.load_error is not None, 30)
        r = requests.get(srv.url + "/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False and r.json()["step"] == "models"
        assert "no-such-target" in r.json()["error"]
        r = requests.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        err = assert_error(r, 503, "not_ready")
        assert "failed to load" in err["message"] and "no-such-target" in err["message"]
        health = requests.get(srv.url + "/healthz")  # liveness fails: an orchestrator restarts the replica
        assert health.status_code == 503 and "no-such-target" in health.json()["error"]


# ---------------------------------------------------------------- config
def test_config_precedence_file_env_overrides(tmp_path):
    top = tmp_path / "top.toml"
    top.write_text('port = 9001\nmax_queue = 5\nserved_model_name = "from-file"\n')
    table = tmp_path / "table.toml"
    table.write_text('[serve]\nport = 9101\napi_keys = ["file-key-0001"]\n')
    assert ServeConfig.load(env={}) == ServeConfig()
    cfg = ServeConfig.load(top, env={})
    assert (cfg.api.port, cfg.admission.max_queue, cfg.api.served_model_name, cfg.api.host) == (
        9001,
        5,
        "from-file",
        "127.0.0.1",
    )
    env = {"SPECOPS_SERVE_PORT": "9002", "SPECOPS_SERVE_AUTH_METRICS": "true", "SPECOPS_SERVE_QUEUE_TIMEOUT_S": "2.5"}
    cfg = ServeConfig.load(top, env=env)
    assert (cfg.api.port, cfg.admission.max_queue, cfg.api.auth_metrics, cfg.admission.queue_timeout_s) == (
        9002,
        5,
        True,
        2.5,
    )
    cfg = ServeConfig.load(top, env=env, overrides={"port": 9003, "max_queue": None, "served_model_name": "flag"})
    assert (cfg.api.port, cfg.admission.max_queue, cfg.api.served_model_name) == (
        9003,
        5,
        "flag",
    )  # None = flag not given
    cfg = ServeConfig.load(table, env={})
    assert (cfg.api.port, cfg.api.api_keys) == (9101, ["file-key-0001"])
    cfg = ServeConfig.load(table, env={"SPECOPS_API_KEYS": " env-key-00001, env-key-00002 ,"})
    assert cfg.api.api_keys == ["env-key-00001", "env-key-00002"]
    assert ServeConfig.load(env={"SPECOPS_SERVE_API_KEYS": "one-key-12345"}).api.api_keys == ["one-key-12345"]
    assert ServeConfig(api_keys="a-key-123456,b-key-123456").api.api_keys == ["a-key-123456", "b-key-123456"]


def test_the_draft_dtype_is_measured_unless_named(tmp_path):
    """``auto`` (measured at load, ``specops.core.draft_dtype``) by default; a precision from a file or the environment."""
    assert ServeConfig().engine.draft_dtype == ServeConfig.load(env={}).engine.draft_dtype == "auto"
    path = tmp_path / "serve.toml"
    path.write_text('draft_dtype = "float32"\n')
    assert ServeConfig.load(path, env={}).engine.draft_dtype == "float32"
    assert ServeConfig.load(path, env={"SPECOPS_SERVE_DRAFT_DTYPE": "bfloat16"}).engine.draft_dtype == "bfloat16"
    assert ServeConfig.load(path, env={"SPECOPS_SERVE_DRAFT_DTYPE": "auto"}).engine.draft_dtype == "auto"


@pytest.mark.parametrize(
    "source, field",
    [
        ({"env": {"SPECOPS_SERVE_PORT": "not-a-port"}}, "port"),
        ({"env": {"SPECOPS_SERVE_PORT": "70000"}}, "port"),
        ({"overrides": {"max_concurrency": 0}}, "max_concurrency"),
        ({"overrides": {"default_method": "magic"}}, "default_method"),
        ({"overrides": {"router": "sometimes"}}, "router"),
        ({"overrides": {"max_body_bytes": 10}}, "max_body_bytes"),
        ({"env": {"SPECOPS_API_KEYS": "short"}}, "api_keys must be at least 8 characters"),
        ({"overrides": {"default_max_tokens": 100, "max_tokens_limit": 50}}, "default_max_tokens (100) is above"),
        ({"env": {"SPECOPS_SERVE_DRAFT_DTYPE": "int8"}}, "draft_dtype"),
        ({"overrides": {"draft_dtype": "float16"}}, "float16 needs a GPU"),
        ({"toml": "prot = 8000\n"}, "prot"),
        ({"toml": "port = \n"}, "cannot read serve config"),
    ],
)
def test_invalid_config_names_the_field(tmp_path, source, field):
    path = None
    if "toml" in source:
        path = tmp_path / "serve.toml"
        path.write_text(source["toml"])
    with pytest.raises(ModelConfigError) as exc:
        ServeConfig.load(path, env=source.get("env", {}), overrides=source.get("overrides"))
    assert field in str(exc.value)


def test_serve_help_shows_every_setting():
    env = {**os.environ, "COLUMNS": "100000"}  # one line per option: no wrapping inside a description
    specops = Path(sys.executable).with_name("specops")  # the console script next to this interpreter
    out = subprocess.run(
        [str(specops), "serve", "--help"], check=False, capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: specops serve"), out.stderr
    text = " ".join(out.stdout.split())
    for name, info in ServeKeys.model_fields.items():
        assert "--" + name.replace("_", "-") in text, name
        assert " ".join(info.description.split()) in text, name


# ---------------------------------------------------------------- logging to the stream
def test_served_requests_are_logged_to_the_stream(tiny_models, tmp_path):
    url = f"local://{tmp_path}/streams"
    responses = {}
    with running(serve_config(tiny_models, stream=url, clusters="code,prose"), tmp_path) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        plan = [("code", "draft"), ("prose", "draft"), ("code", "pld"), (None, "draft")]
        for i, (cluster, method) in enumerate(plan):
            extra = {"speculation": {"method": method}} | ({"cluster": cluster} if cluster else {})
            r = client.completions.create(
                model=MODEL, prompt=f"request number {i}", max_tokens=10, temperature=1, seed=i, extra_body=extra
            )
            responses[r.id.removeprefix("cmpl-")] = (r, i)
        assert srv.state.logger.flush(20)
    cfg = StreamConfig(url=url)
    with open_stream(cfg) as s:
        misses = {m.request_id: m for m in (codec.decode(x.value) for x in s.read(cfg.topics.misses))}
        gens = {g.request_id: g for g in (codec.decode(x.value) for x in s.read(cfg.topics.generations))}
    assert set(misses) == set(gens) == set(responses)
    for rid, (r, seed) in responses.items():
        sp, miss, gen = r.model_extra["speculation"], misses[rid], gens[rid]
        assert isinstance(miss, MissRecord) and isinstance(gen, GenerationRecord)
        assert miss.cluster == gen.cluster == sp["cluster"]
        assert miss.method == gen.method == sp["method"]
        assert miss.draft_version == gen.draft_version == "base"
        if sp["method"] == "draft":
            assert sp["draft_version"] == "base" and gen.draft_model == sp["draft_model"] == f"draft-{sp['cluster']}"
        assert (miss.num_drafted, miss.num_accepted) == (sp["drafted"], sp["accepted"])
        assert (miss.sampling.temperature, miss.sampling.seed, miss.sampling.max_new_tokens) == (1.0, seed, 10)
        assert len(gen.prompt_ids) == r.usage.prompt_tokens and len(gen.output_ids) == r.usage.completion_tokens
        assert srv.state.pair.tokenizer.decode(gen.output_ids.tolist(), skip_special_tokens=True) == r.choices[0].text
    assert sorted(g.cluster for g in gens.values()) == ["code", "code", "default", "prose"]

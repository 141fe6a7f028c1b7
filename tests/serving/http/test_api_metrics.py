"""What one served request adds to ``/metrics`` (vLLM's latency histograms under our prefix, prompt
tokens, rejected steps) and the access-log line it writes, streamed and not."""

from __future__ import annotations

import json
import logging

import pytest
import requests

from specops.logs import JsonFormatter
from tests.serving.http.api_support import MODEL, metric, running, serve_config

KEY = "sk-metrics-test-0001"
CLUSTER = "latency-probe"
HEADERS = {"Authorization": f"Bearer {KEY}"}
HISTOGRAMS = (
    "specops_time_to_first_token_seconds",
    "specops_inter_token_latency_seconds",
    "specops_e2e_request_latency_seconds",
)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    cfg = serve_config(
        tiny_models, api_keys=[f"metrics-team:{KEY}"], route_tenants=["metrics-team"], clusters=[CLUSTER]
    )
    with running(cfg, tmp_path_factory.mktemp("metrics")) as srv:
        yield srv


def scrape(server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", headers=HEADERS).text
    labels = {"cluster": CLUSTER, "method": "target"}
    out = {f"{h}_{s}": metric(text, f"{h}_{s}", **labels) for h in HISTOGRAMS for s in ("count", "sum")}
    out["prompt"] = metric(text, "specops_prompt_tokens_total", cluster=CLUSTER)
    out["generated"] = metric(text, "specops_generated_tokens_total", cluster=CLUSTER)
    out["rejected_draft"] = metric(
        text, "specops_rejected_steps_total", cluster=CLUSTER, method="draft", version="base"
    )
    out["drafted_draft"] = metric(text, "specops_drafted_tokens_total", cluster=CLUSTER, method="draft", version="base")
    return out


def body(method: str, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "temperature": 0,
        "cluster": CLUSTER,
        "speculation": {"method": method},
        **extra,
    }


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def test_a_request_counts_its_prompt_tokens_and_latencies(server):
    """Target-only decoding emits one token per step: the decode's steps time a non-streamed request."""
    before = scrape(server)
    r = requests.post(server.url + "/v1/completions", json=body("target"), headers=HEADERS)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    d = delta(scrape(server), before)
    assert d["prompt"] == usage["prompt_tokens"] > 0 and d["generated"] == usage["completion_tokens"] == 12
    assert d["specops_time_to_first_token_seconds_count"] == 1
    assert d["specops_e2e_request_latency_seconds_count"] == 1
    assert d["specops_inter_token_latency_seconds_count"] == 11, "one gap between successive steps' tokens"
    ttft, e2e = d["specops_time_to_first_token_seconds_sum"], d["specops_e2e_request_latency_seconds_sum"]
    assert 0 < ttft < e2e and d["specops_inter_token_latency_seconds_sum"] < e2e


def test_a_stream_times_its_chunks(server):
    before = scrape(server)
    r = requests.post(server.url + "/v1/completions", json=body("target", stream=True), headers=HEADERS, stream=True)
    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    with_text = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(with_text) >= 2
    d = delta(scrape(server), before)
    assert d["specops_time_to_first_token_seconds_count"] == 1
    assert d["specops_inter_token_latency_seconds_count"] == len(with_text) - 1, "one gap between chunks"
    assert d["specops_e2e_request_latency_seconds_count"] == 1
    assert 0 < d["specops_time_to_first_token_seconds_sum"] < d["specops_e2e_request_latency_seconds_sum"]
    assert d["generated"] == 12 and d["prompt"] > 0


def test_rejected_steps_count_what_the_response_reports(server):
    before = scrape(server)
    r = requests.post(server.url + "/v1/completions", json=body("draft", temperature=1.0, seed=3), headers=HEADERS)
    assert r.status_code == 200, r.text
    s = r.json()["speculation"]
    d = delta(scrape(server), before)
    assert d["drafted_draft"] == s["drafted"] > 0
    assert d["rejected_draft"] == s["rejected_steps"]


def test_every_request_writes_one_access_log_line_without_the_key(server, caplog):
    with caplog.at_level(logging.INFO, logger="specops.access"):
        ok = requests.post(server.url + "/v1/completions", json=body("target"), headers=HEADERS)
        refused = requests.post(server.url + "/v1/completions", json=body("target"))  # no key: 401
        requests.get(server.url + "/readyz")  # a probe: DEBUG, not in the INFO log
    lines = [r for r in caplog.records if r.name == "specops.access"]
    assert [(r.status, r.path) for r in lines] == [(200, "/v1/completions"), (401, "/v1/completions")]
    line = lines[0]
    assert line.levelno == logging.INFO and line.http_method == "POST"
    assert line.request_id == ok.headers["X-Request-Id"] and line.tenant == "metrics-team"
    assert line.bytes == len(ok.content) and 0 < line.duration_s < 60
    assert lines[1].tenant == "-" and lines[1].bytes == len(refused.content)
    for record in lines:
        assert KEY not in record.getMessage() and KEY not in json.dumps(vars(record), default=str)
    parsed = json.loads(JsonFormatter().format(line))  # `specops --log-format json`: the fields are keys
    assert (parsed["logger"], parsed["level"], parsed["status"], parsed["tenant"]) == (
        "specops.access",
        "INFO",
        200,
        "metrics-team",
    )
    assert parsed["request_id"] == ok.headers["X-Request-Id"] and parsed["time"][10] == "T"

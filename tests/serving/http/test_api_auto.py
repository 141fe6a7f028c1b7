"""``auto`` through the HTTP API: the target's output, the response's ``speculation.auto``
block (the methods it used, the decision and its estimates), ``/v1/policy``, the metrics, and
references accepted for it."""

from __future__ import annotations

import requests

from tests.serving.http.api_support import MODEL, metric, running, serve_config


def _post(srv, **body):
    return requests.post(f"{srv.url}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)


def test_auto_through_the_api(tiny_models, tmp_path):
    cfg = serve_config(tiny_models, max_k=12, auto_calibrate=True)
    with running(cfg, tmp_path / "srv") as srv:
        prompt = "the quick brown fox jumps over the lazy dog and then"
        target = _post(srv, prompt=prompt, max_tokens=24, speculation={"method": "target"})
        assert target.status_code == 200, target.text
        answer = target.json()["choices"][0]["text"]
        # the counters are process-wide: another test in this worker may have counted auto steps
        # in cluster "default" before, so read them as a delta around this request
        before = requests.get(f"{srv.url}/metrics", timeout=30).text
        r = _post(srv, prompt=prompt, max_tokens=24, references=[answer], speculation={"method": "auto"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == answer
        spec = body["speculation"]
        assert spec["method"] == "auto" and spec["k"] == 12  # auto's default 16, cut to max_k
        auto = spec["auto"]
        assert auto["chosen"] in auto["methods"] and set(auto["methods"]) <= {"target", "draft", "llma", "dresd"}
        assert sum(m["steps"] for m in auto["methods"].values()) >= 1
        assert auto["last"]["method"] in auto["last"]["estimates"] and "target" in auto["last"]["estimates"]
        assert auto["last"]["tokens_per_s"] > 0
        # the tiny pair's draft is the target's twin and the reference is the answer: whatever auto
        # picks, its drafts are accepted and the target runs fewer passes than target-only
        assert sum(m["accepted"] for m in auto["methods"].values()) == spec["accepted"] > 0, auto
        assert spec["target_forwards"] < target.json()["speculation"]["target_forwards"]

        pol = requests.get(f"{srv.url}/v1/policy", timeout=30).json()
        state = pol["clusters"]["default"]
        assert sum(state["decisions"].values()) >= 1 and state["last"]["method"]
        assert pol["verify_ms"]["1"]["observations"] >= 1 and pol["in_flight"] == 0

        text = requests.get(f"{srv.url}/metrics", timeout=30).text
        steps = sum(
            metric(text, "specops_auto_steps_total", cluster="default", method=m)
            - metric(before, "specops_auto_steps_total", cluster="default", method=m)
            for m in auto["methods"]
        )
        assert steps == sum(m["steps"] for m in auto["methods"].values())
        assert metric(text, "specops_auto_estimate_tokens_per_second", cluster="default", method="target") > 0
        a_s = metric(text, "specops_auto_verify_seconds", load="1", coef="a")
        assert 0 < a_s < 10, "seconds, not milliseconds"

        # a sampled auto request and a chat request work too
        s = _post(srv, prompt=prompt, max_tokens=8, temperature=1.0, seed=3, speculation={"method": "auto"})
        assert s.status_code == 200 and s.json()["usage"]["completion_tokens"] == 8

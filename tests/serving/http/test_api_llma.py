"""LLMA through the HTTP API: `references` on completions, earlier chat turns as references,
the same output as target-only, and the limits and errors naming their field."""

from __future__ import annotations

import requests

from tests.serving.http.api_support import MODEL, assert_error, metric, running, serve_config


def _post(srv, path="/v1/completions", **body):
    return requests.post(f"{srv.url}{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=120)


def test_references_are_copied_and_the_output_is_the_targets(tiny_models, tmp_path):
    cfg = serve_config(tiny_models, max_references=3, max_reference_tokens=400, max_k=12)
    with running(cfg, tmp_path / "srv") as srv:
        prompt = "the quick brown fox jumps over the lazy dog and then"
        capped = _post(srv, prompt=prompt, max_tokens=4, speculation={"method": "llma"})
        assert capped.status_code == 200 and capped.json()["speculation"]["k"] == 12  # llma's default 16, cut to max_k
        target = _post(srv, prompt=prompt, max_tokens=24, speculation={"method": "target"})
        assert target.status_code == 200, target.text
        answer = target.json()["choices"][0]["text"]
        # The target's own answer as a reference (cache-assisted generation): copies are accepted.
        r = _post(
            srv,
            prompt=prompt,
            max_tokens=24,
            references=[answer, "an unrelated text"],
            speculation={"method": "llma", "k": 8, "n": 1},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == answer
        spec = body["speculation"]
        assert spec["method"] == "llma" and spec["accepted"] > 0
        assert spec["target_forwards"] < target.json()["speculation"]["target_forwards"]
        assert spec["llma"]["hits"] > 0 and spec["llma"]["hits_request"] + spec["llma"]["hits_sessions"] > 0
        assert spec["llma"]["reference_tokens"] > 0
        text = requests.get(f"{srv.url}/metrics", timeout=30).text
        assert (
            metric(text, "specops_llma_hits_total", cluster="default", source="request")
            + metric(text, "specops_llma_hits_total", cluster="default", source="sessions")
            > 0
        )
        assert metric(text, "specops_llma_session_cache_outputs", cluster="default") >= 2
        # Chat: the earlier turns are references too.
        msgs = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "say it again"},
        ]
        chat = _post(srv, "/v1/chat/completions", messages=msgs, max_tokens=16, speculation={"method": "llma"})
        plain = _post(srv, "/v1/chat/completions", messages=msgs, max_tokens=16, speculation={"method": "target"})
        assert chat.status_code == plain.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]

        # Errors name the field.
        assert_error(
            _post(srv, prompt="x", references=["a"], speculation={"method": "draft"}),
            400,
            "invalid_request",
            "references",
        )
        assert_error(
            _post(srv, prompt="x", references=["a", "b", "c", "d"], speculation={"method": "llma"}),
            413,
            "request_too_large",
            "references",
        )
        assert_error(
            _post(srv, prompt="x", references=["word " * 500], speculation={"method": "llma"}),
            413,
            "request_too_large",
            "references",
        )
        assert_error(
            _post(srv, prompt="x", references=["ok", ""], speculation={"method": "llma"}),
            400,
            "invalid_request",
            "references[1]",
        )
        assert_error(
            _post(srv, prompt="x", references="one text", speculation={"method": "llma"}),
            400,
            "invalid_request",
            "references",
        )
        assert_error(
            _post(srv, prompt="x", speculation={"method": "pld", "n": 2}), 400, "invalid_request", "speculation.n"
        )
        assert_error(
            _post(srv, prompt="x", speculation={"method": "llma", "n": 0}), 400, "invalid_request", "speculation.n"
        )

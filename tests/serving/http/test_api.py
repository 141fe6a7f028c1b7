"""The OpenAI-compatible HTTP API through the official ``openai`` client and raw HTTP.

One real uvicorn server over the tiny bootstrapped models (a real tokenizer) serves the
whole module: completions and chat, streamed and not, lossless speculation at
temperature 0, seeded sampling, stop sequences, every 4xx with its OpenAI error shape,
and the Prometheus metrics.
"""

from __future__ import annotations

import gc
import json
import random
import shutil
import time
from pathlib import Path

import openai
import pytest
import requests
import torch

from specops.core.models import load_model
from specops.serving.proposers.catalogue import DEFAULT_K
from tests.serving.http.api_support import MODEL, assert_error, metric, running, serve_config, wait_until

MAX_PROMPT_TOKENS = 64
MAX_BODY_BYTES = 4096
TEXT_PROMPTS = ["def foo(x):", "The quick brown fox jumps over", "import numpy as np\n\nclass Model:"]
ID_PROMPTS = [[random.Random(s).randrange(1, 512) for _ in range(6 + 3 * s)] for s in range(3)]


@pytest.fixture(scope="module")
def noisy_draft(tiny_models, tmp_path_factory) -> Path:
    """The tiny draft with noise on its output head: it agrees with the target on some prompts only
    (the plain tiny pair agrees everywhere at temperature 0, which would not exercise rejections)."""
    out = tmp_path_factory.mktemp("noisy") / "draft"
    shutil.copytree(tiny_models / "draft", out)
    model = load_model(out)
    w = model.model.embed_tokens.weight.detach().clone()
    model.config.tie_word_embeddings = False
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.std()
    model.lm_head.weight = torch.nn.Parameter(w + noise)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def server(tiny_models, noisy_draft, tmp_path_factory):
    cfg = serve_config(
        tiny_models,
        draft=str(noisy_draft),
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_body_bytes=MAX_BODY_BYTES,
        clusters=["x", "metrics-probe"],
    )
    with running(cfg, tmp_path_factory.mktemp("api")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(server):
    return server.state.pair.tokenizer


def spec(resp) -> dict:
    return resp.model_extra["speculation"]


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


def stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


# ---------------------------------------------------------------- the openai client
def test_completion_usage_and_speculation_block(client, tok):
    r = complete(client, TEXT_PROMPTS[0], max_tokens=20, extra_body={"speculation": {"method": "draft"}})
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    n_prompt = len(tok(TEXT_PROMPTS[0], add_special_tokens=False)["input_ids"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 20, n_prompt + 20)
    s = spec(r)
    assert (s["method"], s["k"], s["draft_model"], s["draft_version"]) == (
        "draft",
        DEFAULT_K["draft"],
        "draft-default",
        "base",
    )
    assert (s["cluster"], s["cluster_source"], s["router_version"]) == ("default", "default", None)
    assert 0 <= s["accepted"] <= s["drafted"] and s["drafted"] > 0
    assert s["acceptance_rate"] == round(s["accepted"] / s["drafted"], 4)
    assert 1 <= s["target_forwards"] <= 20
    assert s["tokens_per_target_forward"] == round(20 / s["target_forwards"], 4)


def test_a_request_that_names_no_method_is_decoded_by_auto(client):
    """``auto`` is the default: each step's drafter chosen by measured speed, the output the target's."""
    r = complete(client, TEXT_PROMPTS[0], max_tokens=12)
    s = spec(r)
    assert s["method"] == "auto" and sum(m["steps"] for m in s["auto"]["methods"].values()) >= 1
    target = complete(client, TEXT_PROMPTS[0], max_tokens=12, extra_body={"speculation": {"method": "target"}})
    assert r.choices[0].text == target.choices[0].text


def test_streamed_completion_equals_the_non_streamed_one(client):
    draft = {"speculation": {"method": "draft"}}
    for prompt in (TEXT_PROMPTS[1], ID_PROMPTS[1]):
        whole = complete(client, prompt, max_tokens=24, extra_body=draft)
        text, chunks = stream_text(
            complete(
                client, prompt, max_tokens=24, stream=True, stream_options={"include_usage": True}, extra_body=draft
            )
        )
        assert text == whole.choices[0].text
        assert len(chunks) >= 3 and all(c.id == chunks[0].id for c in chunks)
        *body, last_choice, usage = chunks
        assert [c.choices[0].finish_reason for c in body] == [None] * len(body)
        assert last_choice.choices[0].finish_reason == "length"
        s = last_choice.model_extra["speculation"]
        assert (s["method"], s["draft_version"]) == ("draft", "base") and s["accepted"] <= s["drafted"]
        assert usage.choices == [] and usage.usage.model_dump(exclude_none=True) == whole.usage.model_dump(
            exclude_none=True
        )
    # without include_usage no chunk carries usage
    _, chunks = stream_text(complete(client, TEXT_PROMPTS[1], max_tokens=8, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_streamed_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"speculation": {"method": "pld", "k": 5}},
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    s = spec(r)
    assert (s["method"], s["k"], s["draft_model"], s["draft_version"]) == ("pld", 5, None, None)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculation": {"method": "pld", "k": 5}},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].model_extra["speculation"]["method"] == "pld"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # max_completion_tokens is the chat name of max_tokens
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, temperature=0)
    assert r2.usage.completion_tokens == 5


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_retrieve_gives_the_served_model_and_404_for_another(client):
    """``client.models.retrieve`` (GET /v1/models/{id}), as OpenAI clients call it."""
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "specops")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    assert err.value.body["param"] == "model" and MODEL in err.value.body["message"]


# ---------------------------------------------------------------- lossless, seeds, stops
def test_greedy_speculation_is_lossless_through_the_api(client):
    rejected_somewhere = False
    for prompt in TEXT_PROMPTS + ID_PROMPTS:
        ref = complete(client, prompt, max_tokens=24, extra_body={"speculation": {"method": "target"}})
        assert spec(ref)["drafted"] == 0 and spec(ref)["target_forwards"] == ref.usage.completion_tokens
        for method, k in (("draft", 3), ("draft", 8), ("pld", None)):
            sp = {"method": method} | ({"k": k} if k else {})
            r = complete(client, prompt, max_tokens=24, extra_body={"speculation": sp})
            assert r.choices[0].text == ref.choices[0].text, (prompt, method, k)
            assert r.usage.model_dump() == ref.usage.model_dump()
            s = spec(r)
            assert s["method"] == method and (k is None or s["k"] == k)
            rejected_somewhere |= s["accepted"] < s["drafted"]
    assert rejected_somewhere, "some drafts should be rejected, or losslessness is not exercised"


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(client, tok):
    """vLLM's extension: clients (and the engines benchmark) compare outputs by ids, not text."""
    prompt = TEXT_PROMPTS[0]
    r = complete(client, prompt, max_tokens=8, extra_body={"return_token_ids": True})
    choice = r.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert len(choice["token_ids"]) == r.usage.completion_tokens
    assert tok.decode(choice["token_ids"], skip_special_tokens=True) == r.choices[0].text
    plain = complete(client, prompt, max_tokens=8).model_dump()["choices"][0]
    assert "token_ids" not in plain  # only when asked for
    chunks = list(complete(client, prompt, max_tokens=8, stream=True, extra_body={"return_token_ids": True}))
    last = chunks[-1].model_dump()["choices"][0]
    assert last["token_ids"] == choice["token_ids"] and last["prompt_token_ids"] == choice["prompt_token_ids"]


def test_cluster_field_is_reflected(client):
    r = complete(client, TEXT_PROMPTS[0], max_tokens=4, extra_body={"cluster": "x", "speculation": {"method": "draft"}})
    s = spec(r)
    assert (s["cluster"], s["cluster_source"]) == ("x", "request")
    assert (s["draft_model"], s["draft_version"]) == ("draft-x", "base")


def test_seeded_sampling_is_reproducible(client):
    def sample(seed, **kw):
        return complete(client, TEXT_PROMPTS[2], max_tokens=16, temperature=1, seed=seed, **kw).choices[0].text

    # a seed reproduces a sample under a named method (auto, the default, picks its drafter by
    # measured speed: an exact sample, not a reproducible one; docs/api.md says so)
    draft = {"speculation": {"method": "draft"}}
    a = sample(7, extra_body=draft)
    assert a == sample(7, extra_body=draft)
    assert sample(8, extra_body=draft) != a and sample(9, extra_body=draft) != a  # a collision would be a bug
    text, _ = stream_text(
        complete(client, TEXT_PROMPTS[2], max_tokens=16, temperature=1, seed=7, stream=True, extra_body=draft)
    )
    assert text == a


def _stop_for(text: str) -> str | None:
    """A character of ``text`` that first appears after position 0 (the stop then cuts there)."""
    for i in range(1, len(text)):
        if text[i] not in text[:i] and text[i] not in "\ufffd":
            return text[i]
    return None


def test_stop_sequences_cut_the_text(client):
    cases = [(p, complete(client, p, max_tokens=24).choices[0].text) for p in TEXT_PROMPTS + ID_PROMPTS]
    cases = [(p, full, stop) for p, full in cases if (stop := _stop_for(full))]
    assert len(cases) >= 2
    for prompt, full, stop in cases:
        expect = full[: full.index(stop)]
        r = complete(client, prompt, max_tokens=24, stop=stop)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expect, "stop")
        assert r.usage.completion_tokens < 24
        text, chunks = stream_text(complete(client, prompt, max_tokens=24, stop=[stop, "never-appears"], stream=True))
        assert text == expect and chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never occurs changes nothing
    prompt, full, _ = cases[0]
    r = complete(client, prompt, max_tokens=24, stop=["\x00\x01"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full, "length")


# ---------------------------------------------------------------- 4xx, OpenAI-shaped
@pytest.mark.parametrize(
    "kw, code, param",
    [
        ({"max_tokens": 100_000}, "invalid_request", "max_tokens"),
        ({"temperature": 5}, "invalid_request", "temperature"),
        ({"top_p": 0}, "invalid_request", "top_p"),
        ({"n": 17}, "invalid_request", "n"),
        ({"logprobs": 21}, "invalid_request", "logprobs"),
        ({"extra_body": {"foo": 1}}, "invalid_request", "foo"),
        ({"extra_body": {"speculation": {"k": 17}}}, "invalid_request", "speculation.k"),
        ({"extra_body": {"speculation": {"k": 0}}}, "invalid_request", "speculation.k"),
        ({"extra_body": {"speculation": {"method": "magic"}}}, "invalid_request", "speculation.method"),
        ({"extra_body": {"cluster": "a/b"}}, "invalid_request", "cluster"),
        ({"extra_body": {"cluster": "two words"}}, "invalid_request", "cluster"),
        ({"prompt": ""}, "invalid_request", "prompt"),
        ({"prompt": []}, "invalid_request", "prompt"),
        ({"prompt": [5, 512]}, "invalid_request", "prompt"),
        ({"prompt": [-1]}, "invalid_request", "prompt"),
        ({"prompt": list(range(1, MAX_PROMPT_TOKENS + 2))}, "prompt_too_long", "prompt"),
        ({"prompt": "word " * 200}, "prompt_too_long", "prompt"),
        ({"model": "gpt-4"}, "model_not_found", "model"),
    ],
)
def test_bad_requests_get_precise_errors(client, kw, code, param):
    kw = {"model": MODEL, "prompt": "hello", "max_tokens": 4} | kw
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(**kw)
    status = {"prompt_too_long": 413, "model_not_found": 404}.get(code, 400)
    e = exc.value
    assert e.status_code == status and (e.code, e.param) == (code, param), e.body
    assert set(e.body) == {"message", "type", "param", "code"}
    assert e.body["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if "foo" in kw.get("extra_body", {}):
        assert e.body["message"] == "unrecognized request argument: foo"
    if code == "prompt_too_long":
        assert f"the limit is {MAX_PROMPT_TOKENS}" in e.body["message"]


def test_raw_http_errors(server):
    url = server.url
    c = url + "/v1/completions"
    assert_error(requests.post(c, data='{"model": "specops", "prompt":'), 400, "invalid_request", "prompt")
    assert_error(requests.post(c, data="[1, 2]"), 400, "invalid_request")
    assert_error(requests.post(c, json={"prompt": "x"}), 400, "invalid_request", "model")
    big = {"model": MODEL, "prompt": "x" * 2 * MAX_BODY_BYTES}
    err = assert_error(requests.post(c, json=big), 413, "request_too_large")
    assert str(MAX_BODY_BYTES) in err["message"]

    def chunked():  # no Content-Length: the limit holds while the body is read
        yield b'{"model": "specops", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    assert_error(requests.post(c, data=chunked()), 413, "request_too_large")
    err = assert_error(requests.get(url + "/v1/nothing-here"), 404, "not_found")
    assert err["type"] == "not_found_error" and "/v1/nothing-here" in err["message"]
    err = assert_error(requests.post(url + "/v1/models"), 405, "method_not_allowed")
    assert err["type"] == "invalid_request_error"
    chat = url + "/v1/chat/completions"
    assert_error(requests.post(chat, json={"model": MODEL, "messages": []}), 400, "invalid_request", "messages")
    tools = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
    assert_error(requests.post(chat, json=tools), 400, "invalid_request", "tools.0.function")
    # the server is fine afterwards
    ok = requests.post(c, json={"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------- metrics, disconnects
def test_metrics_count_what_was_served(server, client):
    before = requests.get(server.url + "/metrics").text
    r = complete(
        client,
        ID_PROMPTS[0],
        max_tokens=16,
        extra_body={"cluster": "metrics-probe", "speculation": {"method": "draft"}},
    )
    s = spec(r)
    text = requests.get(server.url + "/metrics").text
    assert metric(text, "specops_generated_tokens_total", cluster="metrics-probe") == r.usage.completion_tokens == 16
    labels = {"cluster": "metrics-probe", "method": "draft", "version": "base"}
    assert metric(text, "specops_drafted_tokens_total", **labels) == s["drafted"]
    draft_drafted = s["drafted"]
    assert metric(text, "specops_accepted_tokens_total", **labels) == s["accepted"]
    # prompt lookup is counted under its own method, with no draft version
    r = complete(
        client,
        ID_PROMPTS[0] * 3,
        max_tokens=16,
        extra_body={"cluster": "metrics-probe", "speculation": {"method": "pld"}},
    )
    s = spec(r)
    assert s["method"] == "pld" and s["draft_version"] is None and s["drafted"] > 0
    text = requests.get(server.url + "/metrics").text
    pld = {"cluster": "metrics-probe", "method": "pld", "version": "none"}
    assert metric(text, "specops_drafted_tokens_total", **pld) == s["drafted"]
    assert metric(text, "specops_accepted_tokens_total", **pld) == s["accepted"]
    assert metric(text, "specops_drafted_tokens_total", **labels) == draft_drafted  # the draft's count is its own
    ok = {"endpoint": "/v1/completions", "status": "200"}
    assert metric(text, "specops_api_requests_total", **ok) == metric(before, "specops_api_requests_total", **ok) + 2
    assert metric(text, "specops_admission_queue_depth") == 0
    assert "specops_tokens_per_second" not in text  # a rate: rate(specops_generated_tokens_total[1m])
    for name in (
        "specops_hotswap_swaps_total",
        "specops_stream_logger_dropped_total",
        "specops_admission_running",
        "specops_requests_cancelled_total",
        "specops_api_request_seconds",
    ):
        assert f"# HELP {name} " in text, name


def test_request_seconds_of_a_stream_run_to_its_last_byte(server, client):
    def seconds() -> tuple[float, float]:
        text = requests.get(server.url + "/metrics").text
        labels = {"endpoint": "/v1/completions"}
        return metric(text, "specops_api_request_seconds_count", **labels), metric(
            text, "specops_api_request_seconds_sum", **labels
        )

    count0, sum0 = seconds()
    target_only = {"speculation": {"method": "target"}}
    chunks = list(complete(client, "hello", max_tokens=400, stream=True, extra_body=target_only))
    decode_s = chunks[-1].model_extra["speculation"]["decode_s"]
    assert decode_s > 0.05, "the stream should take a while (target-only, 400 tokens)"
    assert wait_until(lambda: seconds()[0] == count0 + 1, 5)  # observed just after the last byte went out
    assert seconds()[1] - sum0 >= decode_s


def test_a_streaming_client_that_disconnects_stops_the_decode(server, caplog, monkeypatch):
    def gone() -> float:
        text = requests.get(server.url + "/metrics").text
        return metric(text, "specops_requests_cancelled_total", reason="client_gone")

    # Pace the decode (50 ms per emitted piece): a tiny model otherwise writes its whole answer into
    # the socket before a busy test thread reads the first line, and the decode is over before the
    # client goes (seen on a loaded 2-core CI run).
    run = server.state.run

    def paced_run(job):
        emit = job.on_delta
        if emit is not None:  # a streamed request; the non-streamed one at the end runs unpaced

            def paced(text, logprobs):
                time.sleep(0.05)
                emit(text, logprobs)

            job.on_delta = paced
        return run(job)

    monkeypatch.setattr(server.state, "run", paced_run)
    before = gone()
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": 1000,
        "temperature": 0,
        "stream": True,
        "speculation": {"method": "target"},
    }  # target-only decodes 1000 tokens for many seconds
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in resp.iter_lines() if line)
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["finish_reason"] is None
        assert server.state.admission.snapshot().running == 1
    assert wait_until(lambda: server.state.admission.snapshot().running == 0, 5), server.state.admission.snapshot()
    assert wait_until(lambda: gone() == before + 1, 5)
    # the decode's ClientGone is expected: nothing logs it as an unhandled error
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text
    # and the next request is served at once (ignore_eos: at the default temperature a random model may draw EOS first)
    r = requests.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": True}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_non_streaming_client_that_disconnects_stops_the_decode(server, caplog):
    """The client's socket closes mid-request (a read timeout): the decode stops, the slot comes back."""

    def gone() -> float:
        return metric(
            requests.get(server.url + "/metrics").text, "specops_requests_cancelled_total", reason="client_gone"
        )

    before = gone()
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": 1000,
        "temperature": 0,
        "speculation": {"method": "target"},
    }
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/v1/completions", json=body, timeout=(5, 0.3))
    assert wait_until(lambda: gone() == before + 1, 10), "the decode did not notice the client had gone"
    assert wait_until(lambda: server.state.admission.snapshot().running == 0, 5), server.state.admission.snapshot()
    # kafka-python's own loggers left out: a client of an earlier test in this worker may still be retrying
    # its stopped broker (ECONNREFUSED), which says nothing about this server
    errors = [r for r in caplog.records if r.levelname == "ERROR" and not r.name.startswith("kafka")]
    assert not errors, caplog.text
    r = requests.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert r.status_code == 200


def test_json_booleans_are_not_token_ids(server):
    r = requests.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [True, False], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), r.json()

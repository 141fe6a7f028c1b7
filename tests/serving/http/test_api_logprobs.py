"""``logprobs`` through the API: OpenAI's completions and chat shapes, streamed and not, the same
numbers under every method as under target-only decoding, cut with the text at a stop sequence,
``echo``, and 400s naming the field for what cannot be honoured; penalties, ``logit_bias``,
``min_tokens`` and ``ignore_eos`` giving target-only's output under every method.

One real server over the tiny bootstrapped models for the module.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.serving.http.api_support import MODEL, assert_error, running, serve_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]
ATOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models), tmp_path_factory.mktemp("logprobs")) as srv:
        yield srv


def _post(srv, path: str, **body) -> dict:
    base = {"model": MODEL, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    base |= {"messages": MESSAGES} if path == CHAT else {"prompt": "def foo(x):\n    return"}
    r = requests.post(srv.url + path, json=base | body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _events(srv, path: str, **body) -> list[dict]:
    base = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True}
    base |= {"messages": MESSAGES} if path == CHAT else {"prompt": "def foo(x):\n    return"}
    r = requests.post(srv.url + path, json=base | body, timeout=120, stream=True)
    assert r.status_code == 200, r.text
    return [json.loads(x.removeprefix(b"data: ")) for x in r.iter_lines() if x and b"[DONE]" not in x]


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and all(abs(x - y) <= ATOL for x, y in zip(a, b, strict=True)), (a, b)


@pytest.mark.parametrize("method", ["draft", "pld", "llma", "auto"])
def test_completions_logprobs_equal_target_only_under_every_method(server, method):
    ref = _post(server, COMPLETIONS, logprobs=3, speculation={"method": "target"})["choices"][0]
    extra = {"references": ["def foo(x):\n    return x + 1\n"]} if method == "llma" else {}
    got = _post(server, COMPLETIONS, logprobs=3, speculation={"method": method}, **extra)["choices"][0]
    assert got["token_ids"] == ref["token_ids"] and got["text"] == ref["text"]
    lp, want = got["logprobs"], ref["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == want["tokens"] and len(lp["tokens"]) == len(got["token_ids"])
    _close(lp["token_logprobs"], want["token_logprobs"])
    for mine, theirs in zip(lp["top_logprobs"], want["top_logprobs"], strict=True):
        assert len(mine) <= 3 and mine.keys() == theirs.keys()  # (two ids decoding alike share a key)
        _close([mine[t] for t in mine], [theirs[t] for t in mine])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(v <= 0.0 for v in lp["token_logprobs"])
    for token, top, v in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert max(top.values()) == pytest.approx(v, abs=ATOL) and token in top  # greedy: the top token


def test_logprobs_zero_gives_the_chosen_tokens_alone(server):
    lp = _post(server, COMPLETIONS, logprobs=0)["choices"][0]["logprobs"]
    assert lp["top_logprobs"] is None and len(lp["token_logprobs"]) == len(lp["tokens"]) > 0


def test_chat_logprobs_shape(server):
    choice = _post(server, CHAT, logprobs=True, top_logprobs=2)["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None and len(content) == len(choice["token_ids"])
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode("utf-8")) and item["logprob"] <= 0.0
        assert len(item["top_logprobs"]) == 2 and all(
            set(t) == {"token", "logprob", "bytes"} for t in item["top_logprobs"]
        )
    bare = _post(server, CHAT, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [x["top_logprobs"] for x in bare] == [[]] * len(bare)
    assert _post(server, CHAT)["choices"][0]["logprobs"] is None  # not asked: null, as before


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_streamed_logprobs_add_up_to_the_response(server, path):
    ask = {"logprobs": 2} if path == COMPLETIONS else {"logprobs": True, "top_logprobs": 2}
    whole = _post(server, path, **ask)["choices"][0]["logprobs"]
    parts = [e["choices"][0]["logprobs"] for e in _events(server, path, **ask) if e["choices"]]
    parts = [p for p in parts if p is not None]
    if path == COMPLETIONS:
        for key in ("tokens", "text_offset"):
            assert [x for p in parts for x in p[key]] == whole[key]
        _close([x for p in parts for x in p["token_logprobs"]], whole["token_logprobs"])
        tops = [x for p in parts for x in p["top_logprobs"]]  # another run: batched with others, float-close
        assert [t.keys() for t in tops] == [t.keys() for t in whole["top_logprobs"]]
        _close([v for t in tops for v in t.values()], [v for t in whole["top_logprobs"] for v in t.values()])
    else:
        assert [x["token"] for p in parts for x in p["content"]] == [x["token"] for x in whole["content"]]
        _close([x["logprob"] for p in parts for x in p["content"]], [x["logprob"] for x in whole["content"]])


def test_a_stop_sequence_cuts_the_logprobs_with_the_text(server):
    free = _post(server, COMPLETIONS, logprobs=1, max_tokens=16)["choices"][0]
    text, tokens = free["text"], free["logprobs"]["tokens"]
    assert len(tokens) >= 4
    stop = "".join(tokens[2:4]).strip() or tokens[3]  # a stop sequence that starts inside the output
    at = text.find(stop)
    assert at >= 0
    cut = _post(server, COMPLETIONS, logprobs=1, max_tokens=16, stop=[stop])["choices"][0]
    assert cut["text"] == text[:at]
    n = len(cut["logprobs"]["tokens"])
    assert len("".join(tokens[: n - 1])) < max(at, 1) <= len("".join(tokens[:n])) or (at == 0 and n == 0)
    assert cut["logprobs"]["tokens"] == tokens[:n]
    streamed = [
        e["choices"][0]["logprobs"] for e in _events(server, COMPLETIONS, logprobs=1, max_tokens=16, stop=[stop])
    ]
    assert [t for p in streamed if p for t in p["tokens"]] == tokens[:n]


@pytest.mark.parametrize(
    "path, body, code, param",
    [
        (CHAT, {"top_logprobs": 3}, "unsupported_parameter", "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "invalid_request", "top_logprobs"),
        (COMPLETIONS, {"logprobs": 21}, "invalid_request", "logprobs"),
        (COMPLETIONS, {"logprobs": -1}, "invalid_request", "logprobs"),
        (COMPLETIONS, {"logprobs_mode": "processed_logprobs"}, "unsupported_parameter", "logprobs_mode"),
        (COMPLETIONS, {"logprobs": 1, "logprobs_mode": "raw_logits"}, "invalid_request", "logprobs_mode"),
        (COMPLETIONS, {"logprobs": 1, "retrieval": {"kb": "docs", "mode": "ralmspec"}}, "invalid_request", "logprobs"),
        (
            COMPLETIONS,
            {"frequency_penalty": 1.0, "retrieval": {"kb": "docs", "mode": "ralmseq"}},
            "invalid_request",
            "frequency_penalty",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, path, body, code, param):
    base = {"model": MODEL, "max_tokens": 2}
    base |= {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    assert_error(requests.post(server.url + path, json=base | body, timeout=60), 400, code, param)


def test_processed_logprobs_of_a_sampled_request(server):
    """Top-k 3: the sampled tokens' processed log-probabilities are of the 3 kept tokens, which
    sum to 1; the raw ones of the same request are lower (the vocabulary's mass is spread)."""
    ask = dict(logprobs=3, temperature=0.7, top_k=3, seed=5, max_tokens=8, speculation={"method": "draft"})
    processed = _post(server, COMPLETIONS, logprobs_mode="processed_logprobs", **ask)["choices"][0]
    raw = _post(server, COMPLETIONS, **ask)["choices"][0]
    assert processed["token_ids"] == raw["token_ids"]  # the same seed and a named method: the same draws
    for top in processed["logprobs"]["top_logprobs"]:
        assert sum(2.718281828**v for v in top.values()) == pytest.approx(1.0, abs=1e-3) or len(top) < 3
    assert all(
        p >= r - ATOL for p, r in zip(processed["logprobs"]["token_logprobs"], raw["logprobs"]["token_logprobs"])
    )


def test_the_openai_client_reads_them(server):
    """docs/api.md's example, through the official client: its typed objects parse our shapes."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    c = client.completions.create(model=MODEL, prompt="def foo(x):", max_tokens=8, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        t.token for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content
    ]
    assert streamed == [t.token for t in content]


def test_echo_puts_the_prompt_first_and_scores_it(server):
    prompt = "def foo(x):\n    return"
    plain = _post(server, COMPLETIONS, logprobs=1)["choices"][0]
    echoed = _post(server, COMPLETIONS, logprobs=1, echo=True)["choices"][0]
    assert echoed["text"] == prompt + plain["text"]
    lp, n_prompt = echoed["logprobs"], len(echoed["prompt_token_ids"])
    assert len(lp["tokens"]) == n_prompt + len(plain["logprobs"]["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    assert all(v <= 0.0 for v in lp["token_logprobs"][1:])
    assert lp["tokens"][n_prompt:] == plain["logprobs"]["tokens"]
    _close(lp["token_logprobs"][n_prompt:], plain["logprobs"]["token_logprobs"])
    assert lp["text_offset"][n_prompt] == len("".join(lp["tokens"][:n_prompt]))
    # scoring a prompt: echo with max_tokens 0 generates nothing
    scored = requests.post(
        server.url + COMPLETIONS,
        json={"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0},
        timeout=60,
    ).json()
    choice = scored["choices"][0]
    assert choice["text"] == prompt and scored["usage"]["completion_tokens"] == 0
    assert choice["finish_reason"] == "length" and choice["logprobs"]["top_logprobs"] is None
    _close(choice["logprobs"]["token_logprobs"][1:], lp["token_logprobs"][1:n_prompt])
    # the same, streamed: the prompt comes first, with its log-probabilities
    events = _events(server, COMPLETIONS, logprobs=1, echo=True)
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert texts[0] == prompt and "".join(texts) == echoed["text"]
    streamed = [
        t for e in events if e["choices"] and e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]
    ]
    assert streamed == lp["tokens"]
    # echo alone (no logprobs): the text only
    assert _post(server, COMPLETIONS, echo=True)["choices"][0]["text"] == prompt + plain["text"]


def test_max_tokens_zero_is_only_for_scoring(server):
    r = requests.post(server.url + COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 0}, timeout=60)
    assert_error(r, 400, "unsupported_parameter", "max_tokens")


@pytest.mark.parametrize("method", ["draft", "pld", "llma", "auto"])
def test_penalties_give_target_onlys_output_under_every_method(server, method):
    adjust = {
        "presence_penalty": 1.0,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.3,
        "logit_bias": {"5": 3.0},
        "min_tokens": 10,
    }
    ref = _post(server, COMPLETIONS, max_tokens=16, speculation={"method": "target"}, **adjust)["choices"][0]
    plain = _post(server, COMPLETIONS, max_tokens=16, speculation={"method": "target"})["choices"][0]
    assert ref["token_ids"] != plain["token_ids"]  # they change this output
    got = _post(server, COMPLETIONS, max_tokens=16, speculation={"method": method}, **adjust)["choices"][0]
    assert got["token_ids"] == ref["token_ids"], method
    run = _post(server, CHAT, max_tokens=16, ignore_eos=True, speculation={"method": method})
    assert run["usage"]["completion_tokens"] == 16 and run["choices"][0]["finish_reason"] == "length"

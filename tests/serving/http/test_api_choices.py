"""``n`` and ``best_of``: a request's choices decoded together, each seeded ``seed + i``, streamed
interleaved by ``index``, usage over every choice, ``best_of`` keeping the ``n`` of the highest
cumulative log-probability; 400s naming the field for what cannot be honoured.

One real server over the tiny bootstrapped models for the module, without cross-request batching
(``batch_max_size = 1``): a batched pass sums in another order, and a sampled choice compared
with the same seed decoded alone could then differ by a float's rounding at a draw.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from specops.streams.records import CHOICE_SEPARATOR
from specops.trainer.online.trainer import _holdout
from tests.serving.http.api_support import MODEL, assert_error, metric, running, serve_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "def foo(x):\n    return"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models, batch_max_size=1), tmp_path_factory.mktemp("choices")) as srv:
        yield srv


def _post(srv, path: str = COMPLETIONS, **body) -> dict:
    base = {"model": MODEL, "max_tokens": 10, "temperature": 0.9, "return_token_ids": True}
    base["speculation"] = {"method": "draft"}  # a named method: auto's choices depend on what it served before
    base |= {"messages": [{"role": "user", "content": PROMPT}]} if path == CHAT else {"prompt": PROMPT}
    r = requests.post(srv.url + path, json=base | body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("method", ["target", "draft", "llma"])
def test_n_choices_are_the_seeded_single_requests(server, method):
    body = _post(server, n=3, seed=40, speculation={"method": method})
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for i, c in enumerate(choices):  # choice i is the request seeded 40 + i
        alone = _post(server, seed=40 + i, speculation={"method": method})["choices"][0]
        assert c["token_ids"] == alone["token_ids"] and c["text"] == alone["text"], (method, i)
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # independent samples
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    sp = body["speculation"]
    assert [c["index"] for c in sp["choices"]] == [0, 1, 2]
    assert sp["drafted"] == sum(c["drafted"] for c in sp["choices"])


def test_the_choices_share_the_prompts_prefill(server):
    """Choice 0 prefills; the others load its keys and values (all of the prompt but its last token)."""
    shared = "specops_prefill_shared_tokens_total"
    before = metric(requests.get(server.url + "/metrics").text, shared)
    body = _post(server, n=3, seed=5, best_of=4)  # best_of decodes 4: three load the first's prefill
    after = metric(requests.get(server.url + "/metrics").text, shared)
    assert after - before == 3 * (body["usage"]["prompt_tokens"] - 1)


def test_greedy_choices_are_alike_and_chat_takes_n(server):
    choices = _post(server, CHAT, n=2, temperature=0)["choices"]
    assert choices[0]["message"] == choices[1]["message"] and [c["index"] for c in choices] == [0, 1]


def test_best_of_keeps_the_n_most_probable(server):
    body = _post(server, n=2, best_of=4, seed=7)
    sums = []
    for i in range(4):
        alone = _post(server, seed=7 + i, logprobs=0)["choices"][0]
        sums.append((sum(alone["logprobs"]["token_logprobs"]), alone["token_ids"]))
    best = [ids for _, ids in sorted(sums, key=lambda x: -x[0])[:2]]
    assert [c["token_ids"] for c in body["choices"]] == best
    assert all(c["logprobs"] is None for c in body["choices"])  # computed to rank, not asked for
    assert body["usage"]["completion_tokens"] == sum(len(ids) for _, ids in sums)  # every choice decoded


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_streamed_choices_interleave_by_index(server, path):
    whole = _post(server, path, n=2, seed=3)["choices"]
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0.9, "n": 2, "seed": 3, "stream": True}
    body["speculation"] = {"method": "draft"}
    body |= {"messages": [{"role": "user", "content": PROMPT}]} if path == CHAT else {"prompt": PROMPT}
    body["stream_options"] = {"include_usage": True}
    r = requests.post(server.url + path, json=body, timeout=120, stream=True)
    events = [json.loads(x.removeprefix(b"data: ")) for x in r.iter_lines() if x and b"[DONE]" not in x]
    text = {0: "", 1: ""}
    finished = set()
    for e in events:
        for c in e["choices"]:
            piece = c["delta"].get("content") if path == CHAT else c["text"]
            text[c["index"]] += piece or ""
            if c["finish_reason"]:
                finished.add(c["index"])
    assert finished == {0, 1}
    want = [c["message"]["content"] if path == CHAT else c["text"] for c in whole]
    assert [text[0], text[1]] == want
    assert events[-1]["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in whole)


def test_the_openai_client_reads_n_choices(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3, seed=1, temperature=1.0
    )
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content is not None for c in r.choices)


@pytest.mark.parametrize(
    "body, code, param",
    [
        ({"n": 17}, "invalid_request", "n"),
        ({"n": 0}, "invalid_request", "n"),
        ({"n": 3, "best_of": 2}, "unsupported_parameter", "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "unsupported_parameter", "best_of"),
        ({"n": 2, "echo": True, "max_tokens": 0}, "unsupported_parameter", "n"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, code, param):
    r = requests.post(
        server.url + COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2} | body, timeout=60
    )
    assert_error(r, 400, code, param)


def test_a_requests_choices_fall_on_one_side_of_the_held_out_split():
    key = b"k" * 32
    for i in range(50):
        rid = f"tenant/req{i}"
        sides = {_holdout(f"{rid}{CHOICE_SEPARATOR}{c}", 5, key) for c in range(1, 4)} | {_holdout(rid, 5, key)}
        assert len(sides) == 1

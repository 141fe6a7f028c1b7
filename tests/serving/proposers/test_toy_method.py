"""A decoding method added from this file alone reaches the API, ``auto`` and the metrics.

The toy method is a trivial proposer (it drafts an earlier token again, k times), its options
model with one option (``toy_back``: how far back the token it repeats is) and one
:class:`MethodSpec`, registered at run time after the server has started: no other file
names it. At temperature 0 a request with it, its option in the body, returns the target's
own output (the verifier keeps every method lossless); a bad value of its option is a 400
naming the field; its drafted tokens are counted under its method label; ``auto`` builds it
among its candidates because its spec says ``joins_auto``; unregistered, it is gone again.
"""

from __future__ import annotations

import pytest
import requests
import torch
from pydantic import Field

from specops.serving.engine.proposer import Proposer
from specops.serving.engine.types import DecodeState, Proposals
from specops.serving.plan import plain_proposer
from specops.serving.proposers import catalogue
from specops.serving.proposers.catalogue import MethodOptions, MethodSpec, ProposerResources
from tests.serving.http.api_support import MODEL, metric, running, serve_config

TOY = "toy-repeat"


class ToyOptions(MethodOptions):
    """The toy method's one request option."""

    toy_back: int = Field(1, ge=1, le=4)
    """Repeat the token this far back in the context (1: the last one)."""


class RepeatProposer(Proposer):
    """Drafts the context's token ``back`` places from its end ``k`` times (right now and then,
    on repetitive text)."""

    name = TOY

    def __init__(self, back: int = 1) -> None:
        self.back = back

    def propose(self, state: DecodeState, k: int) -> Proposals:
        if k <= 0 or len(state.token_ids) < self.back:
            return Proposals.empty()
        return Proposals(tokens=torch.full((1, k), int(state.token_ids[-self.back]), dtype=torch.long))


TOY_SPEC = MethodSpec(
    TOY,
    "drafts an earlier token again (a test's toy)",
    4,
    frozenset(),
    None,
    build=lambda options, res: RepeatProposer(options.toy_back),
    options=ToyOptions,
    joins_auto=True,
)


@pytest.fixture
def toy():
    catalogue.register(TOY_SPEC)
    try:
        yield TOY_SPEC
    finally:
        catalogue.unregister(TOY)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models), tmp_path_factory.mktemp("toy")) as srv:
        yield srv


def _post(server, method: str, prompt: str = "def foo(x):\n    return x + x + x +", **options):
    speculation = {"method": method, **options}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "speculation": speculation}
    return requests.post(server.url + "/v1/completions", json=body, timeout=60)


def _complete(server, method: str, **options) -> dict:
    r = _post(server, method, **options)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_unregistered_method_is_refused(server):
    body = {"model": MODEL, "prompt": "hi", "speculation": {"method": TOY}}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.method", r.text


def test_a_registered_method_reaches_the_api_and_the_metrics(server, toy):
    assert TOY in catalogue.METHODS and catalogue.DEFAULT_K[TOY] == 4
    target = _complete(server, "target")
    served = _complete(server, TOY)
    assert served["choices"][0]["text"] == target["choices"][0]["text"]  # lossless: greedy-identical
    spec = served["speculation"]
    assert (spec["method"], spec["k"]) == (TOY, 4)
    assert spec["drafted"] > 0 and spec["draft_model"] is None  # it has no artifact
    text = requests.get(server.url + "/metrics", timeout=10).text
    drafted = metric(text, "specops_drafted_tokens_total", cluster="default", method=TOY, version="none")
    assert drafted >= spec["drafted"] > 0
    assert metric(
        text, "specops_accepted_tokens_total", cluster="default", method=TOY, version="none"
    ) == pytest.approx(spec["accepted"])


def test_its_option_reaches_its_proposer_through_the_api(server, toy):
    target = _complete(server, "target")
    for back in (1, 2):
        served = _complete(server, TOY, toy_back=back)
        assert served["choices"][0]["text"] == target["choices"][0]["text"]  # lossless with either value
        assert served["speculation"]["method"] == TOY and served["speculation"]["drafted"] > 0
    assert plain_proposer(ProposerResources(pair=None), TOY, toy_back=3).back == 3  # the option is the proposer's


@pytest.mark.parametrize("bad", [0, 5, "2", 1.5])
def test_a_bad_option_value_is_a_400_naming_the_field(server, toy, bad):
    r = _post(server, TOY, toy_back=bad)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "speculation.toy_back", r.text


def test_its_option_is_refused_for_other_methods_and_once_unregistered(server, toy):
    r = _post(server, "pld", toy_back=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.toy_back", r.text
    assert TOY in r.json()["error"]["message"]  # it names the method that owns the option
    catalogue.unregister(TOY)
    try:
        assert TOY not in catalogue.METHODS
        r = _post(server, "draft", toy_back=2)  # no method owns it now: an unknown field
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculation.toy_back", r.text
        from specops.serving.http.schema import Speculation

        assert "toy_back" not in Speculation.model_json_schema()["properties"]
    finally:
        catalogue.register(TOY_SPEC)  # the fixture unregisters it


def test_a_registered_method_is_in_the_api_schema_and_the_config(server, toy):
    from specops.serving.http.config import ServeConfig
    from specops.serving.http.schema import Speculation

    schema = Speculation.model_json_schema()["properties"]
    assert TOY in schema["method"]["anyOf"][0]["enum"]
    assert schema["toy_back"]["maximum"] == 4 and TOY in schema["toy_back"]["description"]
    assert ServeConfig(default_method=TOY).engine.default_method == TOY


def test_a_method_that_joins_auto_is_among_its_candidates(server, toy, tiny_pair):
    auto = plain_proposer(ProposerResources(pair=tiny_pair), method="auto")
    assert TOY in auto.subs
    not_joining = MethodSpec(
        "toy-alone",
        "drafts the last token again, never in auto",
        4,
        frozenset(),
        None,
        build=lambda options, res: RepeatProposer(),
    )
    catalogue.register(not_joining)
    try:
        auto = plain_proposer(ProposerResources(pair=tiny_pair), method="auto")
        assert TOY in auto.subs and "toy-alone" not in auto.subs
    finally:
        catalogue.unregister("toy-alone")
    target = _complete(server, "target")
    assert _complete(server, "auto")["choices"][0]["text"] == target["choices"][0]["text"]

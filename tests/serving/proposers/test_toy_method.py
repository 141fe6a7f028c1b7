"""A decoding method added from this file alone reaches the API, ``auto`` and the metrics.

The toy method is a trivial proposer (it drafts the last token again, k times) and one
:class:`MethodSpec`, registered at run time after the server has started: no other file
names it. At temperature 0 a request with it returns the target's own output (the verifier
keeps every method lossless); its drafted tokens are counted under its method label; and
``auto`` builds it among its candidates because its spec says ``joins_auto``.
"""

from __future__ import annotations

import pytest
import requests
import torch

from specops.serving.engine.types import DecodeState, Proposals
from specops.serving.proposers import catalogue
from specops.serving.proposers.base import Proposer
from specops.serving.proposers.catalogue import (
    MethodSpec,
    ProposerConfig,
    ProposerResources,
    build_proposer,
)
from tests.serving.http.api_support import MODEL, metric, running, serve_config

TOY = "toy-repeat"


class RepeatProposer(Proposer):
    """Drafts the context's last token ``k`` times (right now and then, on repetitive text)."""

    name = TOY

    def propose(self, state: DecodeState, k: int) -> Proposals:
        if k <= 0 or not state.token_ids:
            return Proposals.empty()
        return Proposals(tokens=torch.full((1, k), int(state.token_ids[-1]), dtype=torch.long))


TOY_SPEC = MethodSpec(
    TOY,
    "drafts the last token again (a test's toy)",
    4,
    frozenset(),
    None,
    build=lambda cfg, res: RepeatProposer(),
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


def _complete(server, method: str, prompt: str = "def foo(x):\n    return x + x + x +") -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "speculation": {"method": method}}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
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


def test_a_registered_method_is_in_the_api_schema_and_the_config(server, toy):
    from specops.serving.http.config import ServeConfig
    from specops.serving.http.schema import Speculation

    assert TOY in Speculation.model_json_schema()["properties"]["method"]["anyOf"][0]["enum"]
    assert ServeConfig(default_method=TOY).default_method == TOY


def test_a_method_that_joins_auto_is_among_its_candidates(server, toy, tiny_pair):
    auto = build_proposer(ProposerConfig(method="auto"), ProposerResources(pair=tiny_pair))
    assert TOY in auto.subs
    not_joining = MethodSpec(
        "toy-alone",
        "drafts the last token again, never in auto",
        4,
        frozenset(),
        None,
        build=lambda cfg, res: RepeatProposer(),
    )
    catalogue.register(not_joining)
    try:
        auto = build_proposer(ProposerConfig(method="auto"), ProposerResources(pair=tiny_pair))
        assert TOY in auto.subs and "toy-alone" not in auto.subs
    finally:
        catalogue.unregister("toy-alone")
    target = _complete(server, "target")
    assert _complete(server, "auto")["choices"][0]["text"] == target["choices"][0]["text"]

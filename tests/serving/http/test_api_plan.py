"""One plan, built once: a request's method is looked up in the catalogue once, at the edge.

The HTTP layer builds the request's ``specops.serving.plan.DecodePlan`` (the method's spec, its
``k``, rows and options, resolved there); the node builds the proposer from the plan and the
engine decodes with it, so nothing below the plan looks the method up again. The catalogue's
look-up is wrapped to count its calls while requests are served through HTTP: one per request,
for methods with and without options and for a chat request.
"""

from __future__ import annotations

import sys

import pytest
import requests

from specops.serving.proposers import catalogue
from tests.serving.http.api_support import MODEL, running, serve_config


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    with running(serve_config(tiny_models), tmp_path_factory.mktemp("plan")) as srv:
        yield srv


@pytest.fixture
def lookups(monkeypatch):
    """Every call of the catalogue's look-up (wherever a module imported it from), by method name."""
    original = catalogue.method_spec
    calls: list[object] = []

    def counted(name):
        calls.append(name)
        return original(name)

    for module in list(sys.modules.values()):
        if getattr(module, "method_spec", None) is original:
            monkeypatch.setattr(module, "method_spec", counted)
    return calls


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"speculation": {"method": "target"}}),
        ("/v1/completions", {"speculation": {"method": "draft", "k": 2}}),
        ("/v1/completions", {"speculation": {"method": "pld", "pld_max_ngram": 2}}),
        ("/v1/completions", {"speculation": {"method": "llma", "n": 2}, "references": ["def f(x): return x"]}),
        ("/v1/completions", {"speculation": {"method": "auto"}}),
        ("/v1/completions", {}),  # the server's default method
        ("/v1/chat/completions", {"speculation": {"method": "draft"}}),
    ],
)
def test_one_catalogue_look_up_per_request(server, lookups, path, body):
    prompt = {"messages": [{"role": "user", "content": "def f(x):"}]} if "chat" in path else {"prompt": "def f(x):"}
    r = requests.post(
        server.url + path, json={"model": MODEL, "max_tokens": 6, "temperature": 0, **prompt, **body}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert len(lookups) == 1, lookups
    assert lookups[0] == body.get("speculation", {}).get("method", r.json()["speculation"]["method"])

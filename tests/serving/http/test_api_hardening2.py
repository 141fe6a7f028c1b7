"""The second probe's findings over HTTP (issue 34, items 3, 4, 8 and 10's first half):

- extreme ``top_p`` / ``temperature`` (``top_p`` 1e-300 is 0 in float32; a temperature of
  5e-324 overflows ``logits / T``) decode with every method of the catalogue, kNN-LM and the
  retrieval loops, and give the greedy output when only one token is left (never a 500);
- the ``auto`` policy's priors are checked (NaN, infinite, negative, out of range: refused,
  naming the field, from a file and from ``policy@champion``); a policy that hangs cannot
  hold a request past its timeout, block ``GET /v1/policy`` or the event loop;
- kNN-LM and the retrieval loops refuse the request fields they would silently ignore;
- a validation error from a model-level check names its field (never ``param: null`` and
  ": Value error, ...").
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time

import pytest
import requests
from pydantic import BaseModel, ValidationError

from specops.core.auto_policy import AutoPolicy, Counts
from specops.serving.http import schema
from specops.serving.http.api import _FirstValidationError
from specops.serving.proposers.catalogue import METHODS
from tests.serving.http.api_support import (
    MODEL,
    assert_error,
    metric,
    running,
    serve_config,
    wait_until,
)

TEXTS = [
    "ls lists directory contents. With -l it shows permissions, owners, sizes and times of each file.",
    "cp copies files and directories. With -r it copies directories recursively, keeping the tree.",
    "grep prints lines that match a pattern; -i ignores case and -r searches directories.",
]


@pytest.fixture(scope="module")
def artifacts(tiny_models, tmp_path_factory):
    """A DReSD datastore, a knowledge base ``tools`` and a kNN-LM datastore ``prose``, all tiny."""
    from specops.core.datastore import Datastore, DatastoreConfig
    from specops.core.index import IndexConfig
    from specops.core.models import load_model, load_tokenizer, tokenizer_hash
    from specops.core.passage import Passage
    from specops.serving.ralm.knnlm.store import build_knnlm
    from specops.serving.retrieval.kb import build_kb

    root = tmp_path_factory.mktemp("artifacts")
    target, tok = load_model(tiny_models / "target"), load_tokenizer(tiny_models / "target")
    docs = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS] * 3
    store, _ = Datastore.build(target, docs, DatastoreConfig(dims=16, value_len=12, index=IndexConfig(kind="flat")))
    kb = build_kb(
        "tools",
        [Passage(i, f"t{i}", t, source=f"/man/{i}") for i, t in enumerate(TEXTS)],
        embedder="hash",
        retrievers=("exact",),
        progress=False,
    )
    knn = build_knnlm(target, docs, tokenizer_sha256=tokenizer_hash(tok), progress=False)
    return {
        "datastore_dir": str(store.save(root / "ds")),
        "kb_dirs": [str(kb.save(root / "tools"))],
        "knnlm_dirs": [str(knn.save(root / "prose"))],
    }


@pytest.fixture(scope="module")
def server(tiny_models, artifacts, tmp_path_factory):
    cfg = serve_config(tiny_models, default_max_tokens=4, max_n_drafts=4, **artifacts)
    with running(cfg, tmp_path_factory.mktemp("hardening2")) as srv:
        yield srv


def post(srv, path: str = "/v1/completions", timeout: float = 60, **body) -> requests.Response:
    if path == "/v1/completions":
        body.setdefault("prompt", "ls lists directory")
    return requests.post(srv.url + path, json={"model": MODEL, "max_tokens": 3, **body}, timeout=timeout)


# ---------------------------------------------------------------- item 3: extreme top_p / temperature
EXTREMES = [(1e-300, 1.0), (5e-324, 2.0), (1e-46, 1e-38), (1.0, 5e-324), (1.0, 1e-300), (0.5, 2.0), (1.0, 2.0)]
"""(top_p, temperature) pairs inside the API's bounds."""


def _one_token_left(top_p: float, temperature: float) -> bool:
    return top_p < 1e-40 or temperature < 1e-40


@pytest.mark.parametrize("method", METHODS)
def test_extreme_sampling_settings_decode_with_every_method(server, method):
    """``{"top_p": 1e-300, "temperature": 1}`` was a 500 for every method (0 in float32 dropped
    every token; ``torch.multinomial`` raised)."""
    greedy = post(server, temperature=0, speculation={"method": method})
    assert greedy.status_code == 200, greedy.text
    for top_p, temperature in EXTREMES:
        r = post(server, top_p=top_p, temperature=temperature, seed=7, speculation={"method": method})
        assert r.status_code == 200, (top_p, temperature, r.text)
        body = r.json()
        assert body["speculation"]["method"] == method and body["usage"]["completion_tokens"] >= 1
        if _one_token_left(top_p, temperature):  # only the most probable token is left: the greedy output
            assert body["choices"][0]["text"] == greedy.json()["choices"][0]["text"], (top_p, temperature)


@pytest.mark.parametrize(
    "extra",
    [
        {"knnlm": {"datastore": "prose", "speculative": True}},
        {"knnlm": {"datastore": "prose", "speculative": False}},
        {"retrieval": {"kb": "tools", "mode": "ralmspec"}, "speculation": {"method": "draft"}},
        {"retrieval": {"kb": "tools", "mode": "oneshot", "passages": 1}, "speculation": {"method": "llma"}},
    ],
)
def test_extreme_sampling_settings_decode_on_the_retrieval_paths(server, extra):
    for top_p, temperature in EXTREMES:
        r = post(server, top_p=top_p, temperature=temperature, seed=7, **extra)
        assert r.status_code == 200, (top_p, temperature, r.text)
    r = post(
        server,
        path="/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        top_p=1e-300,
        temperature=1,
        stream=True,
        **extra,
    )
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


# ---------------------------------------------------------------- item 4: priors, a hanging policy
GOOD_PRIORS = {
    "format": "specops-auto-priors/1",
    "counts": [{"cluster": "default", "key": "draft", "temperature": "greedy", "accepted": 30.0, "rejected": 10.0}],
    "verify": {"1": {"a_ms": 20.0, "b_ms": 1.0}},
    "propose": {"draft": {"a_ms": 2.0, "b_ms": 4.0}},
}


def _priors(path: str, value) -> dict:
    out = json.loads(json.dumps(GOOD_PRIORS))
    *parents, last = path.split(".")
    node = out
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[last] = value
    return out


@pytest.mark.parametrize(
    "path, value, named",
    [
        ("counts.0.accepted", float("nan"), "counts[0].accepted"),
        ("counts.0.rejected", float("inf"), "counts[0].rejected"),
        ("counts.0.accepted", -1.0, "counts[0].accepted"),
        ("counts.0.accepted", 1e300, "counts[0].accepted"),
        ("counts.0.accepted", "30", "counts[0].accepted"),
        ("counts.0.rejected", True, "counts[0].rejected"),
        ("counts.0.temperature", "warm", "counts[0].temperature"),
        ("counts.0.cluster", 7, "counts[0].cluster"),
        ("verify.1.a_ms", float("nan"), "verify.1.a_ms"),
        ("verify.1.b_ms", -float("inf"), "verify.1.b_ms"),
        ("propose.draft.b_ms", float("nan"), "propose.draft.b_ms"),
        ("counts", {"a": 1}, "counts"),
    ],
)
def test_priors_with_bad_numbers_are_refused_naming_the_field_and_change_nothing(path, value, named):
    policy = AutoPolicy()
    before = policy.priors()
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        policy.load_priors(_priors(path, value))
    assert policy.priors() == before  # all or nothing
    policy.load_priors(GOOD_PRIORS)
    assert policy.counts[("default", "draft", "greedy")].trials == pytest.approx(24.0)  # scaled to PRIOR_TRIALS


def test_a_bad_verify_edge_is_refused():
    bad = {**GOOD_PRIORS, "verify": {"many": {"a_ms": 1.0, "b_ms": 1.0}}}
    with pytest.raises(ValueError, match="verify"):
        AutoPolicy().load_priors(bad)


def test_the_policy_never_loops_on_counts_that_are_not_finite():
    """``random.betavariate(nan, ...)`` never returns: whatever got into the counts, a choice does."""
    policy = AutoPolicy(seed=0)
    policy.counts[("default", "draft", "greedy")] = Counts(float("nan"), 1.0)
    policy.counts[("default", "llma", "greedy")] = Counts(float("inf"), float("inf"))
    chosen: list = []
    available = {"draft": {"key": "draft", "max_k": 4}, "llma": {"key": "llma", "max_k": 4}}
    t = threading.Thread(
        target=lambda: chosen.append(policy.choose("default", "greedy", available=available, own={}, k_cap=4)),
        daemon=True,
    )
    t.start()
    t.join(10)
    assert not t.is_alive() and chosen and math.isfinite(chosen[0].speed), "the policy hung on non-finite counts"


def test_a_priors_file_with_nan_stops_the_start_naming_the_field(tiny_models, tmp_path):
    path = tmp_path / "priors.json"
    path.write_text(json.dumps(GOOD_PRIORS).replace("30.0", "NaN"))  # what json.dumps(float("nan")) writes
    with running(
        serve_config(tiny_models, auto_priors=str(path), auto_calibrate=False), tmp_path / "srv", ready=False
    ) as srv:
        assert wait_until(lambda: srv.state.load_error is not None or srv.state.ready.is_set(), 120)
        assert srv.state.load_error is not None, "the server started with NaN priors"
        assert "counts[0].accepted" in srv.state.load_error and str(path) in srv.state.load_error
        r = requests.get(srv.url + "/readyz", timeout=10)
        assert r.status_code == 503 and "counts[0].accepted" in r.json()["error"]


def test_policy_champion_with_nan_is_refused_and_the_policy_kept(sqlite_uri, tmp_path, caplog):
    from specops.registry import RegistryConfig, RegistryStore
    from specops.serving.replica import Replica

    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    d = tmp_path / "bad"
    d.mkdir()
    (d / "priors.json").write_text(json.dumps(_priors("counts.0.rejected", float("nan"))))
    v = reg.artifact("policy").register("", d, meta={"requests": 1}, metrics={"requests": 1.0})
    reg.artifact("policy").promote("", v.version, reason="a damaged fit")
    state = Replica.__new__(Replica)  # only what _load_policy_priors reads
    state.registry, state.cache_dir = reg, tmp_path / "serve-cache"
    policy = AutoPolicy()
    policy.load_priors(GOOD_PRIORS)
    before = policy.priors()
    with caplog.at_level(logging.WARNING, logger="specops.serving.replica"):
        state._load_policy_priors(policy)
    assert policy.priors() == before
    assert "counts[0].rejected" in caplog.text and "finite" in caplog.text


@pytest.fixture
def hanging_policy(monkeypatch):
    """``AutoPolicy.choose`` blocks, holding the policy's lock, until the test ends."""
    release = threading.Event()
    entered = threading.Event()

    def choose(self, *args, **kwargs):
        with self.lock:
            entered.set()
            release.wait(120)
        raise RuntimeError("released")

    monkeypatch.setattr(AutoPolicy, "choose", choose)
    yield entered, release
    release.set()


def test_a_request_times_out_whatever_the_policy_does(tiny_models, tmp_path, hanging_policy):
    cfg = serve_config(tiny_models, request_timeout_s=1.0, max_concurrency=3, auto_calibrate=False)
    entered, release = hanging_policy
    with running(cfg, tmp_path / "srv") as srv:
        try:
            _hung_policy_checks(srv, entered)
        finally:
            release.set()  # the stuck workers end, so the server stops at once


def _hung_policy_checks(srv, entered: threading.Event) -> None:
    hung: dict = {}

    def auto_request() -> None:
        t0 = time.monotonic()
        hung["response"] = post(srv, timeout=30, temperature=0, speculation={"method": "auto"})
        hung["s"] = time.monotonic() - t0

    t = threading.Thread(target=auto_request)
    t.start()
    assert entered.wait(30), "the auto request never reached the policy"
    # the policy is stuck holding its lock: the replica still answers, promptly
    t0 = time.monotonic()
    assert requests.get(srv.url + "/healthz", timeout=5).json() == {"status": "ok"}
    other = post(srv, timeout=30, temperature=0, speculation={"method": "target"})
    assert other.status_code == 200, other.text
    pol = requests.get(srv.url + "/v1/policy", timeout=10)
    assert_error(pol, 503, "unavailable")
    assert time.monotonic() - t0 < 8
    t.join(30)
    assert not t.is_alive()
    err = assert_error(hung["response"], 504, "request_timeout")
    assert "1s" in err["message"] and hung["s"] < 10, hung
    # streaming: the stream ends with the timeout error event
    r = post(srv, timeout=30, temperature=0, stream=True, speculation={"method": "auto"})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and events and events[-1]["error"]["code"] == "request_timeout", r.text
    assert requests.get(srv.url + "/healthz", timeout=5).status_code == 200
    text = requests.get(srv.url + "/metrics", timeout=10).text
    assert metric(text, "specops_requests_cancelled_total", reason="timeout") >= 2


# ---------------------------------------------------------------- item 8: fields a path would ignore
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"speculation": {"method": "draft"}}, "speculation.method"),
        ({"speculation": {"method": "llma"}, "references": ["ls lists"]}, "speculation.method"),
        ({"speculation": {"k": 4}}, "speculation.k"),
        ({"speculation": {"method": "target", "k": 2}}, "speculation.k"),
        ({"speculation": {"n_drafts": 2}}, "speculation.n_drafts"),
        ({"speculation": {"n": 2}}, "speculation.n"),
        ({"references": ["ls lists directory contents"]}, "references"),
    ],
)
def test_knnlm_refuses_what_it_would_ignore(server, extra, param):
    err = assert_error(post(server, knnlm={"datastore": "prose"}, **extra), 400, "invalid_request", param)
    assert "knnlm" in err["message"]


@pytest.mark.parametrize(
    "mode, extra, param",
    [
        ("ralmspec", {"speculation": {"method": "draft", "n_drafts": 2}}, "speculation.n_drafts"),
        ("ralmseq", {"speculation": {"method": "llma", "n": 2}}, "speculation.n"),
    ],
)
def test_the_retrieval_loop_refuses_what_it_would_ignore(server, mode, extra, param):
    err = assert_error(post(server, retrieval={"kb": "tools", "mode": mode}, **extra), 400, "invalid_request", param)
    assert mode in err["message"]


def test_what_the_special_paths_honour_is_still_served(server):
    r = post(server, temperature=0, knnlm={"datastore": "prose"}, speculation={"method": "target"})
    assert r.status_code == 200 and r.json()["speculation"]["method"] == "target", r.text
    r = post(
        server,
        temperature=0,
        retrieval={"kb": "tools", "mode": "oneshot", "passages": 1},
        speculation={"method": "llma", "n": 2, "n_drafts": 2, "k": 4},
        references=["ls lists"],
    )
    assert r.status_code == 200 and r.json()["speculation"]["method"] == "llma", r.text
    r = post(
        server, temperature=0, retrieval={"kb": "tools", "mode": "ralmspec"}, speculation={"method": "draft", "k": 2}
    )
    assert r.status_code == 200 and r.json()["speculation"]["k"] == 2, r.text


# ---------------------------------------------------------------- item 10: model-level errors name a field
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
MODEL_CHECKS = {
    ("ChatCompletionRequest", "_tokens"): (
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 5, "max_completion_tokens": 3},
        "max_completion_tokens",
    ),
    ("ResponseFormat", "_schema"): (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
}
"""Every model-level validator of ``specops.serving.http.schema``: a body that trips it and the field it must name."""


def _model_validators() -> set[tuple[str, str]]:
    found = set()
    for obj in vars(schema).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == schema.__name__:
            found |= {(obj.__name__, name) for name in obj.__pydantic_decorators__.model_validators}
    return found


def test_every_model_validator_has_a_case_here():
    assert _model_validators() == set(MODEL_CHECKS), "add a (path, body, param) case for each model validator"


@pytest.mark.parametrize("check", sorted(MODEL_CHECKS))
def test_a_model_level_error_names_its_field(server, check):
    path, body, param = MODEL_CHECKS[check]
    err = assert_error(post(server, path=path, **body), 400, "invalid_request", param)
    assert err["message"].startswith(f"{param}: ") and "Value error" not in err["message"], err


def test_max_tokens_and_max_completion_tokens_disagreeing():
    """The probe's body: ``param: null`` and ": Value error, max_tokens and ..." before."""
    body = {"model": MODEL, **CHAT, "max_tokens": 5, "max_completion_tokens": 3}
    with pytest.raises(ValidationError) as exc:
        schema.ChatCompletionRequest.model_validate(body)
    err = _FirstValidationError(exc.value.errors())
    assert err.param == "max_completion_tokens"
    assert (
        str(err) == "max_completion_tokens: 3 disagrees with max_tokens (5); send one of them (max_tokens is its "
        "deprecated name)"
    )
    agree = schema.ChatCompletionRequest.model_validate({**body, "max_tokens": 3})
    assert agree.max_tokens == 3


def test_validation_messages_are_clean():
    """pydantic's "Value error, " prefix is not ours to show, and a check with no field (a model
    validator not raising FieldValueError) is not written ": ..."."""
    err = _FirstValidationError(
        [
            {
                "type": "value_error",
                "loc": ("stop",),
                "msg": "Value error, at most 4",
                "input": "x",
                "ctx": {"error": ValueError("at most 4")},
            }
        ]
    )
    assert (str(err), err.param) == ("stop: at most 4 (got 'x')", "stop")
    err = _FirstValidationError(
        [
            {
                "type": "value_error",
                "loc": (),
                "msg": "Value error, fields disagree",
                "input": {"a": 1},
                "ctx": {"error": ValueError("fields disagree")},
            }
        ]
    )
    assert str(err) == "fields disagree"
    nested = schema.FieldValueError("k", "too big")
    err = _FirstValidationError(
        [
            {
                "type": "value_error",
                "loc": ("speculation",),
                "msg": "Value error, too big",
                "input": {"k": 9},
                "ctx": {"error": nested},
            }
        ]
    )
    assert (str(err), err.param) == ("speculation.k: too big", "speculation.k")

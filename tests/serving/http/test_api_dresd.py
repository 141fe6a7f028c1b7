"""DReSD through the HTTP API: the fallback datastore of --datastore-dir serves `dresd`
requests losslessly, `n_drafts` is bounded and named, and without a datastore the request
gets a 400 that names `speculation.method`."""

from __future__ import annotations

import requests

from specops.core.datastore import Datastore, DatastoreConfig
from specops.core.index import IndexConfig
from specops.core.models import load_model, load_tokenizer
from tests.serving.http.api_support import MODEL, assert_error, running, serve_config


def _post(srv, **body):
    return requests.post(f"{srv.url}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)


def test_dresd_requests_use_the_fallback_datastore(tiny_models, tmp_path):
    target = load_model(tiny_models / "target")
    tok = load_tokenizer(tiny_models / "target")
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.\n"] * 4
    store, _ = Datastore.build(
        target,
        [tok(t, add_special_tokens=False)["input_ids"] for t in texts],
        DatastoreConfig(dims=16, value_len=12, index=IndexConfig(kind="flat")),
    )
    store.meta["shape"] = {"n_drafts": 2, "k": 5}  # what a rebuild measured
    path = store.save(tmp_path / "ds")
    with running(serve_config(tiny_models, datastore_dir=str(path), max_n_drafts=8), tmp_path / "srv") as srv:
        ref = _post(srv, prompt="def add(a, b):", max_tokens=12, speculation={"method": "target"}).json()
        r = _post(srv, prompt="def add(a, b):", max_tokens=12, speculation={"method": "dresd", "k": 6, "n_drafts": 4})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == ref["choices"][0]["text"]  # lossless
        sp = body["speculation"]
        assert sp["method"] == "dresd" and sp["datastore_version"] == "base" and sp["n_drafts"] == 4
        assert sp["draft_version"] is None
        sp = _post(srv, prompt="def add(a, b):", max_tokens=12, speculation={"method": "dresd"}).json()["speculation"]
        assert sp["n_drafts"] == 2  # not asked for: the datastore's measured shape
        assert_error(
            _post(srv, prompt="x", max_tokens=2, speculation={"method": "dresd", "n_drafts": 9}),
            400,
            "invalid_request",
            "speculation.n_drafts",
        )
        assert_error(
            _post(srv, prompt="x", max_tokens=2, speculation={"method": "dresd", "n_drafts": 0}),
            400,
            "invalid_request",
            "speculation.n_drafts",
        )
    with running(serve_config(tiny_models), tmp_path / "srv2") as srv:
        assert_error(
            _post(srv, prompt="x", max_tokens=2, speculation={"method": "dresd"}),
            400,
            "invalid_request",
            "speculation.method",
        )

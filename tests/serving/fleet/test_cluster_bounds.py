"""A request may name only a cluster that exists (the configured ones, the router's, those with a
champion draft): anything else is a 400 naming ``cluster``, follows nothing and adds no metric
series; metrics label at most a fixed number of clusters by name and the rest as ``(other)``."""

from __future__ import annotations

import re
import time

import requests

from specops.core import clusters
from specops.core.clusters import OTHER, ClusterLabels
from specops.core.models import load_tokenizer, tokenizer_hash
from specops.core.sessions.store import save_sessions
from specops.registry import RegistryConfig, RegistryStore
from specops.serving.fleet.clusters import MAX_LISTED, KnownClusters
from specops.serving.fleet.datastores import DatastoreFollower
from specops.serving.fleet.follower import FollowConfig
from tests.serving.http.api_support import (
    MODEL,
    assert_error,
    metric,
    running,
    serve_config,
    wait_until,
)


def _complete(url: str, cluster: str | None = None, **body):
    extra = {"cluster": cluster} if cluster is not None else {}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra, **body}
    return requests.post(f"{url}/v1/completions", json=body, timeout=60)


def _cluster_labels(text: str) -> set[str]:
    return set(re.findall(r'cluster="((?:[^"\\]|\\.)*)"', text))


def test_a_made_up_cluster_is_a_400_naming_the_field_and_costs_nothing(tiny_models, tmp_path):
    with running(serve_config(tiny_models, clusters="code,prose"), tmp_path) as srv:
        for name in ("made-up-1", "Code", "code2"):
            err = assert_error(_complete(srv.url, name), 400, "invalid_request", "cluster")
            assert repr(name) in err["message"] and "leave cluster out" in err["message"]
            assert "code, default, prose" in err["message"] and "`clusters`" in err["message"]
        r = requests.post(
            f"{srv.url}/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 2, "cluster": "nope", "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert_error(r, 400, "invalid_request", "cluster")
        for name in ("code", "prose", "default", None):  # configured, the default, routed to the default
            r = _complete(srv.url, name)
            assert r.status_code == 200, r.text
            assert r.json()["speculation"]["cluster"] == (name or "default")
        state = srv.state
        assert set(state.follower.slots) == {"code", "prose", "default"}
        assert state.follower.keys == {"code", "prose", "default"}
        assert state.datastores.keys <= {"code", "prose", "default"}
        text = requests.get(f"{srv.url}/metrics", timeout=10).text
        assert not {"made-up-1", "Code", "code2", "nope"} & _cluster_labels(text)


def test_the_refusal_lists_a_bounded_number_of_clusters():
    known = KnownClusters([f"c{i:03d}" for i in range(500)])
    try:
        known.check("x" * 10_000)
    except ValueError as exc:
        message, param = str(exc), exc.param
    else:
        raise AssertionError("an unknown cluster was accepted")
    assert param == "cluster"
    assert f"c{MAX_LISTED - 1:03d}" in message and f"c{MAX_LISTED:03d}" not in message
    assert f"and {500 - MAX_LISTED} more" in message and len(message) < 800


def test_metrics_label_a_bounded_set_of_clusters(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setattr(clusters, "LABELS", ClusterLabels(limit=4))  # this process's other tests keep theirs
    names = [f"k{i:02d}" for i in range(24)]
    with running(serve_config(tiny_models, clusters=names, max_concurrency=4), tmp_path) as srv:
        tokens = 0
        for name in names:
            r = _complete(srv.url, name, speculation={"method": "draft", "k": 2})
            assert r.status_code == 200, r.text
            tokens += r.json()["usage"]["completion_tokens"]
        text = requests.get(f"{srv.url}/metrics", timeout=10).text
    labelled = _cluster_labels(text) & set(names)
    assert len(labelled) == 4 and OTHER in _cluster_labels(text)
    generated = sum(metric(text, "specops_generated_tokens_total", cluster=c) for c in labelled)
    assert generated + metric(text, "specops_generated_tokens_total", cluster=OTHER) == tokens
    for line in text.splitlines():  # every series labelled by cluster names one of the 4, or (other)
        found = re.search(r'cluster="([^"]*)"', line)
        if found and found.group(1).startswith("k"):
            assert found.group(1) in labelled, line


def test_labels_are_names_up_to_the_limit_then_other():
    labels = ClusterLabels(limit=3)
    assert [labels(c) for c in ("a", "b", "a", "c", "d", "e", "b")] == ["a", "b", "a", "c", OTHER, OTHER, "b"]
    assert labels.names() == {"a", "b", "c"}


def test_registry_champions_exist_and_no_other_registered_name_is_followed(tiny_models, sqlite_uri, tmp_path):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    draft = tiny_models / "draft"
    sha = tokenizer_hash(load_tokenizer(draft))
    v = reg.artifact("draft").register("champ", draft, tokenizer_sha256=sha)
    reg.artifact("draft").promote("champ", v.version)
    reg.artifact("draft").register("challenged", draft, tokenizer_sha256=sha)  # a challenger only: not a cluster
    ghost = reg.artifact("sessions")  # past sessions of a name no request may send
    saved = save_sessions(tmp_path / "ghost", "ghost", [tuple(range(8))], sha)
    ghost.promote("ghost", ghost.register("ghost", saved).version)
    cfg = serve_config(tiny_models, registry=sqlite_uri, session_sharing="shared", poll_s=0.2)
    with running(cfg, tmp_path / "srv") as srv:
        state = srv.state
        assert state.follower.champions == {"champ"}
        r = _complete(srv.url, "champ")
        assert r.status_code == 200 and r.json()["speculation"]["cluster"] == "champ"
        assert_error(_complete(srv.url, "challenged"), 400, "invalid_request", "cluster")
        time.sleep(1.0)  # several listings and polls of the sessions follower
        assert "ghost" not in state.session_follower.keys
        assert_error(_complete(srv.url, "ghost"), 400, "invalid_request", "cluster")
        drafts = reg.artifact("draft")
        drafts.promote("challenged", drafts.by_alias("challenged", "challenger").version)  # now it is a cluster
        assert wait_until(lambda: "challenged" in state.follower.champions, 20)
        assert _complete(srv.url, "challenged").status_code == 200


def test_a_key_that_stops_being_a_cluster_is_no_longer_polled(tmp_path):
    allowed = {"a", "b"}
    fast = FollowConfig(poll_s=0.05, backoff_initial_s=0.05, backoff_max_s=0.05)
    follower = DatastoreFollower(None, None, cache_dir=tmp_path, follow=fast)
    follower.allow = allowed.__contains__
    follower.start()
    try:
        for key in ("a", "b", "made-up"):
            follower.current(key)
        follower.on_event(type("Event", (), {"model_name": "datastore-elsewhere"})())
        assert follower.keys == {"a", "b"}
        allowed.discard("a")
        assert wait_until(lambda: follower.keys == {"b"}, 5)
        allowed.add("a")
        follower.current("a")  # a cluster again: followed again on its next request
        assert follower.keys == {"a", "b"}
    finally:
        follower.stop()


def test_configured_clusters_are_cluster_names():
    from specops.core.errors import ModelConfigError
    from specops.serving.http.config import ServeConfig

    assert ServeConfig.load(env={"SPECOPS_SERVE_CLUSTERS": "code, prose,sql.v2"}).fleet.clusters == [
        "code",
        "prose",
        "sql.v2",
    ]
    for bad in ("code,a/b", "two words", "-lead"):
        try:
            ServeConfig.load(overrides={"clusters": bad})
        except ModelConfigError as exc:
            assert "cluster names are letters" in str(exc)
        else:
            raise AssertionError(f"clusters={bad!r} was accepted")

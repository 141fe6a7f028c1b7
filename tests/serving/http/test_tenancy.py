"""Tenant isolation (issue 34, items 1, 2 and 10): an API key cannot read another key's outputs
through LLMA's past sessions, cluster names are behind a key, routing is a per-key permission,
and the ``auto`` policy's view is for admins.

The extraction replay is the probe that found it: key A's output enters the past-sessions cache;
key B sends 8 tokens of it as a prompt with ``speculation: {method: "llma", n: 8}`` and reads
``llma.hits_sessions`` (an 8-token match in someone's past output) and ``reference_tokens`` (the
cache's size), then extends a known prefix one guessed token at a time. Probes ask for 4 tokens,
under the cache's 8-token minimum, so a probe's own output never enters a cache.
"""

from __future__ import annotations

import pytest
import requests

from specops.core.errors import ModelConfigError
from specops.core.models import load_pair
from specops.core.sessions.cache import SessionCacheConfig
from specops.core.sessions.store import save_sessions
from specops.registry import RegistryConfig, RegistryStore
from specops.serving.http.config import ServeConfig
from specops.serving.http.tenancy import ANONYMOUS, Tenant, Tenants, anonymous_id, split_key
from specops.serving.proposers.session_cache import SessionCache
from tests.serving.http.api_support import MODEL, assert_error, metric, running, serve_config

ALICE, BOB, CAROL, OPS = "alice-key-0001", "bob-key-00002", "carol-key-0003", "ops-key-000004"
UNNAMED = "unnamed-key-0005"
KEYS = [f"alice:{ALICE}", f"bob:{BOB}", f"carol:{CAROL}", f"ops:{OPS}", UNNAMED]
PROMPT = [5, 17, 23, 9, 41, 3]
DECOYS = [11, 29, 47, 61, 83, 97, 131, 167, 199, 233, 271]
"""Wrong guesses of the next token (the right one is added to them)."""


def _post(srv, key: str, **body) -> requests.Response:
    return requests.post(
        f"{srv.url}/v1/completions",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def _get(srv, path: str, key: str | None = None) -> requests.Response:
    return requests.get(srv.url + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


def _secret(srv, key: str, tenant: str) -> list[int]:
    """``key`` generates a sampled (so not guessable) output with LLMA; returns its token ids as
    the cache holds them (the test's ground truth, read from the server's memory)."""
    r = _post(srv, key, prompt=PROMPT, max_tokens=32, temperature=1.0, seed=7, speculation={"method": "llma"})
    assert r.status_code == 200, r.text
    held = srv.state.node.sessions.export("default", tenant)
    assert held, "the output did not enter its tenant's past sessions"
    out = list(held[-1])
    assert len(out) >= 20 and len(set(out[:12])) >= 8, out  # long and varied enough to probe
    return out


def _probe(srv, key: str, tail: list[int]) -> dict:
    """One probe: ``tail`` as the prompt, LLMA copying only 8-token matches; the response's ``llma`` block."""
    r = _post(srv, key, prompt=tail, max_tokens=4, temperature=0, speculation={"method": "llma", "n": 8})
    assert r.status_code == 200, r.text
    return r.json()["speculation"]["llma"]


def _extend(srv, key: str, known: list[int], truth: list[int]) -> list[int]:
    """The extraction: guess the token after ``known`` (the right one among decoys), keep a guess
    whose 8-gram hits the past sessions, repeat. Returns the tokens recovered."""
    recovered: list[int] = []
    for right in truth:
        guesses = [c for c in DECOYS if c != right] + [right]
        hits = [c for c in guesses if _probe(srv, key, (known + recovered + [c])[-8:])["hits_sessions"]]
        if len(hits) != 1:
            break
        recovered.append(hits[0])
    return recovered


@pytest.fixture(scope="module")
def keyed(tiny_models, tmp_path_factory):
    cfg = serve_config(
        tiny_models, api_keys=KEYS, route_tenants=["alice", "bob", "ops"], admin_tenants=["ops"], auto_calibrate=False
    )
    with running(cfg, tmp_path_factory.mktemp("tenancy")) as srv:
        yield srv


# ---------------------------------------------------------------- the extraction replay
def test_another_key_cannot_extract_an_output_through_llma(keyed):
    secret = _secret(keyed, ALICE, "alice")
    window = secret[8:16]  # 8 tokens of A's output, with more of it after them to copy

    mine = _probe(keyed, ALICE, window)  # the positive control: the probe does find A's output ...
    assert mine["hits_sessions"] > 0 and mine["reference_tokens"] >= len(secret)
    theirs = _probe(keyed, BOB, window)  # ... and B's identical probe finds nothing, not even a size
    assert theirs["hits_sessions"] == 0 and theirs["reference_tokens"] == 0, theirs
    assert _probe(keyed, UNNAMED, window)["hits_sessions"] == 0

    # Token by token from a known prefix: A's own key recovers its next tokens, B's recovers none.
    assert _extend(keyed, ALICE, secret[:8], secret[8:10]) == secret[8:10]
    assert _extend(keyed, BOB, secret[:8], secret[8:10]) == []

    # What /metrics shows of the caches is per cluster, every tenant's together: no tenant ids.
    text = _get(keyed, "/metrics").text
    assert metric(text, "specops_llma_session_cache_outputs", cluster="default") >= 1
    for tenant in ("alice", "bob", anonymous_id(UNNAMED)):
        assert tenant not in text


def test_shared_sessions_restore_cross_tenant_copying(tiny_models, tmp_path):
    """``session_sharing = "shared"``: the old behaviour, and the documented risk (B finds A's output)."""
    cfg = serve_config(tiny_models, api_keys=KEYS, session_sharing="shared", auto_calibrate=False)
    with running(cfg, tmp_path) as srv:
        secret = _secret(srv, ALICE, "")  # the cluster's shared scope
        theirs = _probe(srv, BOB, secret[8:16])
        assert theirs["hits_sessions"] > 0 and theirs["reference_tokens"] >= len(secret)
        assert _extend(srv, BOB, secret[:8], secret[8:10]) == secret[8:10]


def test_a_tenant_scoped_server_does_not_seed_from_the_mixed_registry_artifact(tiny_models, sqlite_uri, tmp_path):
    """``sessions-<cluster>`` holds every tenant's outputs: a tenant-scoped server does not follow it."""
    pair = load_pair(tiny_models / "target")
    registered = list(range(100, 140))
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    v = (
        reg.artifact("sessions")
        .register("default", save_sessions(tmp_path / "s", "default", [tuple(registered)], pair.tokenizer_sha256))
        .version
    )
    reg.artifact("sessions").promote("default", v)
    cfg = serve_config(tiny_models, api_keys=KEYS, registry=sqlite_uri, auto_calibrate=False)
    with running(cfg, tmp_path / "srv") as srv:
        assert srv.state.session_follower is None
        assert _probe(srv, ALICE, registered[8:16])["hits_sessions"] == 0


def test_session_cache_scopes_are_separate_and_bounded():
    cache = SessionCache(SessionCacheConfig(max_tokens=100, min_output_tokens=4, max_clusters=2))
    cache.add("c", list(range(10, 20)), "a")
    assert cache.index("c", "b") is None and cache.index("c") is None  # neither b's nor the shared scope
    assert cache.export("c", "a") == [tuple(range(10, 20))]
    cache.add("c", list(range(30, 35)), "b")
    assert cache.stats() == {"c": {"outputs": 2, "tokens": 15}}  # per cluster, every scope together
    cache.add("c", list(range(40, 45)), "d")  # a third (scope, cluster) pushes out the least recently used
    assert cache.index("c", "a") is None and cache.stats()["c"]["outputs"] == 2


# ---------------------------------------------------------------- cluster names and routing
def test_readyz_lists_no_cluster_names(keyed):
    assert _post(keyed, ALICE, prompt="hi", max_tokens=2, cluster="default").status_code == 200
    r = _get(keyed, "/readyz")
    assert r.status_code == 200 and set(r.json()) == {"ready", "draining", "step", "running", "waiting", "load"}
    assert "default" not in r.text
    assert_error(_get(keyed, "/v1/clusters"), 401, "missing_api_key")
    assert _get(keyed, "/v1/clusters", ALICE).json()["drafts"] == {"default": "base"}
    assert_error(_get(keyed, "/v1/clusters", CAROL), 403, "forbidden")  # may not route: no names needed


def test_choosing_the_cluster_is_a_per_key_permission(keyed):
    assert_error(_post(keyed, CAROL, prompt="hi", max_tokens=2, cluster="default"), 403, "forbidden", "cluster")
    routed = _post(keyed, CAROL, prompt="hi", max_tokens=2)  # without `cluster` carol is served as usual
    assert routed.status_code == 200 and routed.json()["speculation"]["cluster_source"] == "default"
    for key in (ALICE, OPS):
        r = _post(keyed, key, prompt="hi", max_tokens=2, cluster="default")
        assert r.status_code == 200 and r.json()["speculation"]["cluster_source"] == "request"
    assert_error(_post(keyed, UNNAMED, prompt="hi", max_tokens=2, cluster="default"), 403, "forbidden", "cluster")


def test_the_policy_view_is_for_admins(keyed):
    assert_error(_get(keyed, "/v1/policy"), 401, "missing_api_key")
    for key in (ALICE, CAROL, UNNAMED):
        assert_error(_get(keyed, "/v1/policy", key), 403, "forbidden")
    r = _get(keyed, "/v1/policy", OPS)
    assert r.status_code == 200 and "clusters" in r.json()


# ---------------------------------------------------------------- the tenant table and its config
def test_keys_map_to_tenants_without_revealing_the_key():
    assert split_key("alice:alice-key-0001") == ("alice", "alice-key-0001")
    assert split_key("no-colon-key") == (anonymous_id("no-colon-key"), "no-colon-key")
    assert split_key("bad name:key-12345678")[1] == "bad name:key-12345678"  # not a NAME: the whole entry is the key
    tenants = Tenants(KEYS + ["alice:alice-rotated-9"], route_tenants=["alice"], admin_tenants=["ops"])
    assert tenants.lookup(b"alice-rotated-9") == tenants.lookup(ALICE.encode()) == Tenant("alice", True, False)
    assert tenants.lookup(OPS.encode()) == Tenant("ops", False, True)
    unnamed = tenants.lookup(UNNAMED.encode())
    assert unnamed.id.startswith("key-") and UNNAMED not in unnamed.id and not unnamed.may_route
    assert tenants.lookup(b"alice") is None and tenants.lookup(b"") is None
    assert not Tenants().required and ANONYMOUS.may_route and ANONYMOUS.admin
    assert Tenants(["k-12345678"]).lookup(b"k-12345678").may_route  # routing is allowed unless restricted


def test_tenant_settings_from_file_env_and_flags(tmp_path):
    table = tmp_path / "serve.toml"
    table.write_text(
        '[serve]\napi_keys = ["ops:file-key-0001", "plain-key-0002"]\nroute_tenants = []\n'
        'admin_tenants = ["ops"]\nsession_sharing = "shared"\n'
    )
    cfg = ServeConfig.load(table, env={})
    assert (cfg.api.route_tenants, cfg.api.admin_tenants, cfg.retrieval.session_sharing) == ([], ["ops"], "shared")
    env = {
        "SPECOPS_API_KEYS": "a:env-key-00001",
        "SPECOPS_SERVE_ROUTE_TENANTS": "a",
        "SPECOPS_SERVE_ADMIN_TENANTS": "*",
    }
    cfg = ServeConfig.load(env=env, overrides={"session_sharing": "tenant"})
    assert (cfg.api.route_tenants, cfg.api.admin_tenants, cfg.retrieval.session_sharing) == (["a"], ["*"], "tenant")
    assert ServeConfig().api.route_tenants == ["*"] and ServeConfig().retrieval.session_sharing == "tenant"
    with pytest.raises(ModelConfigError, match="admin_tenants names 'opps'"):
        ServeConfig.load(env={}, overrides={"api_keys": ["ops:ops-key-0001"], "admin_tenants": ["opps"]})
    with pytest.raises(ModelConfigError, match="api_keys must be at least 8 characters"):
        ServeConfig.load(env={}, overrides={"api_keys": ["ops:short"]})
    with pytest.raises(ModelConfigError, match="session_sharing"):
        ServeConfig.load(env={}, overrides={"session_sharing": "everyone"})


def test_the_serve_command_has_the_tenant_flags():
    import argparse

    from specops.serving.http.config import add_arguments, overrides_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--api-keys", "a:flag-key-0001", "--route-tenants", "", "--admin-tenants", "a", "--session-sharing", "shared"]
    )
    cfg = ServeConfig(**overrides_from_args(args))
    assert (cfg.api.route_tenants, cfg.api.admin_tenants, cfg.retrieval.session_sharing) == ([], ["a"], "shared")


# ---------------------------------------------------------------- request ids (issue 58)
def test_two_tenants_sending_one_request_id_get_distinct_records(tiny_models, tmp_path):
    """A client's ``X-Request-Id`` comes back as sent, but the logged records carry it under the
    tenant's id: two tenants' records never share an id (the trainer dedups and splits by it)."""
    from specops.streams import StreamConfig, codec, open_stream

    url = f"local://{tmp_path}/streams"
    cfg = serve_config(tiny_models, api_keys=KEYS, stream=url, auto_calibrate=False)
    with running(cfg, tmp_path) as srv:
        for key in (ALICE, BOB):
            r = requests.post(
                f"{srv.url}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0},
                headers={"Authorization": f"Bearer {key}", "X-Request-Id": "same-id"},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.headers["X-Request-Id"] == "same-id" and r.json()["id"] == "cmpl-same-id"
        assert srv.state.logger.flush(20)
    sc = StreamConfig(url=url)
    with open_stream(sc) as s:
        gens = [codec.decode(x.value).request_id for x in s.read(sc.topics.generations)]
    assert sorted(gens) == ["alice/same-id", "bob/same-id"]


def test_the_held_out_split_is_keyed_by_the_trainers_secret(tmp_path, monkeypatch):
    """A client picks its request id, not its side of the split: the side depends on a key the
    trainer makes under ``--out`` (kept across restarts) and on nothing the client knows."""
    from specops.trainer.online.trainer import _holdout, holdout_key_for, holdout_key_in

    key = holdout_key_in(tmp_path)
    assert holdout_key_in(tmp_path) == key and len(key) == 32  # made once, read back
    ids = [f"alice/r{i}" for i in range(400)]
    mine = [_holdout(i, 4, key) for i in ids]
    other = [_holdout(i, 4, b"\x01" * 32) for i in ids]
    assert 60 < sum(mine) < 140 and mine != other  # a quarter, and another key splits otherwise
    (tmp_path / "holdout.key").write_text("not hex")
    with pytest.raises(ValueError, match="holdout.key"):
        holdout_key_in(tmp_path)
    monkeypatch.setenv("SPECOPS_HOLDOUT_KEY", "ab" * 16)  # one key for trainers that share no --out
    assert holdout_key_for(tmp_path / "elsewhere") == b"\xab" * 16
    monkeypatch.setenv("SPECOPS_HOLDOUT_KEY", "abc")
    with pytest.raises(ValueError, match="SPECOPS_HOLDOUT_KEY"):
        holdout_key_for(tmp_path)

"""Serving seeds each cluster's past sessions from ``sessions-<cluster>@champion``: found at start,
swapped on a promotion, used by LLMA; a corrupt, foreign or unreachable version keeps the cache."""

from __future__ import annotations

import requests

from specops.core.models import load_pair
from specops.core.sessions.cache import SessionCacheConfig
from specops.core.sessions.store import DATA_FILE, save_sessions
from specops.registry import RegistryConfig, RegistryStore
from specops.serving.engine.spec import SpecEngine
from specops.serving.engine.types import SamplingParams
from specops.serving.fleet.follower import FollowConfig
from specops.serving.fleet.sessions import SessionFollower
from specops.serving.plan import plain_generate
from specops.serving.proposers.session_cache import SessionCache
from tests.serving.http.api_support import MODEL, metric, running, serve_config, wait_until

FAST = FollowConfig(poll_s=0.2, backoff_initial_s=0.05, backoff_max_s=0.1)


def _register(reg, tmp_path, docs, name: str, tokenizer_sha256: str = "tok", corrupt: bool = False) -> str:
    path = save_sessions(tmp_path / name, "code", docs, tokenizer_sha256)
    if corrupt:  # after its own checksum was written: the registry's manifest is right, the file is not
        blob = bytearray((path / DATA_FILE).read_bytes())
        blob[-1] ^= 0x1
        (path / DATA_FILE).write_bytes(bytes(blob))
    kind = reg.artifact("sessions")
    v = kind.register("code", path).version
    kind.promote("code", v)
    return v


def test_the_cache_follows_the_champion_and_keeps_it_on_a_bad_version(sqlite_uri, tmp_path):
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    cache = SessionCache(SessionCacheConfig(max_tokens=60, min_output_tokens=4))
    first = [tuple(range(i, i + 20)) for i in range(4)]  # 80 tokens: the newest 3 fit
    v1 = _register(reg, tmp_path, first, "v1")
    follower = SessionFollower(
        reg, cache, cache_dir=tmp_path / "cache", target_tokenizer_sha256="tok", vocab_size=97, follow=FAST
    ).start()
    try:
        assert wait_until(lambda: follower.serving_version("code") == v1, 20)  # found by listing, no event
        assert cache.export("code") == first[1:]
        assert not list((tmp_path / "cache").rglob("*.safetensors"))  # held in memory, not on disk
        cache.add("code", tuple(range(50, 60)))  # served outputs are added on top

        for bad in (
            _register(reg, tmp_path, first, "corrupt", corrupt=True),
            _register(reg, tmp_path, first, "foreign", tokenizer_sha256="other"),
            _register(reg, tmp_path, [tuple(range(90, 110))], "vocab"),
        ):  # token ids past 97
            assert not follower.check("code") and follower.serving_version("code") == v1
        assert cache.export("code")[-1] == tuple(range(50, 60))

        v5 = _register(reg, tmp_path, [tuple(range(30, 50))], "v5")
        follower.on_event(type("Event", (), {"model_name": "sessions-code"})())
        assert wait_until(lambda: follower.serving_version("code") == v5, 20)
        assert cache.export("code") == [tuple(range(30, 50))] and follower.seeds == 2
    finally:
        follower.stop()


def test_serving_seeds_llma_from_the_champion_at_start(tiny_models, sqlite_uri, tmp_path):
    """A server sharing past sessions across tenants starts its cache with the registered outputs,
    and an LLMA request copies them (a tenant-scoped server does not seed: tests/serving/http/test_tenancy.py)."""
    pair = load_pair(tiny_models / "target")
    prompt = [5, 17, 23, 9, 41, 3]
    answer = plain_generate(SpecEngine(pair), prompt, SamplingParams(max_new_tokens=24), method="target").token_ids
    reg = RegistryStore(RegistryConfig(uri=sqlite_uri))
    path = save_sessions(tmp_path / "s", "default", [tuple(answer)], pair.tokenizer_sha256)
    v = reg.artifact("sessions").register("default", path).version
    reg.artifact("sessions").promote("default", v)

    with running(serve_config(tiny_models, registry=sqlite_uri, session_sharing="shared"), tmp_path / "srv") as srv:
        follower = srv.state.session_follower
        assert follower is not None and wait_until(lambda: follower.serving_version("default") == v, 20)
        r = requests.post(
            f"{srv.url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "speculation": {"method": "llma", "k": 8},
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        spec = r.json()["speculation"]
        assert spec["llma"]["hits_sessions"] > 0 and spec["accepted"] > 0
        text = requests.get(f"{srv.url}/metrics", timeout=30).text
        assert metric(text, "specops_llma_session_version", cluster="default") == float(v)

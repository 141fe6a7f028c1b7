"""``ServeConfig`` in typed sections (issue 59): every flat key users write (serve.toml, the
environment, the flags) maps onto exactly one section's field through the one table ``KEYS``, and
a config built from flat keys, loaded from a file or from the environment is the same config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specops.core.errors import ModelConfigError
from specops.serving.config import ReplicaConfig
from specops.serving.http.config import KEYS, SECTIONS, ServeConfig, ServeKeys


def test_every_key_is_one_field_of_one_section():
    fields = [(section, name) for section, cls in SECTIONS.items() for name in cls.model_fields]
    assert sorted(KEYS.values()) == sorted(fields) and len(set(KEYS.values())) == len(KEYS)
    assert list(ServeKeys.model_fields) == list(KEYS)  # the flags, the env variables, the chart's schema
    for key, (section, name) in KEYS.items():
        flat, field = ServeKeys.model_fields[key], SECTIONS[section].model_fields[name]
        assert (flat.description, flat.get_default(call_default_factory=True)) == (
            field.description,
            field.get_default(call_default_factory=True),
        ), key


def test_flat_keys_sections_file_and_environment_agree(tmp_path):
    flat = {"port": 9100, "vllm_k": 5, "engine": "vllm", "max_queue": 7, "clusters": "code,prose", "kb_dirs": []}
    cfg = ServeConfig(**flat)
    assert (cfg.api.port, cfg.vllm.k, cfg.engine.kind, cfg.admission.max_queue) == (9100, 5, "vllm", 7)
    assert cfg.fleet.clusters == ["code", "prose"] and cfg.retrieval.kb_dirs == []
    assert ServeConfig.from_flat(**flat) == cfg == ServeConfig.from_flat(**cfg.flat())
    path = tmp_path / "serve.toml"
    path.write_text('[serve]\nport = 9100\nvllm_k = 5\nengine = "vllm"\nmax_queue = 7\nclusters = ["code", "prose"]\n')
    assert ServeConfig.load(path, env={}) == cfg
    env = {"SPECOPS_SERVE_PORT": "9100", "SPECOPS_SERVE_VLLM_K": "5", "SPECOPS_SERVE_ENGINE": "vllm"}
    env |= {"SPECOPS_SERVE_MAX_QUEUE": "7", "SPECOPS_SERVE_CLUSTERS": "code, prose"}
    assert ServeConfig.load(env=env) == cfg
    # a section given whole, and a flat key of the same section on top of it
    assert ServeConfig(vllm=cfg.vllm, engine=cfg.engine, api=cfg.api, port=9200).api.port == 9200
    assert ServeConfig(vllm=cfg.vllm).vllm.k == 5 and ServeConfig().flat() == ServeKeys().model_dump()


def test_the_replica_gets_its_sections_and_name_only():
    cfg = ServeConfig(replica="r1", max_concurrency=3, vllm_speculation="draft, copy", poll_s=2.0)
    replica = cfg.replica()
    assert isinstance(replica, ReplicaConfig) and replica.name == "r1" and not hasattr(replica, "api")
    assert (replica.admission.max_concurrency, replica.fleet.poll_s) == (3, 2.0)
    assert replica.vllm.speculations == ("draft", "copy") and replica.engine == cfg.engine
    assert ServeConfig(port=8123).replica().name.endswith("-8123")  # <hostname>-<port> by default


def test_rules_between_keys_name_the_keys():
    with pytest.raises(ModelConfigError, match=r"config: default_max_tokens \(100\) is above max_tokens_limit"):
        ServeConfig.load(env={}, overrides={"default_max_tokens": 100, "max_tokens_limit": 50})
    with pytest.raises(ModelConfigError, match="config: float16 needs a GPU"):
        ServeConfig.load(env={}, overrides={"dtype": "float16"})
    with pytest.raises(ModelConfigError, match=r"vllm_k \(SPECOPS_SERVE_VLLM_K='99'\)"):
        ServeConfig.load(env={"SPECOPS_SERVE_VLLM_K": "99"})
    with pytest.raises(ModelConfigError, match="bogus .*unknown key"):
        ServeConfig.load(env={}, overrides={"bogus": 1})
    with pytest.raises(ValidationError, match="default_cluster"):
        ServeConfig(default_cluster="no spaces")
    with pytest.raises(ValidationError):
        ServeConfig(bogus=1)

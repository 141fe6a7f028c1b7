"""Stream configuration: URLs, environment overrides, and TLS/SASL passthrough to kafka-python."""

from __future__ import annotations

import pytest

from specops.streams import StreamConfig, StreamConfigError, open_stream
from specops.streams.kafka import KafkaStream, client_kwargs
from specops.streams.local.stream import LocalStream


def test_url_schemes_pick_the_backend(tmp_path):
    assert isinstance(open_stream(f"local://{tmp_path}/x"), LocalStream)
    ks = open_stream("kafka://127.0.0.1:1,127.0.0.1:2")
    assert isinstance(ks, KafkaStream) and ks.servers == ["127.0.0.1:1", "127.0.0.1:2"]
    for bad, words in [
        ("redis://x", "local:// or kafka://"),
        ("kafka://", "host:port"),
        ("kafka://host", "host:port"),
        ("local://", "needs a path"),
    ]:
        with pytest.raises(StreamConfigError, match=words):
            open_stream(bad)


def test_environment_overrides_and_validation():
    env = {
        "SPECOPS_STREAM_URL": "kafka://b:9092",
        "SPECOPS_STREAM_NUM_PARTITIONS": "3",
        "SPECOPS_STREAM_FSYNC": "off",
        "SPECOPS_STREAM_SASL_PLAIN_PASSWORD": "s3cret",
    }
    cfg = StreamConfig.from_env(env)
    assert (cfg.url, cfg.num_partitions, cfg.fsync, cfg.sasl_plain_password) == ("kafka://b:9092", 3, False, "s3cret")
    with pytest.raises(StreamConfigError, match="SPECOPS_STREAM_NUM_PARTITIONS"):
        StreamConfig.from_env({"SPECOPS_STREAM_NUM_PARTITIONS": "many"})
    with pytest.raises(StreamConfigError, match="twice heartbeat"):
        StreamConfig(session_timeout_s=1, heartbeat_interval_s=1)
    with pytest.raises(StreamConfigError, match="security_protocol"):
        StreamConfig(security_protocol="TLS")


def test_tls_and_sasl_settings_reach_every_kafka_client():
    cfg = StreamConfig(
        url="kafka://b:9093",
        security_protocol="SASL_SSL",
        ssl_cafile="/etc/ca.pem",
        ssl_certfile="/etc/c.pem",
        ssl_keyfile="/etc/k.pem",
        ssl_check_hostname=False,
        sasl_mechanism="SCRAM-SHA-512",
        sasl_plain_username="u",
        sasl_plain_password="p",
        client_options={"client_id": "serving-1", "metadata_max_age_ms": 1000},
    )
    kw = client_kwargs(["b:9093"], cfg)
    assert kw["security_protocol"] == "SASL_SSL"
    assert (kw["ssl_cafile"], kw["ssl_certfile"], kw["ssl_keyfile"]) == ("/etc/ca.pem", "/etc/c.pem", "/etc/k.pem")
    assert kw["ssl_check_hostname"] is False
    assert (kw["sasl_mechanism"], kw["sasl_plain_username"], kw["sasl_plain_password"]) == ("SCRAM-SHA-512", "u", "p")
    assert kw["client_id"] == "serving-1" and kw["metadata_max_age_ms"] == 1000
    plain = client_kwargs(["b:9092"], StreamConfig(url="kafka://b:9092"))
    assert plain["security_protocol"] == "PLAINTEXT" and "ssl_cafile" not in plain and "sasl_mechanism" not in plain

"""deploy/compose: the single-host stack is valid, documented, and consistent with the code.

No docker engine is needed: compose.yaml is validated against the Compose Specification
schema (check-jsonschema's vendored copy), and the values that must agree with each other
or with the code (topics, ports, paths, URLs, config keys) are compared here.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
ONE_SHOTS = {"kafka-init", "s3-init", "mlflow-db-upgrade", "bootstrap", "kb"}


# ---------------------------------------------------------------- helpers
def strings(node) -> list[str]:
    """Every string value in a parsed YAML tree (what compose interpolates)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return []


def interpolations(text: str) -> list[tuple[str, str, str]]:
    """(name, operator, argument) of each ``${NAME<op>arg}`` / ``$NAME`` in ``text``; ``$$`` is a literal ``$``."""
    found, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            end = text.index("}", i)
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", text[i + 2 : end], re.S)
            assert m, f"cannot parse {text[i : end + 1]!r}"
            found.append((m.group(1), m.group(2) or "", m.group(3) or ""))
            i = end + 1
            continue
        m = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)", text[i:])
        if m:
            found.append((m.group(1), "", ""))
            i += m.end()
            continue
        i += 1
    return found


def resolve(text: str) -> str:
    """``text`` with each ``${VAR:-default}`` replaced by its default (what an empty .env gives)."""

    def sub(m: re.Match) -> str:
        ((name, op, arg),) = interpolations(m.group(0))
        return arg if op in (":-", "-") else f"<{name}>"

    return re.sub(r"(?<!\$)\$\{[^}]*\}", sub, text).replace("$$", "$")


def env_example() -> dict[str, tuple[str, str]]:
    """NAME -> (value, the comment lines right above it) from .env.example."""
    out: dict[str, tuple[str, str]] = {}
    comment: list[str] = []
    for line in (COMPOSE_DIR / ".env.example").read_text().splitlines():
        if line.startswith("#"):
            comment.append(line)
        elif "=" in line:
            name, _, value = line.partition("=")
            assert name not in out, f"{name} twice in .env.example"
            out[name.strip()] = (value.strip(), "\n".join(comment))
            comment = []
        else:
            comment = []
    return out


def command(service: str) -> list[str]:
    """A service's command as argv. A string is interpolated (defaults) then split, as compose does;
    a list is returned as written."""
    cmd = SERVICES[service]["command"]
    return shlex.split(resolve(cmd)) if isinstance(cmd, str) else list(cmd)


def option(argv: list[str], name: str) -> str:
    """The value of ``--name value`` or ``--name=value`` in ``argv``."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    raise AssertionError(f"{name} not in {argv}")


def mounts(service: str) -> dict[str, tuple[str, str]]:
    """target -> (source, mode) of a service's short-syntax volumes."""
    out = {}
    for spec in SERVICES[service].get("volumes", []):
        source, target, *mode = spec.split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


def dockerfile_healthchecks() -> dict[str, bool]:
    """Target -> whether the image built from it has a HEALTHCHECK (inherited through FROM)."""
    base: dict[str, str] = {}
    own: dict[str, bool | None] = {}
    stage = None
    for line in (REPO / "deploy" / "docker" / "Dockerfile").read_text().splitlines():
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            stage = m.group(2)
            base[stage], own[stage] = m.group(1), None
        elif stage and line.startswith("HEALTHCHECK"):
            own[stage] = line.split()[1] != "NONE"

    def has(name: str) -> bool:
        if name not in own:
            return False
        return own[name] if own[name] is not None else has(base[name])

    return {name: has(name) for name in own}


def build_target(service: str) -> str | None:
    build = SERVICES[service].get("build")
    return build.get("target") if isinstance(build, dict) else None


def env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in (SERVICES[service].get("environment") or {}).items()}


# ---------------------------------------------------------------- schema
def _check_jsonschema(*files: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("check-jsonschema")
    assert exe.exists(), f"{exe} is missing: check-jsonschema is a dev dependency (pip install -e '.[dev]')"
    return subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_matches_the_compose_spec(tmp_path):
    done = _check_jsonschema(COMPOSE_FILE)
    assert done.returncode == 0, done.stdout + done.stderr
    # the check is not vacuous: a typo the schema knows about fails it
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE_FILE.read_text().replace("condition: service_healthy", "condition: service_ready", 1))
    done = _check_jsonschema(broken)
    assert done.returncode != 0 and "service_ready" in done.stdout + done.stderr


# ---------------------------------------------------------------- variables
def test_env_example_documents_every_variable_and_its_default():
    used = [i for s in strings(COMPOSE) for i in interpolations(s)]
    documented = env_example()
    names = {name for name, _, _ in used}
    assert names == set(documented), (
        f"in compose.yaml only: {sorted(names - set(documented))}; "
        f"in .env.example only: {sorted(set(documented) - names)}"
    )
    for name, (value, comment) in documented.items():
        assert comment.strip("# \n"), f"{name} has no comment in .env.example"
    for name, op, arg in used:
        value, comment = documented[name]
        if op in (":-", "-"):
            assert arg == value, f"${{{name}}}: compose.yaml defaults to {arg!r}, .env.example says {value!r}"
        elif op in (":?", "?"):
            assert "REQUIRED" in comment and "DEV-ONLY" in comment, f"{name}: say it is required and the value dev-only"
        else:
            pytest.fail(f"${{{name}}} has no default and is not required (`:-default` or `:?message`)")


def test_secrets_are_required_never_defaulted():
    for service, spec in SERVICES.items():
        for key, value in env(service).items():
            if re.search(r"PASSWORD|SECRET", key):
                found = interpolations(value)
                assert found and all(op == ":?" for _, op, _ in found), f"{service}.{key} = {value!r}"
    used = {(name, op) for s in strings(COMPOSE) for name, op, _ in interpolations(s)}
    for secret in ("POSTGRES_PASSWORD", "S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY"):
        assert {op for name, op in used if name == secret} == {":?"}, secret
    # the MLflow backend URI carries no password (libpq reads PGPASSWORD)
    uri = urlsplit(resolve(option(command("mlflow"), "--backend-store-uri")))
    assert uri.password is None and "PGPASSWORD" in env("mlflow")


# ---------------------------------------------------------------- kafka
def test_kafka_is_one_kraft_node_and_kafka_init_creates_the_four_topics():
    from specops.streams.config import StreamConfig, Topics

    kafka = env("kafka")
    assert set(kafka["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node = kafka["KAFKA_NODE_ID"]
    voter_id, _, voter = kafka["KAFKA_CONTROLLER_QUORUM_VOTERS"].partition("@")
    assert voter_id == node and voter == "kafka:" + kafka["KAFKA_LISTENERS"].split("CONTROLLER://:")[1]
    assert kafka["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert int(kafka["KAFKA_MESSAGE_MAX_BYTES"]) >= 16 * 1024 * 1024  # the producer's max_request_size
    health = " ".join(SERVICES["kafka"]["healthcheck"]["test"])
    assert "/opt/kafka/bin/kafka-topics.sh --bootstrap-server localhost:9092 --list" in health
    # the stream URL the apps use is the advertised listener
    stream = urlsplit(env("serving")["SPECOPS_STREAM_URL"])
    assert stream.scheme == "kafka" and f"PLAINTEXT://{stream.netloc}" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    StreamConfig(url=env("serving")["SPECOPS_STREAM_URL"])  # valid for the streams package

    script = command("kafka-init")[-1]
    documented = env_example()
    for topic in Topics().all():
        lines = [ln for ln in script.splitlines() if f"--topic {topic} " in ln + " "]
        assert len(lines) == 1, f"{topic}: {len(lines)} create lines"
        argv = shlex.split(lines[0].replace("$$", "$"))
        assert {"--create", "--if-not-exists"} <= set(argv)
        assert option(argv, "--bootstrap-server") == stream.netloc
        assert option(argv, "--replication-factor") == "1"
        ((name, op, default),) = interpolations(option(argv, "--partitions"))
        assert op == ":-" and int(default) >= 1 and documented[name][0] == default, topic
    assert SERVICES["kafka-init"]["image"] == SERVICES["kafka"]["image"]


# ---------------------------------------------------------------- health and ordering
def test_long_running_services_have_healthchecks_and_depends_on_uses_conditions():
    images = dockerfile_healthchecks()
    assert images["serving"] and images["trainer"] and not images["bootstrap"]
    healthy: set[str] = set()
    for name, spec in SERVICES.items():
        one_shot = spec.get("restart") == "no"
        assert one_shot == (name in ONE_SHOTS), f"{name}: restart {spec.get('restart')!r}"
        if not one_shot:
            assert spec.get("restart") == "unless-stopped", name
            check = spec.get("healthcheck")
            if check is not None:
                assert not check.get("disable") and check["test"], f"{name}: empty healthcheck"
            else:
                assert images.get(build_target(name) or ""), f"{name}: no healthcheck in compose nor in its image"
            healthy.add(name)
    for name, spec in SERVICES.items():
        for dep, cond in (spec.get("depends_on") or {}).items():
            assert isinstance(cond, dict) and "condition" in cond, f"{name} -> {dep}: no condition"
            if cond["condition"] == "service_healthy":
                assert dep in healthy, f"{name} waits for {dep} to be healthy, which has no healthcheck"
            else:
                assert cond["condition"] == "service_completed_successfully" and dep in ONE_SHOTS, (name, dep, cond)
    # mlflow runs in the trainer image: it must not inherit the trainer's health check
    assert build_target("mlflow") == "trainer" and "/health" in " ".join(SERVICES["mlflow"]["healthcheck"]["test"])
    assert all(
        SERVICES[s].get("depends_on") for s in ("serving", "trainer", "mlflow", "gateway", "kafka-init", "s3-init")
    )


def test_images_are_pinned_and_volumes_declared():
    for name, spec in SERVICES.items():
        image = resolve(spec["image"])
        tag = image.rsplit(":", 1)[-1]
        assert ":" in image and re.match(r"v?\d", tag) and tag != "latest", f"{name}: unpinned image {image}"
    declared = set(COMPOSE["volumes"])
    used = {src for name in SERVICES for src, _ in mounts(name).values() if not src.startswith(".")}
    assert used == declared, (used, declared)
    for name in ("serving", "trainer"):
        assert mounts(name)["/models"] == ("models", "ro"), name
    assert mounts("bootstrap")["/models"] == ("models", "rw")
    assert mounts("postgres")["/docker-entrypoint-initdb.d"] == ("./postgres-init", "ro")


# ---------------------------------------------------------------- registry
def test_mlflow_server_uses_postgres_s3_and_serves_artifacts():
    argv = command("mlflow")
    assert argv[:2] == ["mlflow", "server"] and "--serve-artifacts" in argv
    backend = option(argv, "--backend-store-uri")
    assert backend.startswith("postgresql+psycopg2://")
    uri = urlsplit(resolve(backend))
    assert (uri.hostname, uri.port) == ("postgres", 5432)
    pg = env("postgres")
    assert uri.username == resolve(pg["POSTGRES_USER"]) and uri.path == "/" + resolve(pg["POSTGRES_DB"])
    artifacts = option(argv, "--artifacts-destination")
    assert artifacts.startswith("s3://")
    s3_port = option(command("s3"), "-s3.port")
    for name in ("mlflow", "s3-init"):
        endpoint = urlsplit(env(name).get("MLFLOW_S3_ENDPOINT_URL") or env(name)["S3_ENDPOINT_URL"])
        assert (endpoint.hostname, str(endpoint.port)) == ("s3", s3_port), name
    assert urlsplit(resolve(artifacts)).hostname == resolve(env("s3-init")["S3_BUCKET"])  # the bucket s3-init makes
    # the apps reach the server by its compose name: MLflow's host check must accept that Host header
    registry = urlsplit(env("serving")["SPECOPS_REGISTRY_URI"])
    assert registry.hostname == "mlflow" and str(registry.port) == option(argv, "--port")
    allowed = resolve(option(argv, "--allowed-hosts")).split(",")
    published = resolve(SERVICES["mlflow"]["ports"][0]).split(":")[-2]

    def accepted(host: str) -> bool:  # mlflow.server.security_utils.is_allowed_host_header
        return any(fnmatch.fnmatch(host, a) if "*" in a else host == a for a in allowed)

    assert accepted(registry.netloc) and accepted(f"localhost:{published}") and not accepted("evil.example:5000")
    assert env("trainer")["SPECOPS_REGISTRY_URI"] == env("serving")["SPECOPS_REGISTRY_URI"]


# ---------------------------------------------------------------- serving
def test_serve_toml_loads_and_agrees_with_compose_and_the_gateway():
    from specops.serving.http.api import OPEN_PATHS
    from specops.serving.http.config import ServeConfig

    assert mounts("serving")["/etc/specops/serve.toml"] == ("./serve.toml", "ro")
    cfg = ServeConfig.load(COMPOSE_DIR / "serve.toml", env={})  # as `specops serve --config` loads it
    assert cfg.api.host == "0.0.0.0" and SERVICES["serving"]["expose"] == [str(cfg.api.port)]
    assert cfg.fleet.stream == "default" and cfg.fleet.registry == "default"  # compose's SPECOPS_* variables decide
    target, draft = cfg.paths(Path("/data"))
    bootstrap_out = Path(option(command("bootstrap"), "--out"))
    assert (target, draft) == (bootstrap_out / "target", bootstrap_out / "draft")

    haproxy = (COMPOSE_DIR / "haproxy.cfg").read_text()
    m = re.search(r"^\s*server-template\s+\S+\s+1-(\d+)\s+(\S+):(\d+)", haproxy, re.M)
    assert m and (m.group(2), int(m.group(3))) == ("serving", cfg.api.port)
    replicas = int(resolve(str(SERVICES["serving"]["deploy"]["replicas"])))
    assert 1 <= replicas <= int(m.group(1)) and str(replicas) == env_example()["SERVING_REPLICAS"][0]
    probe = re.search(r"http-check send meth GET uri (\S+)", haproxy).group(1)
    assert probe == "/readyz" and probe in OPEN_PATHS  # readiness, and reachable without an API key
    monitor_port = re.search(r"frontend health\s+bind :(\d+)\s+monitor-uri (\S+)", haproxy)
    assert (
        f"http://127.0.0.1:{monitor_port.group(1)}{monitor_port.group(2)}" in SERVICES["gateway"]["healthcheck"]["test"]
    )
    published = resolve(SERVICES["gateway"]["ports"][0]).split(":")
    assert published[-1] == re.search(r"frontend api\s+bind :(\d+)", haproxy).group(1)


def _seconds(duration: str) -> float:
    """A compose duration such as ``1200s`` or ``1m30s`` in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def test_serving_vllm_is_an_opt_in_profile_of_the_serving_front_door_on_vllm():
    """``docker compose --profile vllm up``: the serving front door with engine vllm (vLLM's CPU build), beside
    ``serving`` and like it (models, serve.toml, stream, registry, start order), on a host port of its own."""
    from specops.serving.http.api import OPEN_PATHS
    from specops.serving.http.config import ServeConfig

    vllm = SERVICES["serving-vllm"]
    assert vllm["profiles"] == ["vllm"]
    assert {name: spec["profiles"] for name, spec in SERVICES.items() if spec.get("profiles")} == {
        "serving-vllm": ["vllm"],
        "milvus": ["milvus"],
        "kb": ["milvus"],
        "prometheus": ["monitoring"],
        "grafana": ["monitoring"],
    }, "the rest start always"
    assert build_target("serving-vllm") == "serving-vllm" and vllm["build"]["args"]["VARIANT"] == "cpu"
    assert resolve(vllm["image"]).startswith("ghcr.io/specops/specops-serving-vllm:")
    assert mounts("serving-vllm") == mounts("serving")
    assert vllm["depends_on"] == SERVICES["serving"]["depends_on"]
    assert {k: v for k, v in env("serving-vllm").items() if not k.startswith("SPECOPS_SERVE_")} == env("serving")

    resolved = {k: resolve(v) for k, v in env("serving-vllm").items()}
    cfg = ServeConfig.load(COMPOSE_DIR / "serve.toml", env=resolved)  # as the container loads it
    assert cfg.engine.kind == "vllm" and cfg.vllm.speculation == "draft"
    assert cfg.vllm.max_model_len >= cfg.admission.max_prompt_tokens + cfg.admission.max_tokens_limit, (
        "vLLM would refuse long requests"
    )

    published = {resolve(p).rsplit(":", 2)[-2] for s in ("gateway", "mlflow") for p in SERVICES[s]["ports"]}
    (port,) = vllm["ports"]
    host_port, container_port = resolve(port).rsplit(":", 2)[-2:]
    assert container_port == str(cfg.api.port) and host_port not in published
    check = vllm["healthcheck"]
    probe = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(check["test"]))
    assert probe and probe.group(1) == str(cfg.api.port) and probe.group(2) == "/readyz" and "/readyz" in OPEN_PATHS
    # healthy = ready: the grace must outlast one vLLM server's start (a CPU compiles the model first)
    assert _seconds(check["start_period"]) >= cfg.vllm.start_timeout_s
    assert _seconds(vllm["stop_grace_period"]) >= _seconds(SERVICES["serving"]["stop_grace_period"])


# ---------------------------------------------------------------- knowledge bases (profile milvus)
MILVUS_URI = "http://milvus:19530"


def test_milvus_profile_runs_a_pinned_milvus_standalone_with_embedded_etcd_and_local_storage():
    """``docker compose --profile milvus up``: one Milvus standalone container (no etcd / MinIO services), its
    data on a named volume, healthy once /healthz on its metrics port answers, reachable on the network only."""
    milvus = SERVICES["milvus"]
    assert milvus["profiles"] == ["milvus"] and milvus["restart"] == "unless-stopped"
    assert re.fullmatch(r"milvusdb/milvus:v2\.[56]\.\d+", milvus["image"]), milvus["image"]
    assert milvus["command"] == ["milvus", "run", "standalone"]
    e = env("milvus")
    assert e["ETCD_USE_EMBED"] == "true" and e["COMMON_STORAGETYPE"] == "local" and e["DEPLOY_MODE"] == "STANDALONE"
    volumes = mounts("milvus")
    assert volumes["/var/lib/milvus"] == ("milvus-data", "rw") and "milvus-data" in COMPOSE["volumes"]
    assert Path(e["ETCD_DATA_DIR"]).is_relative_to("/var/lib/milvus"), "etcd's data must live on the volume"
    source, mode = volumes[e["ETCD_CONFIG_PATH"]]
    assert mode == "ro" and (COMPOSE_DIR / source).is_file()
    etcd = yaml.safe_load((COMPOSE_DIR / source).read_text())
    for key in ("listen-client-urls", "advertise-client-urls"):
        assert urlsplit(etcd[key]).hostname == "127.0.0.1", f"{key}: Milvus reaches its embedded etcd in-process"
    assert etcd["auto-compaction-mode"] == "revision" and int(etcd["auto-compaction-retention"]) > 0
    check = milvus["healthcheck"]
    assert check["test"][:2] == ["CMD", "curl"] and "http://localhost:9091/healthz" in check["test"]
    assert _seconds(check["start_period"]) >= 60, "first start initialises etcd and the WAL"
    uri = urlsplit(MILVUS_URI)
    assert set(milvus["expose"]) == {str(uri.port), "9091"} and "ports" not in milvus, "not published on the host"


def test_kb_job_builds_the_default_kb_into_milvus_and_registers_it():
    """The one-shot ``kb`` runs ``specops kb build --backend milvus`` against the ``milvus`` service once it is
    healthy, with the registry and stream settings of the other jobs and the bootstrap's models (tokenizer and
    held-out list)."""
    kb = SERVICES["kb"]
    assert kb["profiles"] == ["milvus"] and kb["restart"] == "no" and "kb" in ONE_SHOTS
    assert build_target("kb") == "trainer" and kb["image"] == SERVICES["trainer"]["image"]
    assert kb["healthcheck"] == {"disable": True}, "a one-shot must not inherit the trainer's health check"
    argv = command("kb")
    assert argv[:3] == ["specops", "kb", "build"]
    assert option(argv, "--backend") == "milvus" and option(argv, "--milvus-uri") == MILVUS_URI
    assert option(argv, "--model-dir") == option(command("bootstrap"), "--out")
    assert mounts("kb") == {"/models": ("models", "ro")}
    assert kb["depends_on"]["milvus"] == {"condition": "service_healthy"}
    assert {k: v for k, v in kb["depends_on"].items() if k != "milvus"} == {
        k: v for k, v in SERVICES["trainer"]["depends_on"].items() if k != "postgres"
    }, "registry, stream and models ready, as for the trainer"
    assert env("kb") == {k: v for k, v in env("trainer").items() if not k.startswith("PG")}


def test_kb_job_command_parses_as_specops_kb_build():
    from specops.cli.main import build_parser

    args = build_parser().parse_args(command("kb")[1:])
    assert (args.name, args.backend, args.milvus_uri) == ("manpages", "milvus", MILVUS_URI)
    assert not args.no_register and not args.no_promote, "the KB is registered and promoted: serving finds it"


def test_every_specops_service_finds_the_milvus_kb_service_and_nothing_always_on_waits_for_it():
    """Compose cannot make a variable depend on a profile, so SPECOPS_MILVUS_URI is set always: it only overrides
    the URI in a Milvus-backed KB's manifest. No service outside the profile depends on the profile's services
    (compose would refuse to start them without ``--profile milvus``)."""
    for name in ("serving", "serving-vllm", "trainer", "kb"):
        assert env(name)["SPECOPS_MILVUS_URI"] == MILVUS_URI, name
    assert urlsplit(MILVUS_URI).hostname in SERVICES
    for name, spec in SERVICES.items():
        if "milvus" not in spec.get("profiles", []):
            assert not {"milvus", "kb"} & set(spec.get("depends_on") or {}), f"{name} waits for profile milvus"


def test_bootstrap_writes_a_subdirectory_of_the_models_volume():
    from specops.cli.main import build_parser

    argv = command("bootstrap")
    assert argv[:2] == ["specops", "bootstrap"]
    args = build_parser().parse_args(argv[1:])
    out = Path(args.out)
    # it renames a sibling temp dir into place: the volume's root (a mount point) cannot be the target
    assert out.parent == Path("/models") and "/models" in mounts("bootstrap")
    assert SERVICES["bootstrap"]["build"]["target"] == "bootstrap"


# ---------------------------------------------------------------- trainer
def test_train_toml_loads_as_specops_train_config():
    import argparse

    from specops import config_file
    from specops.cli.main import build_parser

    assert mounts("trainer")["/etc/specops/train.toml"] == ("./train.toml", "ro")
    path = COMPOSE_DIR / "train.toml"
    settings = tomllib.loads(path.read_text())
    parser = build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    flags = {s for a in train._actions for s in a.option_strings}
    assert all("--" + key.replace("_", "-") in flags for key in settings), "train.toml: keys that are not options"
    # as `specops train --config FILE` does: the file's values become the defaults, checked per key
    train.set_defaults(**config_file.load(path, train, "train"))
    args = parser.parse_args(["train", "--config", str(path)])
    assert {key: getattr(args, key) for key in settings} == {key: settings[key] for key in settings}
    assert args.schedule is True  # the image's health check watches the scheduler
    assert Path(args.model_dir) == Path(option(command("bootstrap"), "--out"))
    assert Path(args.out).is_relative_to("/data") and mounts("trainer")["/data"][0] == "trainer-data"
    # metrics on the compose network only: exposed on the port train.toml names, never published on the host
    assert args.metrics_port == 9400 and SERVICES["trainer"]["expose"] == [str(args.metrics_port)]
    assert "ports" not in SERVICES["trainer"]

    from specops.trainer.schedule import ScheduleConfig

    ScheduleConfig(jobstore_url=args.jobstore)  # a job-store URL the scheduler accepts
    store = urlsplit(args.jobstore)
    assert (store.hostname, store.port, store.username, store.password) == ("postgres", 5432, None, None)
    assert {"PGUSER", "PGPASSWORD"} <= set(env("trainer"))  # libpq's credentials for that URL
    created = re.findall(
        r"CREATE DATABASE (\w+)", "".join(p.read_text() for p in (COMPOSE_DIR / "postgres-init").glob("*.sql"))
    )
    assert store.path.lstrip("/") in created and store.path.lstrip("/") != resolve(env("postgres")["POSTGRES_DB"])


def test_mlflow_schema_is_migrated_once_before_the_server_starts():
    """One one-shot service runs ``mlflow db upgrade`` on MLflow's database; the server waits for it to succeed."""
    argv = command("mlflow-db-upgrade")
    assert argv[:3] == ["mlflow", "db", "upgrade"] and argv[3] == option(command("mlflow"), "--backend-store-uri")
    assert build_target("mlflow-db-upgrade") == "trainer" == build_target("mlflow"), "the same MLflow as the server"
    assert env("mlflow-db-upgrade")["PGPASSWORD"] == env("mlflow")["PGPASSWORD"]
    assert SERVICES["mlflow"]["depends_on"]["mlflow-db-upgrade"] == {"condition": "service_completed_successfully"}
    assert SERVICES["mlflow-db-upgrade"]["depends_on"]["postgres"] == {"condition": "service_healthy"}
    upgrades = [
        n for n, spec in SERVICES.items() if "command" in spec and command(n)[:3] == ["mlflow", "db", "upgrade"]
    ]
    assert upgrades == ["mlflow-db-upgrade"]


def test_serving_stops_after_its_drain_not_before():
    """``stop_grace_period`` covers serve.toml's shutdown_timeout_s, which covers the longest admitted request."""
    from specops.serving.http.config import ServeConfig

    cfg = ServeConfig.load(COMPOSE_DIR / "serve.toml", env={})
    assert cfg.admission.shutdown_timeout_s >= cfg.admission.queue_timeout_s + cfg.admission.request_timeout_s
    for name in ("serving", "serving-vllm"):
        assert mounts(name)["/etc/specops/serve.toml"] == ("./serve.toml", "ro")
        assert _seconds(SERVICES[name]["stop_grace_period"]) > cfg.admission.shutdown_timeout_s, name


# ---------------------------------------------------------------- fleet view (profile monitoring)
PROMETHEUS_FILE = COMPOSE_DIR / "prometheus" / "prometheus.yml"
GRAFANA_DIR = COMPOSE_DIR / "grafana" / "provisioning"
DASHBOARDS = REPO / "deploy" / "helm" / "specops" / "dashboards"


def prometheus_config() -> dict:
    """prometheus.yml as Prometheus reads it, checked to be the file compose mounts at --config.file."""
    source, mode = mounts("prometheus")[option(command("prometheus"), "--config.file")]
    assert mode == "ro" and (COMPOSE_DIR / source).resolve() == PROMETHEUS_FILE
    return yaml.safe_load(PROMETHEUS_FILE.read_text())


def scrape_job(config: dict, name: str) -> dict:
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == name]
    return job


def published_port(service: str) -> tuple[str, str]:
    """(host port variable's default, container port) of a service's one published port."""
    (spec,) = SERVICES[service]["ports"]
    host_ip, host_port, container = resolve(spec).split(":")
    assert host_ip == "127.0.0.1", f"{service}: published on SPECOPS_BIND_ADDRESS (default loopback)"
    assert spec.startswith("${SPECOPS_BIND_ADDRESS:-"), service
    return host_port, container


def test_monitoring_profile_runs_a_pinned_prometheus_and_grafana_and_nothing_else_waits_for_them():
    """``docker compose --profile monitoring up``: Prometheus and Grafana, off by default, published on the
    bind address; no service outside the profile depends on them (compose would refuse to start it)."""
    monitoring = {n for n, s in SERVICES.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    assert all(SERVICES[n]["profiles"] == ["monitoring"] for n in monitoring)
    assert re.fullmatch(r"prom/prometheus:v3\.\d+\.\d+", SERVICES["prometheus"]["image"])
    assert re.fullmatch(r"grafana/grafana:1\d\.\d+\.\d+", SERVICES["grafana"]["image"])
    for name, spec in SERVICES.items():
        if name not in monitoring:
            assert not monitoring & set(spec.get("depends_on") or {}), f"{name} waits for profile monitoring"
    assert SERVICES["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert published_port("prometheus") == (env_example()["PROMETHEUS_PORT"][0], "9090")
    assert published_port("grafana") == (env_example()["GRAFANA_PORT"][0], "3000")
    # samples on a named volume, kept for PROMETHEUS_RETENTION
    assert mounts("prometheus")[option(command("prometheus"), "--storage.tsdb.path")] == ("prometheus-data", "rw")
    retention = resolve(option(command("prometheus"), "--storage.tsdb.retention.time"))
    assert retention == env_example()["PROMETHEUS_RETENTION"][0] and re.fullmatch(r"\d+[dwhy]", retention)
    for name, port in (("prometheus", "9090"), ("grafana", "3000")):
        probe = SERVICES[name]["healthcheck"]["test"]
        assert probe[:2] == ["CMD", "wget"] and urlsplit(probe[-1]).port == int(port), name


def test_prometheus_scrapes_every_serving_replica_by_dns_and_the_trainer():
    """Each replica is its own target (the gateway's /metrics reaches one at a time): a DNS A lookup of the
    serving service name, which Docker answers with every replica, on serve.toml's port; the trainer on
    train.toml's metrics_port."""
    from specops import config_file
    from specops.cli.main import build_parser
    from specops.serving.http.config import ServeConfig

    config = prometheus_config()
    serve = ServeConfig.load(COMPOSE_DIR / "serve.toml", env={})
    assert not serve.api.auth_metrics, "serving's /metrics needs a key: give the serving jobs `authorization`"
    for name in ("serving", "serving-vllm"):
        job = scrape_job(config, name)
        assert job.get("metrics_path", "/metrics") == "/metrics" and "static_configs" not in job, name
        (sd,) = job["dns_sd_configs"]
        assert sd["names"] == [name] and sd["type"] == "A" and sd["port"] == serve.api.port, name
        assert SERVICES[name].get("expose", [str(serve.api.port)]) == [str(serve.api.port)], name
    from specops.serving.http import api

    assert '@app.get("/metrics")' in Path(api.__file__).read_text(), "the path the serving jobs scrape"

    import argparse

    parser = build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    train.set_defaults(**config_file.load(COMPOSE_DIR / "train.toml", train, "train"))
    port = parser.parse_args(["train", "--config", str(COMPOSE_DIR / "train.toml")]).metrics_port
    trainer = scrape_job(config, "trainer")
    assert trainer.get("metrics_path", "/metrics") == "/metrics"  # prometheus_client's start_http_server
    assert trainer["static_configs"] == [{"targets": [f"trainer:{port}"]}]
    assert SERVICES["trainer"]["expose"] == [str(port)]
    # the data source's timeInterval is the scrape interval: $__rate_interval then spans four scrapes
    (source,) = yaml.safe_load((GRAFANA_DIR / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]


def test_prometheus_config_passes_promtool(tmp_path):
    """``promtool check config`` on prometheus.yml (Debian: ``apt-get install prometheus``; skipped without it)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")

    def check(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)

    done = check(PROMETHEUS_FILE)
    assert done.returncode == 0, done.stdout + done.stderr
    # the check is not vacuous: a record type Prometheus does not know fails it
    broken = tmp_path / "prometheus.yml"
    broken.write_text(PROMETHEUS_FILE.read_text().replace("type: A", "type: AAAAA", 1))
    done = check(broken)
    assert done.returncode != 0 and "AAAAA" in done.stdout + done.stderr


def test_grafana_provisions_the_charts_dashboard_read_only_over_that_prometheus():
    """The dashboard is the chart's file, mounted read-only (not a copy); the provisioned Prometheus is the
    default data source, so the dashboard's ``datasource`` variable (type prometheus) resolves to it."""
    volumes = mounts("grafana")
    assert volumes["/etc/grafana/provisioning"] == ("./grafana/provisioning", "ro")
    assert (COMPOSE_DIR / volumes["/etc/grafana/provisioning"][0]).resolve() == GRAFANA_DIR
    (provider,) = yaml.safe_load((GRAFANA_DIR / "dashboards" / "specops.yaml").read_text())["providers"]
    assert provider["type"] == "file" and provider["allowUiUpdates"] is False
    folder = provider["options"]["path"]
    source, mode = volumes[folder]
    assert mode == "ro" and (COMPOSE_DIR / source).resolve() == DASHBOARDS
    home = PurePosixPath(env("grafana")["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == PurePosixPath(folder) and (DASHBOARDS / home.name).is_file()
    dashboard = json.loads((DASHBOARDS / home.name).read_text())
    assert dashboard["uid"] and dashboard["panels"]

    (source,) = yaml.safe_load((GRAFANA_DIR / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True and source["access"] == "proxy"
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus" and str(url.port) == published_port("prometheus")[1]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"] == variables["datasource"] | {"type": "datasource", "query": source["type"]}
    # every data source the dashboard names is that variable, or the provisioned uid
    named = {m for m in re.findall(r'"uid":\s*"([^"]*)"', json.dumps(dashboard)) if m != dashboard["uid"]}
    assert named <= {"${datasource}", source["uid"]}, named


def test_grafana_is_an_anonymous_read_only_view_with_no_login():
    """No admin password to set or leak: anonymous viewers, no login form, no basic auth, no sign-up."""
    e = env("grafana")
    assert e["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and e["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert e["GF_AUTH_DISABLE_LOGIN_FORM"] == "true" and e["GF_AUTH_BASIC_ENABLED"] == "false"
    assert e["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert not [k for k in e if "PASSWORD" in k or "ADMIN" in k]


def _fleet_screenshot_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_fleet_screenshot", REPO / "docs" / "build_fleet_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_the_fleet_screenshot_runs_composes_prometheus_config_with_only_its_targets_moved():
    """docs/build_fleet_screenshot.py (deploy/README.md's picture) scrapes with this prometheus.yml, its targets
    on loopback and nothing else changed, and fills in every variable the dashboard's queries use."""
    script = _fleet_screenshot_script()
    config = prometheus_config()
    serving, trainer, prometheus = ["127.0.0.1:8001", "127.0.0.1:8002"], "127.0.0.1:9400", "127.0.0.1:9090"
    local = script.localize(config, serving, trainer, prometheus)
    assert {k: v for k, v in local.items() if k != "scrape_configs"} == {
        k: v for k, v in config.items() if k != "scrape_configs"
    }
    jobs = {j["job_name"]: j for j in local["scrape_configs"]}
    assert set(jobs) == {"serving", "trainer", "prometheus"}, "serving-vllm has no process on the script's host"
    assert [jobs[n]["static_configs"] for n in ("serving", "trainer", "prometheus")] == [
        [{"targets": serving}],
        [{"targets": [trainer]}],
        [{"targets": [prometheus]}],
    ]
    for name, job in jobs.items():
        original = scrape_job(config, name)
        kept = lambda j: {k: v for k, v in j.items() if k not in ("static_configs", "dns_sd_configs")}  # noqa: E731
        assert kept(job) == kept(original), name
    assert config == prometheus_config(), "localize must not change its argument"

    dashboard = json.loads((DASHBOARDS / "specops.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs and all("$" not in script.fill(e, 15, 60) for e in exprs)
    assert script.grafana_intervals(15, 600, 900) == (15, 60)  # Grafana: max(interval + scrape, 4 * scrape)
    assert script.grafana_intervals(15, 6 * 3600, 900) == (24, 60)

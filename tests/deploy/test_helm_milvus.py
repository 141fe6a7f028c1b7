"""The Helm chart's knowledge-base service (``retrieval.milvus``): none renders nothing of it; lite runs Milvus Lite's
server (Deployment, Service, PVC) and points the pods at it; external points them at your Milvus with the token
from a Secret; ``kbBuild`` is an opt-in post-install / post-upgrade Job building a KB into it.

ci/milvus-values.yaml (lite, with the Job and NetworkPolicies) and ci/milvus-external-values.yaml are linted and
validated with the other ci/ files by test_helm.py. The lite server's command and the Job's wait script are run
here for real (loopback only).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.deploy import helm_support as hs

CI = {path.name: path for path in hs.ci_value_files()}
DEFAULT = CI["default-values.yaml"]
LITE = CI["milvus-values.yaml"]
EXTERNAL = CI["milvus-external-values.yaml"]
MILVUS_ENV = ("SPECOPS_MILVUS_URI", "SPECOPS_MILVUS_TOKEN")


def _values(values_file=None, set_values=None) -> dict:
    """The values the chart renders with: its values.yaml under the file's and the --set ones."""
    return hs._merge(hs.load_values(hs.CHART_DIR / "values.yaml"), hs.load_values(values_file, set_values))


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def _pods(objects: list[dict]) -> dict[str, dict]:
    """component -> pod spec of every Deployment, CronJob and Job."""
    out = {}
    for obj in objects:
        if obj["kind"] in ("Deployment", "CronJob"):
            out[hs.component(obj)] = hs.pod_spec(obj)
        elif obj["kind"] == "Job":
            out[hs.component(obj)] = obj["spec"]["template"]["spec"]
    return out


def _user_pods(objects: list[dict]) -> dict[str, list[dict]]:
    """The containers (init containers too) of serving, the trainer and the kb-build Job."""
    pods = _pods(objects)
    return {
        name: pods[name].get("initContainers", []) + pods[name]["containers"]
        for name in ("serving", "trainer", "kb-build")
        if name in pods
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ none
def test_none_is_the_default_and_renders_nothing_of_milvus():
    assert _values()["retrieval"]["milvus"]["mode"] == "none"
    assert _values()["retrieval"]["milvus"]["kbBuild"]["enabled"] is False
    objects = hs.render(DEFAULT)
    assert not [o for o in objects if hs.component(o) in ("milvus", "kb-build")]
    for pod in _pods(objects).values():
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert not set(MILVUS_ENV) & set(_env(c)), c["name"]
    assert "Knowledge-base service" not in hs.notes(DEFAULT)


# ------------------------------------------------------------------ lite
def test_lite_runs_one_milvus_lite_server_on_its_pvc():
    objects = hs.render(LITE)
    values = _values(LITE)["retrieval"]["milvus"]["lite"]
    deployment = hs.one(objects, "Deployment", "milvus")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}, (
        "one process holds the data directory's lock"
    )
    c = hs.container(deployment, "milvus")
    assert c["image"] == "ghcr.io/specops/specops-serving:0.1.0" and "command" not in c, "tini stays PID 1"
    assert c["args"][:2] == ["python", "-c"] and "milvus_lite.cmdline" in c["args"][2]
    assert c["args"][3:] == [
        "server",
        "--data-dir",
        "/data/milvus",
        "--host",
        "0.0.0.0",
        "--port",
        str(values["port"]),
        "--max-workers",
        str(values["maxWorkers"]),
    ]
    assert c["ports"] == [{"name": "grpc", "containerPort": 19530, "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "grpc"}, probe
    assert c["resources"] == values["resources"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    pod = hs.pod_spec(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert Path("/data/milvus").is_relative_to("/data") and "/tmp" in mounts
    pvc = hs.one(objects, "PersistentVolumeClaim", "milvus")
    assert volumes[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_lite_service_selects_only_the_server_and_its_uri_reaches_serving_trainer_and_the_job():
    objects = hs.render(LITE)
    service = hs.one(objects, "Service", "milvus")
    pods = {hs.component(d): d["spec"]["template"]["metadata"]["labels"] for d in hs.find(objects, "Deployment")}
    assert {name for name, labels in pods.items() if service["spec"]["selector"].items() <= labels.items()} == {
        "milvus"
    }
    (port,) = service["spec"]["ports"]
    assert port == {"name": "grpc", "port": 19530, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}
    uri = f"http://{service['metadata']['name']}:{port['port']}"
    containers = _user_pods(objects)
    assert set(containers) == {"serving", "trainer", "kb-build"}
    for name, cs in containers.items():
        for c in cs:
            env = _env(c)
            assert env["SPECOPS_MILVUS_URI"] == {"name": "SPECOPS_MILVUS_URI", "value": uri}, (name, c["name"])
            assert "SPECOPS_MILVUS_TOKEN" not in env, "Milvus Lite has no authentication"
    # the CronJobs do not retrieve
    for job in hs.find(objects, "CronJob"):
        assert not set(MILVUS_ENV) & {e["name"] for c in hs.pod_spec(job)["containers"] for e in c.get("env", [])}
    assert uri in hs.notes(LITE)


def test_extra_env_still_overrides_the_milvus_uri():
    """extraEnv comes last in every container's env (the later of two equal names wins in Kubernetes)."""
    override = {"extraEnv": [{"name": "SPECOPS_MILVUS_URI", "value": "http://elsewhere:19530"}]}
    objects = hs.render(LITE, override)
    for name, cs in _user_pods(objects).items():
        for c in cs:
            names = [e["name"] for e in c["env"]]
            assert names.count("SPECOPS_MILVUS_URI") == 2, (name, c["name"])
            assert (
                c["env"][len(names) - 1 - names[::-1].index("SPECOPS_MILVUS_URI")]["value"] == "http://elsewhere:19530"
            )


def test_lite_image_has_no_cuda_suffix_and_can_be_set():
    cuda = hs.render(DEFAULT, {"image": {"variant": "cuda"}, "retrieval": {"milvus": {"mode": "lite"}}})
    assert hs.container(hs.one(cuda, "Deployment", "serving"), "serving")["image"].endswith("-cuda")
    assert (
        hs.container(hs.one(cuda, "Deployment", "milvus"), "milvus")["image"] == "ghcr.io/specops/specops-serving:0.1.0"
    )
    own = {"mode": "lite", "lite": {"image": {"repository": "r.example/specops", "tag": "7"}}}
    objects = hs.render(DEFAULT, {"retrieval": {"milvus": own}})
    assert hs.container(hs.one(objects, "Deployment", "milvus"), "milvus")["image"] == "r.example/specops:7"


def test_lite_existing_claim_replaces_the_charts_pvc():
    lite = {"mode": "lite", "lite": {"persistence": {"existingClaim": "old-kb-data"}}}
    objects = hs.render(DEFAULT, {"retrieval": {"milvus": lite}})
    assert hs.find(objects, "PersistentVolumeClaim", "milvus") == []
    volumes = {v["name"]: v for v in hs.pod_spec(hs.one(objects, "Deployment", "milvus"))["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "old-kb-data"


def test_lite_network_policy_admits_only_this_releases_pods():
    objects = hs.render(LITE)
    policy = hs.one(objects, "NetworkPolicy", "milvus")
    server = hs.one(objects, "Deployment", "milvus")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= server.items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    (peer,) = rule["from"]
    clients = [
        hs.one(objects, "Deployment", n)["spec"]["template"]["metadata"]["labels"] for n in ("serving", "trainer")
    ]
    clients.append(hs.one(objects, "Job", "kb-build")["spec"]["template"]["metadata"]["labels"])
    assert all(peer["podSelector"]["matchLabels"].items() <= labels.items() for labels in clients)


# ------------------------------------------------------------------ external
def test_external_points_at_the_uri_with_the_token_from_the_secret():
    objects = hs.render(EXTERNAL)
    external = _values(EXTERNAL)["retrieval"]["milvus"]["external"]
    assert not [o for o in objects if hs.component(o) in ("milvus", "kb-build")], "nothing of Milvus is run"
    assert hs.find(objects, "Secret") == [], "the token is never a value the chart stores"
    containers = _user_pods(objects)
    assert set(containers) == {"serving", "trainer"}
    for name, (c,) in containers.items():
        env = _env(c)
        assert env["SPECOPS_MILVUS_URI"]["value"] == external["uri"], name
        assert env["SPECOPS_MILVUS_TOKEN"] == {
            "name": "SPECOPS_MILVUS_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "specops-milvus", "key": "token"}},
        }, name
    notes = hs.notes(EXTERNAL)
    assert external["uri"] in notes and "specops-milvus" in notes


def test_external_without_a_token_secret_sets_no_token():
    set_values = {"retrieval": {"milvus": {"external": {"tokenSecret": {"name": ""}}}}}
    for name, (c,) in _user_pods(hs.render(EXTERNAL, set_values)).items():
        assert "SPECOPS_MILVUS_TOKEN" not in _env(c) and "SPECOPS_MILVUS_URI" in _env(c), name


# ------------------------------------------------------------------ the kb-build Job
def test_kb_build_is_an_opt_in_post_install_hook_building_into_the_service():
    objects = hs.render(LITE)
    job = hs.one(objects, "Job", "kb-build")
    k = _values(LITE)["retrieval"]["milvus"]["kbBuild"]
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "post-install,post-upgrade"
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation"
    assert job["spec"]["backoffLimit"] == k["backoffLimit"]
    assert job["spec"]["activeDeadlineSeconds"] == k["activeDeadlineSeconds"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    argv = c["args"]
    assert argv[:3] == ["specops", "kb", "build"] and c["image"] == "ghcr.io/specops/specops-trainer:0.1.0"
    uri = _env(c)["SPECOPS_MILVUS_URI"]["value"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {"--name": k["name"], "--backend": "milvus", "--milvus-uri": uri, "--model-dir": "/models"}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["/models"]["readOnly"] is True
    assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["claimName"] == "specops-models"
    (wait,) = pod["initContainers"]
    assert int(_env(wait)["WAIT_TIMEOUT_S"]["value"]) == k["waitTimeoutSeconds"]
    assert "kb-manpages" in hs.notes(LITE)
    # extra arguments come last; with an external Milvus the Job carries its token too
    more = {"retrieval": {"milvus": {"kbBuild": {"enabled": True, "args": ["--embedder", "hash"]}}}}
    job = hs.one(hs.render(EXTERNAL, more), "Job", "kb-build")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"][-2:] == ["--embedder", "hash"] and "SPECOPS_MILVUS_TOKEN" in _env(c)
    hs.validate_object(job)


def test_kb_build_args_parse_as_specops_kb_build():
    from specops.cli.main import build_parser

    parser = build_parser()
    (c,) = hs.one(hs.render(LITE), "Job", "kb-build")["spec"]["template"]["spec"]["containers"]
    args = parser.parse_args(c["args"][1:])
    assert (args.backend, args.milvus_uri, args.model_dir) == (
        "milvus",
        _env(c)["SPECOPS_MILVUS_URI"]["value"],
        "/models",
    )
    assert not args.no_register and not args.no_promote


def test_wait_script_waits_for_both_services_then_gives_up_naming_the_one_missing():
    (wait,) = hs.one(hs.render(LITE), "Job", "kb-build")["spec"]["template"]["spec"]["initContainers"]
    assert wait["args"][:2] == ["python", "-c"]
    script = wait["args"][2]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        up = f"http://127.0.0.1:{listener.getsockname()[1]}"
        env = {"PATH": os.environ["PATH"], "WAIT_TIMEOUT_S": "5"}
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=env | {"SPECOPS_MILVUS_URI": up, "SPECOPS_REGISTRY_URI": up},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("accepts connections") == 2
        down = f"http://127.0.0.1:{_free_port()}"
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=env | {"SPECOPS_MILVUS_URI": up, "SPECOPS_REGISTRY_URI": down, "WAIT_TIMEOUT_S": "0"},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 1 and "SPECOPS_REGISTRY_URI" in done.stderr and "unreachable" in done.stderr


# ------------------------------------------------------------------ the lite server's command, run
def test_lite_server_command_serves_milvus_and_closes_its_data_dir_on_sigterm(tmp_path):
    """The Deployment's args, with a temporary data directory and a loopback port: pymilvus creates, fills and
    searches a collection through it, and SIGTERM (what the kubelet sends) shuts it down cleanly."""
    from pymilvus import MilvusClient

    c = hs.container(hs.one(hs.render(LITE), "Deployment", "milvus"), "milvus")
    argv = list(c["args"])
    port = _free_port()
    argv[argv.index("--data-dir") + 1] = str(tmp_path / "milvus")
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    assert argv[0] == "python"
    server = subprocess.Popen(
        [sys.executable, *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # what the tcpSocket probes check
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        client = MilvusClient(uri=f"http://127.0.0.1:{port}")
        client.create_collection("kb_probe", dimension=4)
        client.insert("kb_probe", [{"id": i, "vector": [float(i == j) for j in range(4)]} for i in range(4)])
        (hits,) = client.search("kb_probe", data=[[0.0, 0.0, 1.0, 0.0]], limit=1)
        assert hits[0]["id"] == 2
        client.close()
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, out
    assert "Shutting down" in out
    assert (tmp_path / "milvus" / "collections").is_dir()


# ------------------------------------------------------------------ refused values
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "milvus"}, "/retrieval/milvus/mode"),
        ({"mode": "external"}, "retrieval.milvus.external.uri is required"),
        ({"mode": "external", "external": {"uri": "kb:19530"}}, "/retrieval/milvus/external/uri"),
        ({"kbBuild": {"enabled": True}}, "kbBuild.enabled needs retrieval.milvus.mode lite or external"),
        ({"mode": "lite", "external": {"tokenSecret": {"name": "s"}}}, "tokenSecret is only used with"),
        ({"lite": {"maxworkers": 4}}, "maxworkers"),
        ({"lite": {"port": 0}}, "/retrieval/milvus/lite/port"),
    ],
    ids=["bad-mode", "external-no-uri", "uri-no-scheme", "job-without-milvus", "token-with-lite", "typo", "port-0"],
)
def test_invalid_milvus_values_are_refused_naming_the_field(values, message):
    with pytest.raises(hs.RenderError) as caught:
        hs.render(DEFAULT, {"retrieval": {"milvus": values}})
    assert message in str(caught.value)


def test_uri_host_is_the_service_for_every_release_name():
    """The URI names the Service by the chart's component naming (long release names are truncated alike)."""
    objects = hs.render(DEFAULT, {"fullnameOverride": "x" * 70, "retrieval": {"milvus": {"mode": "lite"}}})
    service = hs.one(objects, "Service", "milvus")
    uri = _env(hs.container(hs.one(objects, "Deployment", "serving"), "serving"))["SPECOPS_MILVUS_URI"]["value"]
    assert urlsplit(uri).hostname == service["metadata"]["name"] and len(service["metadata"]["name"]) <= 63

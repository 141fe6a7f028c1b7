"""The Helm chart deploy/helm/specops: lint, schema, Kubernetes validity and the properties the app relies on.

Every value set under the chart's ci/ folder is rendered once (helm_support caches renders) and
every object validated: built-in kinds with kubernetes-validate in strict mode, CRD kinds against
the hand-written schemas in helm_support (see its docstring for what they do and do not cover).
The rendered serve.toml is loaded with ServeConfig.load, as ``specops serve --config`` loads it,
and the rendered train.toml is checked key by key against ``specops train``'s own options.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import tomllib

import jsonschema
import kubernetes_validate
import pytest

from specops import config_file
from specops.cli.main import build_parser
from specops.serving.http.config import ServeConfig, ServeKeys
from tests.deploy import helm_support as hs

CI = {path.name: path for path in hs.ci_value_files()}
DEFAULT = CI["default-values.yaml"]
GPU = CI["gpu-keda-strimzi-values.yaml"]
HPA = CI["hpa-values.yaml"]
MULTIGPU = CI["trainer-multigpu-values.yaml"]
VLLM = CI["vllm-values.yaml"]
LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/version",
    "helm.sh/chart",
)
SPECOPS_CONTAINERS = (
    ("Deployment", "serving", "serving"),
    ("Deployment", "trainer", "trainer"),
    ("CronJob", "registry-retain", "registry-retain"),
    ("CronJob", "policy-fit", "policy-fit"),
)
TOPICS = ("spec.misses", "spec.generations", "spec.events", "spec.deadletter")
SERVE_OWNED = (
    {"host", "port", "model_dir", "api_keys", "engine", "shutdown_timeout_s"}
    | {name for name in ServeKeys.model_fields if name.startswith("vllm_") and name != "vllm_python"}
)  # engine and vllm_*: from specops.serving.engine / specops.serving.vllm (tests/deploy/test_helm_vllm.py); shutdown_timeout_s:
# from the grace period (tests/deploy/test_helm_ops.py)
TRAIN_OWNED = {"out", "model_dir", "schedule", "jobstore", "backend", "metrics_port", "zero_stage"}


def test_ci_has_the_value_sets_the_deployments_use():
    assert set(CI) >= {
        "default-values.yaml",
        "gpu-keda-strimzi-values.yaml",
        "hpa-values.yaml",
        "trainer-multigpu-values.yaml",
        "vllm-values.yaml",
    }


@pytest.mark.parametrize("values_file", [None, *CI.values()], ids=["chart-defaults", *CI])
def test_lint_strict_is_clean(values_file):
    report = hs.lint(values_file, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values_file", [None, *CI.values()], ids=["chart-defaults", *CI])
def test_every_object_is_valid_kubernetes(values_file):
    objects = hs.render(values_file)
    checked = {"builtin": 0, "crd": 0}
    for obj in objects:
        checked[hs.validate_object(obj)] += 1
    assert checked["builtin"] >= 12
    if values_file == GPU:  # 2 ServiceMonitors, PrometheusRule, ScaledObject, Kafka, KafkaNodePool, 4 KafkaTopics
        assert checked["crd"] == 10


def test_strict_validation_catches_typos():
    """The validators bite: an unknown field, a non-string KEDA threshold, a topic without partitions and
    malformed alerting rules fail."""
    objects = hs.render(GPU)
    deployment = hs.one(objects, "Deployment", "serving")
    hs.container(deployment, "serving")["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        hs.validate_object(deployment)
    scaled = hs.one(objects, "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4
    with pytest.raises(jsonschema.ValidationError):
        hs.validate_object(scaled)
    topic = hs.find(objects, "KafkaTopic")[0]
    del topic["spec"]["partitions"]
    with pytest.raises(jsonschema.ValidationError):
        hs.validate_object(topic)
    rule = hs.one(objects, "PrometheusRule")
    for mutate in (
        lambda r: r["spec"]["groups"][0]["rules"][0].update({"for": "5 minutes"}),
        lambda r: r["spec"]["groups"][0]["rules"][0].update({"record": "specops:ready"}),
        lambda r: r["spec"]["groups"][0]["rules"][0]["labels"].update({"threshold": 4}),
        lambda r: r["spec"]["groups"][1].update({"name": r["spec"]["groups"][0]["name"]}),
    ):
        broken = json.loads(json.dumps(rule))
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            hs.validate_object(broken)
    with pytest.raises(LookupError):
        hs.validate_object({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


@pytest.mark.parametrize("values_file", CI.values(), ids=CI)
def test_every_object_and_pod_carries_the_standard_labels(values_file):
    for obj in hs.render(values_file):
        labels = obj["metadata"]["labels"]
        assert all(labels.get(k) for k in LABELS), f"{obj['kind']} {obj['metadata']['name']}: {labels}"
        assert labels["app.kubernetes.io/part-of"] == "specops" and labels["app.kubernetes.io/instance"] == hs.RELEASE
        if obj["kind"] in ("Deployment", "CronJob"):
            template = (
                obj["spec"]["jobTemplate"]["spec"]["template"] if obj["kind"] == "CronJob" else obj["spec"]["template"]
            )
            assert all(template["metadata"]["labels"].get(k) for k in LABELS)


def test_serving_deployment_rolls_without_losing_capacity_and_probes_the_app():
    objects = hs.render(DEFAULT)
    deployment = hs.one(objects, "Deployment", "serving")
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    assert deployment["spec"]["replicas"] == 2
    pod = hs.pod_spec(deployment)
    c = hs.container(deployment, "serving")
    assert c["args"] == ["specops", "serve", "--config", "/etc/specops/serve.toml"] and "command" not in c
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/readyz", "port": "http"}, "passes once the models are loaded"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "a model load may take minutes"
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 10}}
    assert pod["terminationGracePeriodSeconds"] == 675, "the preStop sleep, a 660 s drain and a 5 s margin"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert (
        c["securityContext"]["readOnlyRootFilesystem"] is True
        and c["securityContext"]["allowPrivilegeEscalation"] is False
    )
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["/models"]["readOnly"] is True
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "specops-models", "readOnly": True}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]] and "emptyDir" in volumes[mounts["/data"]["name"]]
    assert (
        volumes[mounts["/etc/specops"]["name"]]["configMap"]["name"]
        == hs.one(objects, "ConfigMap", "serving")["metadata"]["name"]
    )
    env = {e["name"]: e for e in c["env"]}
    assert env["SPECOPS_SERVE_REPLICA"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_pdb_service_and_monitor_select_exactly_the_serving_pods():
    objects = hs.render(GPU)
    pods = {hs.component(d): d["spec"]["template"]["metadata"]["labels"] for d in hs.find(objects, "Deployment")}
    assert set(pods) == {"serving", "trainer", "mlflow"}

    def selects(selector):
        return {name for name, labels in pods.items() if selector.items() <= labels.items()}

    assert selects(hs.one(objects, "PodDisruptionBudget", "serving")["spec"]["selector"]["matchLabels"]) == {"serving"}
    assert selects(hs.one(objects, "PodDisruptionBudget", "mlflow")["spec"]["selector"]["matchLabels"]) == {"mlflow"}
    service = hs.one(objects, "Service", "serving")
    assert selects(service["spec"]["selector"]) == {"serving"}
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    monitor = hs.one(objects, "ServiceMonitor", "serving")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "http" and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert selects(hs.one(objects, "Deployment", "mlflow")["spec"]["selector"]["matchLabels"]) == {"mlflow"}


def _monitored_services(objects, monitor) -> set[str]:
    """Names of the Services a ServiceMonitor's selector picks in the render."""
    wanted = monitor["spec"]["selector"]["matchLabels"]
    return {
        s["metadata"]["name"] for s in hs.find(objects, "Service") if wanted.items() <= s["metadata"]["labels"].items()
    }


def test_trainer_serves_metrics_on_a_named_port_behind_a_headless_service():
    objects = hs.render(GPU)
    trainer = hs.one(objects, "Deployment", "trainer")
    c = hs.container(trainer, "trainer")
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert _toml(objects, "trainer", "train.toml")["train"]["metrics_port"] == 9400
    service = hs.one(objects, "Service", "trainer")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= trainer["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "trainer"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP"}]
    monitor = hs.one(objects, "ServiceMonitor", "trainer")
    assert _monitored_services(objects, monitor) == {service["metadata"]["name"]}
    assert _monitored_services(objects, hs.one(objects, "ServiceMonitor", "serving")) == {
        f"{hs.RELEASE}-specops-serving"
    }
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert hs.find(hs.render(DEFAULT), "ServiceMonitor") == [], "off by default"

    moved = hs.render(DEFAULT, {"trainer": {"metrics": {"port": 9500}}})
    assert hs.container(hs.one(moved, "Deployment", "trainer"), "trainer")["ports"][0]["containerPort"] == 9500
    assert _toml(moved, "trainer", "train.toml")["train"]["metrics_port"] == 9500
    assert hs.one(moved, "Service", "trainer")["spec"]["ports"][0]["port"] == 9500
    off = hs.render(GPU, {"trainer": {"metrics": {"enabled": False}, "serviceMonitor": {"enabled": False}}})
    assert "ports" not in hs.container(hs.one(off, "Deployment", "trainer"), "trainer")
    assert "metrics_port" not in _toml(off, "trainer", "train.toml")["train"]
    assert hs.find(off, "Service", "trainer") == [] and hs.find(off, "ServiceMonitor", "trainer") == []
    assert [g["name"] for g in hs.one(off, "PrometheusRule")["spec"]["groups"]] == ["specops-serving"]


def test_autoscaler_is_chosen_by_value():
    keda = hs.render(GPU)
    scaled = hs.one(keda, "ScaledObject")
    assert hs.find(keda, "HorizontalPodAutoscaler") == []
    assert "replicas" not in hs.one(keda, "Deployment", "serving")["spec"], "the autoscaler owns the replica count"
    assert scaled["spec"]["scaleTargetRef"]["name"] == hs.one(keda, "Deployment", "serving")["metadata"]["name"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 16)
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "4"
    assert trigger["metadata"]["serverAddress"] == "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
    query = trigger["metadata"]["query"]
    assert query.startswith("sum(specops_admission_queue_depth{") and f'namespace="{hs.NAMESPACE}"' in query
    assert 'service="prod-specops-serving"' in query, "the label the ServiceMonitor's targets carry"
    custom = hs.render(GPU, {"serving": {"autoscaling": {"keda": {"query": "sum(specops_admission_queue_depth)"}}}})
    assert (
        hs.one(custom, "ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
        == "sum(specops_admission_queue_depth)"
    )

    hpa_objects = hs.render(HPA)
    hpa = hs.one(hpa_objects, "HorizontalPodAutoscaler")
    assert hs.find(hpa_objects, "ScaledObject") == []
    assert "replicas" not in hs.one(hpa_objects, "Deployment", "serving")["spec"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "specops_admission_queue_depth"},
                "target": {"type": "AverageValue", "averageValue": "2"},
            },
        }
    ]

    plain = hs.render(DEFAULT)
    assert hs.find(plain, "ScaledObject") == [] and hs.find(plain, "HorizontalPodAutoscaler") == []


def test_gpus_requested_and_limited_under_a_configurable_resource_name():
    objects = hs.render(GPU)
    for name, gpus in (("serving", 1), ("trainer", 1)):
        resources = hs.container(hs.one(objects, "Deployment", name), name)["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == gpus == resources["limits"]["nvidia.com/gpu"]
        assert resources["requests"]["cpu"] == ("4" if name == "serving" else "2")
    assert (
        hs.container(hs.one(objects, "Deployment", "serving"), "serving")["image"]
        == "ghcr.io/specops/specops-serving:0.1.0-cuda"
    )

    amd = hs.render(GPU, {"gpuResourceName": "amd.com/gpu"})
    resources = hs.container(hs.one(amd, "Deployment", "serving"), "serving")["resources"]
    assert resources["limits"]["amd.com/gpu"] == 1 == resources["requests"]["amd.com/gpu"]
    all_resources = [hs.container(hs.one(amd, "Deployment", n), n)["resources"] for n in ("serving", "trainer")]
    assert "nvidia.com/gpu" not in json.dumps(all_resources)

    cpu = hs.container(hs.one(hs.render(DEFAULT), "Deployment", "serving"), "serving")
    assert "gpu" not in json.dumps(cpu["resources"]) and cpu["image"] == "ghcr.io/specops/specops-serving:0.1.0"


def test_trainer_is_one_recreated_scheduler_with_its_own_volume():
    objects = hs.render(DEFAULT)
    trainer = hs.one(objects, "Deployment", "trainer")
    assert trainer["spec"]["replicas"] == 1 and trainer["spec"]["strategy"] == {"type": "Recreate"}
    assert hs.trainer_launch_argv(objects) == ["specops", "train", "--config", "/etc/specops/train.toml"]
    pvc = hs.one(objects, "PersistentVolumeClaim", "trainer")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    volumes = {v["name"]: v for v in hs.pod_spec(trainer)["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in hs.container(trainer, "trainer")["volumeMounts"]}
    assert volumes[mounts["/data"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    probe = hs.container(trainer, "trainer")["livenessProbe"]
    assert probe["exec"]["command"] == ["python", "/app/trainer_healthcheck.py"]
    # replicas is not a value: the schema refuses one, and the existing-claim switch drops the chart's PVC
    with pytest.raises(hs.RenderError, match="/trainer.*replicas"):
        hs.render(DEFAULT, {"trainer": {"replicas": 2}})
    reused = hs.render(DEFAULT, {"trainer": {"persistence": {"existingClaim": "old-trainer-data"}}})
    assert hs.find(reused, "PersistentVolumeClaim") == []
    reused_volumes = {v["name"]: v for v in hs.pod_spec(hs.one(reused, "Deployment", "trainer"))["volumes"]}
    assert reused_volumes["data"]["persistentVolumeClaim"]["claimName"] == "old-trainer-data"


def test_multi_gpu_trainer_runs_under_the_deepspeed_launcher():
    objects = hs.render(MULTIGPU)
    argv = hs.trainer_launch_argv(objects)
    assert argv == [
        "deepspeed",
        "--num_gpus",
        "2",
        "--no_local_rank",
        "--module",
        "specops",
        "train",
        "--config",
        "/etc/specops/train.toml",
        "--backend",
        "deepspeed",
    ]
    trainer = hs.container(hs.one(objects, "Deployment", "trainer"), "trainer")
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 2 == trainer["resources"]["requests"]["nvidia.com/gpu"]
    rank = build_parser().parse_args(argv[argv.index("--module") + 2 :])  # what each rank's `python -m specops` parses
    assert (rank.command, rank.config, rank.backend) == ("train", "/etc/specops/train.toml", "deepspeed")
    train = _toml(objects, "trainer", "train.toml")["train"]
    assert train["backend"] == "deepspeed" and train["device"] == "cuda" and train["zero_stage"] == 2
    assert hs.one(objects, "Deployment", "trainer")["spec"]["replicas"] == 1
    stage1 = hs.render(MULTIGPU, {"trainer": {"zeroStage": 1}})
    assert _toml(stage1, "trainer", "train.toml")["train"]["zero_stage"] == 1
    assert "zero_stage" not in _toml(hs.render(GPU), "trainer", "train.toml")["train"], "one GPU: no DeepSpeed"


def test_cronjobs_never_overlap_and_their_argv_parses_with_the_cli():
    objects = hs.render(DEFAULT)
    jobs = {hs.component(j): j for j in hs.find(objects, "CronJob")}
    assert set(jobs) == {"registry-retain", "policy-fit"}
    parser = build_parser()
    registry_uri = f"http://{hs.RELEASE}-specops-mlflow:5000"
    for name, job in jobs.items():
        assert job["spec"]["concurrencyPolicy"] == "Forbid"
        assert hs.pod_spec(job)["restartPolicy"] == "Never"
        argv = hs.container(job, name)["args"]
        assert argv[0] == "specops"
        args = parser.parse_args(argv[1:])
        assert args.registry == registry_uri
        if name == "registry-retain":
            assert (args.registry_command, args.keep) == ("retain", 20)
        else:
            assert (args.policy_command, args.register, args.promote) == ("fit", True, True)
            assert args.stream == "kafka://kafka.streams.svc:9092"
    assert hs.find(hs.render(HPA), "CronJob", "policy-fit") == [], "disabled by value"


def test_mlflow_migrates_its_database_first_and_keeps_secrets_out_of_its_args():
    """One Job runs ``mlflow db upgrade``; every MLflow replica waits for the schema (tests/deploy/test_helm_ops.py
    runs that wait against a real database)."""
    objects = hs.render(DEFAULT)
    mlflow = hs.one(objects, "Deployment", "mlflow")
    pod = hs.pod_spec(mlflow)
    uri = "postgresql+psycopg2://mlflow@postgresql.db.svc:5432/mlflow"
    (wait,) = pod["initContainers"]
    assert wait["name"] == "wait-for-schema" and hs.literal_env(wait)["MLFLOW_BACKEND_STORE_URI"] == uri
    job = hs.one(objects, "Job", "mlflow-db-upgrade")
    (init,) = job["spec"]["template"]["spec"]["containers"]
    assert init["command"] == ["mlflow", "db", "upgrade", uri]
    server = hs.container(mlflow, "mlflow")
    argv = server["command"] + server["args"]
    assert argv[:6] == ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
    assert argv[argv.index("--backend-store-uri") + 1] == uri
    assert argv[argv.index("--artifacts-destination") + 1] == "s3://specops-mlflow/artifacts"
    assert "--serve-artifacts" in argv
    allowed = argv[argv.index("--allowed-hosts") + 1].split(",")
    assert f"{hs.RELEASE}-specops-mlflow" in allowed and f"{hs.RELEASE}-specops-mlflow:*" in allowed
    assert server["readinessProbe"]["httpGet"]["path"] == "/health" == server["livenessProbe"]["httpGet"]["path"]
    secret = hs.one(objects, "Secret")
    for c in (init, wait, server):
        password = next(e for e in c["env"] if e["name"] == "PGPASSWORD")
        assert password["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "postgres-password"}
    assert secret["stringData"]["postgres-password"] == "change-me"
    s3_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in server["env"] if e["name"].startswith("AWS_")}
    assert s3_env == {
        "AWS_ACCESS_KEY_ID": {"name": secret["metadata"]["name"], "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": secret["metadata"]["name"], "key": "AWS_SECRET_ACCESS_KEY"},
    }
    config = hs.one(objects, "ConfigMap", "mlflow")["data"]
    assert config["MLFLOW_S3_ENDPOINT_URL"] == "http://minio.storage.svc:9000"
    rendered = json.dumps([o for o in objects if o["kind"] != "Secret"])
    assert "change-me" not in rendered and "minio-secret" not in rendered, "a secret value outside the Secret"


def test_existing_secrets_are_honoured():
    objects = hs.render(GPU)
    assert hs.find(objects, "Secret") == [], "every credential comes from an existing Secret"
    mlflow = hs.one(objects, "Deployment", "mlflow")
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"] for e in hs.container(mlflow, "mlflow")["env"] if "valueFrom" in e
    }
    assert refs["PGPASSWORD"] == {"name": "specops-postgres", "key": "postgres-password"}
    assert refs["AWS_ACCESS_KEY_ID"] == {"name": "specops-s3", "key": "AWS_ACCESS_KEY_ID"}
    assert refs["AWS_SECRET_ACCESS_KEY"] == {"name": "specops-s3", "key": "AWS_SECRET_ACCESS_KEY"}
    serving_env = {e["name"]: e for e in hs.container(hs.one(objects, "Deployment", "serving"), "serving")["env"]}
    assert serving_env["SPECOPS_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "specops-api-keys",
        "key": "api-keys",
    }
    trainer_env = {e["name"]: e for e in hs.container(hs.one(objects, "Deployment", "trainer"), "trainer")["env"]}
    assert trainer_env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "specops-postgres",
        "key": "postgres-password",
    }
    # Secrets with other key names: existingSecretKey / existingSecretPasswordKey name them
    other = hs.render(
        GPU,
        {
            "serving": {"apiKeys": {"existingSecretKey": "keys"}},
            "postgresql": {"external": {"existingSecretPasswordKey": "password"}},
        },
    )
    env = {e["name"]: e for e in hs.container(hs.one(other, "Deployment", "serving"), "serving")["env"]}
    assert env["SPECOPS_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "specops-api-keys", "key": "keys"}
    env = {e["name"]: e for e in hs.container(hs.one(other, "Deployment", "trainer"), "trainer")["env"]}
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "specops-postgres", "key": "password"}

    keyed = hs.render(DEFAULT, {"serving": {"apiKeys": {"keys": ["key-one-12345", "key-two-12345"]}}})
    secret = hs.one(keyed, "Secret")
    assert secret["stringData"]["api-keys"] == "key-one-12345,key-two-12345"
    env = {e["name"]: e for e in hs.container(hs.one(keyed, "Deployment", "serving"), "serving")["env"]}
    assert env["SPECOPS_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "api-keys",
    }
    assert "SPECOPS_API_KEYS" not in json.dumps(hs.render(DEFAULT)), "no keys: no auth"


def _checksum(objects, name):
    return hs.one(objects, "Deployment", name)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def test_config_checksums_follow_their_own_config_only():
    base = hs.render(DEFAULT)
    served = hs.render(DEFAULT, {"serving": {"config": {"max_queue": 64}}})
    assert _checksum(served, "serving") != _checksum(base, "serving")
    assert _checksum(served, "trainer") == _checksum(base, "trainer")
    trained = hs.render(DEFAULT, {"trainer": {"config": {"interval": 16}}})
    assert _checksum(trained, "trainer") != _checksum(base, "trainer")
    assert _checksum(trained, "serving") == _checksum(base, "serving")
    rotated = hs.render(DEFAULT, {"postgresql": {"external": {"password": "rotated-password"}}})
    assert _checksum(rotated, "mlflow") != _checksum(base, "mlflow")
    config_text = hs.render_files(DEFAULT)["specops/templates/serving-configmap.yaml"]
    assert _checksum(base, "serving") == hashlib.sha256(config_text.encode()).hexdigest()


def test_strimzi_cluster_and_topics():
    objects = hs.render(GPU)
    kafka = hs.one(objects, "Kafka")
    cluster = kafka["metadata"]["name"]
    assert kafka["metadata"]["annotations"] == {"strimzi.io/node-pools": "enabled", "strimzi.io/kraft": "enabled"}
    assert kafka["spec"]["kafka"]["config"]["min.insync.replicas"] == 2
    assert kafka["spec"]["kafka"]["config"]["default.replication.factor"] == 3
    # serving's producer sends up to 16 MiB (streams/kafka.py); broker and topics must accept it
    assert kafka["spec"]["kafka"]["config"]["message.max.bytes"] == 16 * 1024 * 1024
    pool = hs.one(objects, "KafkaNodePool")
    assert pool["spec"]["roles"] == ["controller", "broker"] and pool["spec"]["replicas"] == 3
    assert pool["metadata"]["labels"]["strimzi.io/cluster"] == cluster
    assert pool["spec"]["storage"]["volumes"][0]["size"] == "200Gi"
    topics = {t["spec"]["topicName"]: t for t in hs.find(objects, "KafkaTopic")}
    assert set(topics) == set(TOPICS)
    for topic in topics.values():
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == cluster
        assert (topic["spec"]["partitions"], topic["spec"]["replicas"]) == (16, 3)
        assert topic["spec"]["config"]["min.insync.replicas"] == 2
        assert topic["spec"]["config"]["max.message.bytes"] == 16 * 1024 * 1024
    more = hs.render(GPU, {"kafka": {"topics": {"partitions": 32}}})
    assert {t["spec"]["partitions"] for t in hs.find(more, "KafkaTopic")} == {32}
    assert _stream_urls(objects) == {f"kafka://{cluster}-kafka-bootstrap:9092"}


def _alerts(rule: dict) -> dict[str, dict]:
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_prometheus_rule_alerts_on_metrics_the_app_exports():
    objects = hs.render(GPU)
    rule = hs.one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [g["name"] for g in rule["spec"]["groups"]] == ["specops-serving", "specops-trainer"]
    # the labels the ServiceMonitors' targets carry: the Service each monitor picks, in the release's namespace
    serving = f'namespace="{hs.NAMESPACE}",service="{hs.RELEASE}-specops-serving"'
    trainer = f'namespace="{hs.NAMESPACE}",service="{hs.RELEASE}-specops-trainer"'
    expected = {
        "SpecopsServingNotReady": (f"specops_ready{{{serving}}} == 0", "5m"),
        "SpecopsQueueDepthHigh": (f"specops_admission_queue_depth{{{serving}}} > 24", "10m"),
        "SpecopsStreamLoggerDropping": (f"rate(specops_stream_logger_dropped_total{{{serving}}}[5m]) > 0", "5m"),
        "SpecopsStreamPublishErrors": (f"rate(specops_stream_logger_publish_errors_total{{{serving}}}[5m]) > 0", "10m"),
        "SpecopsHotSwapFailures": (f"increase(specops_hotswap_failures_total{{{serving}}}[15m]) > 0", None),
        "SpecopsDraftAutoRollback": (f"increase(specops_hotswap_auto_rollbacks_total{{{serving}}}[1h]) > 0", None),
        "SpecopsTrainerStalled": (
            f"(time() - max(specops_trainer_last_update_timestamp_seconds{{{trainer}}}) > 7200) "
            f"and on() (sum(rate(specops_stream_logger_published_total{{{serving}}}[30m])) > 0)",
            None,
        ),
        "SpecopsTrainerTickErrors": (
            f'increase(specops_trainer_ticks_total{{{trainer},outcome="error"}}[15m]) > 0',
            None,
        ),
    }
    alerts = _alerts(rule)
    assert {name: (r["expr"], r.get("for")) for name, r in alerts.items()} == expected
    source = "".join(
        path.read_text() for d in ("serving", "streams", "trainer") for path in (hs.REPO / d).rglob("*.py")
    )
    for name, r in alerts.items():
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
        for metric in re.findall(r"\b(specops_\w+)\{", r["expr"]):
            assert f'"{metric}"' in source, f"{name}: the app exports no {metric}"
    assert hs.find(hs.render(DEFAULT), "PrometheusRule") == [], "off by default"

    custom = hs.render(
        DEFAULT,
        {
            "prometheusRule": {
                "enabled": True,
                "servingSelector": 'job="serving"',
                "trainerSelector": 'job="trainer"',
                "alertLabels": {"team": "ml", "severity": "page"},
            }
        },
    )
    alerts = _alerts(hs.one(custom, "PrometheusRule"))
    assert alerts["SpecopsServingNotReady"]["expr"] == 'specops_ready{job="serving"} == 0'
    assert (
        alerts["SpecopsTrainerTickErrors"]["expr"]
        == 'increase(specops_trainer_ticks_total{job="trainer",outcome="error"}[15m]) > 0'
    )
    assert {r["labels"]["team"] for r in alerts.values()} == {"ml"}
    assert alerts["SpecopsServingNotReady"]["labels"]["severity"] == "critical", "the chart's severity stays"
    assert "PrometheusRule's" not in hs.notes(
        DEFAULT,
        {
            "prometheusRule": {
                "enabled": True,
                "servingSelector": 'job="serving"',
                "trainerSelector": 'job="trainer"',
                "alertLabels": {"team": "ml", "severity": "page"},
            }
        },
    )
    unscraped = hs.notes(DEFAULT, {"prometheusRule": {"enabled": True}})
    assert "serving.serviceMonitor is off" in unscraped and "trainer.serviceMonitor is off" in unscraped


def _stream_urls(objects) -> set[str]:
    urls = set()
    for kind, comp, name in SPECOPS_CONTAINERS:
        for obj in hs.find(objects, kind, comp):
            env = hs.literal_env(hs.container(obj, name))
            urls.add(env["SPECOPS_STREAM_URL"])
            assert env["SPECOPS_REGISTRY_URI"] == f"http://{hs.RELEASE}-specops-mlflow:5000"
            assert env["SPECOPS_DATA_DIR"] == "/data"
    return urls


def test_external_kafka_renders_no_strimzi_objects():
    objects = hs.render(HPA)
    assert not [o for o in objects if o["apiVersion"].startswith("kafka.strimzi.io/")]
    assert _stream_urls(objects) == {"kafka://kafka-0.kafka:9092,kafka-1.kafka:9092"}
    env = hs.literal_env(hs.container(hs.one(objects, "Deployment", "serving"), "serving"))
    assert (env["SPECOPS_STREAM_NUM_PARTITIONS"], env["SPECOPS_STREAM_REPLICATION_FACTOR"]) == ("8", "3")


def _toml(objects, comp: str, key: str) -> dict:
    return tomllib.loads(hs.one(objects, "ConfigMap", comp)["data"][key])


@pytest.mark.parametrize("values_file", CI.values(), ids=CI)
def test_serve_toml_loads_as_the_cli_loads_it(values_file, tmp_path):
    objects = hs.render(values_file)
    path = tmp_path / "serve.toml"
    path.write_text(hs.one(objects, "ConfigMap", "serving")["data"]["serve.toml"])
    env = hs.literal_env(hs.container(hs.one(objects, "Deployment", "serving"), "serving"))
    env["SPECOPS_SERVE_REPLICA"] = "prod-specops-serving-7d9f-abcde"  # the fieldRef's value in a pod
    cfg = ServeConfig.load(path, env=env)
    assert (cfg.api.host, cfg.api.port, cfg.engine.model_dir) == ("0.0.0.0", 8000, "/models")
    assert cfg.replica_name == "prod-specops-serving-7d9f-abcde"
    assert (cfg.fleet.stream, cfg.fleet.registry) == ("default", "default"), (
        "resolved from SPECOPS_STREAM_URL / SPECOPS_REGISTRY_URI"
    )
    values = hs.load_values(values_file)
    cuda = values.get("image", {}).get("variant") == "cuda"
    vllm = values.get("serving", {}).get("engine") == "vllm"  # the GPU is the vLLM servers'
    assert cfg.engine.device == ("cuda" if cuda and not vllm else "cpu")
    assert cfg.engine.kind == ("vllm" if vllm else "specops")
    if values_file == GPU:
        assert (cfg.engine.dtype, cfg.admission.max_concurrency, cfg.admission.max_queue) == ("bfloat16", 8, 64)


def _train_parser() -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]


@pytest.mark.parametrize("values_file", CI.values(), ids=CI)
def test_train_toml_loads_as_the_cli_loads_it(values_file, tmp_path):
    """specops.config_file.load is what ``specops train --config`` runs: unknown keys, wrong types and values
    outside an option's choices raise there (a whole number written 8.0, as Helm's toToml writes it, would)."""
    objects = hs.render(values_file)
    path = tmp_path / "train.toml"
    path.write_text(hs.one(objects, "ConfigMap", "trainer")["data"]["train.toml"])
    assert set(tomllib.loads(path.read_text())) == {"train"}
    args = config_file.load(path, _train_parser(), "train")
    assert (args["out"], args["model_dir"], args["schedule"]) == ("/data/trainer", "/models", True)
    assert args["backend"] == ("deepspeed" if values_file == MULTIGPU else "torch")
    assert args["metrics_port"] == 9400
    assert args.get("zero_stage") == (2 if values_file == MULTIGPU else None)
    if values_file == GPU:
        assert args["jobstore"] == "postgresql+psycopg2://mlflow@pg-rw.db.svc:5432/specops_jobs"
    else:
        assert args["jobstore"] == "sqlite:////data/trainer/schedule.sqlite"
    if values_file == DEFAULT:
        assert (args["interval"], args["loss"], args["poll_records"]) == (8, "fkl", 256)


def _types(config_schema: dict) -> dict[str, object]:
    return {k: v.get("type", v.get("enum")) for k, v in config_schema["properties"].items()}


def test_schema_config_fields_track_the_app():
    """serving.config and trainer.config in values.schema.json list exactly what the app accepts, with its types."""
    schema = json.loads((hs.CHART_DIR / "values.schema.json").read_text())
    spec = importlib.util.spec_from_file_location("config_schema", hs.REPO / "deploy/helm/tools/config_schema.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    fix = "out of date: run python deploy/helm/tools/config_schema.py"
    serving = schema["properties"]["serving"]["properties"]["config"]
    assert _types(serving) == _types(tool.serve_config_schema()), fix
    assert set(serving["properties"]) == set(ServeKeys.model_fields) - SERVE_OWNED
    trainer = schema["properties"]["trainer"]["properties"]["config"]
    assert _types(trainer) == _types(tool.train_config_schema()), fix
    assert set(trainer["properties"]) == set(config_file.options_of(_train_parser())) - TRAIN_OWNED


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"serving": {"autoscaling": {"mode": "kedaa"}}}, "/serving/autoscaling/mode"),
        ({"kafka": {"mode": "confluent"}}, "/kafka/mode"),
        ({"image": {"variant": "rocm"}}, "/image/variant"),
        ({"serving": {"replicas": -1}}, "/serving/replicas"),
        ({"kafka": {"topics": {"partitions": 0}}}, "/kafka/topics/partitions"),
        ({"serving": {"replicsa": 3}}, "replicsa"),
        ({"serving": {"config": {"max_concurency": 4}}}, "max_concurency"),
        ({"serving": {"config": {"api_keys": ["abcdefgh123"]}}}, "api_keys"),
        ({"trainer": {"config": {"out": "/elsewhere"}}}, "'out'"),
        ({"trainer": {"gpus": "two"}}, "/trainer/gpus"),
        ({"serving": {"config": {"max_queue": "many"}}}, "/serving/config/max_queue"),
        ({"trainer": {"config": {"loss": "mse"}}}, "/trainer/config/loss"),
        ({"models": {"fill": {"mode": "http"}}}, "/models/fill/mode"),
        ({"trainer": {"zeroStage": 3}}, "/trainer/zeroStage"),
        ({"trainer": {"config": {"metrics_port": 9000}}}, "'metrics_port'"),
    ],
    ids=[
        "bad-enum",
        "bad-kafka-mode",
        "bad-variant",
        "negative-replicas",
        "zero-partitions",
        "typo-key",
        "typo-serve-field",
        "api-keys-in-configmap",
        "chart-owned-train-key",
        "wrong-type",
        "wrong-type-serve-field",
        "bad-loss",
        "bad-fill-mode",
        "bad-zero-stage",
        "chart-owned-metrics-port",
    ],
)
def test_invalid_values_are_refused_naming_the_field(values, field):
    with pytest.raises(hs.RenderError) as caught:
        hs.render(DEFAULT, values)
    assert field in str(caught.value)
    lint = hs.lint(DEFAULT, values)
    assert any(field in error for error in lint["errors"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"kafka": {"topics": {"minInsyncReplicas": 4}}},
            "kafka.topics.minInsyncReplicas (4) is above kafka.topics.replicas (3)",
        ),
        (
            {"kafka": {"mode": "strimzi", "strimzi": {"replicas": 1}}},
            "kafka.topics.replicas (3) is above kafka.strimzi.replicas",
        ),
        ({"serving": {"gpus": 1}}, "need image.variant cuda"),
        ({"serving": {"autoscaling": {"mode": "hpa", "minReplicas": 5, "maxReplicas": 2}}}, "minReplicas (5) is above"),
        (
            {"trainer": {"metrics": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
            "trainer.serviceMonitor.enabled needs trainer.metrics.enabled",
        ),
    ],
    ids=[
        "insync-above-replicas",
        "topic-replicas-above-brokers",
        "gpu-on-cpu-image",
        "min-above-max",
        "monitor-without-metrics",
    ],
)
def test_inconsistent_values_fail_with_what_to_change(values, message):
    with pytest.raises(hs.RenderError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hs.render(DEFAULT, values)


def test_notes_say_where_things_are_and_warn_about_the_upstream_mlflow_image():
    text = hs.notes(DEFAULT)
    assert "kafka://kafka.streams.svc:9092" in text and f"http://{hs.RELEASE}-specops-mlflow:5000" in text
    assert "lacks psycopg2" not in text and "lacks psycopg2" not in hs.notes(GPU), "the trainer image has them"
    upstream = {"mlflow": {"image": {"repository": "ghcr.io/mlflow/mlflow", "tag": "v3.17.2"}}}
    assert "lacks psycopg2 and boto3" in hs.notes(DEFAULT, upstream)
    assert "serving.serviceMonitor is off" not in hs.notes(GPU)
    assert "serving.serviceMonitor is off" in hs.notes(GPU, {"serving": {"serviceMonitor": {"enabled": False}}})

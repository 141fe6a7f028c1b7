"""The Helm chart's day-one operations: an MLflow image that has its drivers, probes on the right endpoints, a
grace period that reaches the server's drain, a Job that fills the models volume, one MLflow schema migration,
and the extension points operators expect (accepted by the strict schema, valid Kubernetes at 1.30 and 1.33).

The scripts the chart runs in its pods (the S3 model copy, MLflow's schema wait) are taken from the rendered
objects and run here for real: against moto's S3 server and a real MLflow database.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from specops.cli.main import build_parser
from specops.serving.http.config import ServeConfig
from tests.deploy import helm_support as hs
from tests.deploy import test_docker as docker

CI = {path.name: path for path in hs.ci_value_files()}
DEFAULT = CI["default-values.yaml"]
EXTENSIONS = CI["extensions-values.yaml"]
VALUES_YAML = hs.CHART_DIR / "values.yaml"
APP_VERSION = "0.1.0"


def _values(values_file=None, set_values=None) -> dict:
    """The values the chart renders with: its values.yaml under the file's and the --set ones."""
    return hs._merge(hs.load_values(VALUES_YAML), hs.load_values(values_file, set_values))


def _job(objects: list[dict], component: str) -> dict:
    return hs.one(objects, "Job", component)


def _job_pod(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def _serving(objects: list[dict]) -> tuple[dict, dict, ServeConfig]:
    """(the serving pod spec, its container, serve.toml loaded with the container's env as ``specops serve``)."""
    deployment = hs.one(objects, "Deployment", "serving")
    c = hs.container(deployment, "serving")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "serve.toml"
        path.write_text(hs.one(objects, "ConfigMap", "serving")["data"]["serve.toml"])
        cfg = ServeConfig.load(path, env=hs.literal_env(c))
    return hs.pod_spec(deployment), c, cfg


# ---------------------------------------------------------------- 1. MLflow's image
def _image_packages(target: str) -> set[str]:
    """Distribution names a Dockerfile target's /opt/venv holds: the builder's pip installs of pyproject's runtime
    dependencies and of the names given beside them (boto3), normalised as pip does."""
    stages = docker.chain(target)
    assert any("--from=builder " in c and "/opt/venv" in c for s in stages for c in s.all("COPY")), target
    builder = " ".join(docker.BY_NAME["builder"].all("RUN"))
    assert "['project']['dependencies']" in builder, "the builder installs pyproject's runtime dependencies"
    deps = tomllib.loads((hs.REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[=<>!~\[; ]", d, maxsplit=1)[0] for d in deps}
    (install,) = [c for c in docker.pip_installs("builder") if " -r " in c]
    words = install.split()
    words = words[words.index("install") + 1 :]
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = word in ("-c", "-r", "--index-url", "--constraint", "--requirement")
        else:
            names.add(re.split(r"[=<>!~\[]", word, maxsplit=1)[0])
    return {re.sub(r"[-_.]+", "-", n).lower() for n in names}


def test_default_mlflow_is_our_trainer_image_which_has_its_drivers():
    """Chart defaults and every ci/ value set run MLflow in the trainer image (as compose does): mlflow, the
    PostgreSQL driver and boto3 (S3 artifacts) are in its package list."""
    for values_file in (None, *CI.values()):
        objects = hs.render(values_file)
        image = hs.container(hs.one(objects, "Deployment", "mlflow"), "mlflow")["image"]
        repository, tag = image.rsplit(":", 1)
        assert repository == "ghcr.io/specops/specops-trainer" and tag == APP_VERSION, (values_file, image)
        assert image == _job_pod(_job(objects, "mlflow-db-upgrade"))["containers"][0]["image"]
        assert "lacks psycopg2" not in hs.notes(values_file)
    cuda = hs.render(None, {"image": {"variant": "cuda", "tag": "1.2.3"}})
    assert (
        hs.container(hs.one(cuda, "Deployment", "mlflow"), "mlflow")["image"] == "ghcr.io/specops/specops-trainer:1.2.3"
    )
    assert {"mlflow", "psycopg2-binary", "boto3"} <= _image_packages("trainer")
    assert _values()["mlflow"]["image"]["repository"] == "", "the default is the trainer image, not upstream's"


# ---------------------------------------------------------------- 2. drain
def test_grace_period_reaches_the_servers_shutdown_timeout():
    pod, c, cfg = _serving(hs.render(None))
    grace = pod["terminationGracePeriodSeconds"]
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    margin = _values()["serving"]["drainMarginSeconds"]
    assert cfg.admission.shutdown_timeout_s == grace - sleep - margin > 0
    assert "SPECOPS_SERVE_SHUTDOWN_TIMEOUT_S" not in hs.literal_env(c), "serve.toml is the one source"
    assert cfg.admission.shutdown_timeout_s >= cfg.admission.queue_timeout_s + cfg.admission.request_timeout_s, (
        "the longest admitted request ends"
    )

    pod, c, cfg = _serving(
        hs.render(DEFAULT, {"serving": {"terminationGracePeriodSeconds": 300, "preStopSleepSeconds": 15}})
    )
    assert (pod["terminationGracePeriodSeconds"], cfg.admission.shutdown_timeout_s) == (300, 300 - 15 - margin)
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 15}}
    assert "cut the longest requests" in hs.notes(DEFAULT, {"serving": {"terminationGracePeriodSeconds": 300}})
    assert "cut the longest requests" not in hs.notes(DEFAULT)
    with pytest.raises(hs.RenderError, match="leaves no time to drain"):
        hs.render(DEFAULT, {"serving": {"terminationGracePeriodSeconds": 10}})
    with pytest.raises(hs.RenderError, match="shutdown_timeout_s"):  # the chart owns it
        hs.render(DEFAULT, {"serving": {"config": {"shutdown_timeout_s": 30}}})


# ---------------------------------------------------------------- 3. probes
def test_probes_hit_the_endpoints_that_tell_load_failure_and_drain_apart():
    """Startup on /readyz bounds the model load (it passes only once loaded), liveness on /healthz (503 once the
    load failed, 200 while draining), readiness on /readyz (503 while loading or draining). The startup budget is
    at least the load budget values.yaml documents."""
    documented = re.search(
        r"period x threshold = (\d+) x (\d+) = (\d+) s is the\s+# longest model load", VALUES_YAML.read_text()
    )
    assert documented, "values.yaml states the startup probe's arithmetic"
    period, threshold, budget = map(int, documented.groups())
    assert period * threshold == budget
    for values_file in (None, *CI.values()):
        _, c, _ = _serving(hs.render(values_file))
        assert c["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= budget, values_file
    probes = _values()["serving"]["probes"]
    assert (probes["startupPeriodSeconds"], probes["startupFailureThreshold"]) == (period, threshold)


def test_trainer_startup_probe_covers_its_start_before_liveness_judges_the_schedule():
    """The trainer's health script fails until the models are loaded and the scheduler ticks: a startup probe
    running it has the documented budget, and liveness (the same script) starts after it."""
    documented = re.search(r"period x threshold = (\d+) x (\d+) = (\d+) s for loading", VALUES_YAML.read_text())
    assert documented
    budget = int(documented.group(3))
    c = hs.container(hs.one(hs.render(None), "Deployment", "trainer"), "trainer")
    script = ["python", "/app/trainer_healthcheck.py"]
    assert c["startupProbe"]["exec"]["command"] == script == c["livenessProbe"]["exec"]["command"]
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= budget
    assert (hs.REPO / "deploy/docker/trainer_healthcheck.py").is_file()
    off = hs.container(
        hs.one(hs.render(None, {"trainer": {"livenessProbe": {"enabled": False}}}), "Deployment", "trainer"), "trainer"
    )
    assert "startupProbe" not in off and "livenessProbe" not in off


# ---------------------------------------------------------------- 4. models fill
def test_fill_job_bootstraps_into_the_claim_serving_mounts():
    objects = hs.render(None)
    pvc = hs.one(objects, "PersistentVolumeClaim", "models")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    job = _job(objects, "models-fill")
    assert re.fullmatch(rf"{hs.RELEASE}-specops-models-fill-[0-9a-f]{{8}}", job["metadata"]["name"])
    pod = _job_pod(job)
    (fill,) = pod["containers"]
    assert fill["image"] == f"ghcr.io/specops/specops-bootstrap:{APP_VERSION}"
    assert fill["args"][:2] == ["sh", "-c"]  # `specops bootstrap "$@"`, then the check that writes the marker
    script, _, *bootstrap_args = fill["args"][2:]
    assert script.startswith('specops bootstrap "$@" && exec specops models check --mark ')
    args = build_parser().parse_args(["bootstrap", *bootstrap_args])  # what the bootstrap image's `specops` parses
    claim = {v["name"]: v for v in pod["volumes"]}["models"]["persistentVolumeClaim"]
    assert claim == {"claimName": pvc["metadata"]["name"]}, "read-write"
    (root,) = [m for m in fill["volumeMounts"] if m["name"] == "models"]
    assert "subPath" not in root and not root.get("readOnly")
    subpath = _values()["models"]["subPath"]
    assert Path(args.out) == Path(root["mountPath"]) / subpath, "bootstrap writes the subPath serving mounts"
    for component, name in (("serving", "serving"), ("trainer", "trainer")):
        deployment = hs.one(objects, "Deployment", component)
        spec = hs.pod_spec(deployment)
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"], "readOnly": True}
        mount = {m["mountPath"]: m for m in hs.container(deployment, name)["volumeMounts"]}["/models"]
        assert mount["subPath"] == subpath and mount["readOnly"] is True
        wait = {c["name"]: c for c in spec["initContainers"]}["wait-for-models"]
        ready = Path(hs.literal_env(wait)["MODELS_READY_FILE"])
        (wait_mount,) = wait["volumeMounts"]
        assert "subPath" not in wait_mount, "a subPath is bound at start; the fill renames that directory"
        # the fill's completion marker, written once target/, draft/ and embedder/ are all there and checked
        assert ready == Path(wait_mount["mountPath"]) / subpath / "ready.json"
    cfg = _serving(objects)[2]
    assert cfg.paths(Path("/data"))[0] == Path("/models/target"), "serving reads target/ of the mounted subPath"
    from specops.core.embed import EMBEDDER_DIR_ENV, EMBEDDER_SUBDIR

    for component in ("serving", "trainer"):  # bootstrap copies the router's embedder to OUT/embedder
        env = hs.literal_env(hs.container(hs.one(objects, "Deployment", component), component))
        assert Path(env[EMBEDDER_DIR_ENV]) == Path("/models") / EMBEDDER_SUBDIR

    again = hs.render(None, {"models": {"fill": {"bootstrap": {"args": ["--device", "cpu"]}}}})
    assert _job(again, "models-fill")["metadata"]["name"] != job["metadata"]["name"], "a changed fill is a new Job"
    forced = _job_pod(_job(hs.render(None, {"models": {"fill": {"force": True}}}), "models-fill"))["containers"][0]
    assert build_parser().parse_args(["bootstrap", *forced["args"][4:]]).force is True


def test_wait_for_models_passes_once_the_fill_renamed_the_directory_into_place(tmp_path):
    wait = {c["name"]: c for c in hs.pod_spec(hs.one(hs.render(None), "Deployment", "serving"))["initContainers"]}
    wait = wait["wait-for-models"]
    assert wait["args"][:2] == ["python", "-c"]
    volume = tmp_path / "models-volume"
    ready = Path(hs.literal_env(wait)["MODELS_READY_FILE"])
    local = volume / ready.relative_to(wait["volumeMounts"][0]["mountPath"])

    def run() -> subprocess.CompletedProcess:
        env = {**os.environ, "MODELS_READY_FILE": str(local), "WAIT_TIMEOUT_S": "0"}
        return subprocess.run([sys.executable, *wait["args"][1:]], env=env, capture_output=True, text=True, timeout=60)

    missing = run()
    assert missing.returncode != 0 and "models-fill" in missing.stderr
    local.parent.mkdir(parents=True)
    local.write_text("{}")
    assert run().returncode == 0


def test_a_claim_filled_by_hand_is_mounted_as_is():
    objects = hs.render(DEFAULT)
    assert hs.find(objects, "PersistentVolumeClaim", "models") == [] and hs.find(objects, "Job", "models-fill") == []
    for component in ("serving", "trainer"):
        spec = hs.pod_spec(hs.one(objects, "Deployment", component))
        assert "initContainers" not in spec
        assert {v["name"]: v for v in spec["volumes"]}["models"]["persistentVolumeClaim"][
            "claimName"
        ] == "specops-models"
    warned = hs.notes(DEFAULT, {"models": {"fill": {"enabled": True}}})
    assert "set models.fill.enabled false for a claim you filled yourself" in warned


def test_bootstrap_fill_checks_the_directory_and_writes_the_marker_the_pods_wait_for(tmp_path):
    """The bootstrap fill's container command, run here (a --tiny bootstrap): `specops bootstrap`, then the check
    that writes ready.json; every init container (serving, the trainer, kb-build) waits for that file."""
    values = {
        "models": {"fill": {"bootstrap": {"args": ["--tiny"]}}},
        "retrieval": {"milvus": {"mode": "lite", "kbBuild": {"enabled": True}}},
    }
    objects = hs.render(None, values)
    (fill,) = _job_pod(_job(objects, "models-fill"))["containers"]
    env = hs.literal_env(fill)
    volume = tmp_path / "volume"
    out = volume / Path(env["MODELS_OUT"]).relative_to("/models")
    args = [a if a != env["MODELS_OUT"] else str(out) for a in fill["args"]]
    run_env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the image's `specops`
        "MODELS_OUT": str(out),
        "SPECOPS_DATA_DIR": str(tmp_path / "data"),
    }
    done = subprocess.run(args, env=run_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out / 'ready.json'}" in done.stdout
    marker = json.loads((out / "ready.json").read_text())
    assert {"target/config.json", "draft/config.json", "embedder/embedder.json"} <= set(marker["files"])
    assert marker["embedder"] is True and marker["written_by"] == "specops models check --mark"
    waits = {
        hs.component(o): {c["name"]: c for c in hs.pod_spec(o)["initContainers"]}["wait-for-models"]
        for o in objects
        if hs.component(o) in ("serving", "trainer", "kb-build") and o["kind"] in ("Deployment", "Job")
    }
    assert set(waits) == {"serving", "trainer", "kb-build"}
    for component, wait in waits.items():
        ready = Path(hs.literal_env(wait)["MODELS_READY_FILE"])
        local = volume / ready.relative_to(Path(wait["volumeMounts"][0]["mountPath"]))
        assert local == out / "ready.json", component
        wait_env = {**os.environ, "MODELS_READY_FILE": str(local), "WAIT_TIMEOUT_S": "0"}
        waited = subprocess.run([sys.executable, *wait["args"][1:]], env=wait_env, capture_output=True, text=True)
        assert waited.returncode == 0 and "is there" in waited.stdout, (component, waited.stderr)


def test_fill_embedder_false_lets_a_directory_without_it_be_complete():
    plain = hs.render(None, {"models": {"fill": {"mode": "s3", "s3": {"uri": "s3://b/p"}}}})
    assert _s3_fill(plain)[1]["MODELS_EMBEDDER"] == "true"
    off = {"models": {"fill": {"embedder": False}}}
    s3 = hs.render(None, hs._merge(off, {"models": {"fill": {"mode": "s3", "s3": {"uri": "s3://b/p"}}}}))
    assert _s3_fill(s3)[1]["MODELS_EMBEDDER"] == "false"
    (boot,) = _job_pod(_job(hs.render(None, off), "models-fill"))["containers"]
    assert "specops models check --mark --no-embedder " in boot["args"][2]
    with pytest.raises(hs.RenderError, match="embedder"):
        hs.render(None, {"models": {"fill": {"embedder": "no"}}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"models": {"subPath": ""}}, "models.fill.enabled needs models.subPath"),
        ({"models": {"fill": {"mode": "s3"}}}, "models.fill.mode s3 needs models.fill.s3.uri"),
        ({"models": {"fill": {"gpus": 1}}}, "need image.variant cuda"),
    ],
    ids=["fill-into-the-root", "s3-without-uri", "fill-gpu-on-cpu"],
)
def test_fill_values_that_cannot_work_are_refused(values, message):
    with pytest.raises(hs.RenderError, match=re.escape(message)):
        hs.render(None, values)


def _s3_fill(objects) -> tuple[str, dict[str, str], dict]:
    (fill,) = _job_pod(_job(objects, "models-fill"))["containers"]
    assert fill["args"][:2] == ["python", "-c"]
    return fill["args"][2], hs.literal_env(fill), fill


def test_s3_fill_renders_the_copy_with_its_credentials():
    objects = hs.render(EXTENSIONS)
    _, env, fill = _s3_fill(objects)
    assert fill["image"] == f"ghcr.io/specops/specops-trainer:{APP_VERSION}", "boto3 is in the trainer image"
    assert env["MODELS_S3_URI"] == "s3://specops-models/pairs/llama-3.2-1b-with-draft"
    assert env["MODELS_OUT"] == "/models/llama-pair" and env["MODELS_FORCE"] == "false"
    assert (env["MODELS_S3_ENDPOINT"], env["MODELS_S3_REGION"]) == ("http://minio.storage.svc:9000", "eu-west-1")
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in fill["env"] if "valueFrom" in e}
    assert refs["AWS_ACCESS_KEY_ID"] == {"name": "specops-models-s3", "key": "AWS_ACCESS_KEY_ID"}
    pvc = hs.one(objects, "PersistentVolumeClaim", "models")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "fast-rwx"
    shared = hs.render(DEFAULT, {"models": {"fill": {"enabled": True, "mode": "s3", "s3": {"uri": "s3://b/p"}}}})
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _s3_fill(shared)[2]["env"] if "valueFrom" in e}
    secret = hs.one(shared, "Secret")["metadata"]["name"]
    assert refs["AWS_SECRET_ACCESS_KEY"] == {"name": secret, "key": "AWS_SECRET_ACCESS_KEY"}, "MLflow's S3 keys"


def _run_fill(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_s3_fill_copies_a_model_directory_and_keeps_it_on_a_rerun(s3_bucket, tmp_path, tiny_models):
    from specops.core.model_layout import layout_files
    from tests.specops.cli.test_models import a_models_dir

    script, env, _ = _s3_fill(hs.render(EXTENSIONS))
    src = a_models_dir(tiny_models, tmp_path / "mine")  # a tiny pair and an embedder's files: the fill checks them
    files = {rel: (src / rel).read_bytes() for rel in layout_files(src)}
    for rel, body in files.items():
        s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key=f"pairs/mine/{rel}", Body=body)
    s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key="pairs/mine-not/target/config.json", Body=b"no")
    volume = tmp_path / "volume"
    (volume / "llama-pair").mkdir(parents=True)  # the empty directory a subPath mount leaves behind
    run_env = {
        **env,
        **s3_bucket.env,
        "MODELS_S3_URI": f"s3://{s3_bucket.bucket}/pairs/mine",
        "MODELS_OUT": str(volume / "llama-pair"),
        "MODELS_S3_ENDPOINT": s3_bucket.endpoint,
    }
    done = _run_fill(script, run_env)
    assert done.returncode == 0, done.stderr
    out = volume / "llama-pair"
    assert {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} == set(files) | {"ready.json"}
    assert (out / "draft" / "model.safetensors").read_bytes() == files["draft/model.safetensors"]
    assert sorted(p.name for p in volume.iterdir()) == ["llama-pair"], "no temporary directory left"

    s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key="pairs/mine/draft/model.safetensors", Body=b"v2")
    kept = _run_fill(script, run_env)
    assert kept.returncode == 0 and "kept" in kept.stdout
    assert (out / "draft" / "model.safetensors").read_bytes() == files["draft/model.safetensors"]
    forced = _run_fill(script, {**run_env, "MODELS_FORCE": "true"})
    assert forced.returncode == 0, forced.stderr
    assert (out / "draft" / "model.safetensors").read_bytes() == b"v2"
    assert sorted(p.name for p in volume.iterdir()) == ["llama-pair"]

    missing = _run_fill(
        script, {**run_env, "MODELS_S3_URI": f"s3://{s3_bucket.bucket}/pairs/none", "MODELS_FORCE": "true"}
    )
    assert missing.returncode != 0 and "has no target/config.json" in missing.stderr
    s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key="pairs/half/target/config.json", Body=b"{}")
    half = _run_fill(
        script, {**run_env, "MODELS_S3_URI": f"s3://{s3_bucket.bucket}/pairs/half", "MODELS_FORCE": "true"}
    )
    assert half.returncode != 0 and "has no draft/config.json" in half.stderr
    assert (out / "draft" / "model.safetensors").read_bytes() == b"v2", "a failed fill leaves the models alone"


# ---------------------------------------------------------------- 9. MLflow's schema, once
def test_one_job_migrates_mlflow_and_every_replica_waits_for_it():
    objects = hs.render(EXTENSIONS)
    mlflow = hs.one(objects, "Deployment", "mlflow")
    assert mlflow["spec"]["replicas"] == 2
    pod = hs.pod_spec(mlflow)
    inits = [c["name"] for c in pod["initContainers"]]
    assert inits == ["wait-for-schema", "check"], "the chart's wait first, then the values' init containers"
    assert not [c for c in pod["initContainers"] + pod["containers"] if "upgrade" in (c.get("command") or [])]
    (job,) = hs.find(objects, "Job", "mlflow-db-upgrade")
    (upgrade,) = _job_pod(job)["containers"]
    assert upgrade["command"][:3] == ["mlflow", "db", "upgrade"]
    wait = pod["initContainers"][0]
    assert hs.literal_env(wait)["MLFLOW_BACKEND_STORE_URI"] == upgrade["command"][3]
    assert wait["image"] == upgrade["image"] == hs.container(mlflow, "mlflow")["image"]
    assert _job_pod(job)["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 6
    pdb = hs.one(objects, "PodDisruptionBudget", "mlflow")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= mlflow["spec"]["template"]["metadata"]["labels"].items()
    assert pod["nodeSelector"] == {"node-pool": "system"} and pod["tolerations"][0]["value"] == "system"
    assert pod["affinity"]["podAntiAffinity"] and pod["topologySpreadConstraints"][0]["topologyKey"].startswith(
        "topology"
    )
    assert pod["priorityClassName"] == "specops-system"
    assert hs.container(mlflow, "mlflow")["resources"]["limits"]["memory"] == "4Gi"
    assert hs.find(hs.render(DEFAULT, {"mlflow": {"pdb": {"enabled": False}}}), "PodDisruptionBudget", "mlflow") == []
    newer = hs.render(DEFAULT, {"mlflow": {"image": {"tag": "0.2.0"}}})
    assert (
        _job(newer, "mlflow-db-upgrade")["metadata"]["name"]
        != _job(hs.render(DEFAULT), "mlflow-db-upgrade")["metadata"]["name"]
    )


def _wait_for_schema(uri: str, timeout_s: float = 0) -> subprocess.CompletedProcess:
    # the script checks once before it reads the clock, then sleeps 5 s: timeout 0 is that first check's verdict
    wait = hs.pod_spec(hs.one(hs.render(DEFAULT), "Deployment", "mlflow"))["initContainers"][0]
    assert wait["command"][:2] == ["python", "-c"]
    env = {**os.environ, **hs.literal_env(wait), "MLFLOW_BACKEND_STORE_URI": uri, "WAIT_TIMEOUT_S": str(timeout_s)}
    argv = [sys.executable, *wait["command"][1:]]  # the image's python, here this venv's
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_schema_wait_holds_mlflow_until_the_upgrade_ran(tmp_path):
    """The init container's script, against a real MLflow database: it waits on an empty one, passes once
    ``mlflow db upgrade`` ran, passes a schema newer than its MLflow knows (a chart rollback), and names an
    unreachable database."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    empty = _wait_for_schema(uri)
    assert empty.returncode != 0 and "schema empty" in empty.stderr and "mlflow-db-upgrade" in empty.stderr
    upgrade = subprocess.run(
        [sys.executable, "-m", "mlflow", "db", "upgrade", uri], capture_output=True, text=True, timeout=120
    )
    assert upgrade.returncode == 0, upgrade.stderr[-2000:]
    ready = _wait_for_schema(uri)
    assert ready.returncode == 0 and "MLflow schema is at" in ready.stdout
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        db.execute("UPDATE alembic_version SET version_num = 'f00dfeedbeef'")
    newer = _wait_for_schema(uri)
    assert newer.returncode == 0 and "newer" in newer.stdout
    down = _wait_for_schema("postgresql+psycopg2://mlflow@127.0.0.1:9/mlflow")
    assert down.returncode != 0 and "database unreachable" in down.stderr


# ---------------------------------------------------------------- 10. extension points
@pytest.mark.parametrize("values_file", [None, *CI.values()], ids=["chart-defaults", *CI])
def test_every_value_set_is_valid_at_the_oldest_kubernetes_the_chart_supports(values_file):
    """Chart.yaml's kubeVersion is >=1.30: the preStop sleep action, the Job and PDB fields hold there too."""
    assert re.search(r'kubeVersion:\s*">=\s*1\.30', (hs.CHART_DIR / "Chart.yaml").read_text())
    for obj in hs.render(values_file):
        hs.validate_object(obj, "1.30")


@pytest.mark.parametrize("kube_version", ["1.30", hs.KUBE_VERSION])
def test_extensions_value_set_is_valid_kubernetes(kube_version):
    checked = {"builtin": 0, "crd": 0}
    for obj in hs.render(EXTENSIONS):
        checked[hs.validate_object(obj, kube_version)] += 1
    assert checked["crd"] == 3  # ScaledObject, ServiceMonitor, HTTPRoute
    report = hs.lint(EXTENSIONS)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_every_component_takes_volumes_sidecars_init_containers_and_scheduling():
    objects = hs.render(EXTENSIONS)
    values = _values(EXTENSIONS)
    for component, name, v in (
        ("serving", "serving", values["serving"]),
        ("trainer", "trainer", values["trainer"]),
        ("mlflow", "mlflow", values["mlflow"]),
        ("milvus", "milvus", values["retrieval"]["milvus"]["lite"]),
    ):
        deployment = hs.one(objects, "Deployment", component)
        pod = hs.pod_spec(deployment)
        assert [c["name"] for c in pod["containers"]] == [name] + [c["name"] for c in v["extraContainers"]], component
        assert [c["name"] for c in pod["initContainers"]][-len(v["initContainers"]) :] == [
            c["name"] for c in v["initContainers"]
        ]
        assert {x["name"] for x in v["extraVolumes"]} <= {x["name"] for x in pod["volumes"]}
        mounts = hs.container(deployment, name)["volumeMounts"]
        assert all(m in mounts for m in v["extraVolumeMounts"]), component
        assert pod["priorityClassName"] == v["priorityClassName"], component
        assert pod.get("runtimeClassName", "") == v["runtimeClassName"], component
        if v.get("topologySpreadConstraints"):
            assert pod["topologySpreadConstraints"] == v["topologySpreadConstraints"], component
    jobs = values["jobs"]
    pods = [_job_pod(j) for j in hs.find(objects, "Job")] + [hs.pod_spec(j) for j in hs.find(objects, "CronJob")]
    assert len(pods) == 5  # models fill, mlflow db upgrade, kb build, registry retain, policy fit
    for pod in pods:
        assert pod["nodeSelector"] == jobs["nodeSelector"] and pod["priorityClassName"] == jobs["priorityClassName"]
        assert pod["tolerations"] == jobs["tolerations"]
        assert {x["name"] for x in jobs["extraVolumes"]} <= {x["name"] for x in pod["volumes"]}
        assert jobs["extraVolumeMounts"][0] in pod["containers"][0]["volumeMounts"]
    plain = hs.pod_spec(hs.one(hs.render(DEFAULT), "Deployment", "trainer"))
    assert not {"priorityClassName", "runtimeClassName", "topologySpreadConstraints"} & set(plain)


def test_ingress_and_http_route_send_traffic_to_the_serving_service():
    objects = hs.render(EXTENSIONS)
    service = hs.one(objects, "Service", "serving")
    ingress = hs.one(objects, "Ingress", "serving")
    assert ingress["spec"]["ingressClassName"] == "nginx" and ingress["spec"]["tls"][0]["secretName"] == "specops-tls"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "specops.example.com"
    assert rule["http"]["paths"] == [
        {
            "path": "/",
            "pathType": "Prefix",
            "backend": {"service": {"name": service["metadata"]["name"], "port": {"name": "http"}}},
        }
    ]
    assert service["spec"]["ports"][0]["name"] == "http"
    route = hs.one(objects, "HTTPRoute", "serving")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways", "sectionName": "https"}]
    assert route["spec"]["hostnames"] == ["api.specops.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    _, _, cfg = _serving(objects)
    timeout = rule["timeouts"]["request"]
    assert timeout.endswith("s") and int(timeout[:-1]) > cfg.admission.request_timeout_s, (
        "a stream outlives no route timeout"
    )
    plain = hs.render(DEFAULT)
    assert hs.find(plain, "Ingress") == [] and hs.find(plain, "HTTPRoute") == [], "both off by default"
    with pytest.raises(hs.RenderError, match="parentRefs"):
        hs.render(DEFAULT, {"serving": {"httpRoute": {"enabled": True}}})
    broken = hs.one(objects, "HTTPRoute")
    broken["spec"]["rules"][0]["backendRefs"][0].pop("port")
    with pytest.raises(Exception, match="port"):
        hs.validate_object(broken)


def test_keda_fallback_and_hpa_behavior():
    scaled = hs.one(hs.render(EXTENSIONS), "ScaledObject")
    values = _values(EXTENSIONS)["serving"]["autoscaling"]
    assert scaled["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 4}
    assert scaled["spec"]["triggers"][0]["metricType"] == "AverageValue", "KEDA's fallback needs AverageValue"
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == values["behavior"]
    plain = hs.one(hs.render(CI["gpu-keda-strimzi-values.yaml"]), "ScaledObject")
    assert "fallback" not in plain["spec"] and "advanced" not in plain["spec"]

    hpa_values = {"serving": {"autoscaling": {"mode": "hpa", "behavior": values["behavior"]}}}
    hpa = hs.one(hs.render(DEFAULT, hpa_values), "HorizontalPodAutoscaler")
    assert hpa["spec"]["behavior"] == values["behavior"]
    hs.validate_object(hpa, "1.30")
    default = hs.one(hs.render(CI["hpa-values.yaml"]), "HorizontalPodAutoscaler")
    assert default["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 300}}


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"serving": {"extraVolume": []}}, "extraVolume"),
        ({"serving": {"extraVolumes": [{"emptyDir": {}}]}}, "/serving/extraVolumes/0"),
        ({"trainer": {"extraContainers": [{"name": "x"}]}}, "/trainer/extraContainers/0"),
        ({"mlflow": {"pdb": {"maxUnavailabe": 1}}}, "maxUnavailabe"),
        ({"mlflow": {"topologySpreadConstraint": []}}, "topologySpreadConstraint"),
        ({"serving": {"ingress": {"hosts": [{"host": "a.example", "pathz": []}]}}}, "pathz"),
        ({"serving": {"httpRoute": {"requestTimeout": "10 minutes"}}}, "/serving/httpRoute/requestTimeout"),
        ({"serving": {"autoscaling": {"keda": {"fallback": {"replicas": 2}}}}}, "failureThreshold"),
        ({"serving": {"autoscaling": {"behavior": {"scaleDwn": {}}}}}, "scaleDwn"),
        ({"jobs": {"runtimeClass": "gvisor"}}, "runtimeClass"),
        ({"models": {"fill": {"s3": {"uri": "https://bucket/prefix"}}}}, "/models/fill/s3/uri"),
        ({"serving": {"drainMarginSeconds": -1}}, "/serving/drainMarginSeconds"),
    ],
    ids=[
        "typo-extra-volumes",
        "volume-without-name",
        "container-without-image",
        "typo-mlflow-pdb",
        "typo-mlflow-spread",
        "typo-ingress-paths",
        "bad-route-timeout",
        "fallback-without-threshold",
        "typo-behavior",
        "typo-jobs",
        "fill-uri-not-s3",
        "negative-margin",
    ],
)
def test_the_schema_admits_the_extension_points_and_still_refuses_typos(values, field):
    with pytest.raises(hs.RenderError) as caught:
        hs.render(DEFAULT, values)
    assert field in str(caught.value)


# ---------------------------------------------------------------- 8. logs
def test_log_format_and_access_log_reach_every_specops_container(monkeypatch):
    """logFormat / accessLog become SPECOPS_LOG_FORMAT / SPECOPS_ACCESS_LOG, which the CLI reads as the defaults
    of --log-format and --no-access-log; a format the CLI does not know is refused by the schema."""
    objects = hs.render(DEFAULT, {"logFormat": "json", "accessLog": False})
    for component in ("serving", "trainer"):
        env = hs.literal_env(hs.container(hs.one(objects, "Deployment", component), component))
        assert (env["SPECOPS_LOG_FORMAT"], env["SPECOPS_ACCESS_LOG"]) == ("json", "0"), component
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        args = build_parser().parse_args(["serve"])
        assert (args.log_format, args.access_log) == ("json", False)
    default = hs.literal_env(hs.container(hs.one(hs.render(DEFAULT), "Deployment", "serving"), "serving"))
    assert (default["SPECOPS_LOG_FORMAT"], default["SPECOPS_ACCESS_LOG"]) == ("text", "1")
    with pytest.raises(hs.RenderError) as caught:
        hs.render(DEFAULT, {"logFormat": "xml"})
    assert "logFormat" in str(caught.value)

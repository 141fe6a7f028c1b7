"""deploy/docker: what each image installs, which images exist, and how they are built and released.

No Docker engine, no registry and no network here, so:

- **The serving set** (``deploy/docker/requirements-serving.txt``, what the serving images install instead of all of
  pyproject's dependencies) is checked by running ``deploy/docker/serving_check.py`` (``specops serve``'s entry point
  and app, every serving-side module, the registry client) in this venv *restricted to the distributions that set
  resolves to*: their requirements are followed through the installed metadata (pinned by constraints.txt), and a
  directory of links to only their files is the subprocess's whole site-packages (``python -I -S``). A module of a
  distribution outside the closure is then not found, as in the image; full ``mlflow``'s files (its server, which
  brings pandas, scipy, scikit-learn, flask) stay out while ``mlflow-skinny``'s, the same ``mlflow`` package, go in.
- **The bake file** (``deploy/docker/docker-bake.json``, what ``make images`` builds) is evaluated here as
  ``docker buildx bake --print`` would (variables, ``inherits``, groups) and compared with every image the Helm
  chart renders (every ci/ value set, CPU and CUDA) and compose names, and with the Dockerfile's stages.
- **The release workflow** is validated against the GitHub-workflow schema (check-jsonschema's vendored copy).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy import helm_support as hs
from tests.deploy.test_docker import BY_NAME, STAGES, chain, constraint_pin, pip_installs

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "deploy" / "docker"
SERVING_REQUIREMENTS = DOCKER_DIR / "requirements-serving.txt"
BAKE_FILE = DOCKER_DIR / "docker-bake.json"
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
SITE = Path(sysconfig.get_path("purelib"))

TRAINER_ONLY = ("deepspeed", "mlflow", "apscheduler", "matplotlib", "gguf", "openai", "boto3")
"""pyproject dependencies the serving set leaves out (``mlflow``: its client, ``mlflow-skinny``, is in)."""
HEAVY = ("deepspeed", "scipy", "scikit-learn", "flask", "gunicorn", "matplotlib", "boto3", "botocore", "mlflow")
"""Distributions that must not be in the serving closure (what made the shared venv heavy)."""


# ---------------------------------------------------------------- the serving set and its closure
def serving_requirements() -> list[Requirement]:
    lines = [ln.split("#", 1)[0].strip() for ln in SERVING_REQUIREMENTS.read_text().splitlines()]
    return [Requirement(ln) for ln in lines if ln]


def pin(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req}: pin it exactly"
    return spec.version


@cache
def installed() -> dict[str, metadata.Distribution]:
    """The venv's distributions by canonical name (its site-packages only: not the repo's egg-info)."""
    return {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(SITE)])}


def closure(requirements: list[Requirement]) -> set[str]:
    """Every distribution ``pip install -r`` of ``requirements`` brings, from the installed metadata."""
    dists = installed()
    seen: set[str] = set()
    todo = [(r, "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        assert name in dists, f"{req} (needed by the serving set) is not installed in this venv"
        for wanted in ("", *req.extras):
            key = f"{name}[{wanted}]"
            if key in seen:
                continue
            seen.add(key)
            todo += [(Requirement(r), wanted) for r in dists[name].requires or []]
    return {key.split("[")[0] for key in seen}


def _site_files(dist: metadata.Distribution) -> list[PurePosixPath]:
    return [PurePosixPath(str(f)) for f in dist.files or [] if not str(f).startswith("..")]


def restricted_site(names: set[str], dest: Path) -> Path:
    """A site-packages of links to the files of ``names`` only. A top-level entry that only those distributions
    write is one link; one shared with a distribution left out (``mlflow/``: mlflow-skinny, mlflow-tracing and
    mlflow) gets a link per file of the distributions kept."""
    dists = installed()
    owners: dict[str, set[str]] = {}
    for name, dist in dists.items():
        for f in _site_files(dist):
            owners.setdefault(f.parts[0], set()).add(name)
    dest.mkdir(parents=True)
    for name in sorted(names):
        for f in _site_files(dists[name]):
            top = f.parts[0]
            if top == "__pycache__":
                continue
            if owners[top] <= names:
                link, target = dest / top, SITE / top
            else:
                link, target = dest / f, SITE / f
            if not link.exists() and target.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(target)
    return dest


@pytest.fixture(scope="module")
def serving_site(tmp_path_factory) -> Path:
    names = closure(serving_requirements()) | {"specops"}  # specops itself, without its (full) requirements
    return restricted_site(names, tmp_path_factory.mktemp("serving") / "site-packages")


def run_restricted(site: Path, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in this Python with ``site`` as its only site-packages (its .pth files processed: the editable
    install's finder), no user site, no PYTHONPATH, and the data directories under ``site``'s parent."""
    boot = f"import site, sys; site.addsitedir({str(site)!r}); sys.argv = [sys.argv[0], *sys.argv[1:]]\n{code}"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(site.parent),
        "SPECOPS_DATA_DIR": str(site.parent / "data"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", boot, *args],
        cwd=site.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_serving_requirements_are_pyprojects_pins_less_the_trainers():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = {canonicalize_name(r.name): r for r in map(Requirement, project["dependencies"])}
    serving = {canonicalize_name(r.name): r for r in serving_requirements()}
    assert len(serving) == len(serving_requirements()), "a name twice"
    left_out = set(deps) - set(serving)
    assert left_out == set(TRAINER_ONLY), f"left out of serving: {sorted(left_out)}; expected {TRAINER_ONLY}"
    for name, req in serving.items():
        assert not req.extras and not req.marker, req
        if name in deps:
            assert req.specifier == deps[name].specifier, f"{req} differs from pyproject's {deps[name]}"
        elif name == "mlflow-skinny":
            assert pin(req) == pin(deps["mlflow"]), "MLflow's client at the server's version"
        else:  # what pyproject gets through mlflow: the SQL store's migrations
            assert pin(req) == constraint_pin(req.name), f"{req}: not constraints.txt's pin"
    assert pin(serving["torch"]) == constraint_pin("torch")


def test_serving_closure_is_pinned_and_leaves_the_heavy_packages_out():
    names = closure(serving_requirements())
    assert {"torch", "transformers", "mlflow-skinny", "fastapi", "pymilvus"} <= names
    heavy = names & set(HEAVY)
    assert not heavy, f"the serving set pulls {sorted(heavy)}"
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    for name in names - {"setuptools", "pip", "wheel"}:  # the venv's own (pip freeze leaves them out)
        version = installed()[name].version.split("+")[0]
        assert pins.get(name) == version, f"{name} {version} is not pinned by constraints.txt ({pins.get(name)})"
    # and the trainer's closure (all of pyproject) is larger by at least those
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    full = closure([Requirement(r) for r in project["dependencies"]])
    assert names < full and {"deepspeed", "mlflow", "scipy", "scikit-learn", "flask"} <= full - names


def test_serving_entry_point_runs_with_only_the_serving_set(serving_site):
    """``serving_check.py`` (the Dockerfile's last step of each serving builder) in the restricted environment."""
    site = serving_site
    script = DOCKER_DIR / "serving_check.py"
    done = run_restricted(site, f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert re.search(r"serving check: entry point and app, \d{2,} modules, registry client: ok", done.stdout)


def test_the_restricted_environment_catches_a_trainer_import(serving_site):
    """The check can fail: deepspeed (trainer only) is not found there, and pandas (in the set through the Milvus
    client) imported before `specops serve` builds its app fails the entry-point check."""
    site = serving_site
    done = run_restricted(site, "import deepspeed")
    assert done.returncode != 0 and "No module named 'deepspeed'" in done.stderr, done.stderr[-2000:]
    full_only = {str(f) for f in _site_files(installed()["mlflow"])} - {
        str(f) for name in ("mlflow-skinny", "mlflow-tracing") for f in _site_files(installed()[name])
    }
    assert any(f.startswith("mlflow/server/js/") for f in full_only)  # full mlflow's UI build
    assert not [f for f in full_only if (site / f).exists()], "full mlflow's own files are in the serving set"
    assert (site / "mlflow" / "client.py").exists()  # skinny's: the client serving uses
    script = DOCKER_DIR / "serving_check.py"
    code = (
        "import pandas, runpy, tempfile, pathlib\n"
        f"check = runpy.run_path({str(script)!r})\n"
        "check['check_entry_point'](pathlib.Path(tempfile.mkdtemp()))\n"
    )
    done = run_restricted(site, code)
    assert done.returncode != 0 and re.search(r"`specops serve` imports \[.*'pandas'", done.stderr), done.stderr[-2000:]


# ---------------------------------------------------------------- the bake file: every image, one command
def bake(env: dict[str, str] | None = None) -> dict[str, dict]:
    """``docker buildx bake -f docker-bake.json --print release``'s targets: variables (their defaults, or
    ``env``), ``${VAR}`` interpolation, ``inherits`` (maps merged, other attributes replaced) and nested groups."""
    spec = json.loads(BAKE_FILE.read_text())
    values = {name: (env or {}).get(name, var["default"]) for name, var in spec["variable"].items()}

    def interpolate(node):
        if isinstance(node, str):

            def var(m: re.Match) -> str:
                assert m.group(1) in values, f"${{{m.group(1)}}} is not a variable of {BAKE_FILE.name}"
                return values[m.group(1)]

            return re.sub(r"\$\{(\w+)\}", var, node)
        if isinstance(node, list):
            return [interpolate(v) for v in node]
        if isinstance(node, dict):
            return {k: interpolate(v) for k, v in node.items()}
        return node

    def target(name: str) -> dict:
        own = spec["target"][name]
        out: dict = {}
        for parent in own.get("inherits", []):
            for key, value in target(parent).items():
                out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
        for key, value in own.items():
            if key != "inherits":
                out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
        return out

    def expand(name: str) -> list[str]:
        if name in spec["group"]:
            return [t for member in spec["group"][name]["targets"] for t in expand(member)]
        assert name in spec["target"], f"{name}: neither a group nor a target"
        return [name]

    names = expand("release")
    assert len(names) == len(set(names)) and expand("default") == names
    return {name: interpolate(target(name)) for name in names}


def chart_images() -> set[str]:
    """Every image of the specops repositories a pod of the chart runs: each ci/ value set and the defaults, with
    image.variant cpu and cuda (the sets that need GPUs render with cuda only), and specops.serving.engine vllm."""
    images: set[str] = set()
    variants = [{"image": {"variant": v}} for v in ("cpu", "cuda")]
    vllm = [{**v, "serving": {"engine": "vllm"}} for v in variants]
    for values_file in (None, *hs.ci_value_files()):
        for overrides in (*variants, *(vllm if values_file is None else ())):
            try:
                objects = hs.render(values_file, overrides)
            except hs.RenderError as exc:
                assert "need image.variant cuda" in str(exc), exc
                continue
            for obj in objects:
                if obj.get("kind") in ("Deployment", "StatefulSet", "Job", "CronJob"):
                    spec = hs.pod_spec(obj)
                    for c in (*spec.get("initContainers", []), *spec["containers"]):
                        images.add(c["image"])
    return {i for i in images if i.startswith("ghcr.io/specops/")}


def compose_images() -> dict[str, dict]:
    """compose.yaml's specops images (``${SPECOPS_VERSION:-default}`` at its default) -> their ``build`` section."""
    compose = yaml.safe_load((REPO / "deploy" / "compose" / "compose.yaml").read_text())
    out = {}
    for service in compose["services"].values():
        image = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", service.get("image", ""))
        if image.startswith("ghcr.io/specops/"):
            assert out.get(image, service["build"]) == service["build"], f"{image} is built two ways"
            out[image] = service["build"]
    return out


def test_bake_builds_every_image_the_chart_and_compose_pull():
    targets = bake()
    tags = {tag: name for name, t in targets.items() for tag in t["tags"]}
    app_version = yaml.safe_load((hs.CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    project_version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert json.loads(BAKE_FILE.read_text())["variable"]["TAG"]["default"] == app_version == project_version
    pulled = chart_images()
    assert {
        f"ghcr.io/specops/specops-{name}:{app_version}{suffix}"
        for name in ("serving", "serving-vllm", "trainer", "bootstrap")
        for suffix in ("", "-cuda")
    } == pulled, "the chart's images changed: update docker-bake.json and this list"
    missing = pulled - set(tags)
    assert not missing, f"the chart pulls {sorted(missing)}, which `make images` does not build"
    built_by_compose = compose_images()
    assert len(built_by_compose) == 4
    for image, build in built_by_compose.items():
        assert image in tags, f"compose runs {image}, which `make images` does not build"
        target = targets[tags[image]]
        assert (build["target"], build["args"]["VARIANT"]) == (target["target"], target["args"]["VARIANT"]), image
        assert build["context"].rstrip("/").endswith("..") and build["dockerfile"] == target["dockerfile"], build
    # nothing built that nobody pulls
    assert set(tags) == pulled


def test_every_bake_target_is_a_stage_of_the_dockerfile_with_its_variant():
    from tests.deploy.test_docker import GLOBAL_ARGS

    declared = set(GLOBAL_ARGS) | {a.split("=")[0] for s in STAGES for a in s.all("ARG")}
    for name, target in bake().items():
        assert target["context"] == "." and target["dockerfile"] == "deploy/docker/Dockerfile", name
        variant = target["args"]["VARIANT"]
        assert target["target"] in BY_NAME, f"{name}: the Dockerfile has no stage {target['target']}"
        if target["target"] == "serving-vllm":  # a selector stage: FROM serving-vllm-${VARIANT}
            assert f"serving-vllm-{variant}" in BY_NAME
        assert set(target["args"]) <= declared, f"{name}: the Dockerfile has no ARG {set(target['args']) - declared}"
        (tag,) = target["tags"]
        repository, _, version = tag.rpartition(":")
        assert repository == f"ghcr.io/specops/specops-{target['target']}", tag
        assert version.endswith("-cuda") == name.endswith("-cuda") == (variant == "cuda"), name
        assert target["args"]["VERSION"] == version.removesuffix("-cuda")  # the OCI version label
    # the variables move every tag; the CUDA vLLM image is the Dockerfile's default unless set
    moved = bake({"REGISTRY": "registry.example/team", "TAG": "9.9.9"})
    assert all(t["tags"][0].startswith("registry.example/team/specops-") for t in moved.values())
    assert moved["trainer-cuda"]["tags"] == ["registry.example/team/specops-trainer:9.9.9-cuda"]
    assert bake()["serving-vllm-cuda"]["args"]["VLLM_CUDA_IMAGE"] == GLOBAL_ARGS["VLLM_CUDA_IMAGE"]


def test_make_images_is_the_bake_of_the_release_group():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^BAKE_FILE\s*:=\s*deploy/docker/docker-bake\.json$", makefile, re.M)
    assert re.search(r"^BAKE_TARGETS\s*\?=\s*release$", makefile, re.M)
    assert re.search(r"^images:\n\tdocker buildx bake -f \$\(BAKE_FILE\) .*\$\(BAKE_TARGETS\)$", makefile, re.M)
    assert re.search(r"^images-print:\n\tdocker buildx bake -f \$\(BAKE_FILE\) --print ", makefile, re.M)
    for doc in (DOCKER_DIR / "README.md", REPO / "deploy" / "README.md"):
        assert "make images" in doc.read_text(), f"{doc} does not say how to build the images"


# ---------------------------------------------------------------- the serving images install the serving set
def test_serving_images_install_the_serving_set_and_the_trainer_all():
    for stage in ("builder-serving-cpu", "builder-serving-cuda"):
        installs = " ".join(pip_installs(stage))
        assert "-r requirements-serving.txt" in installs and "-c constraints.txt" in installs, installs
        runs = " ".join(BY_NAME[stage].all("RUN"))
        assert "serving_check.py" in runs and "pip check" in runs
    assert "${TORCH_CPU_INDEX_URL}" in " ".join(pip_installs("builder-serving-cpu"))
    assert "${TORCH_CUDA_INDEX_URL}" in " ".join(pip_installs("builder-serving-cuda"))
    assert BY_NAME["builder-serving"].base == "builder-serving-${VARIANT}"

    def venv_source(target: str) -> str:
        (copy,) = [c for s in chain(target) for c in s.all("COPY") if c.endswith(" /opt/venv /opt/venv")]
        return copy.split()[0].removeprefix("--from=")

    assert venv_source("serving") == "builder-serving"
    assert venv_source("serving-vllm-cpu") == "builder-serving"  # FROM serving
    assert venv_source("serving-vllm-cuda") == "builder-serving-cpu"  # the front door: no second CUDA torch
    assert venv_source("trainer") == venv_source("bootstrap") == "builder"
    assert "['project']['dependencies']" in " ".join(BY_NAME["builder"].all("RUN"))  # the trainer: everything


# ---------------------------------------------------------------- the release workflow
def test_release_workflow_is_valid_and_pushes_the_release_group(tmp_path):
    exe = Path(sys.executable).with_name("check-jsonschema")
    assert exe.exists(), f"{exe} is missing: check-jsonschema is a dev dependency (pip install -e '.[dev]')"
    done = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "release.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "runs_on:", 1))
    done = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.github-workflows", str(broken)], capture_output=True, text=True
    )
    assert done.returncode != 0, "the schema check must be able to fail"

    flow = yaml.safe_load(WORKFLOW.read_text())
    assert flow[True]["push"]["tags"] == ["v*"]  # YAML 1.1 reads the key `on` as True
    assert flow["permissions"]["packages"] == "write"
    job = flow["jobs"]["images"]
    assert sorted(job["strategy"]["matrix"]["target"]) == sorted(bake())
    steps = {s["uses"].split("@")[0]: s for s in job["steps"] if "uses" in s}
    assert {"docker/login-action", "docker/setup-buildx-action", "docker/bake-action"} <= set(steps)
    assert steps["docker/login-action"]["with"]["registry"] == "ghcr.io"
    bake_step = steps["docker/bake-action"]
    assert bake_step["with"]["files"] == str(BAKE_FILE.relative_to(REPO)) and bake_step["with"]["push"] is True
    assert bake_step["with"]["targets"] == "${{ matrix.target }}"
    variables = json.loads(BAKE_FILE.read_text())["variable"]
    assert set(bake_step["env"]) <= set(variables), "the step sets a variable the bake file does not read"
    assert f"|| '{variables['VLLM_CUDA_IMAGE']['default']}'" in bake_step["env"]["VLLM_CUDA_IMAGE"]
    assert f"|| '{variables['REGISTRY']['default']}'" in bake_step["env"]["REGISTRY"]


@pytest.mark.parametrize("ref, ok", [("v0.1.0", True), ("v0.2.0", False)])
def test_release_refuses_a_tag_that_is_not_the_version(tmp_path, ref, ok):
    """The version job's script, run here: the chart pulls <appVersion>[-cuda], so the tag must be v<appVersion>."""
    (step,) = [s for s in yaml.safe_load(WORKFLOW.read_text())["jobs"]["version"]["steps"] if "run" in s]
    output = tmp_path / "output"
    env = {"PATH": os.environ["PATH"], "GITHUB_REF_NAME": ref, "GITHUB_OUTPUT": str(output)}
    done = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=REPO, env=env, capture_output=True, text=True)
    assert (done.returncode == 0) is ok, done.stdout + done.stderr
    if ok:
        assert output.read_text().splitlines()[0] == "tag=0.1.0"

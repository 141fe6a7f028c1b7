"""How every ``specops`` command logs: ISO 8601 times with their offset, as text or one JSON object a line.

``specops --log-format json`` (or ``SPECOPS_LOG_FORMAT=json``) writes each record as one JSON
object: ``time``, ``level``, ``logger``, ``message``, ``exc_info`` (the traceback, when there is
one) and every field the call passed in ``extra`` (the access log's ``status``, ``request_id``,
``tenant``, ...). The text format is ``TIME LEVEL LOGGER: MESSAGE``. The serving API's access log
(``specops.access``, one line per request) is on at INFO unless ``--no-access-log``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging

FORMATS = ("text", "json")
ACCESS_LOGGER = "specops.access"

_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
"""Attributes every LogRecord has: what is not one of these came in ``extra``."""


def iso_time(created: float) -> str:
    """``created`` (seconds since the epoch) as local ISO 8601 time with milliseconds and its UTC offset."""
    return dt.datetime.fromtimestamp(created).astimezone().isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MESSAGE``, TIME in ISO 8601 with its offset."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        return iso_time(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, exc_info and the ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in out:
                out[key] = value
        return json.dumps(out, default=str, ensure_ascii=False)


def setup(level: int, fmt: str = "text", *, access_log: bool = True) -> None:
    """The root logger's one handler (stderr) in format ``fmt``; the access log on or off."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler])  # as before: a no-op where the root has handlers
    logging.getLogger(ACCESS_LOGGER).disabled = not access_log

"""The worker's log output: ``--log-level`` and ``--log-format text|json``."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "configure"]

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")

# The attributes every LogRecord has; anything else was given as ``extra=`` (a field).
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
    the record's structured fields (``event``, ``run_id``, ``command``, ...) and, for an
    exception, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update((k, v) for k, v in vars(record).items() if k not in _STANDARD and k[:1] != "_")
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


@contextlib.contextmanager
def configure(level: str, fmt: str) -> Iterator[None]:
    """Log to stderr at ``level`` in ``fmt`` (on the root logger) while the block runs;
    httpx's per-request lines only at ``debug``. The handlers found are put back after
    (the command may run inside another program, a test)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    httpx = logging.getLogger("httpx")
    saved = (root.handlers[:], root.level, httpx.level)
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if level != "debug":
        httpx.setLevel(logging.WARNING)  # not a line per provider request
    try:
        yield
    finally:
        handler.flush()
        root.handlers[:], _, _ = saved
        root.setLevel(saved[1])
        httpx.setLevel(saved[2])

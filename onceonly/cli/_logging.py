"""The worker's log output: ``--log-level`` and ``--log-format text|json``."""

from __future__ import annotations

import json
import logging
import time
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


def configure(level: str, fmt: str) -> None:
    """Log to stderr at ``level`` in ``fmt`` (the root logger, as ``basicConfig`` does);
    httpx's per-request lines only at ``debug``."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per provider request

"""Process logging for ``mlxd serve``: text for people (default) or one JSON object per line."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HANDLER_NAME = "mlxd"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and the request's fields
    (``extra={"mlxd_fields": {...}}``, see ``server/observe.py``) at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "mlxd_fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, log_format: str) -> dict[str, Any]:
    """Set up the root logger; returns the uvicorn keyword arguments that match.

    Per-request lines come from ``mlxd.request`` in both formats, so uvicorn's own
    access log (which knows no model, tokens or request id) is turned off. In JSON
    mode uvicorn's loggers go through the root handler too, so every line is JSON.
    """
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else
                         logging.Formatter(TEXT_FORMAT))
    handler.set_name(HANDLER_NAME)
    root = logging.getLogger()
    for old in list(root.handlers):  # ours from an earlier call; others' are left alone
        if old.get_name() == HANDLER_NAME:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    uvicorn_kwargs: dict[str, Any] = {"access_log": False}
    if log_format == "json":
        uvicorn_kwargs["log_config"] = None
    return uvicorn_kwargs

"""JSON log lines for the long-running processes (``ark agent``, ``ark arbiter``)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, event and the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname.lower(), "event": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        return json.dumps(out, default=str)


def setup_logging(level: str = "info") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger("ark")
    root.handlers[:] = [h]
    root.setLevel(level.upper())
    root.propagate = False


def event(name: str, /, **fields: Any) -> dict[str, Any]:
    """Keyword arguments of a logger call for one event: ``log.info(**event("x", a=1))``."""
    return {"msg": name, "extra": {"fields": fields}}

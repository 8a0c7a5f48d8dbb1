"""The proxy's log lines: plain or JSON (`MESHLET_PROXY_LOG_FORMAT`), one line per record, with
control characters escaped so that a client-chosen value (a name, a header) cannot forge lines;
the level can change at run time (the admin server's `PUT /proxy-log-level`)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Final

LEVELS: Final = {"trace": "DEBUG", "debug": "DEBUG", "info": "INFO", "warn": "WARNING",
                 "warning": "WARNING", "error": "ERROR"}  # fmt: skip
# C0 controls (but tab), DEL and C1 controls, as \xNN.
_CONTROLS: Final = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F,
                                               *range(0x80, 0xA0))}  # fmt: skip


def escape(text: str) -> str:
    return text.translate(_CONTROLS)


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return escape(super().format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=True)


def setup(level: str, fmt: str) -> None:
    """Logs to stderr at `level` (a name from LEVELS) in `fmt` ("plain" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])


def set_level(text: str) -> str:
    """Changes the level at run time; the level set. ValueError for an unknown name."""
    name = text.strip().lower()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {name[:20]!r}; expected one of trace, debug, info, "
                         "warn, error")  # fmt: skip
    logging.getLogger().setLevel(LEVELS[name])
    return name

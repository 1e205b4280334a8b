"""Log set-up: one line per event, a level on every line, journal-friendly.

``logfmt`` (the default) writes ``<time> <level> <logger>: <message>``; under systemd
(``JOURNAL_STREAM`` set) the time is left to the journal and the line starts with a ``<N>`` syslog
priority so ``journalctl -p`` works.  ``json`` writes one object per line; a route line's fields are
top-level keys there.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, TextIO

from ..supervise import llama_log

ROUTE_LOGGER = "onebit.route"

_SYSLOG_PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


class TextFormatter(logging.Formatter):
    def __init__(self, *, journal: bool) -> None:
        super().__init__()
        self.journal = journal
        # The last second's stamp: a line's time is written to the second and its milliseconds,
        # and most lines (a request's route line among them) share their second with the one before.
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelname.lower()
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if self.journal:
            return f"<{_SYSLOG_PRIORITY.get(record.levelname, 6)}>{level} {record.name}: {message}"
        second = int(record.created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(second))
        return f"{self._stamp}.{int(record.msecs):03d} {level} {record.name}: {message}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "route_fields", None)
        if isinstance(fields, dict):
            data.update(fields)
        else:
            data["msg"] = record.getMessage()
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, separators=(",", ":"))


def setup(fmt: str = "logfmt", level: str = "info", stream: TextIO | None = None, *, children: str = "warning") -> None:
    """One handler on the root logger at ``level`` (``log.level``); the children's lines below
    ``children`` (``log.children``) at debug."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(journal=bool(os.environ.get("JOURNAL_STREAM"))))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    llama_log.set_children_level(children)
    # No line here shows a record's caller, thread or process, and finding them costs every record
    # a walk up the stack and three lookups (the logging HOWTO's "Optimization"): a request's route
    # line is one record.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # httpx logs every decoder call (health checks included) at INFO: noise next to the route line.
    # trio-websocket logs its handshake and frames at DEBUG, six lines per onebitctl call: its own
    # debugging, not onebitd's (log.level = "debug" is for onebitd's and llama-server's lines).
    for name, quiet in (("httpx", logging.WARNING), ("httpcore", logging.WARNING), ("trio-websocket", logging.INFO)):
        logging.getLogger(name).setLevel(quiet)

"""The one control file every subprocess fake takes its modes from, and the logs they write beside it.
Standard library only: the fakes run as programs (``python -m tests.fakes.llama.process``) and import it too.

``FAKE_CONTROL`` names a JSON file with a section per fake::

    {"decoder": {...}, "provider": {...}, "share": {...}}

tests/fakes/llama/process.py reads ``decoder``, tests/fakes/fake_provider.py ``provider`` and
tests/fakes/fake_share_provider.py ``share``; each section holds the fields of that fake's ``Modes`` dataclass
(a missing field keeps its default).  A fake reads its section again whenever a mode matters, so a test
changes what a running fake does by rewriting the file.  Tests write it with ``tests/rigs/rig.py``'s
``Control.set`` (atomically: a temporary file, then ``os.replace``); a file that cannot be read or
parsed counts as empty.  Without ``FAKE_CONTROL`` every fake runs with its defaults and logs nothing.

The fakes' logs and the files they leave for a test live in the control file's folder: ``<section>.log``
(one JSON line per event, appended by :func:`append`, read back by :func:`events`) and the few files a
fake's docstring names (``grandchild.pid``, ``share.marker``, ``<control file>.starts``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ENV = "FAKE_CONTROL"
SECTIONS = ("decoder", "provider", "share")
# Beside the control file, besides each section's log:
PIDFILE = "grandchild.pid"  # a hanging exec fake_provider's own child
MARKER = "share.marker"  # fake_share_provider: one line per job that wrote

T = TypeVar("T")


def path() -> Path | None:
    named = os.environ.get(ENV)
    return Path(named) if named else None


def beside(name: str) -> Path | None:
    """A file in the control file's folder (a log, a pidfile); None without a control file."""
    control = path()
    return None if control is None else control.with_name(name)


def log_path(section: str) -> Path | None:
    return beside(log_name(section))


def log_name(section: str) -> str:
    assert section in SECTIONS, section
    return f"{section}.log"


def section(name: str) -> dict[str, Any]:
    """The ``name`` section as it is now: empty when there is no file, or no such section."""
    control = path()
    if control is None:
        return {}
    try:
        data = json.loads(control.read_text())
    except (OSError, ValueError):
        return {}
    found = data.get(name) if isinstance(data, dict) else None
    return found if isinstance(found, dict) else {}


def modes(name: str, kind: type[T]) -> T:
    """The ``name`` section as a ``Modes`` dataclass; a field it does not know is a TypeError."""
    return kind(**section(name))


def write(control: Path, data: dict[str, Any]) -> None:
    # Atomically: the fakes read this file while we write it.
    tmp = control.with_name(control.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, control)


def append(log: Path | None, record: dict[str, Any]) -> None:
    """One JSON line, with this process's pid, appended to ``log`` (nothing when it is None)."""
    if log is not None:
        append_line(log, json.dumps({**record, "pid": os.getpid()}))


def append_line(path: Path, line: str) -> None:
    # One write on an O_APPEND descriptor: lines from several processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def events(log: Path | None, event: str | None = None) -> list[dict[str, Any]]:
    """A log's lines (only those of ``event`` when given); none before the first."""
    if log is None or not log.exists():
        return []
    found = [json.loads(raw) for raw in log.read_text().splitlines()]
    return [e for e in found if event is None or e["event"] == event]


def provider_main(run_exec: Callable[[], int], run_worker: Callable[[], int]) -> int:
    """A fake provider's command line: no argument for an ``exec`` provider, ``--worker`` for a worker."""
    if sys.argv[1:] == ["--worker"]:
        return run_worker()
    if sys.argv[1:]:
        sys.exit(f"usage: {Path(sys.argv[0]).name} [--worker]")
    return run_exec()

"""Fixtures; what they are made of is in tests/rigs/rig.py.

Unix socket paths must stay under 108 bytes, and pytest's ``tmp_path`` can be longer than that, so
runtime directories are short ``mkdtemp`` directories under /tmp, removed after the test.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.observe.metrics import Metrics
from supervisor.routeline import RouteLine
from tests.fakes import fake_control
from tests.rigs.helpers import gone
from tests.rigs.rig import Control, RouteLines, RouteRig
from tests.rigs.skips import pytest_pyfunc_call  # noqa: F401  (the hook: a trio test's skip keeps its reason)


@pytest.fixture(autouse=True)
def _no_control_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake started by a test without the control fixture runs with its defaults, whatever our shell says.
    monkeypatch.delenv(fake_control.ENV, raising=False)


@pytest.fixture(autouse=True)
def _capture(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ONEBIT_CAPTURE naming a file, every route line and /metrics text a test renders is appended
    to it, one JSON list a line: two trees' files compare byte for byte (behaviour kept across a move)."""
    if not (path := os.environ.get("ONEBIT_CAPTURE")):
        return

    def record(kind: str, text: str) -> None:
        with open(path, "a") as out:
            out.write(json.dumps([request.node.nodeid, kind, text]) + "\n")

    logfmt, render = RouteLine.logfmt, Metrics.render

    def logfmt_kept(self: RouteLine) -> str:
        record("route", text := logfmt(self))
        return text

    def render_kept(self: Metrics) -> bytes:
        record("metrics", (body := render(self)).decode())
        return body

    monkeypatch.setattr(RouteLine, "logfmt", logfmt_kept)
    monkeypatch.setattr(Metrics, "render", render_kept)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ob-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def control(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Control]:
    """The fakes' control file; every fake this test starts (onebitd's children, its own) reads it."""
    made = Control(short_dir)
    monkeypatch.setenv(fake_control.ENV, str(made.path))
    yield made
    # A grandchild of a hanging fake provider that outlived a failing test is ours to end; a passing
    # test proved it gone.
    if made.pidfile.exists() and not gone(pid := int(made.pidfile.read_text())):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def route_lines() -> Iterator[RouteLines]:
    handler = RouteLines()
    logger = logging.getLogger(ROUTE_LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def route_rig(
    short_dir: Path,
    control: Control,
    route_lines: RouteLines,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> RouteRig:
    """onebitd's hybrid route with tests/fakes/fake_provider.py; set ``provider`` and ``mode`` for another."""
    # The share route is on when this is; a test turns it on itself.
    monkeypatch.delenv("ONEBIT_KV_SHARE", raising=False)
    caplog.set_level(logging.INFO, logger="onebit.hybrid")
    return RouteRig(short_dir, control, route_lines, caplog)

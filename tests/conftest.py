"""Shared fixtures: configs that point at the real or the fake decoder, and a daemon run in-process.

Unix socket paths must stay under 108 bytes, and pytest's ``tmp_path`` can be longer than that, so
runtime directories are short ``mkdtemp`` directories under /tmp, removed after the test.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from supervisor import config as configuration
from supervisor import locate
from supervisor.config import Config
from supervisor.daemon import Daemon, Started
from supervisor.logs import ROUTE_LOGGER

TESTS = Path(__file__).parent
FAKE_DECODER = TESTS / "fake_decoder.py"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ob-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def real_llama_server() -> Path:
    """The llama-server scripts/setup built; the suite fails (not skips) without it."""
    found = locate.llama_server("")
    if found is None or not found.is_file():
        pytest.fail("no llama-server: run scripts/setup (it builds one into the cache)")
    return found


# These tests exercise the handoffs themselves, sending the same prompt again and again: the cost
# decision (tests/test_routes.py) would keep a prompt the decoder's slot already holds plain.
HANDOFF_ALWAYS = {"prefer_margin": 1e9}


def make_config(runtime_dir: Path, *, text: str = "", **sections: Any) -> Config:
    """A config on port 0 with its runtime directory at ``runtime_dir``; ``sections`` override keys."""
    base = configuration.loads(text, "test.toml") if text else Config()
    data = configuration.unstructure(base)
    data["server"]["port"] = 0
    data["server"]["runtime_dir"] = str(runtime_dir)
    data["server"]["shutdown_grace_s"] = 10.0
    for section, values in sections.items():
        if not isinstance(values, dict):  # a list of tables ([[provider]]) replaces the whole key
            data[section] = values
            continue
        target = data.setdefault(section, {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key].update(value)
            else:
                target[key] = value
    return configuration.structure(data, "test.toml")


def fake_decoder_config(runtime_dir: Path, *, model_file: Path | None = None, **sections: Any) -> Config:
    """A config whose decoder is tests/fake_decoder.py (run by this interpreter)."""
    model = model_file
    if model is None:
        model = runtime_dir / "fake.gguf"
        model.write_bytes(b"GGUF fake model for tests\n")
    launcher = runtime_dir / "fake-llama-server"
    launcher.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_DECODER} "$@"\n')
    launcher.chmod(0o755)
    decoder = {"binary": str(launcher), "health": {"interval_s": 0.2, "stop_grace_s": 2.0}}
    decoder.update(sections.pop("decoder", {}))
    model_section = {"path": str(model), "parallel": 2}
    model_section.update(sections.pop("model", {}))
    return make_config(runtime_dir, decoder=decoder, model=model_section, **sections)


@attrs.frozen
class Running:
    daemon: Daemon
    started: Started

    @property
    def url(self) -> str:
        return self.started.binds[0]


@asynccontextmanager
async def run_daemon(config: Config, *, wait_ready: bool = True) -> AsyncIterator[Running]:
    """Run onebitd in this trio run; stop it (drain, stop children, reap) on the way out."""
    daemon = Daemon(config)
    async with trio.open_nursery() as nursery:
        started: Started = await nursery.start(daemon.run)
        if wait_ready:
            from supervisor.child import ChildState

            await daemon.decoder.wait_state(ChildState.READY)
        try:
            yield Running(daemon, started)
        finally:
            daemon.request_stop()


def env_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


# -- the fake decoder's control file and the route lines, shared by the daemon-level tests ------------


class Control:
    """The fake decoder's control file and its request log."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "control.json"
        self.log = directory / "fake-decoder.log"
        self.set()

    def set(self, **modes: Any) -> None:
        # Atomically: the fake reads this file while we write it.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(modes))
        os.replace(tmp, self.path)

    def entries(self, event: str = "completion") -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [entry for entry in map(json.loads, lines) if entry["event"] == event]

    async def wait_entries(self, n: int) -> list[dict[str, Any]]:
        """The fake writes a line when a request ends, in its own process: poll its file."""
        while len(found := self.entries()) < n:  # noqa: ASYNC110  # another process: no event to wait on
            await trio.sleep(0.01)
        return found


class RouteLines(logging.Handler):
    """Collects the fields of every route line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []
        self._changed = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "route_fields", None)
        assert isinstance(fields, dict), f"a route line without its fields: {record.getMessage()}"
        self.lines.append(fields)
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, n: int) -> list[dict[str, Any]]:
        while len(self.lines) < n:
            await self._changed.wait()
        return self.lines


@pytest.fixture
def control(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Control:
    for name in list(os.environ):
        if name.startswith("FAKE_DECODER_"):
            monkeypatch.delenv(name)
    made = Control(short_dir)
    # The daemon's children inherit our environment.
    monkeypatch.setenv("FAKE_DECODER_CONTROL", str(made.path))
    monkeypatch.setenv("FAKE_DECODER_LOG", str(made.log))
    return made


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

"""The systemd watchdog (supervisor/supervise/notify.py's run_watchdog, asked by Daemon._alive):
``WATCHDOG=1`` goes on while some model can still serve (loaded, or unloaded by design: the next
request loads it) and stops once every model has failed for good, so that systemd restarts the
service.  Against the fake decoder, with a datagram socket standing in for systemd's notify socket."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from supervisor.config import Config
from supervisor.daemon import Daemon
from supervisor.errors import DecoderUnavailable
from supervisor.models.model import Model, ModelState
from supervisor.supervise.notify import Notifier
from tests.rigs.rig import Control, DecoderModes, fake_decoder_config, several

TIMEOUT = 30
WATCHDOG_USEC = 20_000  # as systemd sets it: onebitd pings every half of it, 10 ms
# No ping is seen over a window: 50 of onebitd's ping intervals.  Each test first sees pings in the
# same window while they are due, so that a window too short for the machine's load fails the test
# rather than passing it.
WINDOW_S = 50 * WATCHDOG_USEC / 2 / 1e6
# The decoder gives up at its first failure (its restart's max_failures): FAILED in a few ms.
GIVE_UP_AT_ONCE = {"restart": {"max_failures": 1, "backoff_initial_s": 0.01}}


class NotifySocket:
    """systemd's end of ``$NOTIFY_SOCKET``: what onebitd sends, a datagram a message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self.sock.bind(str(path))

    def _queued(self) -> list[str]:
        got: list[str] = []
        while True:
            try:
                got.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return got

    async def wait_for(self, word: str) -> None:
        """Until a message that begins with ``word`` comes."""
        while not any(message.startswith(word) for message in self._queued()):
            await trio.lowlevel.wait_readable(self.sock)

    async def pings_within(self, seconds: float) -> int:
        """The ``WATCHDOG=1`` pings sent from now for ``seconds``; those sent before are dropped."""
        self._queued()
        pings = 0
        with trio.move_on_after(seconds):
            while True:
                await trio.lowlevel.wait_readable(self.sock)
                pings += sum(message.startswith("WATCHDOG=1") for message in self._queued())
        return pings


@contextlib.asynccontextmanager
async def watched(
    config: Config, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Daemon, NotifySocket]]:
    """onebitd under a watchdog, as systemd starts it with WatchdogSec=, ready (READY=1 came)."""
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notify = NotifySocket(short_dir / "notify.sock")
    notifier = Notifier(str(notify.path))
    daemon = Daemon(config, notifier=notifier)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.run)
            try:
                await notify.wait_for("READY=1")
                yield daemon, notify
            finally:
                daemon.request_stop()
    finally:
        notifier.close()
        notify.sock.close()


def named(daemon: Daemon, name: str) -> Model:
    model = daemon.models.get(name)
    assert model is not None
    return model


async def test_with_several_models_the_watchdog_goes_on_while_one_can_serve_and_stops_once_all_failed(
    short_dir: Path, control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = several(short_dir, ["a", "b"], decoder=GIVE_UP_AT_ONCE)  # a preloaded, b loaded when asked for
    with trio.fail_after(TIMEOUT):
        async with watched(config, short_dir, monkeypatch) as (daemon, notify):
            a, b = named(daemon, "a"), named(daemon, "b")
            control.set(decoder=DecoderModes(exit=3))  # every decoder started from now on exits at once
            assert a.decoder.pid is not None
            os.kill(a.decoder.pid, signal.SIGKILL)
            await a.wait_state(ModelState.FAILED)
            assert b.state is ModelState.UNLOADED
            one_failed = await notify.pings_within(WINDOW_S)
            with pytest.raises(DecoderUnavailable, match="model b has failed"):
                await daemon.models.load("b")
            assert (a.state, b.state) == (ModelState.FAILED, ModelState.FAILED)
            all_failed = await notify.pings_within(WINDOW_S)
    assert one_failed > 0  # b can still be loaded: a's failure does not restart the service
    assert all_failed == 0


async def test_with_one_model_the_watchdog_goes_on_while_it_is_unloaded_and_stops_once_it_failed(
    short_dir: Path, control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = fake_decoder_config(short_dir, decoder=GIVE_UP_AT_ONCE)
    with trio.fail_after(TIMEOUT):
        async with watched(config, short_dir, monkeypatch) as (daemon, notify):
            model = daemon.models.default
            await daemon.models.unload(model.name)  # onebitctl unload (or ttl_s): the next request loads it
            unloaded = await notify.pings_within(WINDOW_S)
            control.set(decoder=DecoderModes(exit=3))
            await daemon.models.load(model.name)
            assert model.state is ModelState.FAILED
            failed = await notify.pings_within(WINDOW_S)
    assert unloaded > 0
    assert failed == 0

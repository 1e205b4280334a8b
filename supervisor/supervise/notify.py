"""systemd's notify protocol (sd_notify(3)) on ``$NOTIFY_SOCKET``, and its watchdog.

A datagram per message, ``KEY=VALUE`` lines.  Without ``$NOTIFY_SOCKET`` (not under systemd, or
``Type=`` other than notify) every call is a no-op.  The watchdog pings only while the event loop
runs *and* the daemon says it is alive (supervisor/daemon/root.py: some model can still serve): a
wedged loop, or every model's decoder failed for good, stops the pings and systemd restarts the
service.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

import trio

log = logging.getLogger("onebit.notify")


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        # "@name" is the abstract namespace.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket: socket.socket | None = None
        self.sent: list[str] = []  # what was sent, for `onebitctl status` and tests
        self.dropped = 0  # messages not sent since the last one that was (see send)

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, **fields: str | int) -> None:
        if not self._address:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            if self._socket is None:
                # Non-blocking: this runs on the event loop.  A receiver that stops reading (a
                # wedged manager, a test or benchmark that took READY=1 and moved on) fills its
                # queue, and a blocking sendto would then freeze every request (seen: the
                # benchmark's onebitd stopped dead at its first STATUS= past the queue's length).
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            self._socket.sendto(message.encode(), self._address)
        except OSError as exc:
            # Said once per run of failures, not at every status update.
            level = logging.WARNING if self.dropped == 0 else logging.DEBUG
            log.log(level, "sd_notify to %r failed (dropped): %s", self._address, exc)
            self.dropped += 1
            return
        if self.dropped:
            log.info("sd_notify to %r works again, after %d message(s) dropped", self._address, self.dropped)
            self.dropped = 0
        self.sent.append(message)

    def ready(self, status: str) -> None:
        self.send(READY=1, STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def reloading(self) -> None:
        # systemd 253+ wants the monotonic time with RELOADING=1 (Type=notify-reload).
        self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self) -> None:
        self.send(STOPPING=1)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def watchdog_interval() -> float | None:
    """Half of ``$WATCHDOG_USEC`` (systemd's advice), or None when no watchdog is asked for."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 1e6 / 2


async def run_watchdog(notifier: Notifier, interval: float, alive: Callable[[], bool]) -> None:
    """Ping every ``interval`` while ``alive()``; the ping itself proves the loop is turning."""
    while True:
        if alive():
            notifier.send(WATCHDOG=1)
        await trio.sleep(interval)

"""The hang-up watch: a request's :class:`HangUp` (the scope's ``extensions["onebit.hang_up"]``) and
the one watcher task per connection that serves it.

Only one task may wait for a socket.  The watcher, started for a connection's first watch, waits for
the socket while a request runs and stays waiting after it: when the next request comes it hands the
socket to the connection's task (which waits for its word, :meth:`Watched._wait_readable`), so a
request costs no task, no cancel and no new wait.  A watch that raises is logged; a watcher that
fails is logged and hangs up on its own connection only.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Protocol

import trio

from . import framing

log = logging.getLogger("onebit.front")

HANG_UP = "onebit.hang_up"  # the scope's extension: the request's HangUp


class HangUp(Protocol):
    """A request's hang-up, told to a function: ``watch(on_gone)`` calls ``on_gone(why)`` once if the
    client hangs up (or the server takes it for gone: ``why`` then says why, else it is "") before
    ``unwatch(on_gone)``; at once if it is gone already.  After the next request has begun on the
    connection (pipelined) only the server's own hang-up is told."""

    def watch(self, on_gone: Callable[[str], None]) -> None: ...

    def unwatch(self, on_gone: Callable[[str], None]) -> None: ...


class Watched:
    """A connection's side of the hang-up watch (the connection class derives from it): its state,
    the watches, the watcher task, and the server's own hang-up (:meth:`_hang_up`)."""

    sock: socket.socket
    reader: framing.RequestReader

    def __init__(self, nursery: trio.Nursery) -> None:
        self.gone = False  # the client closed or reset the connection, or a write to it failed
        self.broken = False  # a write was cut short: nothing more may be sent on it
        self.hung_up_why: str | None = None  # why the server took the client for gone, where it did
        self._nursery = nursery  # where the watcher runs
        # Only one task may wait for a socket: while the watcher does, the connection's own task
        # waits for its word instead (_wait_readable).
        self._on_gone: list[Callable[[str], None]] = []
        self._watcher_started = False
        self._armed = False  # the watcher is to wait for the socket
        self._watching = False  # the watcher waits for the socket now
        self._reading = False  # the connection's task waits for the socket now
        self._closed = False
        self._arm = trio.lowlevel.ParkingLot()  # the watcher, while not armed
        self._readable = trio.lowlevel.ParkingLot()  # the connection's task, while the watcher waits

    def _close_watch(self) -> None:
        """The connection is closing: the watcher, parked or not, ends."""
        self._closed = True
        self._arm.unpark_all()

    async def _wait_readable(self) -> None:
        if self._watching:
            await self._readable.park()  # the watcher's word
            if self.hung_up_why is not None:
                raise trio.ClosedResourceError  # as a wait of its own would: _hang_up's notify_closing
            return
        self._reading = True
        try:
            await trio.lowlevel.wait_readable(self.sock)
        finally:
            self._reading = False
            if self._on_gone and self._watcher_started:
                self._arm_watcher()  # a watch the watcher gave way to while this task waited

    def _hang_up(self, why: str) -> None:
        """Take the client for gone: nothing more is sent, the app hears a disconnect, and the close
        resets the connection (what the kernel still holds for the client is dropped, not kept to send)."""
        self.gone = self.broken = True
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.hung_up_why = why
        self._tell_gone()
        # Whoever waits for the socket learns it: the wait raises ClosedResourceError.
        trio.lowlevel.notify_closing(self.sock)

    def watch(self, on_gone: Callable[[str], None]) -> None:
        """See :class:`HangUp`."""
        if self.gone:
            on_gone(self.hung_up_why or "")
            return
        self._on_gone.append(on_gone)
        if self.reader.pending or self._watching:
            return  # the next request has begun (only _hang_up tells), or the watcher waits already
        self._arm_watcher()

    def _arm_watcher(self) -> None:
        """Have the watcher wait for the socket (started here the first time)."""
        self._armed = True
        if self._watcher_started:
            self._arm.unpark()
        else:
            self._watcher_started = True
            self._nursery.start_soon(self._watcher)

    def unwatch(self, on_gone: Callable[[str], None]) -> None:
        with contextlib.suppress(ValueError):
            self._on_gone.remove(on_gone)

    def _tell_gone(self) -> None:
        """Tell every watch (each once); one that raises is logged, and fails neither the others nor
        the task telling them (the watcher's would be the whole server's)."""
        told, self._on_gone = self._on_gone, []
        for on_gone in told:
            try:
                on_gone(self.hung_up_why or "")
            except Exception:
                log.exception("a request's hang-up watch failed")

    async def _watcher(self) -> None:
        """Waits for the socket while armed (a request watches); when it is readable, wakes the
        connection's task if that waits for it, and tells a watched request's hang-up (the next
        request's bytes, pipelined, are no hang-up).  It stays waiting after the request that armed
        it, so that the connection's next wait for the socket is its word, not a wait of its own.
        It runs in the server's nursery: a failure of its own hangs up on its connection only."""
        try:
            await self._watch_socket()
        except Exception:
            log.warning("a connection's hang-up watcher failed; the connection is closed", exc_info=True)
            self._watcher_started = False
            self._readable.unpark_all()
            if self.sock.fileno() != -1:
                self._hang_up("onebitd's hang-up watch failed")

    async def _watch_socket(self) -> None:
        sock = self.sock
        while not self._closed:
            if not self._armed or self._reading:
                self._armed = False
                await self._arm.park()
                continue
            self._watching = True
            closed = False
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError:
                closed = True
            finally:
                self._watching = False
            self._armed = False
            self._readable.unpark_all()
            if closed:
                self._watcher_started = False
                return  # _hang_up told the watch, or the connection is closing
            if self._on_gone and not self.reader.pending:
                try:
                    peeked = sock.recv(1, socket.MSG_PEEK)
                except BlockingIOError:
                    self._armed = True  # woken for nothing: wait again
                    continue
                except OSError:
                    peeked = b""
                if not peeked:
                    self.gone = True
                    self._tell_gone()

    async def wait_disconnect(self) -> None:
        """Until the client hangs up, or the server takes it for gone (:meth:`_hang_up`); for ever
        if it sends more (the next request, pipelined)."""
        gone = trio.Event()

        def on_gone(why: str) -> None:
            gone.set()

        self.watch(on_gone)
        try:
            await gone.wait()
        finally:
            self.unwatch(on_gone)

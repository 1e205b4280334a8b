"""One client connection's loop: read a head, run the app on it, write what the app sends straight
to the socket, and read the next head once the response is out (keep-alive, pipelined requests
answered in order), while the app may still run.

- A connection is idle from the end of a response to the end of the next head: it stops reading
  after ``idle_timeout_s`` then, and at once when the server stops; a busy one once its response is
  out.  Its socket closes once the last app run on it has returned (a completion's save after its
  reply, within the server's graceful timeout at a stop).
- A head onebitd does not take (:class:`~supervisor.errors.Malformed`: 400, 431, 501, 505) is answered
  by the one error writer (respond.py's, with ``X-Onebit-Source``) and the connection closes.
- Writes have a deadline: a client that takes no byte of a response for ``write_timeout_s`` loses its
  connection, and the app learns it as a hang-up (``http.disconnect``).
- The socket is a plain non-blocking socket under ``trio.lowlevel.wait_readable``/``wait_writable``;
  its reads are shared with the hang-up watcher (supervisor/http/watch.py).
- A socket error is a gone client; anything else that fails here is logged, and closes this
  connection only.
"""

from __future__ import annotations

import logging
import socket
from typing import Protocol

import trio

from ..errors import Malformed
from . import asgi, framing
from .asgi import Request
from .framing import NEED_DATA, writers
from .respond import Message, Responder
from .watch import HANG_UP, Watched

log = logging.getLogger("onebit.front")

READ_SIZE = 65536
LINGER_S = 2.0  # after the last response on a connection, wait this long for the client's close
READS_BEFORE_YIELD = 16  # reads that found data ready, in a row, before the connection lets others run


class Host(asgi.Server, Protocol):
    """The server, as its connections see it (supervisor/http/server.py's)."""

    @property
    def write_timeout_s(self) -> float: ...

    def _gone(self, connection: Connection) -> None: ...


class Connection(Watched):
    """One client connection: its socket, its requests' framing, and the request on it."""

    def __init__(self, server: Host, sock: socket.socket, nursery: trio.Nursery) -> None:
        super().__init__(nursery)
        self.server = server
        self.sock = sock
        self.reader = framing.RequestReader()
        self._idle: trio.CancelScope | None = None
        self.extensions: Message = {HANG_UP: self}  # every request's scope's
        self._ready_reads = 0  # reads in a row that found data without waiting
        self._waited = True  # the connection waited for its client since its last request began
        peer = sock.getpeername()
        here = sock.getsockname()
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        self.local = (here[0], here[1]) if isinstance(here, tuple) else None

    def stop(self) -> None:
        """The server stops: an idle connection closes now, a busy one once its response is out."""
        if self._idle is not None:
            self._idle.cancel()

    async def run(self) -> None:
        try:
            # A request's app may go on past its response (asgi.Request.serve): the connection
            # closes once the last one has returned.
            async with trio.open_nursery() as apps:
                await self._requests(apps)
        finally:
            self.server._gone(self)
            self._close_watch()
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

    async def _requests(self, apps: trio.Nursery) -> None:
        linger = False
        try:
            while not self.server.stopping:
                if not self._waited:
                    # The next request was there without a wait: let the other tasks run first (a
                    # client that pipelines without pause must not hold the whole front).
                    await trio.lowlevel.checkpoint()
                self._waited = False
                try:
                    request = await self._next_request()
                except Malformed as refusal:
                    await self._refuse(refusal)
                    linger = True
                    break
                if request is None:
                    break
                if not await request.serve(apps):
                    linger = not self.gone
                    break
            if linger:
                await self._linger()
        except Exception:
            log.warning("a client connection failed; it was closed", exc_info=True)

    async def _next_request(self) -> Request | None:
        """The next request's head, parsed; None when the client closed, or the connection was idle
        past ``idle_timeout_s``, or the server stops."""
        head = None
        with trio.CancelScope(deadline=trio.current_time() + self.server.idle_timeout_s) as idle:
            self._idle = idle
            if self.server.stopping:
                idle.cancel()
            head = await self.next_event()
        self._idle = None
        if head is None or idle.cancelled_caught:
            return None
        assert isinstance(head, framing.RequestHead), head  # the last request's body was read to its end
        return Request(self, head)

    async def next_event(self) -> framing.Event | None:
        """The next event of the client's stream, read as needed; None at its end."""
        reader = self.reader
        while True:
            event = reader.next_event()
            if event is not NEED_DATA:
                return event  # type: ignore[return-value]
            data = await self.receive()
            if not data:
                return None
            reader.feed(data)

    async def receive(self) -> bytes:
        """What the socket has; b"" at the end of the client's stream."""
        sock = self.sock
        while True:
            try:
                data = sock.recv(READ_SIZE)
            except BlockingIOError:
                self._ready_reads = 0
                self._waited = True
                try:
                    await self._wait_readable()
                except trio.ClosedResourceError:  # the server took the client for gone (_hang_up)
                    data = b""
                else:
                    continue
            except OSError:
                data = b""
            if not data:
                self.gone = True
                self._tell_gone()
                return data
            self._ready_reads += 1
            if self._ready_reads % READS_BEFORE_YIELD == 0:
                await trio.lowlevel.checkpoint()
            return data

    async def write(self, data: bytes) -> None:
        """Send all of ``data``; a client that is gone takes nothing more (its request is cancelled by
        its disconnect), one that takes no byte for ``write_timeout_s`` is gone, and a write cut short
        by a cancel leaves the connection unusable."""
        if self.gone or self.broken:
            await trio.lowlevel.checkpoint()  # an app that sends on and on still lets its disconnect in
            return
        sock = self.sock
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[sock.send(view) :]
                except BlockingIOError:
                    timeout = self.server.write_timeout_s
                    with trio.move_on_after(timeout) as waited:
                        await trio.lowlevel.wait_writable(sock)
                    if waited.cancelled_caught:
                        self._hang_up(
                            f"the client took no byte of its response for {timeout:g}s (server.write_timeout_s)"
                        )
                        return
        except (OSError, trio.ClosedResourceError):  # the latter: another write's _hang_up
            self.gone = True
            self._tell_gone()
        except BaseException:
            self.broken = True
            raise

    async def _linger(self) -> None:
        """Close after the last response without losing it: a close with unread bytes in the socket
        resets the connection, and a reset can reach the client before the response does."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        with trio.move_on_after(LINGER_S):
            while await self.receive():
                pass

    async def _refuse(self, refusal: Malformed) -> None:
        """Answer a head onebitd does not take, by the one error writer; the connection closes after."""
        reply: list[Message] = []

        async def send(message: Message) -> None:
            reply.append(message)

        await Responder(send, trio.current_time()).error(refusal.status, refusal.code, refusal.message)
        start, whole = reply
        body: bytes = whole["body"]
        headers = [(name, value) for name, value in start["headers"] if name.lower() != b"content-length"]
        await self.write(writers.head(start["status"], headers, len(body), close=True) + body)

"""One client connection inside hypercorn (trio), hardened so that no connection can stop the front.

hypercorn 0.18's ``TCPServer`` serves one connection.  Two of its paths send on the socket: its
``protocol_send`` (under ``send_lock``) and its ``_close`` (``send_eof``, without the lock).  When
h11 finds a request malformed after the app has started on it (a broken chunk footer, say),
hypercorn sends a 400 of its own while the connection closes beside it, and trio raises
``BusyResourceError``: two tasks sending on one stream.  hypercorn lets that escape the connection's
handler, which runs in the nursery of every connection, so one bad request stopped the whole front
and with it onebitd (scripts/chaos's ``fuzz``, 600 cases, found it; hypercorn issue #203 is the
same escape).

:class:`Connection` changes two things, and nothing else:

- a send that finds the stream busy is a send to a closing connection: like a broken one, the
  protocol is told the connection is closed (what hypercorn does for ``BrokenResourceError``);
- anything else a connection raises is logged with its traceback and the connection closed: one
  client's connection is not the server.

:class:`Connection` also takes two costs out of every request (onebitd's CPU per request is its
overhead in front of llama-server; the profile is in docs/benchmarks.md):

- hypercorn starts a task for each idle period of a keep-alive connection (from a response to the
  next request) and cancels it when the next request comes: a task spawned, a lock taken twice and a
  ``Cancelled`` raised per request.  :class:`IdleDeadline` is one task per connection whose deadline
  moves instead.  The behaviour is hypercorn's: an idle connection is closed after
  ``keep_alive_timeout`` (``server.idle_timeout_s``), at once when the server shuts down, and a busy
  one is never closed by it (when the server shuts down, it is closed as soon as its response is out);
- :class:`Protocol` writes a response that declares its length (every whole reply onebitd sends)
  in one send, head and body, where hypercorn writes the head first: one send instead of two.

:func:`install` puts them where hypercorn's trio worker looks for its connection and protocol
classes; ``Front.run`` calls it before it serves, and tests/test_front_limits.py checks both the
effect and that hypercorn still looks there.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from math import inf
from typing import Any

import h11
import hypercorn.protocol
import hypercorn.trio.run
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger("onebit.front")


class IdleDeadline:
    """Stands in for hypercorn's ``TrioSingleTask`` as a connection's ``idle_task``: ``restart`` when
    the connection goes idle, ``stop`` when a request comes.  One task per connection, started by
    the first ``restart``, waits for the server to shut down under a deadline that these two move."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._scope = trio.CancelScope()
        self._idle = False
        self._started = False
        self._finished = False

    async def restart(self, task_group: Any, action: Callable[[], Any]) -> None:
        # ``action`` is hypercorn's ``_idle_timeout``: wait, then close; _watch does both.
        self._idle = True
        if self._connection.context.terminated.is_set():
            self._scope.deadline = -inf  # shutting down: an idle connection goes now
        else:
            self._scope.deadline = trio.current_time() + self._connection.config.keep_alive_timeout
        if not self._started:
            self._started = True
            task_group._nursery.start_soon(self._watch)

    async def stop(self) -> None:
        self._idle = False
        self._scope.deadline = inf

    def finish(self) -> None:
        """The connection's reading is over (the client went, or the connection was closed): the
        watch ends without closing anything.  hypercorn's connection waits for its tasks, this one
        too, before it closes its socket; without this, a connection closed while a request was on
        it (no ``restart`` after that) would keep its socket until onebitd stopped."""
        self._finished = True
        self._scope.cancel()

    async def _watch(self) -> None:
        with self._scope:
            await self._connection.context.terminated.wait()
            if not self._idle:
                await trio.sleep_forever()  # until restart: the response is out
        if self._finished:
            return
        with trio.CancelScope(shield=True):
            await self._connection._initiate_server_close()


class Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, with a response head that announces a body held back until
    that body (or the end of the response) is sent, and sent with it."""

    _held = b""

    async def _send_h11_event(self, event: Any) -> None:
        data = self._encode(event)
        if isinstance(event, h11.Response) and _declares_body(event):
            self._held += data
            return
        if self._held:
            data, self._held = self._held + data, b""
        await self.send(RawData(data=data))

    def _encode(self, event: Any) -> bytes:
        """h11's bytes for ``event``; none for a response to a request h11 already found broken
        (hypercorn's own rule: its error answer goes out another way)."""
        try:
            return self.connection.send(event) or b""
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return b""

    async def _maybe_recycle(self) -> None:
        # A reply sent before the request's body was read (a refusal: 401, 404, 503) can end before
        # the reading task has taken the rest of that body from h11's buffer; hypercorn would then
        # close the connection under a client that may send its next request on it.  What has
        # come of the body is taken now, so h11 sees the request's end and the connection is kept.
        # (The app is done with it: nothing reads this body any more.)
        connection = self.connection
        while connection.our_state is h11.DONE and connection.their_state is h11.SEND_BODY:
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError:
                break  # hypercorn closes it, as before
            if not isinstance(event, h11.Data):
                break
        await super()._maybe_recycle()

    async def stream_send(self, event: StreamEvent) -> None:
        if isinstance(event, StreamClosed) and self._held:
            # The app ended without its body (it failed): what hypercorn would have sent goes now.
            held, self._held = self._held, b""
            await self.send(RawData(data=held))
        await super().stream_send(event)


def _declares_body(event: h11.Response) -> bool:
    for name, value in event.headers:
        if name == b"content-length":
            return value != b"0"
    return False


class Connection(TCPServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_task: IdleDeadline = IdleDeadline(self)  # type: ignore[assignment]  # hypercorn's interface

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            self.idle_task.finish()

    async def run(self) -> None:
        try:
            await super().run()
        except Exception:  # hypercorn's or h11's, on one connection: close it, keep serving the rest
            log.warning("a client connection failed inside hypercorn; it was closed", exc_info=True)
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.stream.aclose()

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        data = event.data
        if not data:  # h11's end of a body that declared its length: nothing to send
            return
        if not self.send_lock.locked() and isinstance(self.stream, trio.SocketStream):
            # Nearly every write fits the socket's buffer: written at once, with no lock, no
            # shielded scope and no trip through the scheduler (per relayed chunk, that was a third
            # of onebitd's CPU on a stream).  No other task can send between the check and the write.
            try:
                sent = os.write(self.stream.socket.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:  # closed, reset: what send_all raises as BrokenResourceError
                await self.protocol.handle(Closed())
                return
            if sent == len(data):
                return
            data = data[sent:]
        # Shielded from before the lock is taken: the rest of a write that has begun must follow it.
        with trio.CancelScope(shield=True):
            async with self.send_lock:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                    await self.protocol.handle(Closed())


def install() -> None:
    """hypercorn's trio worker builds each connection from its module's ``TCPServer``, and each
    connection its HTTP/1.1 protocol from ``hypercorn.protocol``'s ``H11Protocol``."""
    hypercorn.trio.run.TCPServer = Connection  # type: ignore[attr-defined]  # not re-exported; it is looked up there
    hypercorn.protocol.H11Protocol = Protocol  # type: ignore[attr-defined]  # looked up there by ProtocolWrapper

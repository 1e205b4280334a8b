"""The front's HTTP/1.1 server: an ASGI app served on trio's sockets, one task per connection
(and its hang-up watcher, from the first request that watches).

- **One task per connection** reads a head, runs the app in that same task, writes what the app
  sends straight to the socket, and reads the next head.  A head that declares its length goes out
  with the body, in one write; a stream's head goes out at once.  The socket is a plain non-blocking
  socket under ``trio.lowlevel.wait_readable``/``wait_writable``.
- **Requests** are framed by supervisor/http/framing.py (llhttp with onebitd's rules): HTTP/1.1 or 1.0,
  bodies by ``Content-Length`` or ``chunked``, ``Expect: 100-continue`` answered when the app first
  asks for the body.  What it calls :class:`~supervisor.http.framing.Malformed` in a head gets an answer
  in onebitd's JSON error envelope and the connection is closed: 400 (malformed), 431 (head too
  large), 501 (a transfer coding other than chunked, CONNECT), 505 (another HTTP version); in a body,
  the app's ``receive()`` raises it (a :class:`~supervisor.errors.ClientError`).
- **Responses** keep the length the app declares; without one they are chunked (HTTP/1.1) or end
  with the connection (1.0).  HEAD, 1xx, 204 and 304 carry no body.
- **Keep-alive**, with pipelined requests answered in order.  A connection is idle from the end of
  a response to the end of the next head: it is closed after ``idle_timeout_s`` then, and at once
  when the server stops; a busy one is closed when its response is out.  A body the app did not
  read (a refusal) is read and dropped, up to :data:`DISCARD_BYTES` and within ``body_timeout_s``,
  so the connection is kept (else it closes, with no other answer).
- **Writes** have a deadline: a client that takes no byte of a response for ``write_timeout_s``
  loses its connection, and the app learns it as a hang-up (``http.disconnect``).
- **Bodies** have one: a body not all come ``body_timeout_s`` after the request's first wait for it
  makes the app's ``receive()`` raise a 408 :class:`~supervisor.errors.ClientError` (a slowloris
  body), and the connection closes after the answer.  Only a wait for the socket has a deadline: a
  body that came with its head costs none.
- **Settings**: the timeouts are sources (a value, or a function that gives the value now: the
  daemon's one live config), read at each idle period, each write and each body's first wait, so a
  reload applies from the next.
- **Disconnects**: once the body is read, ``receive()`` waits for the client to hang up and then
  returns ``http.disconnect`` (at once after the response has finished, as the ASGI spec says).
  Without a task of its own: the scope's ``extensions["onebit.hang_up"]`` (a :class:`HangUp`)
  calls a function the app gives it when the client hangs up.  Either way one task per connection,
  started for its first watch, waits for the socket while a request runs, and stays waiting after
  it: when the next request comes it hands the socket to the connection's task, so a request
  costs no task, no cancel and no new wait.
- **Failures** stay on their connection: a socket error is a gone client, an app that raises is
  logged with its traceback and answered 500 if nothing was sent yet, a watch that raises or a
  watcher that fails is logged (the latter's connection is hung up on).
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import http
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from ..config import source
from ..errors import ClientError, ListenError, Malformed
from . import framing
from .framing import NEED_DATA
from .respond import Message, Receive, Send, error_body

log = logging.getLogger("onebit.front")

App = Callable[[Message, Receive, Send], Awaitable[None]]

MAX_HEAD_BYTES = framing.MAX_HEAD_BYTES
DISCARD_BYTES = 1 << 20  # a request body the app left unread is dropped up to this; over it, the connection closes
READ_SIZE = 65536
LINGER_S = 2.0  # after the last response on a connection, wait this long for the client's close
BACKLOG = 1024
# A client that takes no byte of its response for this long is gone (nginx's send_timeout).
WRITE_TIMEOUT_S = 60.0
BODY_TIMEOUT_S = 30.0  # a request's body must have come this long after the first wait for it, else 408

_REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_NO_BODY = frozenset({204, 304})
_DISCONNECT: Message = {"type": "http.disconnect"}
HANG_UP = "onebit.hang_up"  # the scope's extension: the request's HangUp
_ASGI: Message = {"version": "3.0", "spec_version": "2.3"}

_ACCEPT_RETRY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# accept(2) passes on a pending connection's own network errors: that connection is gone, the next
# one is not (trio's SocketListener's list).
_ACCEPT_SKIP = frozenset(
    getattr(errno, name)
    for name in [
        *("EPERM", "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET", "EHOSTUNREACH"),
        *("EOPNOTSUPP", "ENETUNREACH", "ENOSR", "ESOCKTNOSUPPORT", "EPROTONOSUPPORT", "ETIMEDOUT", "ECONNRESET"),
    ]
    if hasattr(errno, name)
)
READS_BEFORE_YIELD = 16  # reads that found data ready, in a row, before the connection lets others run


class HangUp(Protocol):
    """A request's hang-up, told to a function: ``watch(on_gone)`` calls ``on_gone(why)`` once if the
    client hangs up (or the server takes it for gone: ``why`` then says why, else it is "") before
    ``unwatch(on_gone)``; at once if it is gone already.  After the next request has begun on the
    connection (pipelined) only the server's own hang-up is told."""

    def watch(self, on_gone: Callable[[str], None]) -> None: ...

    def unwatch(self, on_gone: Callable[[str], None]) -> None: ...


_date = (0, b"")


def _http_date() -> bytes:
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, email.utils.formatdate(now, usegmt=True).encode())
    return _date[1]


def _tokens(values: list[bytes]) -> list[bytes]:
    return [token.strip(b" \t").lower() for value in values for token in value.split(b",") if token.strip(b" \t")]


def _bind(hosts: tuple[str, ...], port: int) -> list[socket.socket]:
    """A listening socket for each address, or ListenError naming the one that failed (and none left open)."""
    bound: list[socket.socket] = []
    try:
        for host in hosts:
            address = host.strip("[]")
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address, port))
            except OSError as exc:
                # In use: the port is what to change (or the other program to stop); else the address.
                key = "server.port" if exc.errno == errno.EADDRINUSE else "server.host"
                raise ListenError(f"{key}: cannot listen on {host} port {port}: {exc.strerror or exc}") from None
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


class HttpServer:
    """Serves ``app`` on ``hosts``:``port`` until ``shutdown`` returns; ``started`` with the bound URLs."""

    def __init__(
        self,
        app: App,
        *,
        hosts: tuple[str, ...],
        port: int,
        idle_timeout_s: float | Callable[[], float],
        shutdown: Callable[[], Awaitable[object]],
        graceful_timeout_s: float = 2.0,
        write_timeout_s: float | Callable[[], float] = WRITE_TIMEOUT_S,
        body_timeout_s: float | Callable[[], float] = BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.hosts = hosts
        self.port = port
        self._idle_timeout_s = source(idle_timeout_s)
        self._write_timeout_s = source(write_timeout_s)
        self._body_timeout_s = source(body_timeout_s)
        self.graceful_timeout_s = graceful_timeout_s
        self._shutdown = shutdown
        self.stopping = False
        self._connections: set[_Connection] = set()
        self._left = trio.Event()
        self._bound: list[socket.socket] = []

    @property
    def idle_timeout_s(self) -> float:
        """Now: read at the start of each idle period."""
        return self._idle_timeout_s()

    @idle_timeout_s.setter
    def idle_timeout_s(self, value: float) -> None:
        """A fixed value in place of the source it was given (a test's)."""
        self._idle_timeout_s = source(value)

    @property
    def write_timeout_s(self) -> float:
        """Now: read at each write."""
        return self._write_timeout_s()

    @property
    def body_timeout_s(self) -> float:
        """Now: read at a request's first wait for its body."""
        return self._body_timeout_s()

    def bind(self) -> None:
        """Bind every address now (ListenError naming the key otherwise), for :meth:`run` to serve
        on: a daemon binds before it starts anything that takes time."""
        if not self._bound:
            self._bound = _bind(self.hosts, self.port)

    def close(self) -> None:
        """Close sockets :meth:`bind` made that :meth:`run` never took."""
        self._close_listeners(self._bound)
        self._bound = []

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        listeners, self._bound = self._bound or _bind(self.hosts, self.port), []
        try:
            async with trio.open_nursery() as connections:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept, listener, connections)
                    task_status.started([_url(listener) for listener in listeners])
                    await self._shutdown()
                    accepting.cancel_scope.cancel()
                self._close_listeners(listeners)
                self.stopping = True
                for connection in list(self._connections):
                    connection.stop()
                with trio.move_on_after(self.graceful_timeout_s):
                    while self._connections:
                        await self._left.wait()
                connections.cancel_scope.cancel()
        finally:
            self._close_listeners(listeners)

    @staticmethod
    def _close_listeners(listeners: list[socket.socket]) -> None:
        for listener in listeners:
            if listener.fileno() != -1:
                trio.lowlevel.notify_closing(listener)
                listener.close()

    async def _accept(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(listener)
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                if exc.errno in _ACCEPT_SKIP:
                    continue
                if exc.errno not in _ACCEPT_RETRY:
                    raise
                log.error("cannot accept a connection (%s); trying again in 0.1 s", exc.strerror)
                await trio.sleep(0.1)
                continue
            try:
                sock.setblocking(False)
                if sock.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connection = _Connection(self, sock, nursery)  # asks the peer's address: a reset client has none
            except OSError:
                sock.close()
                continue
            self._connections.add(connection)
            nursery.start_soon(connection.run)

    def _gone(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        self._left.set()
        self._left = trio.Event()


class _Connection:
    """One client connection: its socket, its requests' framing, and the request on it."""

    def __init__(self, server: HttpServer, sock: socket.socket, nursery: trio.Nursery) -> None:
        self.server = server
        self.sock = sock
        self.reader = framing.RequestReader()
        self.gone = False  # the client closed or reset the connection, or a write to it failed
        self.broken = False  # a write was cut short: nothing more may be sent on it
        self.hung_up_why: str | None = None  # why the server took the client for gone, where it did
        self._idle: trio.CancelScope | None = None
        self._nursery = nursery  # where the watcher runs
        self.extensions: Message = {HANG_UP: self}  # every request's scope's
        # The hang-up watch (_watcher).  Only one task may wait for a socket: while the watcher
        # does, the connection's own task waits for its word instead (_wait_readable).
        self._on_gone: list[Callable[[str], None]] = []
        self._watcher_started = False
        self._armed = False  # the watcher is to wait for the socket
        self._watching = False  # the watcher waits for the socket now
        self._reading = False  # the connection's task waits for the socket now
        self._closed = False
        self._arm = trio.lowlevel.ParkingLot()  # the watcher, while not armed
        self._readable = trio.lowlevel.ParkingLot()  # the connection's task, while the watcher waits
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
                if not await request.serve():
                    linger = not self.gone
                    break
            if linger:
                await self._linger()
        except Exception:
            log.warning("a client connection failed; it was closed", exc_info=True)
        finally:
            self.server._gone(self)
            self._closed = True
            self._arm.unpark_all()
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

    async def _next_request(self) -> _Request | None:
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
        assert isinstance(head, framing.Request), head  # the last request's body was read to its end
        return _Request(self, head)

    async def next_event(self) -> framing.Event | None:
        """The next event of the client's stream, read as needed; None at its end."""
        reader = self.reader
        while True:
            event = reader.next_event()
            if event is not NEED_DATA:
                return event  # type: ignore[return-value]
            data = await self._receive()
            if not data:
                return None
            reader.feed(data)

    async def _receive(self) -> bytes:
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

    # -- the hang-up watch --------------------------------------------------------------------------

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

    async def _refuse(self, refusal: Malformed) -> None:
        body = error_body(refusal.status, refusal.code, refusal.message)
        await self.write(_head(refusal.status, [(b"Content-Type", b"application/json")], len(body), close=True) + body)

    async def _linger(self) -> None:
        """Close after the last response without losing it: a close with unread bytes in the socket
        resets the connection, and a reset can reach the client before the response does."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        with trio.move_on_after(LINGER_S):
            while await self._receive():
                pass


def _head(status: int, headers: list[tuple[bytes, bytes]], length: int | None, *, close: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    if length is not None:
        lines.append(b"Content-Length: %d\r\n" % length)
    if close:
        lines.append(b"Connection: close\r\n")
    lines.append(b"Date: " + _http_date() + b"\r\n\r\n")
    return b"".join(lines)


class _Request:
    """One request on a connection: its scope, its body as the app reads it, its response as the app
    sends it."""

    def __init__(self, connection: _Connection, head: framing.Request) -> None:
        self.connection = connection
        self.head = head
        self.method = head.method
        self.version = head.version
        self.path = head.path
        self.chunked = head.chunked
        self.remaining = head.length  # of a Content-Length body, still to come
        self.body_done = not self.chunked and self.remaining == 0
        if self.body_done:
            connection.reader.next_event()  # its END, queued behind the head
        self.body_given = False  # the app has had the body's last message (an empty body has one too)
        self.body_deadline: float | None = None  # set at the first wait for the body
        self.keep = head.keep_alive
        self.continue_due = head.expect_continue
        # The response.
        self.status = 0
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.head_sent = False
        self.finished = False
        self.chunked_out = False
        self.declared: int | None = None
        self.sent = 0
        self.bodiless = False

    def scope(self) -> Message:
        connection = self.connection
        return {
            "type": "http",
            "asgi": _ASGI,
            "http_version": self.version,
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.head.raw_path,
            "query_string": self.head.query,
            "root_path": "",
            "headers": self.head.headers,
            "client": connection.client,
            "server": connection.local,
            "extensions": connection.extensions,
        }

    async def serve(self) -> bool:
        """Run the app on this request; whether the connection may carry another."""
        try:
            await self.connection.server.app(self.scope(), self.receive, self.send)
        except Exception as exc:
            self.keep = False
            if isinstance(exc, ClientError):
                await self._answer(exc.status, exc.code, exc.message)
            else:
                log.error("the app failed on %s %s", self.method, self.path, exc_info=True)
                await self._answer(500, "internal", "onebitd failed on this request")
        if not self.status:
            self.keep = False
            await self._answer(500, "internal", "onebitd sent no response")
        elif not self.finished:
            self.keep = False  # the response was cut: only a close can tell the client
        connection = self.connection
        if self.keep and not self.body_done:
            await self._discard()
        return self.keep and not connection.gone and not connection.broken and not connection.server.stopping

    async def _answer(self, status: int, code: str, message: str) -> None:
        """The server's own answer, in the JSON error envelope, where the app's never began."""
        if self.head_sent:
            return
        self.status = 0
        body = error_body(status, code, message)
        headers = [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(body))]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def _discard(self) -> None:
        """Drop the rest of a body the app did not read, so the next request can follow it."""
        with trio.move_on_after(self.connection.server.idle_timeout_s) as waited:
            try:
                while not self.body_done:
                    await self._body_part()
            except (_Gone, ClientError):  # the latter: malformed, or past its deadline (keep is off)
                return
        if waited.cancelled_caught:
            self.keep = False

    # -- the request body ---------------------------------------------------------------------------

    async def receive(self) -> Message:
        if not self.body_given:
            chunk = b""
            if not self.body_done:
                if self.continue_due:
                    self.continue_due = False
                    if not self.head_sent:  # else the answer is out and the connection closes after it
                        await self.connection.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                try:
                    chunk = await self._body_part()
                except _Gone:
                    return self._disconnect()
            self.body_given = self.body_done
            return {"type": "http.request", "body": chunk, "more_body": not self.body_done}
        if not self.finished:
            await self.connection.wait_disconnect()
        return self._disconnect()

    def _disconnect(self) -> Message:
        why = self.connection.hung_up_why
        return _DISCONNECT if why is None else {"type": "http.disconnect", "reason": why}

    async def _body_part(self) -> bytes:
        """The next piece of the body that has come (at least one byte, unless the body is done); a
        malformed body raises :class:`Malformed` (a ClientError) and closes the connection after."""
        reader = self.connection.reader
        while True:
            try:
                piece, done = reader.take_body()
            except Malformed:
                self.keep = False
                raise
            if done:
                self.body_done = True
                break
            if piece:
                break
            if self.body_deadline is None:
                self.body_deadline = trio.current_time() + self.connection.server.body_timeout_s
            with trio.CancelScope(deadline=self.body_deadline) as waiting:
                data = await self.connection._receive()
            if waiting.cancelled_caught:
                self.keep = False
                timeout = self.connection.server.body_timeout_s
                raise ClientError(
                    408, "body_timeout", f"request body not received within server.body_timeout_s ({timeout:g})"
                )
            if not data:
                self.keep = False
                raise _Gone
            reader.feed(data)
        self.remaining -= len(piece)
        return piece

    # -- the response -------------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.status:
                raise RuntimeError("http.response.start sent twice")
            self.status = message["status"]
            self.response_headers = list(message.get("headers", ()))
            if not any(name.lower() == b"content-length" for name, _ in self.response_headers):
                # A stream: its head goes now (a client waits for it before it reads on); a head
                # that declares a length waits for its body and goes with it, in one write.
                head = self._response_head()
                self.head_sent = True
                await self.connection.write(head)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.status or self.finished:
            raise RuntimeError("http.response.body outside a response")
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        data = b"" if self.head_sent else self._response_head()
        if self.bodiless:
            pass
        elif self.chunked_out:
            if body:
                data += b"%x\r\n" % len(body) + body + b"\r\n"
            if not more:
                data += b"0\r\n\r\n"
        elif body:
            if self.declared is not None and self.sent + len(body) > self.declared:
                raise RuntimeError("response body longer than its Content-Length")
            self.sent += len(body)
            data += body
        self.head_sent = True  # from here on, what is built is sent
        if not more:
            self.finished = True
            if self.declared is not None and self.sent != self.declared and not self.bodiless:
                self.keep = False
        if data:
            await self.connection.write(data)

    def _response_head(self) -> bytes:
        """The response's head; it also settles the body's framing and whether the connection is kept."""
        self.declared = None
        self.chunked_out = False
        status = self.status
        headers: list[tuple[bytes, bytes]] = []
        for name, value in self.response_headers:
            lower = name.lower()
            if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name:
                raise RuntimeError(f"response header {name!r} holds a line break")
            if lower == b"content-length":
                if not value.isdigit():
                    raise RuntimeError(f"response Content-Length {value!r} is not a length")
                self.declared = int(value)
                continue
            if lower == b"connection":
                if b"close" in _tokens([value]):
                    self.keep = False
                continue
            if lower == b"transfer-encoding":
                continue
            headers.append((name, value))
        self.bodiless = self.method == "HEAD" or status in _NO_BODY or status < 200
        length = self.declared
        if length is None and not self.bodiless:
            if self.version == "1.1":
                self.chunked_out = True
                headers.append((b"Transfer-Encoding", b"chunked"))
            else:
                self.keep = False  # the body ends with the connection
        unread = not self.body_done and (self.continue_due or self.chunked or self.remaining > DISCARD_BYTES)
        if unread or self.connection.server.stopping:
            # A body the app did not read is dropped after the response only if that is cheap and it
            # is on its way (no 100 Continue owed); else the connection closes.
            self.keep = False
        if status in _NO_BODY or status < 200:
            length = None
        return _head(status, headers, length, close=not self.keep)


class _Gone(Exception):
    """The client closed its connection in the middle of its request's body."""

"""HTTP/1.1 to a llama-server over its unix socket: the bytes under :class:`~supervisor.llama.decoder.DecoderClient`.

A client for exactly what onebitd asks of llama-server: one host, requests onebitd builds itself,
each written in one send; replies framed by :class:`~supervisor.http.framing.ResponseReader`
(llhttp), read with as few receives as they come in, and never a wait for more bytes while it holds
some for the caller (a stream is relayed as it comes).

- :class:`UnixTransport` keeps keep-alive connections, retired before llama-server's own idle close,
  and sends a request again, once, on a new connection when a pooled one was closed before any byte
  of the answer came back (see :meth:`UnixTransport.send`).
- :class:`Transport` is the seam: ``DecoderClient`` takes any, and the tests hand it an in-process
  fake llama-server (tests/fakes/llama/inprocess.py) through the same two calls.

Every failure here is a :class:`~supervisor.errors.DecoderUnavailable`: this module is the seam
where ``OSError``, trio's stream errors and a reply that is not HTTP (:class:`~supervisor.http.framing.Malformed`)
become onebit's.
"""

from __future__ import annotations

import contextlib
import errno
import re
import socket as stdlib_socket
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

import attrs
import trio

from ..errors import DecoderUnavailable, Malformed
from . import framing
from .framing import END, NEED_DATA

# llama-server (cpp-httplib) closes a keep-alive connection after 5 s idle; ours are retired at 4 s,
# which is still past the health check's 2 s interval (a check does not reconnect every time).
KEEPALIVE_EXPIRY_S = 4.0
# A local socket that takes this long to accept is not being served.
CONNECT_TIMEOUT_S = 5.0
# A request is a few KiB that llama-server reads at once; one it does not read in this long is stuck.
WRITE_TIMEOUT_S = 30.0
# cpp-httplib's own limit on a request head is 8 KiB; a reply head over 64 KiB is not llama-server's.
MAX_HEAD = 65536
RECEIVE = 65536
_PATH = re.compile(r"/[\x21-\x7e]*").fullmatch
# A header onebitd passes on (a client's X-Conversation-Id): a token for a name, visible ASCII and
# inner spaces for a value, so nothing a client sends can end the head or add a field to it.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+").fullmatch
_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?").fullmatch
Headers = Sequence[tuple[str, str]]


def carries(name: str, value: str) -> bool:
    """Whether a header is one :meth:`Transport.send` passes on (see ``_TOKEN`` and ``_VALUE``)."""
    return bool(_TOKEN(name) and _VALUE(value))


_STALE_ERRNOS = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ECONNABORTED})


class Stale(Exception):
    """A pooled connection was closed before any byte of the answer came back: the request was not
    taken up, so sending it again on a new connection cannot do its work twice."""


@attrs.define(eq=False)
class Response:
    """A reply whose head has come.  Read the body with :meth:`chunks` or :meth:`read`, then
    :meth:`aclose` it (always): a connection whose body was read to the end goes back to the pool,
    one left half-read is closed, which makes llama-server stop working on the request."""

    status: int
    headers: dict[str, str]  # names lower-case, repeats joined with ", "
    chunks: Callable[[], AsyncGenerator[bytes, None]]
    aclose: Callable[[], Awaitable[None]]
    fields: list[tuple[bytes, bytes]] = attrs.Factory(list)  # the head's fields, names as the server wrote them
    # The whole body at once, where the transport reads it so (no generator for a body that came
    # with its head, as a short reply's does); else the chunks, joined.
    whole: Callable[[], Awaitable[bytes]] | None = None

    async def read(self) -> bytes:
        if self.whole is not None:
            return await self.whole()
        return b"".join([chunk async for chunk in self.chunks()])


class Transport(Protocol):
    async def send(self, method: str, path: str, body: bytes | None, headers: Headers = ()) -> Response:
        """Send one request (``body`` as JSON when not None, ``headers`` besides onebitd's own);
        return once the reply's head is in."""
        ...

    async def aclose(self) -> None: ...


@attrs.define(eq=False)
class _Connection:
    """One connection to llama-server: a non-blocking socket read and written directly, waiting
    (``trio.lowlevel.wait_readable``/``wait_writable``) only when it would block, where trio's socket
    methods yield to the scheduler on every call, ready or not."""

    sock: stdlib_socket.socket
    reader: framing.ResponseReader = attrs.Factory(lambda: framing.ResponseReader(MAX_HEAD))
    idle_since: float = 0.0
    used: bool = False

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()

    async def receive(self) -> bytes:
        """Bytes as they come; b"" at the end (a reset is an end: llama-server closing)."""
        sock = self.sock
        while True:
            try:
                return sock.recv(RECEIVE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
            except OSError as exc:
                if exc.errno in _STALE_ERRNOS:
                    return b""
                raise DecoderUnavailable(f"decoder connection failed: {_describe(exc)}") from exc

    async def send_all(self, data: bytes) -> None:
        # The whole request nearly always fits the socket's buffer: one send, no deadline to keep.
        sock = self.sock
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        with trio.move_on_after(WRITE_TIMEOUT_S) as scope:
            while view:
                await trio.lowlevel.wait_writable(sock)
                with contextlib.suppress(BlockingIOError):
                    view = view[sock.send(view) :]
        if scope.cancelled_caught:
            raise DecoderUnavailable(f"the request was not read in {WRITE_TIMEOUT_S:g}s")


class UnixTransport:
    """Connections to one unix socket, at most ``max_connections`` at once (a request waits for one)."""

    def __init__(self, socket: Path, *, max_connections: int = 64) -> None:
        self.socket = socket
        self._idle: list[_Connection] = []
        self._permits = trio.Semaphore(max_connections)
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        await trio.lowlevel.checkpoint()

    async def send(self, method: str, path: str, body: bytes | None, headers: Headers = ()) -> Response:
        """A pooled connection is tried first.  llama-server closes pooled connections on its own
        schedule, even ones younger than its idle timeout (a streamed turn's next request meets one):
        a request that finds its connection closed before any byte of the answer was not taken up,
        and goes again, once, on a new connection.  A new connection that fails is the answer."""
        if not _PATH(path):
            raise DecoderUnavailable(f"not a request path: {path!r}")
        head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n"
        for name, value in headers:
            if not carries(name, value):
                raise DecoderUnavailable(f"not a request header: {name!r}: {value!r}")
            head += f"{name}: {value}\r\n"
        if body is None:
            request = (head + "\r\n").encode()
        else:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            request = head.encode() + body
        await trio.lowlevel.checkpoint_if_cancelled()  # no other await need yield when all is ready
        try:
            self._permits.acquire_nowait()
        except trio.WouldBlock:
            await self._permits.acquire()
        try:
            connection = self._pooled()
            if connection is not None:
                try:
                    return await self._exchange(connection, method, request)
                except Stale:
                    pass
            connection = await self._connect()
            try:
                return await self._exchange(connection, method, request)
            except Stale:
                raise DecoderUnavailable("decoder closed the connection without answering") from None
        except BaseException:
            self._permits.release()
            raise

    def _pooled(self) -> _Connection | None:
        """The connection used last; the expired ones (the oldest first) are closed on the way, so
        none waits in the pool for llama-server to close it."""
        idle = self._idle
        expired = trio.current_time() - KEEPALIVE_EXPIRY_S
        while idle and idle[0].idle_since <= expired:
            idle.pop(0).close()
        return idle.pop() if idle else None

    async def _connect(self) -> _Connection:
        """A failed connect (the socket not there yet, a restart) is tried once more."""
        for attempt in (1, 2):
            sock = None
            try:
                sock = trio.socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
                with trio.fail_after(CONNECT_TIMEOUT_S):
                    await sock.connect(str(self.socket))
            except (OSError, trio.TooSlowError) as exc:  # no socket (EMFILE), or none listening
                if sock is not None:
                    sock.close()
                if attempt == 2:
                    raise DecoderUnavailable(f"cannot connect to {self.socket}: {_describe(exc)}") from exc
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            else:
                raw = stdlib_socket.socket(fileno=sock.detach())
                raw.setblocking(False)
                return _Connection(raw)
        raise AssertionError("unreachable")

    async def _exchange(self, connection: _Connection, method: str, request: bytes) -> Response:
        """Write the request, read the reply's head.  :class:`Stale` only from a pooled connection."""
        pooled = connection.used
        connection.used = True
        connection.reader.expect(method)
        try:
            try:
                await connection.send_all(request)
            except OSError as exc:
                if pooled and exc.errno in _STALE_ERRNOS:
                    raise Stale from exc
                raise
            head = await self._head(connection, pooled)
            reply = _Reply(self, connection, head)
        except Stale:
            connection.close()
            raise
        except OSError as exc:
            connection.close()
            raise DecoderUnavailable(f"decoder connection failed: {_describe(exc)}") from exc
        except BaseException:
            connection.close()
            raise
        return reply.response()

    async def _head(self, connection: _Connection, pooled: bool) -> framing.ResponseHead:
        reader = connection.reader
        while True:
            event = _next(reader)
            if event is NEED_DATA:
                data = await connection.receive()
                if not data:
                    if reader.pending:
                        raise DecoderUnavailable("decoder closed the connection before its reply head was complete")
                    if pooled:
                        raise Stale
                    raise DecoderUnavailable("decoder closed the connection without answering")
                reader.feed(data)
                continue
            assert isinstance(event, framing.ResponseHead), event
            if event.status >= 200:
                return event
            # An informational reply (100 Continue) comes before the real one.
            end = _next(reader)
            assert end is END, end

    def release(self, connection: _Connection, reusable: bool) -> None:
        """The end of a reply: its connection back to the pool, or closed."""
        self._permits.release()
        if reusable and not self._closed and not connection.reader.pending:
            connection.idle_since = trio.current_time()
            self._idle.append(connection)
        else:
            connection.close()


class _Reply:
    """The body of one reply, framed as its head says, and what happens to its connection after."""

    def __init__(self, pool: UnixTransport, connection: _Connection, head: framing.ResponseHead) -> None:
        self.pool = pool
        self.connection: _Connection | None = connection
        self.head = head
        self.left = head.length  # of a reply with a Content-Length, the bytes still to come
        headers: dict[str, str] = {}
        for name, value in head.headers:
            key = name.lower().decode("latin-1")
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        self.headers = headers

    def response(self) -> Response:
        if self.head.length == 0:
            assert self.connection is not None
            end = _next(self.connection.reader)  # queued with the head
            assert end is END, end
            self._finish()
        return Response(self.head.status, self.headers, self.chunks, self.aclose, self.head.headers, self.read)

    async def aclose(self) -> None:
        """Before the end of the body (a reply read to its end has released its connection)."""
        connection, self.connection = self.connection, None
        if connection is not None:
            self.pool.release(connection, reusable=False)

    def _finish(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            self.pool.release(connection, reusable=self.head.keep_alive)

    def chunks(self) -> AsyncGenerator[bytes, None]:
        connection = self.connection
        if connection is None:
            return _nothing()
        return self._body(connection)

    async def read(self) -> bytes:
        """The whole body (b"" once it was read)."""
        connection = self.connection
        if connection is None:
            return b""
        pieces: list[bytes] = []
        while True:
            data, done = self._take(connection)
            pieces.append(data)
            if done or not await self._more(connection):
                return b"".join(pieces)  # one piece (the common body): that piece itself, no copy

    async def _body(self, connection: _Connection) -> AsyncGenerator[bytes, None]:
        """Every piece of the body that has come is handed on at once, joined."""
        while True:
            data, done = self._take(connection)
            if data:
                yield data
            if done or not await self._more(connection):
                return

    def _take(self, connection: _Connection) -> tuple[bytes, bool]:
        """What has come of the body, and whether that is its end (the connection then released)."""
        try:
            data, done = connection.reader.take_body()
        except Malformed as exc:
            raise DecoderUnavailable(f"decoder sent a {exc.message}") from None
        if data and self.left is not None:
            self.left -= len(data)
        if done:
            self._finish()
        return data, done

    async def _more(self, connection: _Connection) -> bool:
        """Wait for more of the body and feed it; False at its end (a body that runs to the close)."""
        more = await connection.receive()
        if not more:
            if self.head.until_eof:
                self._finish()
                return False
            if self.head.chunked:
                raise DecoderUnavailable("decoder closed the connection before the end of its chunked reply")
            raise DecoderUnavailable(f"decoder closed the connection with {self.left} bytes of its reply unsent")
        connection.reader.feed(more)
        return True


def _next(reader: framing.ResponseReader) -> framing.Event | object:
    try:
        return reader.next_event()
    except Malformed as exc:
        raise DecoderUnavailable(f"decoder sent a {exc.message}") from None


async def _nothing() -> AsyncGenerator[bytes, None]:
    return
    yield


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return f"no answer in {CONNECT_TIMEOUT_S:g}s"
    return f"{type(exc).__name__}: {exc}"

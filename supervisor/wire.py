"""HTTP/1.1 to a llama-server over its unix socket: the bytes under :class:`~supervisor.decoder.DecoderClient`.

onebitd relays every request through here, so what it costs per request is onebitd's overhead.
httpx over httpcore took 29% of onebitd's CPU on short completions (py-spy, docs/benchmarks.md):
its request and response models, a pool built for many hosts, h11's event machine, and a request
head and body written in two sends.  llama-server needs none of that: one host, requests onebitd
builds itself, replies framed by ``Content-Length`` or chunked.  So this is a client for exactly
that, which writes a request in one send, reads a reply with as few receives as it comes in, and
never waits for more bytes while it holds some for the caller (a stream is relayed as it comes).

- :class:`UnixTransport` keeps keep-alive connections, retired before llama-server's own idle close,
  and sends a request again, once, on a new connection when a pooled one was closed before any byte
  of the answer came back (see :meth:`UnixTransport.send`).
- :class:`Transport` is the seam: ``DecoderClient`` takes any, and the tests hand it an in-process
  fake llama-server (tests/fake_llama.py) through the same two calls.

Every failure here is a :class:`~supervisor.errors.DecoderUnavailable`: this module is the seam
where ``OSError`` and trio's stream errors become onebit's.
"""

from __future__ import annotations

import contextlib
import errno
import re
import socket as stdlib_socket
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Protocol

import attrs
import trio

from .errors import DecoderUnavailable

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
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}").fullmatch
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

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


class Transport(Protocol):
    async def send(self, method: str, path: str, body: bytes | None) -> Response:
        """Send one request (``body`` as JSON when not None); return once the reply's head is in."""
        ...

    async def aclose(self) -> None: ...


@attrs.define(eq=False)
class _Connection:
    """One connection to llama-server: a non-blocking socket read and written directly, waiting
    (``trio.lowlevel.wait_readable``/``wait_writable``) only when it would block.  trio's socket
    methods yield to the scheduler on every call, ready or not: two trips per request saved."""

    sock: stdlib_socket.socket
    buffer: bytearray = attrs.Factory(bytearray)
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

    async def send(self, method: str, path: str, body: bytes | None) -> Response:
        """A pooled connection is tried first.  llama-server closes pooled connections on its own
        schedule, even ones younger than its idle timeout (seen on a streamed turn's next request):
        a request that finds its connection closed before any byte of the answer was not taken up,
        and goes again, once, on a new connection.  A new connection that fails is the answer."""
        if not _PATH(path):
            raise DecoderUnavailable(f"not a request path: {path!r}")
        head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n"
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
        try:
            try:
                await connection.send_all(request)
            except OSError as exc:
                if pooled and exc.errno in _STALE_ERRNOS:
                    raise Stale from exc
                raise
            status, headers = await self._head(connection, pooled)
            reply = _Reply(self, connection, method, status, headers)
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

    async def _head(self, connection: _Connection, pooled: bool) -> tuple[int, dict[str, str]]:
        buffer = connection.buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            while end < 0:
                if len(buffer) > MAX_HEAD:
                    raise DecoderUnavailable(f"decoder sent a reply head over {MAX_HEAD} bytes")
                data = await connection.receive()
                if not data:
                    if buffer:
                        raise DecoderUnavailable("decoder closed the connection before its reply head was complete")
                    if pooled:
                        raise Stale
                    raise DecoderUnavailable("decoder closed the connection without answering")
                buffer += data
                end = buffer.find(b"\r\n\r\n")
            lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
            del buffer[: end + 4]
            status = _status(lines[0])
            if status >= 200:
                return status, _headers(lines[1:], lines[0])
            # An informational reply (100 Continue) comes before the real one.

    def release(self, connection: _Connection, reusable: bool) -> None:
        """The end of a reply: its connection back to the pool, or closed."""
        self._permits.release()
        if reusable and not self._closed and not connection.buffer:
            connection.idle_since = trio.current_time()
            self._idle.append(connection)
        else:
            connection.close()


class _Reply:
    """The body of one reply, framed as its head says, and what happens to its connection after."""

    def __init__(
        self, pool: UnixTransport, connection: _Connection, method: str, status: int, headers: dict[str, str]
    ) -> None:
        self.pool = pool
        self.connection: _Connection | None = connection
        self.status = status
        self.headers = headers
        self.keep_alive = "close" not in _tokens(headers.get("connection", ""))
        if method == "HEAD" or status in (204, 304):
            self.length: int | None = 0
            self.chunked = False
        elif "chunked" in _tokens(headers.get("transfer-encoding", "")):
            self.length, self.chunked = None, True
        elif "content-length" in headers:
            value = headers["content-length"]
            if not (value.isascii() and value.isdigit()):
                raise DecoderUnavailable(f"decoder sent content-length {value!r}")
            self.length, self.chunked = int(value), False
        else:  # the body runs to the end of the connection
            self.length, self.chunked, self.keep_alive = None, False, False

    def response(self) -> Response:
        if self.length == 0:
            self._finish()
        return Response(self.status, self.headers, self.chunks, self.aclose)

    async def aclose(self) -> None:
        """Before the end of the body (a reply read to its end has released its connection)."""
        connection, self.connection = self.connection, None
        if connection is not None:
            self.pool.release(connection, reusable=False)

    def _finish(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            self.pool.release(connection, reusable=self.keep_alive)

    def chunks(self) -> AsyncGenerator[bytes, None]:
        connection = self.connection
        if connection is None:
            return _nothing()
        return self._chunked(connection) if self.chunked else self._plain(connection)

    async def _plain(self, connection: _Connection) -> AsyncGenerator[bytes, None]:
        buffer = connection.buffer
        left = self.length
        while True:
            if buffer:
                take = len(buffer) if left is None else min(left, len(buffer))
                data = bytes(buffer[:take])
                del buffer[:take]
                if left is not None:
                    left -= take
                yield data
            if left == 0:
                self._finish()
                return
            more = await connection.receive()
            if not more:
                if left is None:
                    self._finish()
                    return
                raise DecoderUnavailable(f"decoder closed the connection with {left} bytes of its reply unsent")
            buffer += more

    async def _chunked(self, connection: _Connection) -> AsyncGenerator[bytes, None]:
        """Every complete or partial chunk's data that has come is handed on at once, joined."""
        buffer = connection.buffer
        state, left = _SIZE, 0  # left: data bytes of the current chunk still to come
        while True:
            out = bytearray()
            while True:
                if state == _DATA:
                    take = min(left, len(buffer))
                    out += buffer[:take]
                    del buffer[:take]
                    left -= take
                    if left:
                        break
                    state = _CRLF
                elif state == _CRLF:
                    if len(buffer) < 2:
                        break
                    if buffer[:2] != b"\r\n":
                        raise DecoderUnavailable("decoder sent a malformed chunk (no CRLF after its data)")
                    del buffer[:2]
                    state = _SIZE
                else:  # a size line, or a line of the trailer that ends the body with an empty one
                    end = buffer.find(b"\r\n")
                    if end < 0:
                        if len(buffer) > MAX_HEAD:
                            raise DecoderUnavailable("decoder sent a chunk size or trailer line too long")
                        break
                    line = bytes(buffer[:end])
                    del buffer[: end + 2]
                    if state == _TRAILER:
                        if not line:
                            state = _DONE
                            break
                    else:
                        left = _chunk_size(line)
                        state = _DATA if left else _TRAILER
            if out:
                yield bytes(out)
            if state == _DONE:
                self._finish()
                return
            more = await connection.receive()
            if not more:
                raise DecoderUnavailable("decoder closed the connection before the end of its chunked reply")
            buffer += more


_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)


async def _nothing() -> AsyncGenerator[bytes, None]:
    return
    yield


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0].strip()
    if not _HEX(digits):
        raise DecoderUnavailable(f"decoder sent a malformed chunk size {line[:40]!r}")
    return int(digits, 16)


def _tokens(value: str) -> list[str]:
    return [token.strip() for token in value.lower().split(",")]


def _status(line: str) -> int:
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise DecoderUnavailable(f"decoder sent a malformed status line {line[:80]!r}")
    return int(parts[1])


def _headers(lines: list[str], status_line: str) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise DecoderUnavailable(f"decoder sent a malformed header line {line[:80]!r}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    if status_line.startswith("HTTP/1.0") and "keep-alive" not in headers.get("connection", "").lower():
        headers.setdefault("connection", "close")
    return headers


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return f"no answer in {CONNECT_TIMEOUT_S:g}s"
    return f"{type(exc).__name__}: {exc}"

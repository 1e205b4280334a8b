"""The front's HTTP/1.1 server: an ASGI app served on trio's sockets, one task per connection (and
its hang-up watcher, from the first request that watches).

This module binds and accepts, and stops: listeners first, then idle connections at once, busy ones
when their response is out, all within ``graceful_timeout_s``.  The rest, each in a module of its own:

- supervisor/http/connection.py: a connection's loop (keep-alive, the idle timeout, the write
  deadline, a refused head);
- supervisor/http/asgi.py: a request as the app sees it (scope, ``receive`` with the body's deadline,
  ``send``);
- supervisor/http/watch.py: :class:`HangUp` and the one watcher task per connection;
- supervisor/http/framing/: the request's parse, the response's head and chunks, keep or close.

The timeouts are sources (a value, or a function that gives the value now: the daemon's one live
config), read at each idle period, each write and each body's first wait, so a reload applies from
the next.  Their defaults are the config's (``server.*`` in supervisor/config/schema.py).
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable

import trio

from ..config import ServerConfig, source
from ..errors import ListenError
from . import framing
from .asgi import App
from .connection import Connection
from .watch import HANG_UP, HangUp

__all__ = ["BODY_TIMEOUT_S", "HANG_UP", "MAX_HEAD_BYTES", "WRITE_TIMEOUT_S", "App", "HangUp", "HttpServer"]

log = logging.getLogger("onebit.front")

MAX_HEAD_BYTES = framing.MAX_HEAD_BYTES
BACKLOG = 1024
_DEFAULTS = ServerConfig()  # the config's defaults, one place for both
WRITE_TIMEOUT_S = _DEFAULTS.write_timeout_s
BODY_TIMEOUT_S = _DEFAULTS.body_timeout_s

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
        self._connections: set[Connection] = set()
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
                connection = Connection(self, sock, nursery)  # asks the peer's address: a reset client has none
            except OSError:
                sock.close()
                continue
            self._connections.add(connection)
            nursery.start_soon(connection.run)

    def _gone(self, connection: Connection) -> None:
        self._connections.discard(connection)
        self._left.set()
        self._left = trio.Event()

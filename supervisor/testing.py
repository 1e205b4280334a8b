"""onebitd inside this trio run: the one harness the tests, the benchmarks and the chaos runs share.

:func:`run_daemon` starts a :class:`~supervisor.daemon.Daemon` in a nursery of the caller's trio run,
waits until its decoder is ready (and, asked, every provider's child), and yields a :class:`Running`;
on the way out, whatever happened, it asks the daemon to stop, which drains, stops its children and
reaps them.  :meth:`Running.clients` opens the two HTTP clients a measurement compares: one through
onebitd's front, one straight to the decoder's socket.  Nothing in onebitd itself imports this module
(as nothing in trio imports trio.testing).

:func:`unix_transport` is httpx, the reference client of the tests and the benchmarks, on a
llama-server's unix socket, held to the rules onebitd's own client (supervisor/http/wire.py) keeps
with llama-server: keep-alive connections retired at :data:`~supervisor.http.wire.KEEPALIVE_EXPIRY_S`,
and a request a pooled connection dropped unanswered sent again once (:class:`FreshOnStale`).  Only
this harness imports httpx; onebitd does not.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from .config import Config
from .daemon import Daemon, Started
from .errors import ChildError
from .http import wire
from .models.model import ModelState
from .supervise.child import ChildState


@attrs.frozen
class Clients:
    front: httpx.AsyncClient  # through onebitd
    direct: httpx.AsyncClient  # straight to the decoder's socket, as onebitd's own client goes


@attrs.frozen
class Running:
    daemon: Daemon
    started: Started

    @property
    def url(self) -> str:
        return self.started.binds[0]

    @property
    def runtime(self) -> Path:
        return self.started.runtime_dir

    @asynccontextmanager
    async def clients(
        self,
        *,
        request_timeout_s: float,
        direct_timeout_s: float | None = None,
        max_connections: int = 64,
        keepalive: int = 64,
    ) -> AsyncIterator[Clients]:
        """A client of onebitd's front (``max_connections``, ``keepalive``: its pool) and one of its
        decoder's socket (``direct_timeout_s``: its own timeout, else ``request_timeout_s``), for the
        block.  The direct one retires keep-alive connections before llama-server's 5 s idle close,
        as onebitd's own does (:func:`unix_transport`), which would otherwise fail a request now and
        then."""
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=keepalive)
        transport = unix_transport(self.daemon.models.default.parts.launcher.socket)
        direct_timeout = request_timeout_s if direct_timeout_s is None else direct_timeout_s
        async with (
            httpx.AsyncClient(base_url=self.url, timeout=request_timeout_s, limits=limits) as front,
            httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=direct_timeout) as direct,
        ):
            yield Clients(front, direct)


class FreshOnStale(httpx.AsyncBaseTransport):
    """Sends a request again, once, when the connection it went out on was closed before any byte
    of an answer came back ("Server disconnected without sending a response"): the rule of
    :meth:`supervisor.http.wire.UnixTransport.send` (llama-server closes pooled connections on its
    own schedule; a request that got no answer at all was never taken up, so sending it again cannot
    do its work twice), for httpx."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._inner.handle_async_request(request)
        except httpx.RemoteProtocolError as exc:
            if "without sending a response" not in str(exc):
                raise
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def unix_transport(socket: Path, *, max_connections: int = 64) -> httpx.AsyncBaseTransport:
    """httpx over llama-server's unix socket, with keep-alive connections retired as onebitd's own
    are, and a request the server dropped unanswered on a pooled connection sent again once."""
    return FreshOnStale(
        httpx.AsyncHTTPTransport(
            uds=str(socket),
            limits=httpx.Limits(max_connections=max_connections, keepalive_expiry=wire.KEEPALIVE_EXPIRY_S),
            # A failed connect (the socket not there yet, a restart) is tried once more, as wire's is.
            retries=1,
        )
    )


async def wait_daemon_ready(daemon: Daemon, *, providers: bool = False) -> None:
    """Until the decoder is ready (ChildError when it failed instead) and its model loaded (its
    slot context read and its restores probed), and, with ``providers``, every provider's child and
    its start-time check too."""
    model = daemon.models.default
    if await model.decoder.wait_state(ChildState.READY, ChildState.FAILED) is ChildState.FAILED:
        raise ChildError(f"the decoder failed to start: {model.decoder.statistics().last_exit}")
    if await model.wait_state(ModelState.LOADED, ModelState.FAILED) is ModelState.FAILED:
        raise ChildError(f"model {model.name} failed to load: {model.decoder.statistics().last_exit}")
    if providers:
        for provider in daemon.models.default.parts.providers.all:
            if provider.child is not None:  # healthy, or given up on (it will not be)
                await provider.child.wait_state(ChildState.READY, ChildState.FAILED)
            await provider.wait_settled()  # and the start-time check's verdict, where it has one


@asynccontextmanager
async def run_daemon(
    config: Config,
    *,
    wait_ready: bool = True,
    providers_ready: bool = False,
    check_fidelity: bool = True,
    ready_timeout_s: float = math.inf,
) -> AsyncIterator[Running]:
    """Run onebitd in this trio run for the block; ``wait_ready``: first until it is ready
    (``providers_ready``: its providers' children too), for at most ``ready_timeout_s``.  Stopped on
    the way out (drain, stop the children, reap them)."""
    daemon = Daemon(config, check_fidelity=check_fidelity)
    async with trio.open_nursery() as nursery:
        started: Started = await nursery.start(daemon.run)
        try:
            if wait_ready:
                with trio.fail_after(ready_timeout_s):
                    await wait_daemon_ready(daemon, providers=providers_ready)
            yield Running(daemon, started)
        finally:
            daemon.request_stop()


class RouteLines(logging.Handler):
    """The fields of every route line onebitd logs (each once its request is over: after the last
    byte, and after its slot was saved for the prefix store), for a benchmark or a test to read back."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []
        self.at: list[float] = []  # when each line came, by time.perf_counter()
        self._changed = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "route_fields", None)
        if isinstance(fields, dict):
            self.add(fields)

    def add(self, fields: dict[str, Any]) -> None:
        """One route line's fields: a record of this process's, or a line an onebitd process logged."""
        self.lines.append(fields)
        self.at.append(time.perf_counter())
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, n: int) -> list[dict[str, Any]]:
        """All the lines, once there are at least ``n``."""
        while len(self.lines) < n:
            await self._changed.wait()
        return self.lines

    async def wait(self, n: int) -> dict[str, Any]:
        """The n-th line, once it came."""
        return (await self.until(n))[n - 1]

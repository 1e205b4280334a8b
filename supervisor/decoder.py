"""The client side of the decoder: llama-server's HTTP API over its unix socket.

The only module that imports httpx.  Every httpx error becomes a
:class:`~supervisor.errors.DecoderError` here, so the rest of onebit never sees a foreign exception.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx

from .errors import DecoderProtocolError, DecoderUnavailable

# Generation has no natural upper bound (a long reply on a slow CPU); a stuck decoder is caught by the
# health check instead.  Connecting to a local socket that takes over 5 s means it is not listening.
_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
_BASE = "http://decoder"
_JSON = (("content-type", "application/json"),)
# Parsed request URLs kept per path: a handful of endpoints, plus a slot action's per slot.
_URL_CACHE = 256


@attrs.frozen
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise DecoderProtocolError(
                f"decoder answered {self.status} with a body that is not JSON", upstream_status=self.status
            ) from None


@attrs.frozen
class Stream:
    status: int
    headers: Mapping[str, str]
    chunks: AsyncIterator[bytes]


def _translate(exc: httpx.HTTPError, what: str) -> DecoderUnavailable:
    return DecoderUnavailable(f"decoder {what}: {type(exc).__name__}: {exc}".rstrip(": "))


class FreshOnStale(httpx.AsyncBaseTransport):
    """Sends a request again, once, when the connection it went out on was closed before any byte
    of an answer came back ("Server disconnected without sending a response"): llama-server (its
    cpp-httplib) closes pooled keep-alive connections on its own schedule, even ones younger than its
    5 s idle timeout (seen here on a streamed turn's next request), and a request that got no answer
    at all was never taken up: sending it again on a new connection cannot do its work twice.
    Seen in the benchmarks and the real tests as random failures of requests to a healthy decoder."""

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
    """HTTP over llama-server's unix socket, with keep-alive connections retired in time, and a
    request the server dropped unanswered on a pooled connection sent again once."""
    return FreshOnStale(
        httpx.AsyncHTTPTransport(
            uds=str(socket),
            # llama-server closes an idle keep-alive connection after 5 s (cpp-httplib's default);
            # reusing one at that moment fails the request.  Retire ours sooner, but after the
            # health check's 2 s interval, so that the check does not reconnect every time (the
            # profile in docs/benchmarks.md); a close that races us anyway is FreshOnStale's.
            limits=httpx.Limits(max_connections=max_connections, keepalive_expiry=4.0),
            # A failed connect (the socket not there yet, a restart) is tried once more.
            retries=1,
        )
    )


class DecoderClient:
    """Talks to one llama-server on ``socket``.  Close with :meth:`aclose`.

    ``transport`` replaces the unix-socket one (httpx's ``MockTransport`` style): the tests hand it
    an in-process fake llama-server (tests/fake_llama.py) and need no process at all."""

    def __init__(
        self, socket: Path, *, max_connections: int = 64, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.socket = socket
        self._transport = transport or unix_transport(socket, max_connections=max_connections)
        self._client = httpx.AsyncClient(transport=self._transport, base_url=_BASE, timeout=_TIMEOUT)
        self._urls: dict[str, httpx.URL] = {}

    async def aclose(self) -> None:
        await self._client.aclose()

    async def healthy(self) -> bool:
        try:
            response = await self._client.get("/health", timeout=httpx.Timeout(5.0))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _build(self, method: str, path: str, body: Any) -> httpx.Request:
        url = self._urls.get(path)
        if url is None:
            url = httpx.URL(_BASE + path)
            if len(self._urls) < _URL_CACHE:
                self._urls[path] = url
        if body is None:
            return httpx.Request(method, url, extensions={"timeout": _TIMEOUT.as_dict()})
        return httpx.Request(
            method, url, content=json.dumps(body).encode(), headers=_JSON, extensions={"timeout": _TIMEOUT.as_dict()}
        )

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Straight to the transport (the connection pool).  The client's layers (base URL merging,
        auth, redirects, cookies, event hooks) do nothing for llama-server and cost each request
        about 0.3 ms of CPU before it reaches the decoder, measured (docs/benchmarks.md)."""
        response = await self._transport.handle_async_request(request)
        response.request = request
        return response

    async def request(self, method: str, path: str, body: Any = None) -> Reply:
        """One request; the whole reply.  ``body`` is sent as JSON when not None."""
        try:
            response = await self._send(self._build(method, path, body))
            try:
                content = await response.aread()
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise _translate(exc, f"{method} {path}") from exc
        return Reply(response.status_code, dict(response.headers), content)

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        """POST JSON, expect JSON back (any status); returns ``(status, decoded body)``."""
        reply = await self.request("POST", path, body)
        return reply.status, reply.json()

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[Stream]:
        """POST and relay the reply as it comes.  Leaving the block closes the connection, which
        makes llama-server stop working on the request."""
        request = self._build("POST", path, body)
        try:
            response = await self._send(request)
        except httpx.HTTPError as exc:
            raise _translate(exc, f"POST {path}") from exc
        try:

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                except httpx.HTTPError as exc:
                    raise _translate(exc, f"stream {path}") from exc

            yield Stream(response.status_code, dict(response.headers), chunks())
        finally:
            await response.aclose()

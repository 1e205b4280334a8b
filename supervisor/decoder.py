"""The client side of the decoder: llama-server's HTTP API over its unix socket.

:class:`DecoderClient` is how onebitd talks to every llama-server it runs (the decoder, a llama
provider), over supervisor/wire.py's HTTP/1.1, which raises only :class:`~supervisor.errors.DecoderError`.

:func:`unix_transport` is for clients that talk to a llama-server directly, beside onebitd (the
benchmarks' baseline, the tests' references): httpx over the same socket, with the same keep-alive
care.  This is the only module that imports httpx.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from . import wire
from .errors import DecoderError, DecoderProtocolError

# A reply's read has no time limit: generation has no natural upper bound (a long reply on a slow
# CPU); a stuck decoder is caught by the health check, which gives one answer this long.
_HEALTH_TIMEOUT_S = 5.0


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

    The bytes go through ``transport``: :class:`~supervisor.wire.UnixTransport` on ``socket`` unless
    one is given (httpx's ``MockTransport`` style): the tests hand it an in-process fake llama-server
    (tests/fake_llama.py) and need no process at all."""

    def __init__(self, socket: Path, *, max_connections: int = 64, transport: wire.Transport | None = None) -> None:
        self.socket = socket
        self._transport = transport or wire.UnixTransport(socket, max_connections=max_connections)

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def healthy(self) -> bool:
        with trio.move_on_after(_HEALTH_TIMEOUT_S):
            try:
                response = await self._transport.send("GET", "/health", None)
                try:
                    await response.read()
                finally:
                    await response.aclose()
            except DecoderError:
                return False
            return response.status == 200
        return False

    @staticmethod
    def _encode(body: Any) -> bytes | None:
        return None if body is None else json.dumps(body).encode()

    async def request(self, method: str, path: str, body: Any = None, headers: wire.Headers = ()) -> Reply:
        """One request; the whole reply.  ``body`` is sent as JSON when not None."""
        response = await self._transport.send(method, path, self._encode(body), headers)
        try:
            content = await response.read()
        finally:
            await response.aclose()
        return Reply(response.status, response.headers, content)

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        """POST JSON, expect JSON back (any status); returns ``(status, decoded body)``."""
        reply = await self.request("POST", path, body)
        return reply.status, reply.json()

    @asynccontextmanager
    async def stream(
        self, path: str, body: Any, headers: wire.Headers = (), *, method: str = "POST"
    ) -> AsyncIterator[Stream]:
        """POST (or ``method``) and relay the reply as it comes.  Leaving the block closes the
        connection (unless the reply was read to its end), which makes llama-server stop working on
        the request (one that carries ``X-Conversation-Id`` goes on into its stream session)."""
        response = await self._transport.send(method, path, self._encode(body), headers)
        chunks = response.chunks()
        try:
            yield Stream(response.status, response.headers, chunks)
        finally:
            try:
                await chunks.aclose()
            finally:
                await response.aclose()

"""The HTTP front: an ASGI app served by hypercorn's trio worker.

It checks who may ask (Host, Origin, API key), reads and vets the body, and runs every completion
request in its own cancel scope: a client that hangs up cancels the scope, which closes the decoder
request (llama-server then stops working on it) and releases the slot.  Exactly one route line is
logged per completion request, whatever happened.
"""

from __future__ import annotations

import hmac
import ipaddress
import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from .child import ChildState
from .completion import ENDPOINTS, Completions, Decoder, decoder_error_envelope
from .config import ServerConfig
from .decoder import DecoderClient
from .errors import ClientError, DecoderError, OnebitError
from .logs import ROUTE_LOGGER
from .respond import Responder
from .routeline import RouteLine
from .status import FrontStatistics, InflightStatistics

log = logging.getLogger("onebit.front")
route_log = logging.getLogger(ROUTE_LOGGER)

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PASS_THROUGH = ("/tokenize", "/detokenize", "/apply-template")
LOOPBACK_NAMES = {"localhost", "localhost.", "ip6-localhost"}


@attrs.frozen
class InflightRequest:
    req: str
    endpoint: str
    started: float  # trio clock
    wall_started: float
    line: RouteLine  # filled in as the request goes: its route so far

    def statistics(self, now: float) -> InflightStatistics:
        return InflightStatistics(
            req=self.req,
            endpoint=self.endpoint,
            route=self.line.route,
            slot=self.line.slot,
            age_s=round(now - self.started, 3),
        )


def _is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(value: str) -> str:
    """The host part of a Host header (``name:port``, ``[v6]:port``) or of an origin URL."""
    if "://" in value:
        return urlsplit(value).hostname or ""
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Front:
    def __init__(
        self,
        server: ServerConfig,
        *,
        decoder: Decoder,
        client: DecoderClient,
        completions: Completions,
        emit: Callable[[RouteLine], None] | None = None,
        metrics: Callable[[], bytes] | None = None,
    ) -> None:
        self.server = server
        self.decoder = decoder
        self.client = client
        self.completions = completions
        self._emit_hook = emit
        self.metrics = metrics
        self._shutdown = trio.Event()
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}"
        self.inflight: dict[str, InflightRequest] = {}
        self._inflight_changed = trio.Event()
        self._draining = False
        self._loopback_only = _is_loopback(server.host)
        self._keys = [key.encode() for key in server.api_keys]

    # -- lifecycle ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`stop`; ``started`` with the bound addresses once listening."""
        config = HypercornConfig()
        host = self.server.host
        config.bind = [f"[{host}]:{self.server.port}" if ":" in host else f"{host}:{self.server.port}"]
        # The daemon drains in-flight completions itself (up to server.shutdown_grace_s) before it
        # stops the front; what hypercorn still waits for then is idle keep-alive connections.
        config.graceful_timeout = 2.0
        config.accesslog = None
        config.errorlog = logging.getLogger("onebit.hypercorn")
        # A slow client may legitimately hold a stream for minutes; idle keep-alive sockets need not.
        config.keep_alive_timeout = 75
        await serve(
            self,  # type: ignore[arg-type]  # hypercorn types its app with its own TypedDicts
            config,
            shutdown_trigger=self._shutdown.wait,
            task_status=task_status,
            mode="asgi",
        )

    def configure(self, server: ServerConfig) -> None:
        """Take the settings `onebitctl reload` may change live (bind address and port stay)."""
        self.server = attrs.evolve(server, host=self.server.host, port=self.server.port)
        self._keys = [key.encode() for key in server.api_keys]

    async def wait_inflight_changed(self) -> None:
        await self._inflight_changed.wait()

    def stop(self) -> None:
        """Stop accepting; hypercorn lets in-flight requests finish within the grace period."""
        self._shutdown.set()

    async def wait_idle(self) -> None:
        while self.inflight:
            await self._inflight_changed.wait()

    def _changed(self) -> None:
        self._inflight_changed.set()
        self._inflight_changed = trio.Event()

    # -- draining and what is in flight -------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Refuse new completion requests (503 ``draining``, and /health says so); those in flight go on."""
        self._draining = True

    def resume(self) -> None:
        """Take new completion requests again."""
        self._draining = False

    def statistics(self) -> FrontStatistics:
        now = trio.current_time()
        return FrontStatistics(
            draining=self._draining,
            inflight=tuple(request.statistics(now) for request in self.inflight.values()),
        )

    # -- ASGI ---------------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def health(self) -> tuple[int, str]:
        if self.draining:
            return 503, "draining"
        state = self.decoder.state
        if state is ChildState.READY:
            return 200, "ok"
        if state is ChildState.FAILED:
            return 503, "failed"
        if state in (ChildState.STOPPING, ChildState.STOPPED) and self._shutdown.is_set():
            return 503, "stopping"
        return 503, "loading"

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        started = trio.current_time()
        out = Responder(send, started)
        method: str = scope["method"]
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check_caller(method, path, headers)
            if path == "/metrics" and self.metrics is not None:
                self._allow(method, "GET")
                await out.whole(200, self.metrics(), METRICS_CONTENT_TYPE)
            elif path == "/health":
                self._allow(method, "GET", "HEAD")
                status, word = self.health()
                retry = [("retry-after", str(self.server.retry_after_s))] if status != 200 else []
                await out.json(status, {"status": word}, retry)
            elif path == "/v1/models":
                self._allow(method, "GET")
                await self._pass_through(out, "GET", path, None)
            elif path in PASS_THROUGH:
                self._allow(method, "POST")
                body = await self._read_json(receive, headers)
                await self._pass_through(out, "POST", path, body)
            elif path in ENDPOINTS:
                self._allow(method, "POST")
                if self.draining:
                    raise ClientError(
                        503,
                        "draining",
                        "onebitd is draining: not taking new requests",
                        retry_after=self.server.retry_after_s,
                    )
                body = await self._read_json(receive, headers)
                await self._completion(path, body, receive, out)
            else:
                raise ClientError(404, "not_found", f"no such endpoint: {path}")
        except ClientError as exc:
            if not out.started:
                await out.error(exc.status, exc.code, exc.message, retry_after=exc.retry_after)
            if path in ENDPOINTS:
                # Refused before _completion (caller, method, body): it logs its own line otherwise.
                self._refused(path, exc, out, started)
        except DecoderError as exc:
            if not out.started:
                await out.error(exc.status, exc.code, exc.message, retry_after=self._retry_after(exc))

    def _refused(self, path: str, exc: ClientError, out: Responder, started: float) -> None:
        """A completion request refused before it began still gets its one route line."""
        line = RouteLine(req=f"{self._prefix}-{next(self._ids)}", endpoint=path, outcome="error", error=exc.message)
        line.status = out.status or exc.status
        line.first_byte_ms = out.first_byte_ms
        line.total_ms = (trio.current_time() - started) * 1000
        self.emit(line)

    def _retry_after(self, exc: DecoderError) -> int | None:
        return self.server.retry_after_s if exc.status == 503 else None

    @staticmethod
    def _allow(method: str, *allowed: str) -> None:
        if method not in allowed:
            raise ClientError(405, "method_not_allowed", f"{method} is not allowed here; use {', '.join(allowed)}")

    def _check_caller(self, method: str, path: str, headers: dict[str, str]) -> None:
        if self._loopback_only:
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 still sends its own Host.
            host = _host_of(headers.get("host", ""))
            if host and not _is_loopback(host):
                raise ClientError(403, "forbidden_host", f"Host {host!r} is not allowed on a loopback bind")
            origin = headers.get("origin")
            if method == "POST" and origin and origin != "null" and not _is_loopback(_host_of(origin)):
                raise ClientError(403, "cross_origin", f"cross-site request from {origin!r} refused")
        if self._keys and path not in ("/health", "/metrics"):
            given = headers.get("authorization", "")
            token = given[7:].strip().encode() if given[:7].lower() == "bearer " else b""
            # Compare against every key, so the time taken does not say which one nearly matched.
            matched = False
            for key in self._keys:
                matched |= hmac.compare_digest(token, key)
            if not matched:
                raise ClientError(401, "invalid_api_key", "missing or wrong API key (Authorization: Bearer ...)")

    async def _read_json(self, receive: Receive, headers: dict[str, str]) -> dict[str, Any]:
        limit = self.server.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ClientError(413, "body_too_large", f"request body over server.max_body_bytes ({limit})")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientError(499, "client_gone", "the client went away while sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ClientError(413, "body_too_large", f"request body over server.max_body_bytes ({limit})")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ClientError(400, "bad_json", f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ClientError(400, "bad_json", "request body must be a JSON object")
        return body

    async def _pass_through(self, out: Responder, method: str, path: str, body: Any) -> None:
        self.completions.check_ready()
        reply = await self.client.request(method, path, body)
        if 200 <= reply.status < 300:
            await out.whole(reply.status, reply.body, reply.headers.get("content-type", "application/json"))
        else:
            message, type_, code = decoder_error_envelope(reply.status, reply.body)
            await out.error(reply.status, code, message, source="decoder", type_=type_)

    # -- a completion request, in its own cancel scope ----------------------------------------------

    async def _completion(self, path: str, body: dict[str, Any], receive: Receive, out: Responder) -> None:
        req = f"{self._prefix}-{next(self._ids)}"
        line = RouteLine(req=req, endpoint=path)
        started = trio.current_time()
        self.inflight[req] = InflightRequest(req, path, started, time.time(), line)
        self._changed()
        gone = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope, gone, out)
                try:
                    await self.completions.serve(path, body, out, line)
                except ClientError as exc:
                    line.outcome, line.error = "error", exc.message
                    await out.error(exc.status, exc.code, exc.message, retry_after=exc.retry_after)
                except DecoderError as exc:
                    line.outcome, line.error = "error", exc.message
                    if not out.started:
                        await out.error(exc.status, exc.code, exc.message, retry_after=self._retry_after(exc))
                except OnebitError as exc:
                    line.outcome, line.error = "error", str(exc)
                    if not out.started:
                        await out.error(500, "internal", str(exc))
                nursery.cancel_scope.cancel()
        finally:
            # hypercorn reports a disconnect after a finished response too: that is no cancellation.
            if gone.is_set() and not out.finished:
                line.outcome = "cancelled"
            line.status = out.status or 499  # 499: the client closed before any answer (nginx's code)
            line.first_byte_ms = out.first_byte_ms
            line.total_ms = (trio.current_time() - started) * 1000
            del self.inflight[req]
            self._changed()
            self.emit(line)

    def emit(self, line: RouteLine) -> None:
        route_log.info(line.logfmt(), extra={"route_fields": line.fields()})
        if self._emit_hook is not None:
            self._emit_hook(line)

    @staticmethod
    async def _watch_disconnect(receive: Receive, scope: trio.CancelScope, gone: trio.Event, out: Responder) -> None:
        """A client that hangs up cancels its request, but only while the response is unfinished:
        hypercorn reports a disconnect after every finished response too, and what the request does
        after its last byte (verification, bookkeeping) is the server's work, not the client's."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                if not out.finished:
                    scope.cancel()
                return

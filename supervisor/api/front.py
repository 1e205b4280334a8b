"""The HTTP front: an ASGI app, served by onebitd's own HTTP/1.1 server (supervisor/http/server.py).

It checks who may ask (Host, Origin, API key), reads and vets the body, and runs every completion
request in its own cancel scope: a client that hangs up cancels the scope, which closes the decoder
request (llama-server then stops working on it) and releases the slot.  A stream sent with
``X-Conversation-Id`` is the exception once the decoder's reply has begun: llama-server goes on
into the conversation's stream session for a replay, so onebitd goes on reading it, the slot held,
for at most ``server.detach_timeout_s`` (``outcome=detached``).  Exactly one route line is logged
per completion request, whatever happened.  Vertex AI's prediction route, where onebitd's
environment asks for it, runs each of its instances through the same table (supervisor/api/vertex.py).
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol
from urllib.parse import quote

import attrs
import trio

from ..config import ServerConfig, source
from ..config.origins import host_of, is_loopback
from ..errors import ClientError, DecoderError, OnebitError
from ..http.respond import Receive, Responder, Send, speaks_anthropic
from ..http.server import HANG_UP, HangUp, HttpServer
from ..llama.decoder import DecoderClient
from ..observe.logs import ROUTE_LOGGER
from ..observe.status import FrontStatistics, InflightStatistics
from ..routeline import RouteLine
from ..routes.completion import Completions, Decoder
from ..routes.relay import SSE_HEADERS, relay_reply, sse_error
from ..supervise.child import ChildState
from . import vertex as aip
from .cors import Cors
from .endpoints import ROUTES, Endpoint, Kind, lookup
from .vertex import Vertex

log = logging.getLogger("onebit.front")
route_log = logging.getLogger(ROUTE_LOGGER)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Answered without an API key, as llama-server answers /health (and onebitd its /metrics).
PUBLIC = ("/health", "/v1/health", "/metrics", "/metrics/decoder")
# A scrape waits this long for the decoder's own metrics, then goes without them.
DECODER_METRICS_TIMEOUT_S = 2.0
# The header that makes llama-server keep a stream in a session for a replay (server-stream.h).
CONVERSATION_HEADER = "X-Conversation-Id"
# A detached stream past server.detach_timeout_s is stopped with a DELETE, given this long.
STOP_TIMEOUT_S = 5.0
# What onebitd passes on of a client's query string or header: visible ASCII, as wire.py sends it.
_VISIBLE = re.compile(r"[\x21-\x7e]*").fullmatch


@attrs.frozen
class ProviderReadiness:
    """What ``/health`` needs of the providers: whether every one's first start is over (healthy,
    or failed), and the names of those not ready now."""

    settled: bool = True
    not_ready: tuple[str, ...] = ()


async def _never_gone() -> dict[str, Any]:
    """A prediction instance's ``receive``: the hang-up of the whole request cancels them all."""
    await trio.sleep_forever()
    raise AssertionError("unreachable")


@attrs.define
class Kept:
    """An instance's answer, kept instead of sent: what llama-server puts in its prediction."""

    messages: list[dict[str, Any]] = attrs.Factory(list)

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        await trio.lowlevel.checkpoint()

    def prediction(self) -> Any:
        body = b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return body.decode("utf-8", "replace")


class Served(Protocol):
    """What a request needs of the model that serves it (supervisor/models/model.py's Model)."""

    @property
    def completions(self) -> Completions: ...

    @property
    def client(self) -> DecoderClient: ...

    @property
    def decoder(self) -> Decoder: ...


class Router(Protocol):
    """Which model serves a request (supervisor/models/registry.py's Models)."""

    @property
    def several(self) -> bool: ...

    @property
    def default(self) -> Served: ...

    def use(
        self, asked: Any, line: RouteLine | None = None, *, any_loaded: bool = False
    ) -> AbstractAsyncContextManager[Served]:
        """The model the request's ``model`` names, held for the block; ClientError 404 for none.
        ``any_loaded``: a request that names none may go to any loaded model (a relayed GET)."""
        ...

    def health_state(self) -> ChildState: ...

    def listing(self) -> dict[str, Any]: ...


@attrs.frozen
class One:
    """The router of a front with one model and nothing else (a test's, a tool's)."""

    completions: Completions
    client: DecoderClient
    decoder: Decoder
    several = False

    @property
    def default(self) -> Served:
        return self

    @asynccontextmanager
    async def use(
        self, asked: Any, line: RouteLine | None = None, *, any_loaded: bool = False
    ) -> AsyncIterator[Served]:
        yield self

    def health_state(self) -> ChildState:
        return self.decoder.state

    def listing(self) -> dict[str, Any]:
        return {}


@attrs.define
class Watch:
    """What a request's hang-up watcher is given, and what it reports back."""

    scope: trio.CancelScope
    gone: list[str]
    detached: list[bool]
    conversation: str | None
    line: RouteLine
    client: DecoderClient  # the decoder of the model serving it, once known


def _hang_up_of(scope: dict[str, Any]) -> HangUp | None:
    """The server's hang-up watch for this request (supervisor/http/server.py), where it offers one."""
    extensions = scope.get("extensions") or {}
    hang_up: HangUp | None = extensions.get(HANG_UP)
    return hang_up


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


class Front:
    def __init__(
        self,
        server: ServerConfig | Callable[[], ServerConfig],
        *,
        decoder: Decoder,
        client: DecoderClient,
        completions: Completions,
        models: Router | None = None,
        emit: Callable[[RouteLine], None] | None = None,
        metrics: Callable[[], bytes] | None = None,
        providers: Callable[[], ProviderReadiness] = ProviderReadiness,
        vertex: Vertex | None = None,
    ) -> None:
        """``server``: the settings, or where to read them at each request (the daemon's one config,
        swapped whole by a reload; the bind address and port are read once, by :meth:`bind`).
        ``models``: which model serves a request (the daemon's); without it, the one ``decoder``."""
        self._server = source(server)
        self.router: Router = models if models is not None else One(completions, client, decoder)
        self.providers = providers
        self._emit_hook = emit
        self.metrics = metrics
        self._shutdown = trio.Event()
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}"
        self.inflight: dict[str, InflightRequest] = {}
        self._inflight_changed: trio.Event | None = None  # made by the first waiter: most requests have none
        self._draining = False
        first = self._server()
        self._loopback_only = all(is_loopback(host) for host in first.host)
        # What a request's checks derive from the settings, rebuilt when a reload swapped them.
        self._access_for = first
        self._keys = [key.encode() for key in first.api_keys]
        self._cors = Cors(first.cors_origins)
        self._http_server: HttpServer | None = None
        # Vertex AI's routes, where onebitd's environment asks for them (AIP_MODE=PREDICTION).
        self.vertex = vertex
        self._extra: dict[str, dict[str, Endpoint]] = {}
        self._health_paths: tuple[str, ...] = ("/health", "/v1/health")
        if vertex is not None:
            self._extra[vertex.predict] = {"POST": Endpoint(Kind.PREDICT)}
            if vertex.health:
                self._extra[vertex.health] = {"GET": Endpoint(Kind.LOCAL)}
                self._health_paths += (vertex.health,)
        self._public = (*PUBLIC, *self._health_paths)
        self._aliases = aip.aliases(ROUTES)

    @property
    def server(self) -> ServerConfig:
        return self._server()

    # The default model's parts now (a model's parts are built afresh at each load).
    @property
    def decoder(self) -> Decoder:
        return self.router.default.decoder

    @property
    def client(self) -> DecoderClient:
        return self.router.default.client

    @property
    def completions(self) -> Completions:
        return self.router.default.completions

    def _access(self, server: ServerConfig) -> None:
        if server is not self._access_for:
            self._access_for = server
            self._keys = [key.encode() for key in server.api_keys]
            self._cors = Cors(server.cors_origins)

    # -- lifecycle ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`stop`; ``started`` with the bound addresses once listening."""
        # The daemon drains in-flight completions itself (up to server.shutdown_grace_s) before it
        # stops the front; what the server still waits for then is idle keep-alive connections.
        # A slow client may hold a stream for minutes; an idle keep-alive connection or a head that
        # never ends is closed after idle_timeout_s; a stalled body is bounded in _read_json.
        if self._http_server is None:
            self.bind()
        assert self._http_server is not None
        await self._http_server.run(task_status=task_status)

    def bind(self) -> None:
        """Bind ``server.host``:``server.port`` now; ListenError (naming the key) when it cannot be."""
        if self._http_server is None:
            self._http_server = HttpServer(
                self,
                hosts=self.server.host,
                port=self.server.port,
                idle_timeout_s=lambda: self.server.idle_timeout_s,
                write_timeout_s=lambda: self.server.write_timeout_s,
                body_timeout_s=lambda: self.server.body_timeout_s,
                shutdown=self._shutdown.wait,
            )
        self._http_server.bind()

    def unbind(self) -> None:
        """Close what :meth:`bind` bound if :meth:`run` never served on it."""
        if self._http_server is not None:
            self._http_server.close()

    async def wait_inflight_changed(self) -> None:
        if self._inflight_changed is None:
            self._inflight_changed = trio.Event()
        await self._inflight_changed.wait()

    def stop(self) -> None:
        """Stop accepting; the server lets in-flight requests finish within its grace period."""
        self._shutdown.set()

    async def wait_idle(self) -> None:
        while self.inflight:
            await self.wait_inflight_changed()

    def _changed(self) -> None:
        if self._inflight_changed is not None:
            self._inflight_changed.set()
            self._inflight_changed = None

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
        # supervisor/http/server.py sends only "http" scopes (no lifespan: the daemon starts and stops us).
        if scope["type"] == "http":
            await self._http(scope, receive, send)

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status and body: ``ok`` once the decoder is ready and every provider's first
        start is over (the first requests must not quietly take the plain route because a provider is
        still loading); the providers not ready are named."""
        if self.draining:
            return 503, {"status": "draining"}
        state = self.router.health_state()
        providers = self.providers()
        named = {"providers_not_ready": list(providers.not_ready)} if providers.not_ready else {}
        if state is ChildState.READY and providers.settled:
            return 200, {"status": "ok", **named}
        if state is ChildState.FAILED:
            return 503, {"status": "failed"}
        if state in (ChildState.STOPPING, ChildState.STOPPED) and self._shutdown.is_set():
            return 503, {"status": "stopping"}
        return 503, {"status": "loading", **named}

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        started = trio.current_time()
        method: str = scope["method"]
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self._access(self.server)
        out = Responder(send, started, self._cors.headers(headers.get("origin")), anthropic=speaks_anthropic(path))
        methods = self._extra.get(path) or lookup(path)
        routed = methods is not None and any(endpoint.routed for endpoint in methods.values())
        try:
            self._check_host(headers)
            if method == "OPTIONS":
                # A preflight carries no credentials: answered before the key check, as llama-server does.
                preflight = self._cors.preflight(headers.get("origin"), headers.get("access-control-request-headers"))
                await out.whole(200, b"", "text/plain", preflight)
                return
            self._check_caller(method, path, headers)
            if methods is None:
                raise ClientError(404, "not_found", f"no such endpoint: {path}")
            endpoint = methods.get("GET" if method == "HEAD" else method)
            if endpoint is None:
                allowed = [*methods, *(["HEAD"] if "GET" in methods else [])]
                self._allow(method, *allowed)
            assert endpoint is not None
            await self._dispatch(endpoint, method, path, scope, headers, receive, out)
        except ClientError as exc:
            if not out.started:
                await out.error(exc.status, exc.code, exc.message, retry_after=exc.retry_after)
            if routed:
                # Refused before _completion (caller, method, body): it logs its own line otherwise.
                self._refused(path, exc, out)
        except DecoderError as exc:
            if exc.public != exc.message:
                # The client is told words; the operator, what happened (a socket, an errno).
                log.info("%s %s: %s", method, path, exc.message)
            if not out.started:
                await out.error(exc.status, exc.code, exc.public, retry_after=self._retry_after(exc))

    async def _dispatch(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        scope: dict[str, Any],
        headers: dict[str, str],
        receive: Receive,
        out: Responder,
    ) -> None:
        if endpoint.kind is Kind.LOCAL:
            await self._local(path, out)
        elif endpoint.kind is Kind.REFUSED:
            await out.llama_error(501, "not_supported_error", endpoint.why)
        elif endpoint.kind is Kind.RELAY:
            if await self._slots_off(path, out):
                return
            query = scope.get("query_string", b"").decode("latin-1")
            if not _VISIBLE(query):
                raise ClientError(400, "bad_query", "the query string must be visible ASCII (percent-encode the rest)")
            target = f"{path}?{query}" if query else path
            body = await self._read_json(receive, headers) if method == "POST" else None
            asked = "GET" if method == "HEAD" else method
            if path in ("/v1/models", "/models") and self.router.several:
                await out.json(200, self.router.listing())  # every model, with its state
            elif endpoint.streamed:
                await self._relay_streamed(out, target, receive, _hang_up_of(scope))
            else:
                await self._pass_through(out, asked, target, body)
        elif endpoint.kind is Kind.PREDICT:
            self._check_draining()
            body = await self._read_json(receive, headers)
            await self._predict(body, receive, out, _hang_up_of(scope))
        else:
            self._check_draining()
            conversation = self._conversation(headers)
            body = await self._read_json(receive, headers)
            hang_up = _hang_up_of(scope) if conversation is None else None
            await self._completion(path, body, receive, out, endpoint, conversation, hang_up)

    def _check_draining(self) -> None:
        if self.draining:
            raise ClientError(
                503, "draining", "onebitd is draining: not taking new requests", retry_after=self.server.retry_after_s
            )

    async def _predict(self, body: dict[str, Any], receive: Receive, out: Responder, hang_up: HangUp | None) -> None:
        """Vertex AI's prediction: every instance at once, each through onebitd's table as a request
        of its own would go (a completion takes a slot and logs its route line), answered together."""
        try:
            instances = aip.instances_of(body)
        except aip.Refused as exc:
            await out.llama_error(400, "invalid_request_error", exc.message)
            return
        predictions: list[Any] = [None] * len(instances)
        async with self._hang_up_cancels(receive, hang_up), trio.open_nursery() as each:
            for index, instance in enumerate(instances):
                each.start_soon(self._predict_one, index, instance, predictions)
        await out.json(200, {"predictions": predictions})

    async def _predict_one(self, index: int, instance: Any, predictions: list[Any]) -> None:
        try:
            path, payload = aip.resolve(instance, self._aliases, ROUTES)
        except aip.Refused as exc:
            predictions[index] = aip.error(exc.message)
            return
        methods = ROUTES[path]
        method = "POST" if "POST" in methods else "GET"
        endpoint = methods[method]
        kept = Kept()
        sub = Responder(kept.send, trio.current_time())
        try:
            if endpoint.routed:
                await self._completion(path, payload, _never_gone, sub, endpoint)
            elif endpoint.kind is Kind.LOCAL:
                await self._local(path, sub)
            elif endpoint.kind is Kind.REFUSED:
                await sub.llama_error(501, "not_supported_error", endpoint.why)
            elif endpoint.kind is Kind.RELAY and not endpoint.streamed:
                if not await self._slots_off(path, sub):
                    await self._pass_through(sub, method, path, payload if method == "POST" else None)
            else:
                raise aip.Refused("predict route does not support streaming responses")
        except aip.Refused as exc:
            predictions[index] = aip.error(exc.message)
        except ClientError as exc:
            predictions[index] = aip.error(exc.message, code=exc.status)
        except DecoderError as exc:
            predictions[index] = aip.error(exc.public, code=exc.status, type_="server_error")
        else:
            predictions[index] = kept.prediction()

    async def _local(self, path: str, out: Responder) -> None:
        if path in self._health_paths:
            status, body = self.health()
            retry = [("Retry-After", str(self.server.retry_after_s))] if status != 200 else []
            await out.json(status, body, retry)
        elif path == "/metrics/decoder":
            await self._pass_through(out, "GET", "/metrics", None)
        elif self.metrics is None:
            raise ClientError(404, "not_found", f"no such endpoint: {path}")
        else:
            await out.whole(200, self.metrics() + await self._decoder_metrics(), METRICS_CONTENT_TYPE)

    async def _decoder_metrics(self) -> bytes:
        """The decoder's own metrics (llama-server's ``llamacpp:*`` names, from its ``--metrics``),
        appended to onebitd's, so that one scrape has both; nothing while it is not ready."""
        if self.decoder.state is not ChildState.READY:
            return b""
        with trio.move_on_after(DECODER_METRICS_TIMEOUT_S):
            try:
                reply = await self.client.request("GET", "/metrics")
            except DecoderError:
                return b""
            if reply.status == 200:
                return reply.body if reply.body.endswith(b"\n") or not reply.body else reply.body + b"\n"
        return b""

    async def _slots_off(self, path: str, out: Responder) -> bool:
        """``/slots`` while server.slots_endpoint is off: llama-server's --no-slots answer, in its
        words and shape; whether it was."""
        if path != "/slots" or self.server.slots_endpoint:
            return False
        await out.llama_error(
            501,
            "not_supported_error",
            "This server does not support slots endpoint: /slots shows every client's prompt; "
            "set server.slots_endpoint = true in onebit.toml to serve it (llama-server's --slots)",
        )
        return True

    def _refused(self, path: str, exc: ClientError, out: Responder) -> None:
        """A completion request refused before it began still gets its one route line."""
        line = RouteLine(req=f"{self._prefix}-{next(self._ids)}", endpoint=path, outcome="error", error=exc.message)
        line.status = out.status or exc.status
        line.first_byte_ms = out.first_byte_ms
        line.total_ms = out.elapsed_ms()
        self.emit(line)

    def _retry_after(self, exc: DecoderError) -> int | None:
        return self.server.retry_after_s if exc.status == 503 else None

    @staticmethod
    def _allow(method: str, *allowed: str) -> None:
        if method not in allowed:
            raise ClientError(405, "method_not_allowed", f"{method} is not allowed here; use {', '.join(allowed)}")

    def _check_host(self, headers: dict[str, str]) -> None:
        if self._loopback_only:
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 still sends its own Host.
            host = host_of(headers.get("host", ""))
            if host and not is_loopback(host):
                raise ClientError(403, "forbidden_host", f"Host {host!r} is not allowed on a loopback bind")

    def _check_caller(self, method: str, path: str, headers: dict[str, str]) -> None:
        origin = headers.get("origin")
        if method not in ("GET", "HEAD") and origin and not self._cors.allows(origin):
            # A browser sends a "simple" POST cross-site without asking first: CORS would only hide
            # the answer from the page, not stop the request.
            raise ClientError(403, "cross_origin", f"cross-site request from {origin!r} refused (server.cors_origins)")
        if self._keys and path not in self._public:
            # llama-server takes the key from Authorization (Bearer optional), else X-Api-Key.
            given = headers.get("authorization") or headers.get("x-api-key", "")
            token = (given[7:] if given[:7].lower() == "bearer " else given).strip().encode()
            # Compare against every key, so the time taken does not say which one nearly matched.
            matched = False
            for key in self._keys:
                matched |= hmac.compare_digest(token, key)
            if not matched:
                raise ClientError(
                    401, "invalid_api_key", "missing or wrong API key (Authorization: Bearer ..., or X-Api-Key)"
                )

    async def _read_json(self, receive: Receive, headers: dict[str, str]) -> dict[str, Any]:
        server = self.server
        limit = server.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ClientError(413, "body_too_large", f"request body over server.max_body_bytes ({limit})")
        chunks: list[bytes] = []
        size = 0
        # A body that stops coming: the server's receive() raises 408 past server.body_timeout_s.
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
        except RecursionError:
            # json's C decoder recurses once per nesting level: a body of 100,000 "[" would raise
            # RecursionError through us (a 500) without this.
            raise ClientError(400, "bad_json", "request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise ClientError(400, "bad_json", "request body must be a JSON object")
        return body

    async def _pass_through(self, out: Responder, method: str, path: str, body: Any) -> None:
        """Relayed to the model the body names (the default one without a body, or a name)."""
        asked = body.get("model") if isinstance(body, dict) else None
        # A relay that names no model (a GET: /props, /slots, a monitor's poll) loads none.
        async with self.router.use(asked, any_loaded=asked is None) as served:
            served.completions.check_ready()
            reply = await served.client.request(method, path, body)
        await relay_reply(out, reply.status, reply.headers, reply.body)

    async def _relay_streamed(self, out: Responder, path: str, receive: Receive, hang_up: HangUp | None) -> None:
        """A GET whose answer comes as it is made (a stream session's replay, which waits for the
        live bytes until the session ends): relayed chunk by chunk; a client that hangs up closes
        the decoder's request, which ends the decoder's reading for it."""
        self.completions.check_ready()
        async with (
            self._hang_up_cancels(receive, hang_up),
            self.client.stream(path, None, method="GET") as upstream,
        ):
            if upstream.status != 200:
                body = b"".join([chunk async for chunk in upstream.chunks])
                await relay_reply(out, upstream.status, upstream.headers, body)
            else:
                await out.start(200, SSE_HEADERS, source="decoder")
                try:
                    async for chunk in upstream.chunks:
                        await out.body(chunk, more=True)
                except DecoderError as exc:
                    log.warning("%s: the decoder stopped mid-replay: %s", path, exc.message)
                    await out.body(sse_error(f"the decoder stopped mid-stream ({exc.public})"), more=True)
                await out.body(b"", more=False)

    @asynccontextmanager
    async def _hang_up_cancels(self, receive: Receive, hang_up: HangUp | None) -> AsyncIterator[None]:
        """The block in a scope that the client's hang-up cancels: told by the server where it can
        (``hang_up``, no task; ``_completion`` does the same inline, with its own rule), else found
        by a task reading ``receive``.  A body the block never read is the server's to drop."""
        if hang_up is not None:
            with trio.CancelScope() as scope:

                def on_gone(why: str) -> None:
                    scope.cancel()

                hang_up.watch(on_gone)
                try:
                    yield
                finally:
                    hang_up.unwatch(on_gone)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._cancel_on_hang_up, receive, nursery.cancel_scope)
            yield
            nursery.cancel_scope.cancel()

    @staticmethod
    async def _cancel_on_hang_up(receive: Receive, scope: trio.CancelScope) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except ClientError:
            pass  # a body that broke off (malformed, or past server.body_timeout_s): the client is gone too
        scope.cancel()

    @staticmethod
    def _conversation(headers: dict[str, str]) -> str | None:
        """The client's ``X-Conversation-Id``, to pass on; None without one."""
        value = headers.get(CONVERSATION_HEADER.lower())
        if value is None or not value.strip():
            return None
        value = value.strip()
        if not _VISIBLE(value.replace(" ", "!")):
            raise ClientError(400, "bad_conversation_id", f"{CONVERSATION_HEADER} must be visible ASCII")
        return value

    # -- a completion request, in its own cancel scope ----------------------------------------------

    async def _completion(
        self,
        path: str,
        body: dict[str, Any],
        receive: Receive,
        out: Responder,
        endpoint: Endpoint,
        conversation: str | None = None,
        hang_up: HangUp | None = None,
    ) -> None:
        """Served in a cancel scope that a hang-up cancels.  The server tells a hang-up itself
        (``hang_up``, :class:`~supervisor.http.server.HangUp`) to a request without a conversation id;
        one with an id, which may go on detached, has a task that waits on ``receive``."""
        req = f"{self._prefix}-{next(self._ids)}"
        line = RouteLine(req=req, endpoint=path)
        # Its age and its times count from its arrival, as its first byte's does (out.started_at).
        self.inflight[req] = InflightRequest(req, path, out.started_at, time.time(), line)
        self._changed()
        gone: list[str] = []  # a hang-up, with the server's reason where it gave one
        detached: list[bool] = []  # the hang-up left the stream to finish into its session
        passed = [(CONVERSATION_HEADER, conversation)] if conversation else []
        try:
            if hang_up is not None:
                with trio.CancelScope() as scope:

                    def on_gone(why: str) -> None:
                        gone.append(why)
                        if not out.complete:
                            scope.cancel()

                    hang_up.watch(on_gone)
                    try:
                        await self._serve(body, out, line, endpoint, passed, None)
                    finally:
                        hang_up.unwatch(on_gone)
            else:
                async with trio.open_nursery() as nursery:
                    watch = Watch(nursery.cancel_scope, gone, detached, conversation, line, self.client)
                    nursery.start_soon(self._watch_disconnect, receive, watch, out)
                    await self._serve(body, out, line, endpoint, passed, watch)
                    nursery.cancel_scope.cancel()
        finally:
            # A disconnect is reported after a finished response too, and a client may close once it
            # has a stream's final event: neither is a cancellation.
            if detached:
                if line.outcome == "ok":
                    line.outcome = "detached"
            elif gone and not out.complete:
                line.outcome = "cancelled"
                if gone[0]:
                    line.error = gone[0]
            line.status = out.status or 499  # 499: the client closed before any answer (nginx's code)
            line.first_byte_ms = out.first_byte_ms
            line.total_ms = out.elapsed_ms()
            del self.inflight[req]
            self._changed()
            self.emit(line)

    async def _serve(
        self,
        body: dict[str, Any],
        out: Responder,
        line: RouteLine,
        endpoint: Endpoint,
        passed: list[tuple[str, str]],
        watch: Watch | None,
    ) -> None:
        try:
            async with self.router.use(body.get("model"), line) as served:
                if watch is not None:
                    watch.client = served.client
                if endpoint.kind is Kind.COMPLETION:
                    await served.completions.serve(endpoint.canonical, body, out, line, passed)
                else:
                    await served.completions.relay(endpoint.canonical, body, out, line, passed, pinned=endpoint.pinned)
        except ClientError as exc:
            line.outcome, line.error = "error", exc.message
            await out.error(exc.status, exc.code, exc.message, retry_after=exc.retry_after)
        except DecoderError as exc:
            line.outcome, line.error = "error", exc.message
            if not out.started:
                await out.error(exc.status, exc.code, exc.public, retry_after=self._retry_after(exc))
        except OnebitError as exc:
            line.outcome, line.error = "error", str(exc)
            if not out.started:
                await out.error(500, "internal", str(exc))

    def emit(self, line: RouteLine) -> None:
        route_log.info(line.logfmt(), extra={"route_fields": line.fields()})
        if self._emit_hook is not None:
            self._emit_hook(line)

    async def _watch_disconnect(self, receive: Receive, watch: Watch, out: Responder) -> None:
        """A client that hangs up cancels its request, but only while the response is incomplete:
        the server reports a disconnect after every finished response too, a client may close once
        it has a stream's final event, and what the request does after that (the rest of the
        relay, verification, bookkeeping) is the server's work, not the client's.  A client that
        took nothing for ``server.write_timeout_s`` is reported the same way, with why.

        A stream with a conversation id whose decoder reply has begun is left to run instead: the
        decoder goes on into the conversation's session whatever onebitd does (llama-server's
        server-stream.cpp), so its slot stays busy; the relay reads on, to the end, and holds
        onebitd's slot until then, for at most ``server.detach_timeout_s``.  Past that the stream is
        stopped as a client's ``DELETE /v1/stream`` stops it, and the request cancelled (the slot
        then settles as after any hang-up).  Before the reply began llama-server itself drops a
        request whose client left, and so does onebitd."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                watch.gone.append(message.get("reason", ""))
                if out.complete:
                    return
                if watch.conversation is None or not out.streaming:
                    watch.scope.cancel()
                    return
                watch.detached.append(True)
                break
        timeout = self.server.detach_timeout_s
        await trio.sleep(timeout)
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_TIMEOUT_S):
            try:
                await watch.client.request("DELETE", f"/v1/stream?conv_id={quote(watch.conversation, safe='')}")
            except DecoderError as exc:
                log.warning("%s: stopping its detached stream failed: %s", watch.line.req, exc.message)
        watch.line.error = f"the detached stream ran past server.detach_timeout_s ({timeout:g}s); stopped"
        watch.scope.cancel()

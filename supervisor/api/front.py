"""The HTTP front: an ASGI app, served by onebitd's own HTTP/1.1 server (supervisor/http/server.py).

It admits a request (supervisor/api/access.py: Host, Origin, API key, body), finds who answers its
path (supervisor/api/endpoints.py) and dispatches it: local answers to supervisor/api/local.py, a
relayed path to supervisor/api/relayed.py, Vertex AI's prediction route (where onebitd's environment
asks for it) to supervisor/api/predict.py, and a completion to supervisor/api/lifecycle.py, which
runs it to its route line.  The requests in flight and the drain are supervisor/api/inflight.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from ..config import ServerConfig, source
from ..errors import ClientError, DecoderError
from ..http import wire
from ..http.respond import Receive, Responder, Send, speaks_anthropic
from ..http.server import HttpServer
from ..routeline import RouteLine
from . import access, hangup, relayed, statuspage
from .access import Access
from .endpoints import Endpoint, Kind, lookup, page_name, public, vertex_endpoints
from .inflight import Inflight, InflightRequest
from .lifecycle import Lifecycle, answer_error
from .local import Answers, ProviderReadiness
from .predict import Predict
from .serving import One, Router, Served
from .vertex import Vertex

__all__ = ["Front", "InflightRequest", "One", "ProviderReadiness", "Router", "Served"]

log = logging.getLogger("onebit.front")


class Front:
    """The ASGI app: admits, finds the endpoint, dispatches; serves on its own HTTP server."""

    def __init__(
        self,
        server: ServerConfig | Callable[[], ServerConfig],
        models: Router,
        *,
        emit: Callable[[RouteLine], None] | None = None,
        metrics: Callable[[], bytes] | None = None,
        providers: Callable[[], ProviderReadiness] = ProviderReadiness,
        vertex: Vertex | None = None,
    ) -> None:
        """``server``: the settings, or where to read them at each request (the daemon's one config,
        swapped whole by a reload; the bind address and port are read once, by :meth:`bind`).
        ``models``: which model serves a request (the daemon's; :class:`One` for one model)."""
        self._server = source(server)
        self.router = models
        self._shutdown = trio.Event()
        self.registry = Inflight()
        self.lifecycle = Lifecycle(models, self.registry, self._server, emit)
        self.completion = self.lifecycle.serve  # a completion request, run to its route line
        self._access = Access(self._server())
        self._http_server: HttpServer | None = None
        self.answers = Answers(models, providers, metrics, self._server)
        self.predict = Predict(self)
        self.page: statuspage.StatusPage | None = None  # /onebit/, the daemon's; None: those paths are 404
        self._extra = vertex_endpoints(vertex)

    @property
    def server(self) -> ServerConfig:
        return self._server()

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`stop`; ``started`` with the bound addresses once listening."""
        # The daemon drains in-flight completions itself (server.shutdown_grace_s) before it stops the
        # front; the server then closes idle keep-alive connections (idle_timeout_s, body_timeout_s).
        if self._http_server is None:
            self.bind()
        assert self._http_server is not None
        await self._http_server.run(task_status=task_status)

    def bind(self) -> None:
        """Bind ``server.host``:``server.port`` now; ListenError (naming the key) when it cannot be."""
        if self._http_server is None:
            live = self._server
            self._http_server = HttpServer(
                self,
                hosts=live().host,
                port=live().port,
                idle_timeout_s=lambda: live().idle_timeout_s,
                write_timeout_s=lambda: live().write_timeout_s,
                body_timeout_s=lambda: live().body_timeout_s,
                shutdown=self._shutdown.wait,
            )
        self._http_server.bind()

    def unbind(self) -> None:
        """Close what :meth:`bind` bound if :meth:`run` never served on it."""
        if self._http_server is not None:
            self._http_server.close()

    def stop(self) -> None:
        """Stop accepting; the server lets in-flight requests finish within its grace period."""
        self._shutdown.set()

    @property
    def draining(self) -> bool:
        """Refusing new completions (``registry.drain()``); those in flight go on."""
        return self.registry.draining

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status and body (supervisor/api/local.py's :func:`~supervisor.api.local.health`)."""
        return self.answers.health(draining=self.draining, stopping=self._shutdown.is_set())

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        # supervisor/http/server.py sends only "http" scopes (no lifespan: the daemon starts and stops us).
        if scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        started = trio.current_time()
        method: str = scope["method"]
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self._access.update(self.server)
        if (name := page_name(path)) is not None:  # /onebit/: the API's Host and key rules, no CORS
            await statuspage.serve(self.page, self._access, name, scope, headers, send, started, self._shutdown.wait)
            return
        cors = self._access.cors
        out = Responder(send, started, cors.headers(headers.get("origin")), anthropic=speaks_anthropic(path))
        methods = self._extra.get(path) or lookup(path)
        routed = methods is not None and any(endpoint.routed for endpoint in methods.values())
        try:
            self._access.check_host(headers)
            if method == "OPTIONS":
                # A preflight carries no credentials: answered before the key check, as llama-server does.
                preflight = cors.preflight(headers.get("origin"), headers.get("access-control-request-headers"))
                await out.whole(200, b"", "text/plain", preflight)
                return
            self._access.check_caller(method, public(methods), headers)
            if methods is None:
                raise ClientError(404, "not_found", f"no such endpoint: {path}")
            endpoint = methods.get("GET" if method == "HEAD" else method)
            if endpoint is None:
                access.check_method(method, *methods, *(["HEAD"] if "GET" in methods else []))
            assert endpoint is not None
            await self._dispatch(endpoint, method, path, scope, headers, receive, out)
        except (ClientError, DecoderError) as exc:
            words = await answer_error(exc, out, self.server.retry_after_s)
            if isinstance(exc, DecoderError) and exc.public != exc.message:
                # The client is told words; the operator, what happened (a socket, an errno).
                log.info("%s %s: %s", method, path, exc.message)
            if isinstance(exc, ClientError) and routed:
                # Refused before the completion's life began (caller, method, body): it logs its own line otherwise.
                self.lifecycle.refused(path, out, exc.status, words)

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
            await self.local(endpoint, out)
        elif endpoint.kind is Kind.REFUSED:
            await out.llama_error(501, "not_supported_error", endpoint.why)
        elif endpoint.kind is Kind.RELAY:
            if await self.answers.slots_off(endpoint, out):
                return
            target = access.target(path, scope.get("query_string", b""))
            body = await access.read_json(receive, headers, self.server.max_body_bytes) if method == "POST" else None
            if await self.answers.listed(endpoint, out):
                return
            if endpoint.streamed:
                await relayed.relay_streamed(self.router, out, target, receive, hangup.hang_up_of(scope))
            else:
                forwarded = relayed.proxy_headers(headers) if endpoint.proxied else []
                await self.pass_through(out, "GET" if method == "HEAD" else method, target, body, forwarded)
        elif endpoint.kind is Kind.PREDICT:
            self.registry.check_open(self.server.retry_after_s)
            body = await access.read_json(receive, headers, self.server.max_body_bytes)
            await self.predict(body, out, hangup.hang_up_cancels(receive, hangup.hang_up_of(scope)))
        else:
            self.registry.check_open(self.server.retry_after_s)
            conversation = hangup.conversation(headers)
            body = await access.read_json(receive, headers, self.server.max_body_bytes)
            hang_up = hangup.hang_up_of(scope) if conversation is None else None
            await self.lifecycle.serve(path, body, receive, out, endpoint, conversation, hang_up)

    async def local(self, endpoint: Endpoint, out: Responder) -> None:
        await self.answers.answer(endpoint, out, draining=self.draining, stopping=self._shutdown.is_set())

    async def slots_off(self, endpoint: Endpoint, out: Responder) -> bool:
        return await self.answers.slots_off(endpoint, out)

    async def pass_through(self, out: Responder, method: str, path: str, body: Any, headers: wire.Headers = ()) -> None:
        await relayed.pass_through(self.router, out, method, path, body, headers)

"""The HTTP front: an ASGI app, served by onebitd's own HTTP/1.1 server (supervisor/http/server.py).

It admits a request (supervisor/api/access.py: Host, Origin, API key, body), finds who answers its
path (supervisor/api/endpoints.py), turns errors into answers, and runs every completion request in
its own cancel scope that the client's hang-up cancels (supervisor/api/hangup.py, which also keeps
a stream sent with ``X-Conversation-Id`` going, ``outcome=detached``).  Exactly one route line is
logged per completion request, whatever happened, built by the request's story
(supervisor/routes/story.py) and logged by :meth:`Front._end`.  Local answers are
supervisor/api/local.py's; Vertex AI's prediction route, where onebitd's environment asks for it,
supervisor/api/predict.py's.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio

from ..config import ServerConfig, source
from ..errors import ClientError, DecoderError, OnebitError
from ..http import wire
from ..http.respond import Receive, Responder, Send, speaks_anthropic
from ..http.server import HangUp, HttpServer
from ..observe.logs import ROUTE_LOGGER
from ..observe.status import FrontStatistics, InflightStatistics
from ..routeline import RouteLine
from ..routes.story import Story
from . import access, hangup, relayed, statuspage
from .access import Access
from .endpoints import Endpoint, Kind, Local, local_endpoint, lookup, page_name, public
from .hangup import CONVERSATION_HEADER, Watch
from .local import Answers, ProviderReadiness
from .predict import Predict
from .serving import One, Router, Served
from .vertex import Vertex

__all__ = ["Front", "InflightRequest", "One", "ProviderReadiness", "Router", "Served"]

log = logging.getLogger("onebit.front")
route_log = logging.getLogger(ROUTE_LOGGER)


@attrs.frozen
class InflightRequest:
    req: str
    endpoint: str
    started: float  # trio clock
    wall_started: float
    story: Story  # told as the request goes: its route so far

    def statistics(self, now: float) -> InflightStatistics:
        return InflightStatistics(
            req=self.req,
            endpoint=self.endpoint,
            route=self.story.route,
            slot=self.story.slot,
            age_s=round(now - self.started, 3),
        )


class Front:
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
        self._emit_hook = emit
        self._shutdown = trio.Event()
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}"
        self.inflight: dict[str, InflightRequest] = {}
        self._inflight_changed: trio.Event | None = None  # made by the first waiter: most requests have none
        self._draining = False
        self._access = Access(self._server())
        self._http_server: HttpServer | None = None
        self.answers = Answers(models, providers, metrics, self._server)
        self.predict = Predict(self)
        self.page: statuspage.StatusPage | None = None  # /onebit/, the daemon's; None: those paths are 404
        # Vertex AI's routes, where onebitd's environment asks for them (AIP_MODE=PREDICTION).
        self._extra: dict[str, dict[str, Endpoint]] = {}
        if vertex is not None:
            self._extra[vertex.predict] = {"POST": Endpoint(Kind.PREDICT)}
            if vertex.health:
                self._extra[vertex.health] = {"GET": local_endpoint(Local.HEALTH)}

    @property
    def server(self) -> ServerConfig:
        return self._server()

    # -- lifecycle ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`stop`; ``started`` with the bound addresses once listening."""
        # The daemon drains in-flight completions itself (up to server.shutdown_grace_s) before it
        # stops the front; what the server still waits for then is idle keep-alive connections.
        # A slow client may hold a stream for minutes; an idle keep-alive connection or a head that
        # never ends is closed after idle_timeout_s; a stalled body, after body_timeout_s.
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

    # -- draining and what is in flight -------------------------------------------------------------

    async def wait_inflight_changed(self) -> None:
        if self._inflight_changed is None:
            self._inflight_changed = trio.Event()
        await self._inflight_changed.wait()

    async def wait_idle(self) -> None:
        while self.inflight:
            await self.wait_inflight_changed()

    def _changed(self) -> None:
        if self._inflight_changed is not None:
            self._inflight_changed.set()
            self._inflight_changed = None

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

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status and body (supervisor/api/local.py's :func:`~supervisor.api.local.health`)."""
        return self.answers.health(draining=self._draining, stopping=self._shutdown.is_set())

    # -- ASGI ---------------------------------------------------------------------------------------

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
        except ClientError as exc:
            if not out.started:
                await out.error(exc.status, exc.code, exc.message, retry_after=exc.retry_after)
            if routed:
                # Refused before _completion (caller, method, body): it logs its own line otherwise.
                story = Story(self._req(), path)
                story.failed(exc.message)
                self._end(story, out, exc.status)
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
            await self.local(endpoint, out)
        elif endpoint.kind is Kind.REFUSED:
            await out.llama_error(501, "not_supported_error", endpoint.why)
        elif endpoint.kind is Kind.RELAY:
            if await self.answers.slots_off(endpoint, out):
                return
            target = access.target(path, scope.get("query_string", b""))
            body = await self._read_json(receive, headers) if method == "POST" else None
            if await self.answers.listed(endpoint, out):
                return
            if endpoint.streamed:
                await relayed.relay_streamed(self.router, out, target, receive, hangup.hang_up_of(scope))
            else:
                forwarded = relayed.proxy_headers(headers) if endpoint.proxied else []
                await self.pass_through(out, "GET" if method == "HEAD" else method, target, body, forwarded)
        elif endpoint.kind is Kind.PREDICT:
            self._check_draining()
            body = await self._read_json(receive, headers)
            await self.predict(body, out, hangup.hang_up_cancels(receive, hangup.hang_up_of(scope)))
        else:
            self._check_draining()
            conversation = hangup.conversation(headers)
            body = await self._read_json(receive, headers)
            hang_up = hangup.hang_up_of(scope) if conversation is None else None
            await self.completion(path, body, receive, out, endpoint, conversation, hang_up)

    def _check_draining(self) -> None:
        if self.draining:
            raise ClientError(
                503, "draining", "onebitd is draining: not taking new requests", retry_after=self.server.retry_after_s
            )

    def _retry_after(self, exc: DecoderError) -> int | None:
        return self.server.retry_after_s if exc.status == 503 else None

    async def _read_json(self, receive: Receive, headers: dict[str, str]) -> dict[str, Any]:
        return await access.read_json(receive, headers, self.server.max_body_bytes)

    # -- what predict.Serves asks for, besides completion -------------------------------------------

    async def local(self, endpoint: Endpoint, out: Responder) -> None:
        await self.answers.answer(endpoint, out, draining=self._draining, stopping=self._shutdown.is_set())

    async def slots_off(self, endpoint: Endpoint, out: Responder) -> bool:
        return await self.answers.slots_off(endpoint, out)

    async def pass_through(self, out: Responder, method: str, path: str, body: Any, headers: wire.Headers = ()) -> None:
        await relayed.pass_through(self.router, out, method, path, body, headers)

    # -- a completion request, in its own cancel scope ----------------------------------------------

    async def completion(
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
        req = self._req()
        story = Story(req, path)
        # Its age and its times count from its arrival, as its first byte's does (out.started_at).
        self.inflight[req] = InflightRequest(req, path, out.started_at, time.time(), story)
        self._changed()
        gone: list[str] = []  # a hang-up, with the server's reason where it gave one
        detached: list[bool] = []  # the hang-up left the stream to finish into its session
        passed = [(CONVERSATION_HEADER, conversation)] if conversation else []
        watch: Watch | None = None

        def cancels(why: str) -> bool:
            gone.append(why)
            return not out.complete

        try:
            if hang_up is not None:
                with hangup.told_by_server(hang_up, cancels):
                    await self._serve(body, out, story, endpoint, passed, None)
            else:
                async with trio.open_nursery() as nursery:
                    client = self.router.default.client
                    watch = Watch(nursery.cancel_scope, gone, detached, conversation, req, client, self._server)
                    nursery.start_soon(hangup.watch_disconnect, receive, watch, out)
                    await self._serve(body, out, story, endpoint, passed, watch)
                    nursery.cancel_scope.cancel()
        finally:
            # A disconnect is reported after a finished response too, and a client may close once it
            # has a stream's final event: neither is a cancellation.
            if watch is not None and watch.stopped is not None:
                story.stopped(watch.stopped)
            story.left(detached=bool(detached), why=gone[0] if gone and not out.complete else None)
            del self.inflight[req]
            self._changed()
            self._end(story, out, 499)  # 499: the client closed before any answer (nginx's code)

    async def _serve(
        self,
        body: dict[str, Any],
        out: Responder,
        story: Story,
        endpoint: Endpoint,
        passed: list[tuple[str, str]],
        watch: Watch | None,
    ) -> None:
        hold = self.router.use(body.get("model"))
        try:
            async with hold as served:
                if watch is not None:
                    watch.client = served.client
                await self._run(served, body, out, story, endpoint, passed)
        except ClientError as exc:
            story.failed(exc.message)
            await out.error(exc.status, exc.code, exc.message, retry_after=exc.retry_after)
        except DecoderError as exc:
            story.failed(exc.message)
            if not out.started:
                await out.error(exc.status, exc.code, exc.public, retry_after=self._retry_after(exc))
        except OnebitError as exc:
            story.failed(str(exc))
            if not out.started:
                await out.error(500, "internal", str(exc))
        finally:
            story.held(hold.model, hold.load_ms)

    @staticmethod
    async def _run(
        served: Served,
        body: dict[str, Any],
        out: Responder,
        story: Story,
        endpoint: Endpoint,
        passed: list[tuple[str, str]],
    ) -> None:
        if endpoint.kind is Kind.COMPLETION:
            await served.completions.serve(endpoint.canonical, body, out, story, passed)
        else:
            completions = served.completions
            await completions.relay(
                endpoint.canonical, body, out, story, passed, pinned=endpoint.pinned, generates=endpoint.generates
            )

    # -- the route line -----------------------------------------------------------------------------

    def _req(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _end(self, story: Story, out: Responder, status: int) -> None:
        """The end of a request: its status (``status`` where none was sent), its times, its line."""
        self.emit(story.line(status=out.status or status, first_byte_ms=out.first_byte_ms, total_ms=out.elapsed_ms()))

    def emit(self, line: RouteLine) -> None:
        route_log.info(line.logfmt(), extra={"route_fields": line.fields()})
        if self._emit_hook is not None:
            self._emit_hook(line)

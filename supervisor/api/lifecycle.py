"""A completion request's life at the front: its id, its place among those in flight, a cancel scope
its client's hang-up cancels (supervisor/api/hangup.py, which also keeps a stream sent with
``X-Conversation-Id`` going, ``outcome=detached``), its model held (the registry), its errors answered
(:func:`answer_error`, the front's one error mapper), and exactly one route line at its end, whatever
happened, built by its story (supervisor/routes/story.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import trio

from ..config import ServerConfig
from ..errors import ClientError, DecoderError, OnebitError
from ..http import wire
from ..http.respond import Receive, Responder
from ..http.server import HangUp
from ..observe.logs import ROUTE_LOGGER
from ..routeline import RouteLine
from ..routes.story import Story
from . import hangup
from .endpoints import Endpoint, Kind
from .hangup import CONVERSATION_HEADER, Watch
from .inflight import Inflight, InflightRequest
from .serving import Router, Served

route_log = logging.getLogger(ROUTE_LOGGER)


async def answer_error(exc: OnebitError, out: Responder, retry_after_s: int) -> str:
    """The client's answer to ``exc`` where its response has not begun (the client's own error, the
    decoder's in public words, or onebitd's 500), and the words the route line and the log keep."""
    if isinstance(exc, ClientError):
        status, code, public, retry_after, words = exc.status, exc.code, exc.message, exc.retry_after, exc.message
    elif isinstance(exc, DecoderError):
        retry_after = retry_after_s if exc.status == 503 else None
        status, code, public, words = exc.status, exc.code, exc.public, exc.message
    else:
        status, code, public, retry_after, words = 500, "internal", str(exc), None, str(exc)
    if not out.started:
        await out.error(status, code, public, retry_after=retry_after)
    return words


class Lifecycle:
    """The completion requests' lives, each from its arrival to its route line."""

    def __init__(
        self,
        router: Router,
        inflight: Inflight,
        server: Callable[[], ServerConfig],
        emit: Callable[[RouteLine], None] | None,
    ) -> None:
        self.router = router
        self.inflight = inflight
        self._server = server
        self._emit_hook = emit
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}"

    def req(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def serve(
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
        req = self.req()
        story = Story(req, path)
        # Its age and its times count from its arrival, as its first byte's does (out.started_at).
        self.inflight.add(InflightRequest(req, path, out.started_at, time.time(), story))
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
            self.inflight.remove(req)
            self.end(story, out, 499)  # 499: the client closed before any answer (nginx's code)

    async def _serve(
        self,
        body: dict[str, Any],
        out: Responder,
        story: Story,
        endpoint: Endpoint,
        passed: wire.Headers,
        watch: Watch | None,
    ) -> None:
        hold = self.router.use(body.get("model"))
        try:
            async with hold as served:
                if watch is not None:
                    watch.client = served.client
                await _run(served, body, out, story, endpoint, passed)
        except OnebitError as exc:
            story.failed(await answer_error(exc, out, self._server().retry_after_s))
        finally:
            story.held(hold.model, hold.load_ms)

    def refused(self, path: str, out: Responder, status: int, words: str) -> None:
        """The route line of a completion request refused before it was served (caller, method, body)."""
        story = Story(self.req(), path)
        story.failed(words)
        self.end(story, out, status)

    def end(self, story: Story, out: Responder, status: int) -> None:
        """The end of a request: its status (``status`` where none was sent), its times, its line."""
        line = story.line(status=out.status or status, first_byte_ms=out.first_byte_ms, total_ms=out.elapsed_ms())
        route_log.info(line.logfmt(), extra={"route_fields": line.fields()})
        if self._emit_hook is not None:
            self._emit_hook(line)


async def _run(
    served: Served,
    body: dict[str, Any],
    out: Responder,
    story: Story,
    endpoint: Endpoint,
    passed: wire.Headers,
) -> None:
    if endpoint.kind is Kind.COMPLETION:
        await served.completions.serve(endpoint.canonical, body, out, story, passed)
    else:
        completions = served.completions
        await completions.relay(
            endpoint.canonical, body, out, story, passed, pinned=endpoint.pinned, generates=endpoint.generates
        )

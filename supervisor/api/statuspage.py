"""The status page: ``/onebit/`` and what it reads, served by the front on the API's own port.

- ``GET /onebit/`` (and ``/onebit``), ``/onebit/page.css``, ``/onebit/page.js``: the page, files of this package
  (supervisor/api/page/), fetched from nowhere else, so it works offline.  With ``server.admin_keys``
  set they are answered to anyone without a key: the page asks for one and sends it on every fetch.
- ``GET /onebit/status``: exactly what ``onebitctl status --json`` prints (the ``status`` verb's result).
- ``GET /onebit/events``: server-sent events of the daemon's feed, the one ``onebitctl watch`` reads
  (supervisor/observe/routestats.py): ``hello`` first (the last route lines, ``recent``), then
  ``line`` (a route line's fields), ``child`` and ``model`` (transitions).  Each
  reader has a bounded channel of its own; one that falls :data:`FEED_BOUND` events behind is
  dropped at once (its response cut short), so a slow reader slows nothing and holds no memory
  without limit.  At most :data:`MAX_FEEDS` are open at a time, :data:`MAX_CLIENT_FEEDS` of them
  one client's (its key, else its address: supervisor/api/access.py).

Who may read any of it is the operator's rule (supervisor/api/access.py, ``check_operator``):
loopback clients, or with ``server.admin_keys`` a request bearing one.  Every answer under
``/onebit/`` carries :data:`HEADERS` (a Content-Security-Policy that lets the page load only its
own files and talk only to onebitd) and no CORS header: the front leaves CORS out for these paths
whatever ``server.cors_origins`` allows.  The page never shows a prompt's or a reply's text: none
is in what it reads (a route line's ``error`` comes through supervisor/observe/redact.py).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import suppress
from importlib import resources
from typing import Any

import trio

from ..errors import ClientError
from ..http.respond import Responder, Send
from ..http.server import HangUp
from ..observe.routestats import Event, RouteStats
from .access import Access, check_method
from .endpoints import PAGE
from .hangup import hang_up_of

# The page's own files and their types; nothing else is served from its folder.
ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "page.css": ("page.css", "text/css; charset=utf-8"),
    "page.js": ("page.js", "text/javascript; charset=utf-8"),
}
DATA = ("status", "events")  # what the page reads; the API key's, where one is set
# On every answer under /onebit/: the page runs only its own script (no inline one), loads only
# its own files, talks only to onebitd, and is never framed.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
HEADERS = [
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
]
# A feed reader may fall this many events behind before it is dropped: a route line is ~700 bytes
# of JSON, so at most ~180 kB waits per reader, and a browser tab in the background (which still
# reads its fetch streams) stays well inside it.
FEED_BOUND = 256
# Feeds open at once: each is a task and a channel; a page holds one.
MAX_FEEDS = 32
# Feeds one client may hold, so that one cannot take them all: a tab holds one, and a few tabs or
# a reconnect that overlaps its predecessor's end fit in it.
MAX_CLIENT_FEEDS = 4
# A comment line on an idle feed, so a reader that went away is noticed by the write that fails,
# and a proxy between does not time an idle stream out.
HEARTBEAT_S = 15.0


def asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("page", name).read_bytes()


def sse(event: Event) -> bytes:
    """One event of the feed, as server-sent events frame it: its kind, and its JSON on one line."""
    return f"event: {event['event']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


class StatusPage:
    """``status``: the status verb's result now; ``events``: the daemon's feed."""

    def __init__(self, status: Callable[[], dict[str, Any]], events: RouteStats) -> None:
        self.status = status
        self.events = events
        self.feeds = 0
        self.client_feeds: Counter[str] = Counter()  # feeds open per client (access.py's who)

    @staticmethod
    def is_data(name: str) -> bool:
        """What the page reads, not the page's own files: these may need a key where they do not."""
        return name in DATA

    async def answer(
        self,
        method: str,
        name: str,
        out: Responder,
        hang_up: HangUp | None,
        stopping: Callable[[], Awaitable[None]],
        client: str,
    ) -> None:
        """``name``: the path under /onebit/ (supervisor/api/endpoints.py's ``page_name``);
        ``stopping`` returns when the front stops (an open feed ends then); ``client``: who asks
        (supervisor/api/access.py's ``check_operator``)."""
        if name not in ASSETS and name not in DATA:
            raise ClientError(404, "not_found", f"no such endpoint: {PAGE}{name}")
        check_method(method, "GET", "HEAD")
        if name == "status":
            await out.json(200, self.status())
        elif name == "events" and method == "HEAD":
            await out.whole(200, b"", "text/event-stream")  # its head only: a feed has no end to wait for
        elif name == "events":
            await self.feed(out, hang_up, stopping, client)
        else:
            file, content_type = ASSETS[name]
            await out.whole(200, asset(file), content_type)

    async def feed(
        self, out: Responder, hang_up: HangUp | None, stopping: Callable[[], Awaitable[None]], client: str
    ) -> None:
        """Until the reader goes, falls behind (cut short: the server closes the connection), or the
        front stops (ended)."""
        if self.client_feeds[client] >= MAX_CLIENT_FEEDS:
            raise ClientError(
                429,
                "too_many_client_feeds",
                f"this client has {MAX_CLIENT_FEEDS} status page feeds open already, the most one client may",
            )
        if self.feeds >= MAX_FEEDS:
            raise ClientError(
                503, "too_many_feeds", f"{MAX_FEEDS} status page feeds are open already, the most for all clients"
            )
        self.feeds += 1
        self.client_feeds[client] += 1
        try:
            async with trio.open_nursery() as nursery:
                scope = nursery.cancel_scope

                def gone(_why: str) -> None:
                    scope.cancel()

                async def stop() -> None:
                    await stopping()
                    scope.cancel()

                nursery.start_soon(stop)
                if hang_up is not None:
                    hang_up.watch(gone)
                try:
                    with self.events.watch(FEED_BOUND, on_full=scope.cancel) as receive, suppress(trio.EndOfChannel):
                        await out.start(200, [("Content-Type", "text/event-stream")])
                        await out.body(sse({"event": "hello", "recent": self.events.recent()}), more=True)
                        while True:
                            with trio.move_on_after(HEARTBEAT_S) as idle:
                                event = await receive.receive()
                            await out.body(b": idle\n\n" if idle.cancelled_caught else sse(event), more=True)
                finally:
                    if hang_up is not None:
                        hang_up.unwatch(gone)
        finally:
            self.feeds -= 1
            self.client_feeds[client] -= 1
            if not self.client_feeds[client]:
                del self.client_feeds[client]


async def serve(
    page: StatusPage | None,
    access: Access,
    name: str,
    scope: dict[str, Any],
    headers: dict[str, str],
    send: Send,
    started: float,
    stopping: Callable[[], Awaitable[None]],
) -> None:
    """A request under /onebit/ (``name``: the rest of its path), as the front hands it over: the
    API's Host rule, the operator's rule (the peer is ``scope["client"]``) and the API's error
    envelope, :data:`HEADERS` on every answer, and no CORS header whatever server.cors_origins
    allows (these data are for onebitd's own page only).  ``page`` None: a front without one
    (tests' fronts), where every such path is 404."""
    out = Responder(send, started, HEADERS)
    method: str = scope["method"]
    peer = scope.get("client")
    try:
        access.check_host(headers)
        if page is None:
            raise ClientError(404, "not_found", f"no such endpoint: {scope['path']}")
        client = access.check_operator(peer[0] if peer else None, page.is_data(name), headers)
        await page.answer(method, name, out, hang_up_of(scope), stopping, client)
    except ClientError as exc:
        if not out.started:
            await out.error(exc.status, exc.code, exc.message, retry_after=exc.retry_after)

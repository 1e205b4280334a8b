"""The ASGI adapter: one request on a connection as the app sees it, its scope, its ``receive`` (the
body, then the client's hang-up) and its ``send`` (the response, framed by framing/writers.py).

- **Bodies**: ``Expect: 100-continue`` is answered when the app first asks for the body.  A body not
  all come ``body_timeout_s`` after the request's first wait for it makes ``receive()`` raise a 408
  :class:`~supervisor.errors.ClientError` (a slowloris body); a malformed one raises
  :class:`~supervisor.errors.Malformed`.  Only a wait for the socket has a deadline: a body that came
  with its head costs none.  A body the app did not read (a refusal) is read and dropped, up to
  :data:`DISCARD_BYTES` and within ``idle_timeout_s``, so the connection is kept.
- **Disconnects**: once the body is read, ``receive()`` waits for the client to hang up and then
  returns ``http.disconnect`` (at once after the response has finished, as the ASGI spec says).
- **Failures**: an app that raises a ClientError is answered with it, one that raises anything else
  is logged with its traceback and answered 500, one that sends nothing is answered 500, each where
  nothing was sent yet, by the one error writer (respond.py's :class:`~supervisor.http.respond.Responder`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from ..errors import ClientError, Malformed
from . import framing
from .framing import writers
from .framing.writers import Close
from .respond import Message, Receive, Responder, Send, speaks_anthropic

App = Callable[[Message, Receive, Send], Awaitable[None]]


class Server(Protocol):
    """The server, as a request sees it."""

    @property
    def app(self) -> App: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def idle_timeout_s(self) -> float: ...

    @property
    def body_timeout_s(self) -> float: ...


class Link(Protocol):
    """The connection, as a request on it sees it (supervisor/http/connection.py's)."""

    @property
    def server(self) -> Server: ...

    @property
    def reader(self) -> framing.RequestReader: ...

    @property
    def gone(self) -> bool: ...

    @property
    def broken(self) -> bool: ...

    @property
    def hung_up_why(self) -> str | None: ...

    @property
    def client(self) -> tuple[str, int] | None: ...

    @property
    def local(self) -> tuple[str, int] | None: ...

    @property
    def extensions(self) -> Message: ...

    async def write(self, data: bytes) -> None: ...

    async def receive(self) -> bytes: ...

    async def wait_disconnect(self) -> None: ...


log = logging.getLogger("onebit.front")

DISCARD_BYTES = 1 << 20  # a request body the app left unread is dropped up to this; over it, the connection closes
_DISCONNECT: Message = {"type": "http.disconnect"}
_ASGI: Message = {"version": "3.0", "spec_version": "2.3"}


class Gone(Exception):
    """The client closed its connection in the middle of its request's body."""


class Request:
    """One request on a connection: its scope, its body as the app reads it, its response as the app
    sends it."""

    def __init__(self, connection: Link, head: framing.RequestHead) -> None:
        self.connection = connection
        self.head = head
        self.method = head.method
        self.version = head.version
        self.path = head.path
        self.chunked = head.chunked
        self.remaining = head.length  # of a Content-Length body, still to come
        self.body_done = not self.chunked and self.remaining == 0
        if self.body_done:
            connection.reader.next_event()  # its END, queued behind the head
        self.body_given = False  # the app has had the body's last message (an empty body has one too)
        self.body_deadline: float | None = None  # set at the first wait for the body
        self.close: Close | None = None if head.keep_alive else Close.CLIENT_ASKED
        self.continue_due = head.expect_continue
        # The response.
        self.status = 0
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.head_sent = False
        self.finished = False
        self.chunked_out = False
        self.declared: int | None = None
        self.sent = 0
        self.bodiless = False
        self._out = trio.Event()  # the response is out (its last byte sent), or the app returned

    @property
    def keep(self) -> bool:
        """Whether the connection is kept after this response, so far (see :class:`Close`)."""
        return self.close is None

    def closes(self, why: Close) -> None:
        """The connection closes after this response (the first reason is the one kept)."""
        if self.close is None:
            self.close = why

    def scope(self) -> Message:
        connection = self.connection
        return {
            "type": "http",
            "asgi": _ASGI,
            "http_version": self.version,
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.head.raw_path,
            "query_string": self.head.query,
            "root_path": "",
            "headers": self.head.headers,
            "client": connection.client,
            "server": connection.local,
            "extensions": connection.extensions,
        }

    async def serve(self, apps: trio.Nursery) -> bool:
        """Run the app on this request, in ``apps`` (the connection's), until its response is out;
        whether the connection may carry another.

        The app may go on past its response's last byte: a completion's work after its reply (the
        prefix store's save of the slot) is the request's own, but the client has all it asked
        for.  The connection takes the client's next request meanwhile, as hypercorn recycles a
        connection at its response's end, so that request does not wait for that work."""
        apps.start_soon(self._run_app)
        await self._out.wait()
        connection = self.connection
        if self.keep and not self.body_done:
            await self._discard()
        return self.keep and not connection.gone and not connection.broken and not connection.server.stopping

    async def _run_app(self) -> None:
        """The app on this request, its failures answered where nothing was sent yet, and logged
        (never raised: the connection's next request may be running beside it)."""
        try:
            try:
                await self.connection.server.app(self.scope(), self.receive, self.send)
            except Exception as exc:
                self.closes(Close.APP_FAILED)
                if isinstance(exc, ClientError):
                    await self._answer(exc.status, exc.code, exc.message)
                else:
                    log.error("the app failed on %s %s", self.method, self.path, exc_info=True)
                    await self._answer(500, "internal", "onebitd failed on this request")
            if not self.status:
                self.closes(Close.NO_RESPONSE)
                await self._answer(500, "internal", "onebitd sent no response")
            elif not self.finished:
                self.closes(Close.CUT)
        except Exception:  # answering the failure failed: this connection only, never the front
            log.warning(
                "answering a failed request on %s %s failed; its connection closes",
                self.method,
                self.path,
                exc_info=True,
            )
            self.closes(Close.APP_FAILED)
        finally:
            self._out.set()

    async def _answer(self, status: int, code: str, message: str) -> None:
        """The server's own answer, where the app's never began: the one error writer's, in the
        envelope of the request's API (Anthropic's on its paths) with ``X-Onebit-Source``."""
        if self.head_sent:
            return
        self.status = 0
        responder = Responder(self.send, trio.current_time(), anthropic=speaks_anthropic(self.path))
        await responder.error(status, code, message)

    async def _discard(self) -> None:
        """Drop the rest of a body the app did not read, so the next request can follow it."""
        with trio.move_on_after(self.connection.server.idle_timeout_s) as waited:
            try:
                while not self.body_done:
                    await self._body_part()
            except (Gone, ClientError):  # the latter: malformed, or past its deadline (keep is off)
                return
        if waited.cancelled_caught:
            self.closes(Close.DISCARD_TIMEOUT)

    # -- the request body ---------------------------------------------------------------------------

    async def receive(self) -> Message:
        if self.finished:
            return self._disconnect()  # the connection may be reading its next request
        if not self.body_given:
            chunk = b""
            if not self.body_done:
                if self.continue_due:
                    self.continue_due = False
                    if not self.head_sent:  # else the answer is out and the connection closes after it
                        await self.connection.write(writers.CONTINUE)
                try:
                    chunk = await self._body_part()
                except Gone:
                    return self._disconnect()
            self.body_given = self.body_done
            return {"type": "http.request", "body": chunk, "more_body": not self.body_done}
        if not self.finished:
            await self.connection.wait_disconnect()
        return self._disconnect()

    def _disconnect(self) -> Message:
        why = self.connection.hung_up_why
        return _DISCONNECT if why is None else {"type": "http.disconnect", "reason": why}

    async def _body_part(self) -> bytes:
        """The next piece of the body that has come (at least one byte, unless the body is done); a
        malformed body raises :class:`Malformed` (a ClientError) and closes the connection after."""
        reader = self.connection.reader
        while True:
            try:
                piece, done = reader.take_body()
            except Malformed:
                self.closes(Close.BODY_MALFORMED)
                raise
            if done:
                self.body_done = True
                break
            if piece:
                break
            if self.body_deadline is None:
                self.body_deadline = trio.current_time() + self.connection.server.body_timeout_s
            data = await self._body_bytes(self.body_deadline)
            reader.feed(data)
        self.remaining -= len(piece)
        return piece

    async def _body_bytes(self, deadline: float) -> bytes:
        """What the socket has of the body, by the body's deadline (408 past it; :class:`Gone` at the
        end of the client's stream)."""
        with trio.CancelScope(deadline=deadline) as waiting:
            data = await self.connection.receive()
        if waiting.cancelled_caught:
            self.closes(Close.BODY_TIMEOUT)
            timeout = self.connection.server.body_timeout_s
            raise ClientError(
                408, "body_timeout", f"request body not received within server.body_timeout_s ({timeout:g})"
            )
        if not data:
            self.closes(Close.BODY_GONE)
            raise Gone
        return data

    # -- the response -------------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.status:
                raise RuntimeError("http.response.start sent twice")
            self.status = message["status"]
            self.response_headers = list(message.get("headers", ()))
            if not any(name.lower() == b"content-length" for name, _ in self.response_headers):
                # A stream: its head goes now (a client waits for it before it reads on); a head
                # that declares a length waits for its body and goes with it, in one write.
                head = self._response_head()
                self.head_sent = True
                await self.connection.write(head)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.status or self.finished:
            raise RuntimeError("http.response.body outside a response")
        await self._send_body(message.get("body", b""), message.get("more_body", False))

    async def _send_body(self, body: bytes, more: bool) -> None:
        data = b"" if self.head_sent else self._response_head()
        if self.bodiless:
            pass
        elif self.chunked_out:
            if body:
                data += writers.chunk(body)
            if not more:
                data += writers.LAST_CHUNK
        elif body:
            if self.declared is not None and self.sent + len(body) > self.declared:
                raise RuntimeError("response body longer than its Content-Length")
            self.sent += len(body)
            data += body
        self.head_sent = True  # from here on, what is built is sent
        if not more:
            self.finished = True
            if self.declared is not None and self.sent != self.declared and not self.bodiless:
                self.closes(Close.WRONG_LENGTH)
        if data:
            await self.connection.write(data)
        if not more:
            self._out.set()

    def _response_head(self) -> bytes:
        """The response's head; it also settles the body's framing and whether the connection is kept."""
        framed = writers.frame(self.method, self.version, self.status, self.response_headers)
        self.declared, self.chunked_out, self.bodiless = framed.declared, framed.chunked, framed.bodiless
        if framed.close is not None:
            self.closes(framed.close)
        unread = not self.body_done and (self.continue_due or self.chunked or self.remaining > DISCARD_BYTES)
        # A body the app did not read is dropped after the response only if that is cheap and it
        # is on its way (no 100 Continue owed); else the connection closes.
        if unread:
            self.closes(Close.BODY_UNREAD)
        if self.connection.server.stopping:
            self.closes(Close.STOPPING)
        length = writers.length_sent(self.status, self.declared)
        return writers.head(self.status, framed.headers, length, close=not self.keep)

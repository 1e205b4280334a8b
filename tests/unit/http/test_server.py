"""supervisor/http/server.py in process, with small ASGI apps, driven by raw bytes over TCP: request framing
(Content-Length, chunked, 100-continue), keep-alive and pipelining, response framing, the server's own
refusals, disconnects, failures, the idle timeout, shutdown and binding."""

from __future__ import annotations

import json
import logging
import select
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from supervisor.errors import ClientError, ListenError
from supervisor.http.respond import Message, Receive, Send
from supervisor.http.server import HANG_UP, MAX_HEAD_BYTES, App, HangUp, HttpServer

TIMEOUT = 10
FOREVER = TIMEOUT * 10  # a timeout the test's own TIMEOUT runs out before
IDLE = 0.2
GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
DISCONNECT: Message = {"type": "http.disconnect"}


# -- the server ---------------------------------------------------------------------------------------


@attrs.define
class Served:
    server: HttpServer
    urls: list[str]
    stop: trio.Event  # the server's shutdown
    returned: trio.Event  # server.run returned

    @property
    def port(self) -> int:
        return int(self.urls[0].rsplit(":", 1)[1])


@asynccontextmanager
async def serving(
    app: App,
    *,
    hosts: tuple[str, ...] = ("127.0.0.1",),
    idle_timeout_s: float | Callable[[], float] = FOREVER,
    graceful_timeout_s: float = 1.0,
    write_timeout_s: float | Callable[[], float] = FOREVER,
    body_timeout_s: float | Callable[[], float] = FOREVER,
) -> AsyncIterator[Served]:
    """An HttpServer on port 0 for the test's body, stopped after it; all of it within TIMEOUT."""
    stop = trio.Event()
    returned = trio.Event()
    server = HttpServer(
        app,
        hosts=hosts,
        port=0,
        idle_timeout_s=idle_timeout_s,
        shutdown=stop.wait,
        graceful_timeout_s=graceful_timeout_s,
        write_timeout_s=write_timeout_s,
        body_timeout_s=body_timeout_s,
    )

    async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        await server.run(task_status=task_status)
        returned.set()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            urls: list[str] = await nursery.start(run)
            try:
                yield Served(server, urls, stop, returned)
            finally:
                stop.set()


# -- the client ---------------------------------------------------------------------------------------


@attrs.define
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""

    def header(self, name: str) -> str | None:
        values = self.all(name)
        assert len(values) <= 1, f"{name} sent {len(values)} times"
        return values[0] if values else None

    def all(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key == name]

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    """One raw connection: sends exact bytes, reads responses byte-exactly."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def dribble(self, data: bytes) -> None:
        """``data`` a byte per write, each handled by the server before the next is sent."""
        for i in range(len(data)):
            await self.stream.send_all(data[i : i + 1])
            await trio.testing.wait_all_tasks_blocked()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise AssertionError(f"the server closed the connection in a response, after {bytes(self.buffer)!r}")
        self.buffer += data

    async def line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            await self._fill()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    async def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._fill()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    async def head(self) -> Response:
        version, status, _ = (await self.line()).split(b" ", 2)
        assert version == b"HTTP/1.1"
        headers = []
        while line := await self.line():
            name, colon, value = line.partition(b":")
            assert colon, line
            headers.append((name.decode("latin-1").lower(), value.strip(b" \t").decode("latin-1")))
        return Response(int(status), headers)

    async def chunk(self) -> bytes:
        """The next chunk's data of a chunked body; b"" for the last chunk (its trailers read too)."""
        size = int((await self.line()).partition(b";")[0], 16)
        if not size:
            while await self.line():
                pass
            return b""
        data = await self.exactly(size)
        assert await self.line() == b""
        return data

    async def response(self, *, to_head: bool = False) -> Response:
        """One whole response: its body by its framing (none for HEAD, 1xx, 204, 304)."""
        response = await self.head()
        if to_head or response.status < 200 or response.status in (204, 304):
            return response
        if response.header("transfer-encoding") == "chunked":
            assert response.header("content-length") is None
            parts = []
            while part := await self.chunk():
                parts.append(part)
            response.body = b"".join(parts)
        elif (length := response.header("content-length")) is not None:
            response.body = await self.exactly(int(length))
        else:
            response.body = await self.rest()
        return response

    async def rest(self) -> bytes:
        """Everything the server sends until it closes the connection."""
        while data := await self.stream.receive_some(65536):
            self.buffer += data
        rest = bytes(self.buffer)
        self.buffer.clear()
        return rest

    def waiting(self) -> bool:
        """Whether the server has sent anything not read yet (without waiting for it)."""
        readable, _, _ = select.select([self.stream.socket.fileno()], [], [], 0)
        return bool(self.buffer) or bool(readable)


@asynccontextmanager
async def connected(port: int, host: str = "127.0.0.1") -> AsyncIterator[Client]:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        yield Client(stream)


def assert_envelope(response: Response, status: int, code: str) -> dict[str, str]:
    """``response`` is onebitd's JSON error envelope with ``status`` and ``code``; its error."""
    assert response.status == status
    assert response.header("content-type") == "application/json"
    error: dict[str, str] = response.json()["error"]
    assert set(error) == {"message", "type", "code", "source"}
    assert (error["code"], error["source"]) == (code, "onebitd")
    return error


# -- the apps -----------------------------------------------------------------------------------------


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        assert message["type"] == "http.request", message
        chunk: bytes = message.get("body", b"")
        body += chunk
        if not message.get("more_body", False):
            return body


def declares_body(scope: Message) -> bool:
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and value != b"0")
        for name, value in scope["headers"]
    )


async def answer(send: Send, status: int, body: bytes, content_type: bytes = b"text/plain") -> None:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def flood(send: Send) -> None:
    """A stream's head, then 64 KiB pieces until cancelled: a client that reads nothing fills the
    buffers, and the server's writes wait."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    while True:
        await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})


async def echo(scope: Message, receive: Receive, send: Send) -> None:
    """Answers what it was asked, as JSON, after reading the body where the request declares one."""
    body = await read_body(receive) if declares_body(scope) else b""
    seen = {
        "method": scope["method"],
        "path": scope["path"],
        "raw_path": scope["raw_path"].decode("latin-1"),
        "query_string": scope["query_string"].decode("latin-1"),
        "http_version": scope["http_version"],
        "headers": [[name.decode("latin-1"), value.decode("latin-1")] for name, value in scope["headers"]],
        "client_port": scope["client"][1],
        "body": body.decode("latin-1"),
    }
    await answer(send, 200, json.dumps(seen).encode(), b"application/json")


async def refuse(scope: Message, receive: Receive, send: Send) -> None:
    """Answers 401 without reading the body; any other path is echoed."""
    if scope["path"] != "/refuse":
        await echo(scope, receive, send)
        return
    await answer(send, 401, b"no", b"text/plain")


# -- request bodies -----------------------------------------------------------------------------------


async def test_a_content_length_body_sent_a_byte_per_write_reaches_the_app_whole() -> None:
    body = b'{"prompt": "hello, world"}'
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nX-Two: a\r\n\r\n" % len(body)
    async with serving(echo) as served, connected(served.port) as client:
        await client.dribble(request + body)
        response = await client.response()
    assert response.status == 200
    assert response.header("transfer-encoding") is None
    assert response.all("content-length") == [str(len(response.body))]
    seen = response.json()
    assert (seen["method"], seen["path"], seen["body"]) == ("POST", "/v1/completions", body.decode())
    assert ["x-two", "a"] in seen["headers"]


async def test_a_chunked_body_with_an_extension_and_a_trailer_reaches_the_app_whole() -> None:
    head = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    async with serving(echo) as served, connected(served.port) as client:
        await client.send(head)
        await client.dribble(body)
        first = await client.response()
        await client.send(GET)  # the trailer's end was found: the connection carries the next request
        second = await client.response()
    assert (first.status, first.json()["body"]) == (200, "hello world")
    assert first.header("connection") is None
    assert (second.status, second.json()["path"]) == (200, "/")


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nhello\r\n0\r\n\r\n",
        b"5\r\nhelloXY0\r\n\r\n",
        b"5;\nX\r\nhello\r\n0\r\n\r\n",
        b" 5 \r\nhello\r\n0\r\n\r\n",
        b"5;" + b"x" * 2000 + b"\r\nhello\r\n0\r\n\r\n",
    ],
    ids=["bad_hex_size", "no_crlf_after_data", "bare_lf_in_extension", "spaces_around_size", "size_line_too_long"],
)
async def test_a_malformed_chunked_body_is_a_400_and_closes_the_connection(body: bytes) -> None:
    head = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with serving(echo) as served, connected(served.port) as client:
        await client.send(head + body)
        response = await client.response()
        rest = await client.rest()
    assert_envelope(response, 400, "bad_chunked_body")
    assert response.header("connection") == "close"
    assert rest == b""


async def test_a_request_without_a_body_still_gives_the_app_one_empty_http_request_message() -> None:
    entered = trio.Event()
    got: list[Message] = []

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        entered.set()
        got.append(await receive())
        await answer(send, 200, b"ok")

    async with serving(app) as served, connected(served.port) as client:
        await client.send(b"POST /empty HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await entered.wait()
        await trio.testing.wait_all_tasks_blocked()  # nothing to wait for: the body is known to be empty
        assert got == [{"type": "http.request", "body": b"", "more_body": False}]
        assert (await client.response()).status == 200


# -- Expect: 100-continue -----------------------------------------------------------------------------


async def test_100_continue_is_sent_when_the_app_asks_for_the_body_and_then_the_response() -> None:
    entered = trio.Event()
    go = trio.Event()

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        entered.set()
        await go.wait()
        await echo(scope, receive, send)

    head = b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    async with serving(app) as served, connected(served.port) as client:
        await client.send(head)
        await entered.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert not client.waiting()  # the app has not asked for the body yet
        go.set()
        interim = await client.head()
        assert interim.status == 100
        await client.send(b"hello")
        response = await client.response()
    assert (response.status, response.json()["body"]) == (200, "hello")
    assert response.header("connection") is None


async def test_an_app_that_refuses_without_reading_the_body_sends_no_100_continue_and_closes() -> None:
    head = b"POST /refuse HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    async with serving(refuse) as served, connected(served.port) as client:
        await client.send(head)
        response = await client.response()
        rest = await client.rest()
    assert (response.status, response.body) == (401, b"no")
    assert response.header("connection") == "close"
    assert rest == b""


# -- keep-alive ---------------------------------------------------------------------------------------


async def test_two_requests_one_after_the_other_are_answered_on_one_connection() -> None:
    async with serving(echo) as served, connected(served.port) as client:
        await client.send(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n")
        first = await client.response()
        await client.send(b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n")
        second = await client.response()
    assert [first.status, second.status] == [200, 200]
    assert [first.json()["path"], second.json()["path"]] == ["/1", "/2"]
    assert first.json()["client_port"] == second.json()["client_port"]
    assert first.header("connection") is None


async def test_pipelined_requests_sent_in_one_write_are_answered_in_order() -> None:
    requests = (
        b"POST /1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /3 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nde\r\n0\r\n\r\n"
    )
    async with serving(echo) as served, connected(served.port) as client:
        await client.send(requests)
        seen = [(await client.response()).json() for _ in range(3)]
    assert [(s["path"], s["body"]) for s in seen] == [("/1", "abc"), ("/2", ""), ("/3", "de")]


async def test_the_next_request_on_a_connection_is_answered_while_the_last_ones_app_goes_on_past_its_response() -> None:
    # A completion's work after its reply (the prefix store's save of the slot) is its app's own: the
    # client, which has the whole response, sends its next request on the connection, and is answered
    # meanwhile.  Run in the connection's task, the app would hold the next request until it returned.
    go = trio.Event()
    returned: list[str] = []

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        await answer(send, 200, scope["path"].encode())
        if scope["path"] == "/1":
            await go.wait()
            assert await receive() == DISCONNECT  # the response is out: the next request's bytes are not its
        returned.append(scope["path"])

    async with serving(app) as served, connected(served.port) as client:
        await client.send(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n")
        first = await client.response()
        await client.send(b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n")
        second = await client.response()
        await trio.testing.wait_all_tasks_blocked()
        assert returned == ["/2"]  # /1's app still runs
        go.set()
        await trio.testing.wait_all_tasks_blocked()
        await client.send(b"GET /3 HTTP/1.1\r\nHost: x\r\n\r\n")
        third = await client.response()
    assert [first.body, second.body, third.body] == [b"/1", b"/2", b"/3"]
    assert returned == ["/2", "/1", "/3"]


async def test_shutdown_waits_for_an_app_that_goes_on_after_its_response() -> None:
    # Its work after the response is the request's: it is not cut short by the stop, which waits for it
    # within the graceful timeout (the connection itself closes once the app returns).
    go = trio.Event()
    after: list[str] = []

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        await answer(send, 200, b"done")
        await go.wait()
        after.append("done")

    async with serving(app, graceful_timeout_s=FOREVER) as served:
        async with connected(served.port) as client:
            await client.send(GET)
            response = await client.response()
            served.stop.set()
            await trio.testing.wait_all_tasks_blocked()
            assert not served.returned.is_set()  # the server waits for the app
            go.set()
            rest = await client.rest()
        await served.returned.wait()
    assert (response.status, rest, after) == (200, b"", ["done"])


async def test_a_client_that_pipelines_without_pause_lets_other_tasks_run_between_its_requests() -> None:
    # Every request here is in the buffer before the first is answered, and the app never waits: a
    # connection that yielded only when its socket would block would hold the whole front.
    ticks = 0
    seen: list[int] = []

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        seen.append(ticks)
        await answer(send, 200, b"ok")

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    async with serving(app) as served, connected(served.port) as client, trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
        statuses = [(await client.response()).status for _ in range(20)]
        nursery.cancel_scope.cancel()
    assert statuses == [200] * 20
    # Held, every request would see the same count; yielding once per request, the ticker runs at
    # least every other request (trio may run the two tasks in either order within a batch).
    assert len(set(seen)) > 5, seen


async def test_a_client_that_resets_before_it_is_accepted_does_not_stop_the_server() -> None:
    async with serving(echo) as served:
        # No checkpoint between the connect and the reset: the server has not accepted it yet.
        lost = socket.create_connection(("127.0.0.1", served.port))
        lost.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        lost.close()
        async with connected(served.port) as client:
            await client.send(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
            response = await client.response()
    assert response.status == 200
    assert served.returned.is_set()


async def test_a_client_s_connection_close_is_answered_with_connection_close_and_then_eof() -> None:
    async with serving(echo) as served, connected(served.port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        response = await client.response()
        rest = await client.rest()
    assert response.status == 200
    assert response.header("connection") == "close"
    assert rest == b""


async def test_an_http_1_0_request_is_answered_and_its_connection_closed() -> None:
    async with serving(echo) as served, connected(served.port) as client:
        await client.send(b"GET /old HTTP/1.0\r\n\r\n")
        response = await client.response()
        rest = await client.rest()
    assert (response.status, response.json()["http_version"], response.json()["path"]) == (200, "1.0", "/old")
    assert response.header("connection") == "close"
    assert rest == b""


# -- response framing ---------------------------------------------------------------------------------


def streaming(go: trio.Event) -> App:
    """Sends "first", waits for ``go``, sends "second"; no Content-Length."""

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await go.wait()
        await send({"type": "http.response.body", "body": b"second", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def test_a_response_without_a_length_is_chunked_on_http_1_1_and_each_chunk_sent_as_it_comes() -> None:
    go = trio.Event()
    async with serving(streaming(go)) as served, connected(served.port) as client:
        await client.send(GET)
        head = await client.head()
        assert (head.status, head.header("transfer-encoding"), head.header("content-length")) == (200, "chunked", None)
        assert head.header("connection") is None
        assert await client.chunk() == b"first"  # before the app sends the rest
        go.set()
        assert await client.chunk() == b"second"
        assert await client.chunk() == b""
        await client.send(GET)  # the last chunk ended the response: the connection carries the next
        again = await client.response()
    assert (again.status, again.body) == (200, b"firstsecond")


async def test_a_response_without_a_length_on_http_1_0_ends_with_the_connection() -> None:
    go = trio.Event()
    async with serving(streaming(go)) as served, connected(served.port) as client:
        await client.send(b"GET / HTTP/1.0\r\n\r\n")
        head = await client.head()
        assert (head.status, head.header("transfer-encoding"), head.header("content-length")) == (200, None, None)
        assert head.header("connection") == "close"
        assert await client.exactly(5) == b"first"  # before the app sends the rest
        go.set()
        assert await client.rest() == b"second"


async def test_head_gets_the_headers_and_no_body_and_the_connection_carries_the_next_request() -> None:
    async def app(scope: Message, receive: Receive, send: Send) -> None:
        await answer(send, 200, b"hello")

    async with serving(app) as served, connected(served.port) as client:
        await client.send(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await client.response(to_head=True)
        await client.send(GET)
        after = await client.response()
    assert (head.status, head.header("content-length"), head.header("connection")) == (200, "5", None)
    assert (after.status, after.body) == (200, b"hello")


# -- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "status", "code"),
    [
        (b"GET /\r\nHost: x\r\n\r\n", 400, "bad_request"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n", 400, "bad_request"),
        (b"GET / HTTP/1.1\r\n\r\n", 400, "bad_request"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", 431, "head_too_large"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "transfer_encoding"),
        (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400, "bad_request"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3a\r\n\r\n", 400, "bad_request"),
        (b"\r\n" * 40 + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
    ],
    ids=[
        "malformed_request_line",
        "header_without_colon",
        "no_host",
        "head_too_large",
        "gzip",
        "http_2",
        "te_and_cl",
        "non_digit_length",
        "blank_lines_without_end",
    ],
)
async def test_a_request_the_server_refuses_gets_the_error_envelope_and_the_connection_closed(
    request_: bytes, status: int, code: str
) -> None:
    called = False

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        nonlocal called
        called = True
        await echo(scope, receive, send)

    async with serving(app) as served, connected(served.port) as client:
        await client.send(request_)
        response = await client.response()
        rest = await client.rest()
    assert_envelope(response, status, code)
    assert response.header("connection") == "close"
    assert rest == b""
    assert not called


async def test_an_app_s_refusal_of_a_small_body_keeps_the_connection_and_drops_the_body() -> None:
    async with serving(refuse) as served, connected(served.port) as client:
        await client.send(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        refused = await client.response()
        await client.send(b"hello" + b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        after = await client.response()
    assert (refused.status, refused.body, refused.header("connection")) == (401, b"no", None)
    assert (after.status, after.json()["method"], after.json()["path"]) == (200, "GET", "/next")


# -- disconnects --------------------------------------------------------------------------------------


async def test_receive_after_the_body_waits_for_the_client_to_hang_up_and_then_says_disconnect() -> None:
    reading = trio.Event()
    done = trio.Event()
    got: list[Message] = []

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        assert await read_body(receive) == b"hello"
        reading.set()
        got.append(await receive())
        done.set()

    async with serving(app) as served:
        async with connected(served.port) as client:
            await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            await reading.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert not done.is_set()  # the client is still there
        await done.wait()
    assert got == [DISCONNECT]


async def test_receive_after_the_response_finished_says_disconnect_at_once() -> None:
    done = trio.Event()
    got: list[Message] = []

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        assert await read_body(receive) == b"hello"
        await answer(send, 200, b"ok")
        got.append(await receive())
        done.set()

    async with serving(app) as served, connected(served.port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        response = await client.response()
        await trio.testing.wait_all_tasks_blocked()
        assert done.is_set()  # while the client is still connected
    assert (response.status, response.body) == (200, b"ok")
    assert got == [DISCONNECT]


# -- failures -----------------------------------------------------------------------------------------


async def test_an_app_that_raises_before_responding_gets_a_500_and_other_connections_are_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        await echo(scope, receive, send)

    async with serving(app) as served:
        async with connected(served.port) as client:
            await client.send(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
            failed = await client.response()
            rest = await client.rest()
        async with connected(served.port) as client:
            await client.send(GET)
            other = await client.response()
    assert_envelope(failed, 500, "internal")
    assert failed.header("connection") == "close"
    assert rest == b""
    assert other.status == 200
    [record] = [r for r in caplog.records if r.name == "onebit.front" and r.levelno == logging.ERROR]
    assert record.getMessage() == "the app failed on GET /boom"
    assert record.exc_info is not None


async def test_an_app_that_raises_a_client_error_before_responding_gets_its_status_and_code() -> None:
    async def app(scope: Message, receive: Receive, send: Send) -> None:
        raise ClientError(418, "teapot", "no")

    async with serving(app) as served, connected(served.port) as client:
        await client.send(GET)
        response = await client.response()
        rest = await client.rest()
    error = assert_envelope(response, 418, "teapot")
    assert error["message"] == "no"
    assert response.header("connection") == "close"
    assert rest == b""


# -- the idle timeout ---------------------------------------------------------------------------------


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout() -> None:
    async with serving(echo, idle_timeout_s=IDLE) as served, connected(served.port) as client:
        assert await client.rest() == b""


async def test_a_connection_that_sends_half_a_head_is_closed_after_the_idle_timeout() -> None:
    async with serving(echo, idle_timeout_s=IDLE) as served, connected(served.port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHo")
        assert await client.rest() == b""


async def test_an_idle_timeout_changed_while_serving_applies_to_the_next_connection() -> None:
    async with serving(echo, idle_timeout_s=FOREVER) as served:
        served.server.idle_timeout_s = IDLE
        async with connected(served.port) as client:
            assert await client.rest() == b""


async def test_an_idle_timeout_read_from_a_source_is_the_sources_value_at_the_next_connection() -> None:
    # The daemon's source: its one live config, which a reload swaps.
    timeouts: dict[str, float] = {"idle": FOREVER}
    async with serving(echo, idle_timeout_s=lambda: timeouts["idle"]) as served:
        timeouts["idle"] = IDLE
        async with connected(served.port) as client:
            assert await client.rest() == b""


async def test_a_response_slower_than_the_idle_timeout_is_not_cut_by_it() -> None:
    async def slow(scope: Message, receive: Receive, send: Send) -> None:
        await trio.sleep(IDLE * 3)  # the behaviour under test: an app that takes longer than the idle timeout
        await answer(send, 200, b"late")

    async with serving(slow, idle_timeout_s=IDLE) as served, connected(served.port) as client:
        await client.send(GET)
        response = await client.response()
    assert (response.status, response.body, response.header("connection")) == (200, b"late", None)


# -- the body's deadline -------------------------------------------------------------------------------


async def test_a_body_that_stops_coming_is_a_408_past_body_timeout_s_and_the_connection_closes() -> None:
    async with serving(echo, body_timeout_s=IDLE) as served, connected(served.port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        response = await client.response()
        assert response.status == 408
        assert response.json()["error"]["code"] == "body_timeout"
        assert "server.body_timeout_s (0.2)" in response.json()["error"]["message"]
        assert response.header("connection") == "close"
        assert await client.rest() == b""


# -- the hang-up told to a function (the scope's extension) -------------------------------------------


async def test_a_watched_request_is_told_its_hang_up() -> None:
    told: list[str] = []
    watching = trio.Event()
    hung_up = trio.Event()

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        hang_up: HangUp = scope["extensions"][HANG_UP]
        assert await read_body(receive) == b"hello"

        def on_gone(why: str) -> None:
            told.append(why)
            hung_up.set()

        hang_up.watch(on_gone)
        watching.set()
        await hung_up.wait()
        hang_up.unwatch(on_gone)

    async with serving(app) as served:
        async with connected(served.port) as client:
            await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            await watching.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert told == []  # the client is still there
        await hung_up.wait()
    assert told == [""]


async def test_the_watcher_hands_the_socket_back_between_keep_alive_requests_and_unwatch_ends_a_watch() -> None:
    # Each request watches and unwatches; the watcher goes on waiting for the socket after each, so
    # the next request's bytes reach the connection through it.  None of them hangs up.
    told: list[str] = []

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        hang_up: HangUp = scope["extensions"][HANG_UP]
        await read_body(receive)
        hang_up.watch(told.append)
        await trio.testing.wait_all_tasks_blocked()  # the watcher is waiting for the socket
        await answer(send, 200, scope["path"].encode())
        hang_up.unwatch(told.append)

    async with serving(app) as served, connected(served.port) as client:
        for index in range(5):
            await trio.testing.wait_all_tasks_blocked()  # the connection waits for the next head
            await client.send(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % index)
            response = await client.response()
            assert (response.status, response.body) == (200, b"/%d" % index)
    assert told == []


async def test_the_next_request_arriving_while_one_is_watched_is_no_hang_up() -> None:
    # The watcher wakes for /b's bytes while /a runs: the client is still there, and /a is not told.
    told: list[str] = []
    watching = trio.Event()
    go = trio.Event()

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        hang_up: HangUp = scope["extensions"][HANG_UP]
        hang_up.watch(told.append)
        if scope["path"] == "/a":
            watching.set()
            await go.wait()
        await answer(send, 200, scope["path"].encode())
        hang_up.unwatch(told.append)

    async with serving(app) as served, connected(served.port) as client:
        await client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        await watching.wait()
        await client.send(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()  # the watcher has seen /b's bytes
        go.set()
        first, second = await client.response(), await client.response()
        assert (first.body, second.body) == (b"/a", b"/b")
    assert told == []


async def test_a_watch_that_raises_is_logged_and_the_server_serves_on(caplog: pytest.LogCaptureFixture) -> None:
    watching = trio.Event()
    told = trio.Event()

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["path"] == "/next":
            await answer(send, 200, b"served")
            return
        hang_up: HangUp = scope["extensions"][HANG_UP]

        def on_gone(why: str) -> None:
            told.set()
            raise RuntimeError("a watch that fails")

        hang_up.watch(on_gone)
        watching.set()
        await told.wait()

    async with serving(app) as served:
        async with connected(served.port) as client:
            await client.send(GET)
            await watching.wait()
        await told.wait()
        async with connected(served.port) as client:
            await client.send(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.response()).body == b"served"
    [record] = [r for r in caplog.records if "hang-up watch failed" in r.getMessage()]
    assert record.exc_info is not None
    assert "a watch that fails" in str(record.exc_info[1])


async def test_a_watcher_that_fails_hangs_up_on_its_connection_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def fails(self: object) -> None:
        raise RuntimeError("the watcher broke")

    monkeypatch.setattr("supervisor.http.watch.Watched._watch_socket", fails)
    told: list[str] = []
    done = trio.Event()

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["path"] == "/next":
            await answer(send, 200, b"served")
            return
        hang_up: HangUp = scope["extensions"][HANG_UP]
        hang_up.watch(told.append)
        await trio.testing.wait_all_tasks_blocked()
        done.set()

    async with serving(app) as served:
        async with connected(served.port) as client:
            await client.send(GET)
            await done.wait()
            with pytest.raises(trio.BrokenResourceError):  # hung up on: reset, no response
                await client.rest()
        async with connected(served.port) as client:
            await client.send(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await client.response()).body == b"served"
    assert told == ["onebitd's hang-up watch failed"]
    assert any("hang-up watcher failed" in r.getMessage() for r in caplog.records)


def flooding_until_told(told: list[str], watching: trio.Event, stopped: trio.Event) -> App:
    """An app that watches its hang-up and floods its client until it is told (``told``)."""

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        hang_up: HangUp = scope["extensions"][HANG_UP]
        with trio.CancelScope() as cancel:

            def on_gone(why: str) -> None:
                told.append(why)
                cancel.cancel()

            hang_up.watch(on_gone)
            watching.set()
            await flood(send)
        stopped.set()

    return app


async def test_the_write_timeout_is_told_to_a_watched_request_with_why() -> None:
    told: list[str] = []
    stopped = trio.Event()
    app = flooding_until_told(told, trio.Event(), stopped)
    async with serving(app, write_timeout_s=IDLE) as served, connected(served.port) as client:
        client.stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await client.send(GET)
        await stopped.wait()
    [why] = told
    assert "server.write_timeout_s" in why


async def test_a_write_that_finds_the_client_gone_tells_the_watch() -> None:
    # The next request came with this one (pipelined), so the watcher does not wait for the socket:
    # the client's reset is found by the flood's next write, which tells the watch.
    told: list[str] = []
    watching = trio.Event()
    stopped = trio.Event()
    async with serving(flooding_until_told(told, watching, stopped)) as served:
        async with connected(served.port) as client:
            client.stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await client.send(GET + GET)
            await watching.wait()
            client.stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stopped.wait()  # the close was a reset
    assert told == [""]


# -- the write deadline -------------------------------------------------------------------------------


async def test_a_client_that_takes_nothing_for_the_write_timeout_loses_its_connection_as_a_hang_up() -> None:
    got: list[Message] = []
    stopped = trio.Event()

    async def flooding(scope: Message, receive: Receive, send: Send) -> None:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (message := await receive())["type"] != "http.disconnect":
                    pass
                got.append(message)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await flood(send)  # until the disconnect
        stopped.set()

    async with serving(flooding, write_timeout_s=IDLE) as served, connected(served.port) as client:
        client.stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await client.send(GET)
        await stopped.wait()
        with pytest.raises(trio.BrokenResourceError):  # reset: the server closed with the flood unread
            await client.rest()
    [message] = got
    assert message["type"] == "http.disconnect"
    assert "server.write_timeout_s" in message["reason"]


async def test_the_write_timeout_s_hang_up_reaches_an_app_watching_while_the_next_request_waits() -> None:
    # A pipelined request behind this one: the disconnect watch has no socket to wait on, only the hang-up.
    got: list[Message] = []
    stopped = trio.Event()

    async def flooding(scope: Message, receive: Receive, send: Send) -> None:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (message := await receive())["type"] != "http.disconnect":
                    pass
                got.append(message)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await flood(send)
        stopped.set()

    async with serving(flooding, write_timeout_s=IDLE) as served, connected(served.port) as client:
        client.stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await client.send(GET + GET)
        await stopped.wait()
    [message] = got
    assert "server.write_timeout_s" in message["reason"]


# -- shutdown -----------------------------------------------------------------------------------------


async def test_shutdown_closes_an_idle_keep_alive_connection_at_once() -> None:
    async with serving(echo, graceful_timeout_s=FOREVER) as served:
        async with connected(served.port) as client:
            await client.send(GET)
            assert (await client.response()).status == 200
            served.stop.set()
            assert await client.rest() == b""  # not after the graceful timeout: that is past the test's
        await served.returned.wait()


async def test_shutdown_lets_a_request_in_flight_finish_with_connection_close_and_then_closes() -> None:
    entered = trio.Event()
    go = trio.Event()

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        entered.set()
        await go.wait()
        await answer(send, 200, b"done")

    async with serving(app, graceful_timeout_s=FOREVER) as served:
        async with connected(served.port) as client:
            await client.send(GET)
            await entered.wait()
            served.stop.set()
            await trio.testing.wait_all_tasks_blocked()
            assert not served.returned.is_set()  # the server waits for the response
            with pytest.raises(OSError, match="all attempts to connect"):  # and takes no new connection
                await trio.open_tcp_stream("127.0.0.1", served.port)
            go.set()
            response = await client.response()
            rest = await client.rest()
        await served.returned.wait()
    assert (response.status, response.body, response.header("connection")) == (200, b"done", "close")
    assert rest == b""


# -- binding ------------------------------------------------------------------------------------------


def has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


async def test_port_0_on_two_hosts_gives_a_url_for_each_that_serves() -> None:
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    async with serving(echo, hosts=("127.0.0.1", "::1")) as served:
        v4, v6 = served.urls
        assert v4.startswith("http://127.0.0.1:")
        assert v6.startswith("http://[::1]:")
        for url, host in [(v4, "127.0.0.1"), (v6, "::1")]:
            async with connected(int(url.rsplit(":", 1)[1]), host) as client:
                await client.send(b"GET /%s HTTP/1.1\r\nHost: x\r\n\r\n" % host.encode())
                response = await client.response()
            assert (response.status, response.json()["path"]) == (200, f"/{host}")


async def test_an_address_not_on_this_machine_is_a_listen_error_naming_server_host() -> None:
    server = HttpServer(echo, hosts=("192.0.2.1",), port=0, idle_timeout_s=IDLE, shutdown=trio.sleep_forever)
    with trio.fail_after(TIMEOUT), pytest.raises(ListenError, match=r"server\.host.*192\.0\.2\.1"):
        await server.run()


# -- the scope ----------------------------------------------------------------------------------------


async def test_the_path_is_percent_decoded_and_the_query_string_is_passed_raw() -> None:
    async with serving(echo) as served, connected(served.port) as client:
        await client.send(b"GET /a%20b?x=1&y=%20 HTTP/1.1\r\nHost: x\r\n\r\n")
        seen = (await client.response()).json()
    assert (seen["path"], seen["raw_path"], seen["query_string"]) == ("/a b", "/a%20b", "x=1&y=%20")

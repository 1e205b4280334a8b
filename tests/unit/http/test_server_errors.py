"""The server's own error replies, read as raw bytes: a refused head, an app that raises or sends
nothing, and a body past its deadline are answered by respond.py's one error writer, so each carries
``X-Onebit-Source: onebitd`` and, on Anthropic's paths, Anthropic's error shape."""

from __future__ import annotations

import json
import re

import pytest
import trio

from supervisor.errors import ClientError
from supervisor.http import asgi
from supervisor.http.respond import Message, Receive, Send
from tests.unit.http.test_server import GET, IDLE, connected, echo, serving

DATE = re.compile(rb"\r\nDate: [^\r]+\r\n")


async def raw_reply(app: object, request: bytes, **timeouts: float) -> bytes:
    """Everything the server sends for ``request`` until it closes, its Date masked."""
    async with serving(app, **timeouts) as served, connected(served.port) as client:  # type: ignore[arg-type]
        await client.send(request)
        reply = await client.rest()
    return DATE.sub(b"\r\nDate: -\r\n", reply)


def expected(status: bytes, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nX-Onebit-Source: onebitd\r\n"
        b"Content-Length: %d\r\nConnection: close\r\nDate: -\r\n\r\n" % len(data) + data
    )


def onebitd(message: str, type_: str, code: str) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "code": code, "source": "onebitd"}}


def anthropic(type_: str, message: str) -> dict[str, object]:
    return {"type": "error", "error": {"type": type_, "message": message}}


async def boom(scope: Message, receive: Receive, send: Send) -> None:
    raise RuntimeError("boom")


async def silent(scope: Message, receive: Receive, send: Send) -> None:
    pass


async def test_a_refused_head_is_answered_by_the_one_error_writer_with_its_source() -> None:
    reply = await raw_reply(echo, b"GET / HTTP/2.0\r\nHost: x\r\n\r\n")
    message = "HTTP version 2.0 is not supported"
    assert reply == expected(b"505 HTTP Version Not Supported", onebitd(message, "server_error", "http_version"))


async def test_an_app_that_raises_is_answered_500_with_the_source_header() -> None:
    reply = await raw_reply(boom, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    body = onebitd("onebitd failed on this request", "server_error", "internal")
    assert reply == expected(b"500 Internal Server Error", body)


async def test_an_app_that_raises_on_anthropic_s_path_is_answered_in_anthropic_s_shape() -> None:
    reply = await raw_reply(boom, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert reply == expected(b"500 Internal Server Error", anthropic("api_error", "onebitd failed on this request"))


async def test_an_app_that_sends_nothing_is_answered_500_in_the_shape_of_its_path() -> None:
    reply = await raw_reply(silent, b"GET /v1/messages/count_tokens HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply == expected(b"500 Internal Server Error", anthropic("api_error", "onebitd sent no response"))


async def test_a_client_error_the_app_raises_is_answered_with_the_source_header() -> None:
    async def refuses(scope: Message, receive: Receive, send: Send) -> None:
        raise ClientError(418, "teapot", "no")

    reply = await raw_reply(refuses, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply == expected(b"418 I'm a Teapot", onebitd("no", "invalid_request_error", "teapot"))


async def test_a_body_past_its_deadline_on_anthropic_s_path_is_anthropic_s_timeout_error() -> None:
    request = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhe"
    with trio.fail_after(5):
        reply = await raw_reply(echo, request, body_timeout_s=IDLE)
    message = "request body not received within server.body_timeout_s (0.2)"
    assert reply == expected(b"408 Request Timeout", anthropic("timeout_error", message))


async def test_a_failure_the_server_cannot_answer_closes_that_connection_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # The app runs beside the connection's next request (asgi.Request.serve): what escapes it would
    # end the server's whole nursery, every client's connection with it.
    async def unanswerable(self: asgi.Request, status: int, code: str, message: str) -> None:
        raise RuntimeError("cannot answer")

    monkeypatch.setattr(asgi.Request, "_answer", unanswerable)
    async with serving(boom) as served:
        async with connected(served.port) as client:
            await client.send(GET)
            assert await client.rest() == b""
        monkeypatch.undo()
        async with connected(served.port) as client:
            await client.send(GET)
            assert (await client.response()).status == 500

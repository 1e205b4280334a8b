"""supervisor/http/wire.py against a scripted HTTP/1.1 server on a unix socket: framing, keep-alive, a
pooled connection the server closed, and a stream handed on as it comes."""

from __future__ import annotations

import socket as stdlib_socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from supervisor.errors import DecoderUnavailable
from supervisor.http import wire

TIMEOUT = 10


@attrs.define
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Answer = Callable[[trio.SocketStream, Seen, int], Awaitable[bool]]  # -> keep the connection open


@attrs.define
class Server:
    """Serves each request with ``answer``; counts connections and requests."""

    answer: Answer
    connections: int = 0
    seen: list[Seen] = attrs.Factory(list)
    closed: trio.Event = attrs.Factory(trio.Event)  # a connection's client closed it

    async def serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = bytearray()
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        self.closed.set()
                        return
                    buffer += data
                end = buffer.index(b"\r\n\r\n")
                lines = bytes(buffer[:end]).decode().split("\r\n")
                del buffer[: end + 4]
                method, path, _ = lines[0].split(" ")
                headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                body = bytes(buffer[:length])
                del buffer[:length]
                seen = Seen(method, path, headers, body)
                self.seen.append(seen)
                if not await self.answer(stream, seen, len(self.seen)):
                    await stream.aclose()
                    return
        except trio.BrokenResourceError:
            self.closed.set()


@asynccontextmanager
async def serving(tmp_path: Path, answer: Answer) -> AsyncIterator[tuple[Server, wire.UnixTransport]]:
    path = tmp_path / "s.sock"
    sock = trio.socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    await sock.bind(str(path))
    sock.listen()
    server = Server(answer)
    transport = wire.UnixTransport(path, max_connections=4)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, server.serve, [trio.SocketListener(sock)])
            try:
                yield server, transport
            finally:
                await transport.aclose()
                nursery.cancel_scope.cancel()


def reply(status: int, body: bytes, *headers: str) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def ok(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
    await stream.send_all(reply(200, b'{"n": %d}' % n, "Content-Type: application/json"))
    return True


async def call(transport: wire.Transport, method: str = "POST", path: str = "/completion") -> tuple[int, bytes]:
    response = await transport.send(method, path, b'{"prompt": "hi"}' if method == "POST" else None)
    try:
        return response.status, await response.read()
    finally:
        await response.aclose()


async def test_a_request_goes_out_whole_and_its_connection_is_kept_for_the_next(tmp_path: Path) -> None:
    async with serving(tmp_path, ok) as (server, transport):
        assert await call(transport) == (200, b'{"n": 1}')
        assert await call(transport, "GET", "/health") == (200, b'{"n": 2}')
    assert server.connections == 1
    first, second = server.seen
    assert (first.method, first.path, first.body) == ("POST", "/completion", b'{"prompt": "hi"}')
    assert first.headers["content-type"] == "application/json"
    assert (second.method, second.path, second.body) == ("GET", "/health", b"")


async def test_the_reply_head_is_parsed_whatever_way_its_bytes_arrive(tmp_path: Path) -> None:
    async def dribbled(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        data = b"HTTP/1.1 100 Continue\r\n\r\n" + reply(201, b"abc", "X-Two: a", "x-two: b", "Connection: keep-alive")
        for i in range(len(data)):
            await stream.send_all(data[i : i + 1])
        return True

    async with serving(tmp_path, dribbled) as (_, transport):
        response = await transport.send("GET", "/x", None)
        assert (response.status, response.headers["x-two"]) == (201, "a, b")
        assert await response.read() == b"abc"
        await response.aclose()


async def test_a_chunked_stream_is_handed_on_before_the_rest_of_it_is_sent(tmp_path: Path) -> None:
    go_on = trio.Event()

    async def streamed(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
        await go_on.wait()
        await stream.send_all(b"lo\r\n6;ext=1\r\n world\r\n0\r\nTrailer: x\r\n\r\n")
        return True

    async with serving(tmp_path, streamed) as (server, transport):
        response = await transport.send("POST", "/completion", b"{}")
        chunks = response.chunks()
        assert await chunks.__anext__() == b"hel"  # before the server sends the rest
        go_on.set()
        assert b"".join([chunk async for chunk in chunks]) == b"lo world"
        await response.aclose()
        assert await call(transport) == (200, b"hello world")
    assert server.connections == 1


async def test_a_chunked_body_split_at_every_byte_is_put_back_together(tmp_path: Path) -> None:
    body = b"4\r\nabcd\r\n1\r\ne\r\n0\r\n\r\n"

    async def bytewise(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(len(body)):
            await stream.send_all(body[i : i + 1])
        await stream.send_all(reply(200, b"next"))  # the next request's, on the same connection
        return True

    async with serving(tmp_path, bytewise) as (server, transport):
        assert await call(transport) == (200, b"abcde")
    assert server.connections == 1


async def test_a_reply_without_a_length_is_read_to_the_close_and_its_connection_not_kept(tmp_path: Path) -> None:
    async def to_the_close(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nab")
        await trio.testing.wait_all_tasks_blocked()  # the client has read the first piece and waits
        await stream.send_all(b"cd")
        return False  # closes the connection: the end of the body

    async with serving(tmp_path, to_the_close) as (server, transport):
        assert await call(transport) == (200, b"abcd")
        assert await call(transport) == (200, b"abcd")
    assert server.connections == 2


async def test_a_pooled_connection_closed_unanswered_sends_the_request_again_on_a_new_one(tmp_path: Path) -> None:
    async def once_per_connection(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        await stream.send_all(reply(200, b"%d" % n))
        return False  # closes without saying so, as llama-server does on its own schedule

    async with serving(tmp_path, once_per_connection) as (server, transport):
        assert await call(transport) == (200, b"1")
        assert await call(transport) == (200, b"2")
    assert (server.connections, len(server.seen)) == (2, 2)


async def test_a_reply_cut_off_mid_answer_is_an_error_and_is_not_sent_again(tmp_path: Path) -> None:
    async def cut(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        return False

    async with serving(tmp_path, cut) as (server, transport):
        response = await transport.send("POST", "/completion", b"{}")
        with pytest.raises(DecoderUnavailable, match="7 bytes of its reply unsent"):
            await response.read()
        await response.aclose()
    assert len(server.seen) == 1


async def test_a_new_connection_closed_unanswered_is_an_error_after_one_try(tmp_path: Path) -> None:
    async def silent(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        return False

    async with serving(tmp_path, silent) as (server, transport):
        with pytest.raises(DecoderUnavailable, match="without answering"):
            await call(transport)
    assert len(server.seen) == 1


@pytest.mark.parametrize("value", ["close", "Keep-Alive, close"])
async def test_a_reply_that_says_close_does_not_keep_its_connection(tmp_path: Path, value: str) -> None:
    async def closing(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        await stream.send_all(reply(200, b"x", f"Connection: {value}"))
        return True  # the server would even have served another; the client must not ask

    async with serving(tmp_path, closing) as (server, transport):
        await call(transport)
        await call(transport)
    assert (server.connections, len(server.seen)) == (2, 2)


async def test_a_stream_left_half_read_closes_its_connection(tmp_path: Path) -> None:
    async def endless(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        return True

    async with serving(tmp_path, endless) as (server, transport):
        response = await transport.send("POST", "/completion", b"{}")
        chunks = response.chunks()
        assert await chunks.__anext__() == b"abc"
        await chunks.aclose()
        await response.aclose()
        await server.closed.wait()  # the server sees the client go: llama-server stops the request
    assert server.connections == 1


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (b"HTTP/1.1 2xx OK\r\n\r\n", "malformed status line"),
        (b"SSH-2.0\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "content-length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "content-length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\n", "malformed chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n", "no CRLF after its data"),
    ],
)
async def test_a_malformed_reply_is_the_decoder_s_fault(tmp_path: Path, head: bytes, why: str) -> None:
    async def bad(stream: trio.SocketStream, seen: Seen, n: int) -> bool:
        await stream.send_all(head)
        return True

    async with serving(tmp_path, bad) as (_, transport):
        with pytest.raises(DecoderUnavailable, match=why):
            await call(transport)


async def test_an_expired_keep_alive_connection_is_not_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "KEEPALIVE_EXPIRY_S", 0.0)
    async with serving(tmp_path, ok) as (server, transport):
        await call(transport)
        await call(transport)
    assert server.connections == 2


async def test_no_socket_is_an_error_that_names_it(tmp_path: Path) -> None:
    transport = wire.UnixTransport(tmp_path / "gone.sock")
    with trio.fail_after(TIMEOUT), pytest.raises(DecoderUnavailable, match=r"gone\.sock"):
        await call(transport)


async def test_no_socket_to_be_had_is_the_decoder_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # EMFILE: the process is out of file descriptors; the health check must see an error it handles.
    def exhausted(*args: object) -> trio.socket.SocketType:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(trio.socket, "socket", exhausted)
    transport = wire.UnixTransport(tmp_path / "d.sock")
    with trio.fail_after(TIMEOUT), pytest.raises(DecoderUnavailable, match="Too many open files"):
        await call(transport)


async def test_a_path_that_is_not_one_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    async with serving(tmp_path, ok) as (server, transport):
        with pytest.raises(DecoderUnavailable, match="not a request path"):
            await call(transport, "GET", "/a b\r\nX: y")
    assert server.seen == []


async def test_no_more_connections_than_the_limit_are_open_at_once(tmp_path: Path) -> None:
    async with serving(tmp_path, ok) as (server, transport):
        held = [await transport.send("GET", "/x", None) for _ in range(4)]
        waiting = trio.Event()
        done: list[tuple[int, bytes]] = []

        async def fifth() -> None:
            waiting.set()
            done.append(await call(transport, "GET", "/x"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fifth)
            await waiting.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert (done, server.connections) == ([], 4)
            for response in held:
                await response.read()
                await response.aclose()
        assert done == [(200, b'{"n": 5}')]
    assert server.connections == 4

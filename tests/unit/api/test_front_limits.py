"""What a malformed or stalled request gets from the front, against tests/fakes/llama/process.py: a body
nested too deeply is a 400 (not a 500), a body that stops arriving is a 408 after
``server.body_timeout_s``, a head that never ends is closed after ``server.idle_timeout_s``, and a
client that stops reading its stream is cancelled after ``server.write_timeout_s``.
scripts/chaos's ``fuzz`` scenario does the same and more against the real llama-server."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import trio
import trio.testing

from supervisor.http import connection, watch
from tests.rigs.helpers import CHAT, assert_envelope, client_for, open_raw, receive_until, request_head
from tests.rigs.rig import Control, DecoderModes, RouteLines, fake_decoder_config, run_daemon

TIMEOUT = 20  # seconds; a test that needs more is stuck, not slow


async def test_a_body_nested_too_deeply_for_json_is_refused_with_400(short_dir: Path, control: Control) -> None:
    body = b"[" * 100_000  # json's decoder recurses once per level: RecursionError, not ValueError
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, client_for(running) as client:
            reply = await client.post(CHAT, content=body, headers={"content-type": "application/json"})
            error = assert_envelope(reply, 400)
    assert error["code"] == "bad_json"
    assert "nested too deeply" in error["message"]
    assert control.entries() == []


async def test_a_body_that_stops_arriving_gets_408_after_body_timeout_s(short_dir: Path, control: Control) -> None:
    config = fake_decoder_config(short_dir, server={"body_timeout_s": 0.3})
    data = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, await open_raw(running) as raw:
            # The head and half the body; the rest never comes.
            await raw.send_all(request_head(CHAT, len(data)) + data[: len(data) // 2])
            buffer = bytearray()
            await receive_until(raw, buffer, b"}}")
    head, _, payload = bytes(buffer).partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"408"
    assert b"connection: close" in head.lower()  # the rest of that body would be the next request
    assert json.loads(payload)["error"]["code"] == "body_timeout"
    assert control.entries() == []


async def test_a_client_that_stops_reading_its_stream_is_cancelled_after_write_timeout_s(
    short_dir: Path, control: Control, route_lines: RouteLines
) -> None:
    # Through the real server: the write deadline hangs up on the client, the server tells the
    # request's watch, and the request is cancelled like a hang-up, its line saying why.
    config = fake_decoder_config(short_dir, server={"write_timeout_s": 0.3})
    word = "w" * 2000  # every streamed token a 2 KB event: the socket's buffers fill after a few hundred
    data = json.dumps({"messages": [{"role": "user", "content": word}], "stream": True, "max_tokens": 100_000})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, await open_raw(running) as raw:
            raw.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await raw.send_all(request_head(CHAT, len(data)) + data.encode())
            (line,) = await route_lines.until(1)  # the client reads nothing meanwhile
            [entry] = await control.wait_entries(1)
    assert (line["outcome"], line["status"]) == ("cancelled", 200)
    assert "server.write_timeout_s" in line["error"]
    assert entry["disconnected"] is True  # the decoder's request was closed
    assert entry["sent"] < 100_000


async def test_a_head_that_never_ends_is_closed_after_idle_timeout_s(short_dir: Path, control: Control) -> None:
    config = fake_decoder_config(short_dir, server={"idle_timeout_s": 0.3})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running:
            async with await open_raw(running) as raw:
                await raw.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
                received = b""
                while chunk := await raw.receive_some():  # until the server closes
                    received += chunk
            # And the daemon still serves.
            async with client_for(running) as client:
                health = await client.get("/health")
    assert health.status_code == 200
    assert received == b""


async def test_a_broken_chunked_body_never_stops_the_front(short_dir: Path, control: Control) -> None:
    # hypercorn (onebitd's server until 2026-12-01) answered h11's "malformed chunk footer" with a
    # 400 of its own while the connection closed beside it: trio.BusyResourceError (two tasks sending
    # on one socket) escaped its connection handler and stopped the whole front (chaos's fuzz).
    broken = [b"2\r\n{}0\r\n\r\n", b"zz\r\n{}\r\n0\r\n\r\n", b"-1\r\n", b"ffffffffffffffff\r\nx", b"5\r\n{}\r\n"]
    paths = [CHAT, "/v1/completions", "/completion", "/health", "/nowhere"]
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir, server={"body_timeout_s": 0.5})) as running:
            for path in paths:
                for chunk in broken:
                    head = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
                    async with await open_raw(running) as raw:
                        await raw.send_all(head.encode() + b"content-type: application/json\r\n\r\n" + chunk)
                        with trio.move_on_after(2):  # a 4xx, or a close: either is fine
                            while await raw.receive_some():
                                pass
            async with client_for(running) as client:
                health = await client.get("/health")
    assert health.status_code == 200


def _stream_request(max_tokens: int) -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": True})
    return request_head(CHAT, len(body)) + body.encode()


async def test_a_keep_alive_connection_is_closed_after_idle_timeout_s_but_never_mid_request(
    short_dir: Path, control: Control
) -> None:
    # A stream that lasts longer than the idle timeout (6 tokens 0.15 s apart, against 0.3 s), then
    # a second request on the same connection, then nothing: closed once idle for 0.3 s.
    control.set(decoder=DecoderModes(token_delay_s=0.15))
    config = fake_decoder_config(short_dir, server={"idle_timeout_s": 0.3})
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, await open_raw(running) as raw:
            buffer = bytearray()
            await raw.send_all(_stream_request(6))
            await receive_until(raw, buffer, b"\r\n0\r\n\r\n")
            streamed = bytes(buffer)
            buffer.clear()
            await raw.send_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await receive_until(raw, buffer, b"}")
            health = bytes(buffer)
            while await raw.receive_some():  # until the server closes
                pass
    assert streamed.startswith(b"HTTP/1.1 200 ")
    assert b"[DONE]" in streamed
    assert health.startswith(b"HTTP/1.1 200 ")


async def test_an_idle_keep_alive_connection_is_closed_at_once_when_onebitd_stops(
    short_dir: Path, control: Control
) -> None:
    # idle_timeout_s is 75 s by default: a stop that waited for it would fail the timeout.
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running:
            raw = await open_raw(running)
            buffer = bytearray()
            await raw.send_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await receive_until(raw, buffer, b"}")
        async with raw:
            assert await raw.receive_some() == b""


async def test_a_refusal_sent_before_the_body_was_read_keeps_the_connection_for_the_next_request(
    short_dir: Path, control: Control
) -> None:
    # A refusal (here a 401) answers without reading the request's body.  A server that closes a
    # connection whose request body it has not seen the end of (hypercorn did, once a whole reply
    # went out in one write) makes the client's next request on it meet a close ("Server
    # disconnected without sending a response", test_api_keys_are_required_everywhere_but_health
    # through httpx, 2 runs in 10).  Sent as httpx sends it, this failed every time.
    config = fake_decoder_config(short_dir, server={"api_keys": ["key"]})
    data = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    replies: list[bytes] = []
    with trio.fail_after(TIMEOUT):
        async with run_daemon(config) as running, await open_raw(running) as raw:
            for _ in range(20):
                buffer = bytearray()
                await raw.send_all(request_head(CHAT, len(data)))  # as httpx sends: head, then body
                await raw.send_all(data)
                await receive_until(raw, buffer, b"}}")
                replies.append(bytes(buffer))
            buffer = bytearray()
            await raw.send_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await receive_until(raw, buffer, b"}")
    assert all(reply.startswith(b"HTTP/1.1 401 ") for reply in replies)
    assert buffer.startswith(b"HTTP/1.1 200 ")


def _tasks_named(name: str) -> list[trio.lowlevel.Task]:
    found: list[trio.lowlevel.Task] = []
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        if task is None:
            continue
        if task.name == name:
            found.append(task)
        stack.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return found


async def test_a_client_that_hangs_up_mid_stream_has_its_connection_closed(short_dir: Path, control: Control) -> None:
    # It sends its end-of-file and keeps reading: onebitd must close its side, and the decoder's
    # request.  A connection closed while a request was on it once kept its socket (and a task)
    # until onebitd stopped.  The stream would last 500 tokens x 0.2 s = 100 s, five times the
    # test's bound: a hang-up that is ignored fails on the bound, never passes by the stream ending.
    tokens, delay_s = 500, 0.2
    assert tokens * delay_s >= 5 * TIMEOUT
    control.set(decoder=DecoderModes(token_delay_s=delay_s))
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running, await open_raw(running) as raw:
            buffer = bytearray()
            await raw.send_all(_stream_request(tokens))
            await receive_until(raw, buffer, b"data: ")
            await raw.send_eof()
            while await raw.receive_some():  # until onebitd closes
                pass
            [entry] = await control.wait_entries(1)
    assert entry["disconnected"] is True
    assert entry["sent"] < tokens


async def test_a_connection_closed_after_its_reply_leaves_no_task_behind(short_dir: Path, control: Control) -> None:
    # A connection's tasks: its own, and the hang-up watcher its first streamed request started.
    # Seen while it is open, so that a rename fails here instead of finding nothing after the close.
    serving, watching = f"{connection.__name__}.Connection.run", f"{watch.__name__}.Watched._watcher"
    with trio.fail_after(TIMEOUT):
        async with run_daemon(fake_decoder_config(short_dir)) as running:
            async with await open_raw(running) as raw:
                buffer = bytearray()
                await raw.send_all(_stream_request(3))
                await receive_until(raw, buffer, b"\r\n0\r\n\r\n")
                await trio.testing.wait_all_tasks_blocked()
                open_ = [len(_tasks_named(serving)), len(_tasks_named(watching))]
                await raw.send_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                while await raw.receive_some():  # until onebitd closes
                    pass
            await trio.testing.wait_all_tasks_blocked()
            left = _tasks_named(serving) + _tasks_named(watching)
    assert open_ == [1, 1]
    assert left == []

"""Resumable streams through onebitd against the real llama-server: a stream sent with
``X-Conversation-Id`` whose client hangs up mid-way goes on into the decoder's session, and its
replay (``GET /v1/stream``), lookup (``POST /v1/streams/lookup``) and stop (``DELETE /v1/stream``)
answer through onebitd exactly as straight from the decoder's socket.

One onebitd (two slots) for the whole story: a few decoder starts' worth of time on a loaded machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from supervisor.api.endpoints import ROUTES, Kind
from supervisor.testing import unix_transport
from tests.rigs.helpers import open_raw, receive_until, wait_until
from tests.rigs.rig import RouteLines, Running, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

MODEL = {"parallel": 2, "ctx_size": 2048}
DEADLINE_S = 240
# Long enough that the client hangs up well before the end (ignore_eos: the length is max_tokens).
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0, "seed": 42, "stream": True}
# Longer than any test waits: a stream that only a stop ends.
ENDLESS = {**LONG, "max_tokens": 900}


def chat_body(**extra: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Count slowly."}], **extra}).encode()


async def hang_up_mid_stream(running: Running, conversation: str, body: bytes) -> None:
    """Send a streamed chat with a conversation id on a bare socket; close it after the first event."""
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"X-Conversation-Id: {conversation}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    async with await open_raw(running) as raw:
        await raw.send_all(head + body)
        buffer = bytearray()
        await receive_until(raw, buffer, b"data: ")
        assert buffer.startswith(b"HTTP/1.1 200"), bytes(buffer[:200])


async def replay(client: httpx.AsyncClient, conversation: str, offset: int = 0) -> tuple[int, str, bytes]:
    reply = await client.get("/v1/stream", params={"conv_id": conversation, "from": offset})
    return reply.status_code, reply.headers.get("content-type", ""), reply.content


async def lookup(client: httpx.AsyncClient, *ids: str) -> tuple[int, Any]:
    reply = await client.post("/v1/streams/lookup", json={"conversation_ids": list(ids)})
    return reply.status_code, reply.json()


def shape(sessions: Any) -> Any:
    """A lookup's answer less its clock: which sessions, whether done, how many bytes."""
    return [(s["conversation_id"], s["is_done"], s["total_bytes"]) for s in sessions]


async def test_a_stream_left_mid_way_finishes_into_its_session_and_replays_as_from_llama_server(
    short_dir: Path, route_lines: RouteLines
) -> None:
    real_llama_server()
    config = make_config(short_dir, model=MODEL, hybrid={"enabled": False})
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config) as running:
            transport = unix_transport(running.daemon.models.default.parts.launcher.socket)
            async with (
                httpx.AsyncClient(base_url=running.url, timeout=DEADLINE_S) as front,
                httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=DEADLINE_S) as direct,
            ):
                await hang_up_mid_stream(running, "conv-a", chat_body(**LONG))
                # The decoder's request went on to its end: the line comes once it has, detached.
                [line] = await route_lines.until(1)
                assert (line["outcome"], line["status"], line["endpoint"]) == ("detached", 200, "/v1/chat/completions")
                assert line["decoder_prompt_n"] is not None  # read from the final event, after the hang-up
                assert running.daemon.models.default.parts.slots.statistics().busy == 0

                # The whole stream, from the first byte and from an offset, as the decoder replays it.
                mine, theirs = await replay(front, "conv-a"), await replay(direct, "conv-a")
                assert mine == theirs
                assert mine[0] == 200
                assert mine[1].startswith("text/event-stream")
                assert mine[2].rstrip().endswith(b"data: [DONE]")
                assert mine[2].count(b"data: ") > 200  # a token each, the final event, [DONE]
                assert await replay(front, "conv-a", 100) == await replay(direct, "conv-a", 100)

                # Lookups, of a known and an unknown conversation.
                mine_l, theirs_l = await lookup(front, "conv-a", "nobody"), await lookup(direct, "conv-a", "nobody")
                assert mine_l[0] == theirs_l[0] == 200
                assert shape(mine_l[1]) == shape(theirs_l[1]) == [("conv-a", True, len(mine[2]))]

                # Errors in the decoder's words: no conv_id, a lost session, a bad offset.
                for params in ({}, {"conv_id": "nobody"}, {"conv_id": "conv-a", "from": "x"}):
                    a = await front.get("/v1/stream", params=params)
                    b = await direct.get("/v1/stream", params=params)
                    assert (a.status_code, a.json()) == (b.status_code, b.json()), params
                    assert a.headers["x-onebit-source"] == "decoder"

                # A stop: 204, and the session is gone for both.
                stopped = await front.delete("/v1/stream", params={"conv_id": "conv-a"})
                assert (stopped.status_code, stopped.content) == (204, b"")
                assert (await replay(front, "conv-a"))[0] == (await replay(direct, "conv-a"))[0] == 404
                assert await lookup(front, "conv-a") == await lookup(direct, "conv-a") == (200, [])


async def test_a_stop_ends_a_detached_stream_and_frees_its_slot(short_dir: Path, route_lines: RouteLines) -> None:
    real_llama_server()
    config = make_config(short_dir, model=MODEL, hybrid={"enabled": False})
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config) as running, httpx.AsyncClient(base_url=running.url, timeout=DEADLINE_S) as front:
            await hang_up_mid_stream(running, "conv-b", chat_body(**ENDLESS))
            # Detached, not cancelled: the slot stays held while the decoder goes on.
            assert running.daemon.models.default.parts.slots.statistics().busy == 1
            assert route_lines.lines == []
            status, sessions = await lookup(front, "conv-b")
            assert (status, [s["is_done"] for s in sessions]) == (200, [False])
            # A live replay sees the bytes as they come (a bare socket: httpx leaves generators behind
            # when a stream is abandoned), then the stop ends it.
            async with await open_raw(running) as raw:
                await raw.send_all(b"GET /v1/stream?conv_id=conv-b HTTP/1.1\r\nHost: localhost\r\n\r\n")
                buffer = bytearray()
                await receive_until(raw, buffer, b"data: ")
                assert buffer.startswith(b"HTTP/1.1 200"), bytes(buffer[:200])
                stopped = await front.delete("/v1/stream", params={"conv_id": "conv-b"})
                assert stopped.status_code == 204
                # The replay ends with the session: the chunked body's last chunk.
                await receive_until(raw, buffer, b"\r\n0\r\n\r\n")
            [line] = await route_lines.until(1)
            assert (line["outcome"], line["status"]) == ("detached", 200)
            await wait_until(lambda: running.daemon.models.default.parts.slots.statistics().busy == 0)
            assert await lookup(front, "conv-b") == (200, [])


async def test_every_route_onebitd_relays_or_routes_is_one_the_real_llama_server_answers(short_dir: Path) -> None:
    """The other half of tests/unit/api/test_endpoints.py's check against llama-server's route list: what
    onebitd passes on, the decoder it runs knows (none answers 404 there)."""
    real_llama_server()
    config = make_config(short_dir, model=MODEL, hybrid={"enabled": False})
    # One token at most wherever a body could start a generation: each asks the decoder for little.
    body = {"n_predict": 1, "max_tokens": 1, "max_output_tokens": 1}
    passed = [
        (method, path)
        for path, methods in ROUTES.items()
        for method, endpoint in methods.items()
        if endpoint.kind in (Kind.COMPLETION, Kind.SLOT, Kind.RELAY) and path != "/metrics/decoder"
    ]
    assert len(passed) >= 35
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config) as running:
            transport = unix_transport(running.daemon.models.default.parts.launcher.socket)
            async with httpx.AsyncClient(transport=transport, base_url="http://decoder", timeout=DEADLINE_S) as direct:
                answers = {}
                for method, path in passed:
                    reply = await direct.request(method, path, json=body if method == "POST" else None)
                    answers[(method, path)] = reply.status_code
    assert {route: status for route, status in answers.items() if status == 404} == {}
    assert answers[("GET", "/cors-proxy")] == 403  # --ui-mcp-proxy is off: "this feature is disabled"

"""The tests' and the benchmarks' httpx transport (supervisor/testing.py): a request llama-server
dropped unanswered on a pooled connection is sent again once; anything else is not."""

from __future__ import annotations

import httpx
import pytest

from supervisor.testing import FreshOnStale


class Flaky(httpx.AsyncBaseTransport):
    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        if self.failures:
            raise self.failures.pop(0)
        return httpx.Response(200, json={"ok": True})


STALE = httpx.RemoteProtocolError("Server disconnected without sending a response.")


async def test_a_request_dropped_unanswered_is_sent_again_once() -> None:
    inner = Flaky(STALE)
    async with httpx.AsyncClient(transport=FreshOnStale(inner), base_url="http://decoder") as client:
        reply = await client.post("/completion", json={"prompt": "hi"})
    assert (reply.status_code, inner.sent) == (200, 2)


async def test_twice_dropped_is_an_error() -> None:
    inner = Flaky(STALE, STALE)
    async with httpx.AsyncClient(transport=FreshOnStale(inner), base_url="http://decoder") as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/completion", json={"prompt": "hi"})
    assert inner.sent == 2


async def test_a_connection_lost_mid_answer_is_not_sent_again() -> None:
    inner = Flaky(httpx.RemoteProtocolError("peer closed connection without sending complete message body"))
    async with httpx.AsyncClient(transport=FreshOnStale(inner), base_url="http://decoder") as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/completion", json={"prompt": "hi"})
    assert inner.sent == 1

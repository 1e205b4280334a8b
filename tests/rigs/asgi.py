"""Driving ``Front`` in process, the way its HTTP server drives it, for the tests that need no socket.

:func:`call` sends one request through the ASGI interface and collects the reply.  Like the server,
it reports ``http.disconnect`` once the response has finished, and its ``send`` goes on awaiting
after queueing that disconnect (the stream's events, the socket write): a cancel can land inside it,
which is how a response's last byte used to cancel the work after it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import trio

from supervisor.api.front import Front
from supervisor.supervise.child import ChildState, ChildStatistics


@attrs.define
class ReadyDecoder:
    """The supervised decoder as ``Completions`` and ``Front`` see it: ready, in some generation."""

    state: ChildState = ChildState.READY
    generation: int = 1

    def statistics(self) -> ChildStatistics:
        raise AssertionError("a ready decoder is not asked why it failed")


@attrs.frozen
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    chunks: list[bytes]

    def json(self) -> Any:
        return json.loads(self.body)


async def call(
    front: Front,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    query: str = "",
    *,
    hang_up_on: bytes | None = None,
    hang_up_after_s: float | None = None,
    body_after_s: float = 0.0,
    client: tuple[str, int] | None = ("127.0.0.1", 50000),
) -> Reply:
    """One request; the client hangs up once the reply is whole, or once a chunk holding
    ``hang_up_on`` came (as a client that closes on ``data: [DONE]``), or ``hang_up_after_s`` after
    its body, whatever came by then (no reply at all: status 0).  ``body_after_s``: the body
    comes this long after the head (a slow client; under an autojump clock, no real wait).
    ``client``: the peer's address, as the server gives it (None: unknown)."""
    sent: list[dict[str, Any]] = []
    finished = trio.Event()
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            if body_after_s:
                await trio.sleep(body_after_s)
            raw = b"" if body is None else json.dumps(body).encode()
            return {"type": "http.request", "body": raw, "more_body": False}
        with trio.move_on_after(math.inf if hang_up_after_s is None else hang_up_after_s):
            await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finished.set()
        if hang_up_on is not None and hang_up_on in message.get("body", b""):
            finished.set()
        for _ in range(3):
            await trio.lowlevel.checkpoint()

    given = {"host": "localhost", "content-type": "application/json", **(headers or {})}
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query.encode(),
        "headers": [(k.encode(), v.encode()) for k, v in given.items()],
        "client": client,
    }
    await front(scope, receive, send)
    if not sent:
        return Reply(0, {}, b"", [])
    [start, *bodies] = sent
    chunks = [m.get("body", b"") for m in bodies]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}  # as a client's, case-insensitive
    return Reply(start["status"], headers, b"".join(chunks), chunks)

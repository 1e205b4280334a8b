"""The way back to the HTTP client: an ASGI ``send`` with the JSON error envelope and first-byte timing.

Every error onebitd itself answers has one shape, and says who produced it:

    {"error": {"message": "...", "type": "invalid_request_error", "code": "bad_json", "source": "onebitd"}}

except on Anthropic's paths (``/v1/messages``...), where an Anthropic client reads Anthropic's shape:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

What the decoder answered (a reply, or an error in llama-server's own shape) is relayed as it wrote it.
Every response says who produced it in ``X-Onebit-Source: onebitd|decoder``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

# The ASGI callables, declared once: supervisor/http/server.py calls the app with them, front.py is the app.
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SOURCE_HEADER = "X-Onebit-Source"
ANTHROPIC_PATHS = "/v1/messages"  # the path and those below it (count_tokens)

# Anthropic's error types by status (its API's errors page); another 4xx is an invalid request, and
# another 5xx an API error.  onebitd's 503s (every slot busy, the decoder not ready, draining) are
# what Anthropic calls overloaded.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_body(status: int, code: str, message: str, *, source: str = "onebitd", type_: str = "") -> bytes:
    if not type_:
        type_ = "invalid_request_error" if status < 500 else "server_error"
        if status == 401:
            type_ = "authentication_error"
    envelope = {"error": {"message": message, "type": type_, "code": code, "source": source}}
    return json.dumps(envelope).encode()


def anthropic_error_body(status: int, message: str) -> bytes:
    type_ = _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return json.dumps({"type": "error", "error": {"type": type_, "message": message}}).encode()


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


class Responder:
    """Wraps ASGI ``send``: remembers whether the response started and when the first byte left."""

    def __init__(
        self, send: Send, started_at: float, headers: Iterable[tuple[str, str]] = (), *, anthropic: bool = False
    ) -> None:
        self._send = send
        # onebitd's own errors in Anthropic's shape (a request on its API's paths).
        self.anthropic = anthropic
        # The request's arrival (trio clock): the one origin of every time the route line gives.
        self.started_at = started_at
        self._headers = list(headers)  # on every response (the CORS headers)
        self.status: int | None = None
        self.first_byte_ms: float | None = None
        self.finished = False  # the last byte was handed to the server
        # The client has had all it asked for: the last byte, or a stream's final event (what
        # follows it, the end of the chunked body, tells the client nothing).  A client may hang up
        # from here on (the README's openai example closes on ``data: [DONE]``) and that is no
        # cancellation.
        self.complete = False
        self.streaming = False  # the response is an event stream (its body comes as it is made)

    @property
    def started(self) -> bool:
        return self.status is not None

    async def start(self, status: int, headers: Iterable[tuple[str, str]] = (), *, source: str = "onebitd") -> None:
        self.status = status
        every = [*headers, *self._headers, (SOURCE_HEADER, source)]
        self.streaming = any(k == "Content-Type" and v.startswith("text/event-stream") for k, v in every)
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in every],
            }
        )

    def elapsed_ms(self) -> float:
        """Milliseconds since the request arrived."""
        return (trio.current_time() - self.started_at) * 1000

    async def body(self, chunk: bytes, *, more: bool, final: bool = False) -> None:
        """``final``: ``chunk`` holds the stream's final event (see :attr:`complete`)."""
        if self.first_byte_ms is None and chunk:
            self.first_byte_ms = self.elapsed_ms()
        # Set before sending: the server may report the client's disconnect (and so cancel us)
        # while the chunk is being handed over, and that is a complete response.
        if final or not more:
            self.complete = True
        if not more:
            self.finished = True
        await self._send({"type": "http.response.body", "body": chunk, "more_body": more})

    async def whole(
        self,
        status: int,
        body: bytes,
        content_type: str,
        headers: Iterable[tuple[str, str]] = (),
        *,
        source: str = "onebitd",
    ) -> None:
        head = [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers]
        await self.start(status, head, source=source)
        await self.body(body, more=False)

    async def json(self, status: int, data: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
        await self.whole(status, json.dumps(data).encode(), "application/json", headers)

    async def error(
        self,
        status: int,
        code: str,
        message: str,
        *,
        source: str = "onebitd",
        retry_after: int | None = None,
        type_: str = "",
    ) -> None:
        headers = [("Retry-After", str(retry_after))] if retry_after is not None else []
        if self.anthropic:
            body = anthropic_error_body(status, message)
        else:
            body = error_body(status, code, message, source=source, type_=type_)
        await self.whole(status, body, "application/json", headers)

    async def llama_error(self, status: int, type_: str, message: str) -> None:
        """onebitd's answer in llama-server's error shape, where it stands in for an answer llama-server
        gives itself (a feature that is off): ``{"error": {"code": 501, "message", "type"}}``."""
        body = json.dumps({"error": {"code": status, "message": message, "type": type_}}).encode()
        await self.whole(status, body, "application/json; charset=utf-8")

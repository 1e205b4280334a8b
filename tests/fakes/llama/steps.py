"""What the fake llama-server's core reads and returns: a :class:`Request`, an :class:`HttpError` for an
error reply in llama-server's shape, and the :data:`Step`\\ s of an answer, which an adapter drives
(a pause is the adapter's to wait out; closing the answer says the client left)."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 501: "not_supported_error"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, type_: str = "", **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ERROR_TYPES.get(status, "unavailable_error" if status == 503 else "server_error")
        self.extra = extra  # fields some errors carry besides the three

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]  # each name's last value
    raw: bytes

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.raw or b"{}")
        except ValueError as exc:
            raise HttpError(400, f"[json.exception.parse_error.101] parse error: {exc}") from None
        if not isinstance(data, dict):
            raise HttpError(400, "[json.exception.type_error.304] cannot use at() with array")
        return data


def dump(data: Any) -> bytes:
    """JSON as llama-server writes it: no spaces (nlohmann's ``dump()``)."""
    return json.dumps(data, separators=(",", ":")).encode()


JSON = "application/json; charset=utf-8"
EVENTS = "text/event-stream"


@dataclass(frozen=True)
class Whole:
    """A whole reply.  ``close``: the connection is closed after it, as llama-server does after an error."""

    status: int
    body: bytes
    content_type: str = JSON
    close: bool = False


@dataclass(frozen=True)
class Head:
    """A streamed reply begins; its :class:`Chunk`\\ s follow, and it ends with the answer."""

    status: int = 200
    content_type: str = EVENTS


@dataclass(frozen=True)
class Chunk:
    data: bytes


@dataclass(frozen=True)
class Pause:
    """Wait while ``held()``: the in-process adapter until its ``release``, the program by polling (both
    give up when the client leaves, which closes the answer)."""

    held: Callable[[], bool]


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class After:
    """An effect to run once the reply before it is sent (blocking; the in-process adapter runs it in a
    thread)."""

    effect: Callable[[], None]


Step = Whole | Head | Chunk | Pause | Sleep | After
Answer = Generator[Step, None, None]


def reply(status: int, data: Any) -> Whole:
    return Whole(status, dump(data))


def event(data: dict[str, Any] | str) -> Chunk:
    """One server-sent event: ``data: {...}`` (or ``data: [DONE]``)."""
    return Chunk(b"data: " + (data.encode() if isinstance(data, str) else dump(data)) + b"\n\n")

"""The front's responses as bytes, without I/O: the head, the chunks of a body without a length, and
whether the connection is kept after the response (:class:`Close`, the one table of reasons to close).

A response keeps the length the app declares; without one it is chunked (HTTP/1.1) or ends with the
connection (1.0).  HEAD, 1xx, 204 and 304 carry no body.  Every head carries ``Date`` and, when the
connection closes after it, ``Connection: close``.
"""

from __future__ import annotations

import email.utils
import enum
import http
import time

import attrs

from .reading import tokens

REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
NO_BODY = frozenset({204, 304})
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


class Close(enum.Enum):
    """Why a connection closes after its response; a request with none of them keeps it."""

    CLIENT_ASKED = "the request said Connection: close, or spoke HTTP/1.0"
    APP_ASKED = "the response's head said Connection: close"
    UNTIL_EOF = "an HTTP/1.0 response without a length: its body ends with the connection"
    BODY_UNREAD = "a body the app left unread that is not cheap to drop (chunked, large, or 100 Continue owed)"
    STOPPING = "the server stops"
    APP_FAILED = "the app raised (its answer, if any, is the server's)"
    NO_RESPONSE = "the app returned without a response"
    CUT = "the response did not finish: only a close tells the client"
    WRONG_LENGTH = "the body sent was not the length the head declared"
    BODY_MALFORMED = "the request's body was not HTTP"
    BODY_TIMEOUT = "the request's body did not come within server.body_timeout_s"
    BODY_GONE = "the client closed in the middle of its request's body"
    DISCARD_TIMEOUT = "the unread body was not dropped within the idle timeout"


_date = (0, b"")


def http_date() -> bytes:
    """Now, as a Date header's value (made once a second)."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, email.utils.formatdate(now, usegmt=True).encode())
    return _date[1]


def head(status: int, headers: list[tuple[bytes, bytes]], length: int | None, *, close: bool) -> bytes:
    """A response head: the status line, ``headers`` as given, then Content-Length, Connection and Date."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b""))]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    if length is not None:
        lines.append(b"Content-Length: %d\r\n" % length)
    if close:
        lines.append(b"Connection: close\r\n")
    lines.append(b"Date: " + http_date() + b"\r\n\r\n")
    return b"".join(lines)


def chunk(body: bytes) -> bytes:
    """One chunk of a chunked body (``body`` not empty: an empty chunk is the last, :data:`LAST_CHUNK`)."""
    return b"%x\r\n" % len(body) + body + b"\r\n"


@attrs.define(slots=True)
class Framing:
    """How a response's body is framed, from its head as the app gave it."""

    headers: list[tuple[bytes, bytes]]  # as they go out: without Content-Length, Connection, Transfer-Encoding
    declared: int | None  # the app's Content-Length
    chunked: bool
    bodiless: bool
    close: Close | None  # a reason the head itself gives to close


def frame(method: str, version: str, status: int, given: list[tuple[bytes, bytes]]) -> Framing:
    """The framing of the app's response head (RuntimeError for a head that cannot go out)."""
    declared: int | None = None
    close: Close | None = None
    headers: list[tuple[bytes, bytes]] = []
    for name, value in given:
        lower = name.lower()
        if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name:
            raise RuntimeError(f"response header {name!r} holds a line break")
        if lower == b"content-length":
            if not value.isdigit():
                raise RuntimeError(f"response Content-Length {value!r} is not a length")
            declared = int(value)
            continue
        if lower == b"connection":
            if b"close" in tokens([value]):
                close = Close.APP_ASKED
            continue
        if lower == b"transfer-encoding":
            continue
        headers.append((name, value))
    bodiless = method == "HEAD" or status in NO_BODY or status < 200
    chunked = False
    if declared is None and not bodiless:
        if version == "1.1":
            chunked = True
            headers.append((b"Transfer-Encoding", b"chunked"))
        elif close is None:
            close = Close.UNTIL_EOF
    return Framing(headers, declared, chunked, bodiless, close)


def length_sent(status: int, declared: int | None) -> int | None:
    """The Content-Length the head says: the app's, except on a status that has no body."""
    return None if status in NO_BODY or status < 200 else declared

"""What both readers share (supervisor/http/framing/readers.py): the events they hand out, the limits
they count, and feeding llhttp one message's bytes at a time.

Every limit is counted here, on the bytes' place in the stream, so it holds the same whatever way the
bytes were split into reads: a head up to ``max_head`` bytes before its blank line, at most
:data:`MAX_HEADERS` fields, trailers up to :data:`MAX_TRAILER_BYTES`, a chunk-size line up to
:data:`MAX_CHUNK_LINE` (requests), blank lines before a request line up to :data:`MAX_BLANK_BYTES`.
For that the reader feeds llhttp no message's bytes together with the next one's: a head is fed up to
the CRLF CRLF that ends it, a Content-Length body to its length, a chunked body up to each line end
(a request's) or each CRLF CRLF (a reply's; its last bytes are one), so that a message always ends
where a piece fed ends, and the blank lines after it are counted here.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import attrs
import httptools

from ...errors import Malformed

MAX_HEAD_BYTES = 16 * 1024  # a request line and its headers (h11's and hypercorn's limit)
MAX_HEADERS = 100  # fields in a head, and in trailers (Apache's LimitRequestFields)
MAX_TRAILER_BYTES = 16 * 1024
MAX_CHUNK_LINE = 1024  # a chunk-size line with its extensions
MAX_BLANK_BYTES = 64  # CR and LF bytes before a request line (RFC 9112 section 2.2 asks for at least one)
MAX_LENGTH_DIGITS = 18  # a Content-Length that fits in 63 bits

_HEAD_END = b"\r\n\r\n"
_SPECIAL = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"expect"})
_REASONS = (
    # llhttp's reason -> (status, code, what) for what is refused on its word.
    ("Invalid HTTP version", 505, "http_version", "HTTP version"),
    ("can't be present with", 400, "bad_request", "content-length"),  # both Content-Length and Transfer-Encoding
    ("Transfer-Encoding", 501, "transfer_encoding", "Transfer-Encoding"),
    ("Content-Length", 400, "bad_request", "content-length"),
    ("status", 400, "bad_request", "status line"),
    ("HTTP/", 400, "bad_request", "status line"),
    ("chunk size", 400, "bad_chunked_body", "chunk size"),
    ("chunk data", 400, "bad_chunked_body", "chunk (no CRLF after its data)"),
    ("chunk", 400, "bad_chunked_body", "chunk"),
    ("header", 400, "bad_request", "header line"),
    ("method", 400, "bad_request", "request line"),
    ("url", 400, "bad_request", "request target"),
)


@attrs.define(slots=True)  # not frozen: its __init__ runs once a request (see docs/benchmarks.md)
class RequestHead:
    method: str
    path: str  # percent-decoded
    raw_path: bytes
    query: bytes
    version: str  # "1.1" or "1.0"
    headers: list[tuple[bytes, bytes]]  # names lower-case, in order
    keep_alive: bool  # the client did not ask to close (and speaks 1.1)
    expect_continue: bool
    chunked: bool
    length: int  # of a Content-Length body; 0 when chunked


@attrs.define(slots=True)
class ResponseHead:
    status: int
    version: str
    headers: list[tuple[bytes, bytes]]  # names as the server wrote them, in order
    keep_alive: bool
    chunked: bool
    length: int | None  # None: chunked, or the body runs to the end of the connection (until_eof)
    until_eof: bool


class _End:
    def __repr__(self) -> str:
        return "END"


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


END: Final = _End()
NEED_DATA: Final = _NeedData()
Event = RequestHead | ResponseHead | bytes | _End

_BOUNDARY, _HEAD, _LENGTH, _CHUNKED, _EOF = range(5)


def _last3(tail: bytes, piece: bytes) -> bytes:
    return piece[-3:] if len(piece) >= 3 else (tail + piece)[-3:]


def tokens(values: list[bytes]) -> list[bytes]:
    """The comma-separated tokens of a field's values, lower-case (``Connection``, ``Expect``...)."""
    return [token.strip(b" \t").lower() for value in values for token in value.split(b",") if token.strip(b" \t")]


def _translate(exc: Exception, body: bool) -> Malformed:
    reason = str(exc)
    status, code, what = next(
        ((status, code, what) for fragment, status, code, what in _REASONS if fragment in reason),
        (400, "bad_request", "message"),
    )
    if body and code == "bad_request":
        code = "bad_chunked_body"
    return Malformed(status, code, f"malformed {what}: {reason}")


class _Reader:
    """What both readers share: feeding llhttp piece by piece, the event queue, the limits."""

    _parser: httptools.HttpRequestParser | httptools.HttpResponseParser
    _whole_chunks = False  # True: a chunked body is fed up to each CRLF CRLF (a reply's), not line by line

    def __init__(self, max_head: int) -> None:
        self.max_head = max_head
        self._events: deque[Event] = deque()
        self._error: Malformed | None = None
        self._state = _BOUNDARY
        self._blank = 0  # CR and LF bytes since the last message
        self._head = 0  # bytes of the head so far
        self._tail = b""  # the head's or the chunked body's last bytes, for a CRLF CRLF split across reads
        self._left = 0  # bytes of a Content-Length body still to come
        self._line = 0  # bytes since the last LF (a chunked request body)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._lower = True  # the head's names as the reader hands them: lower-case, or as written
        self._special: dict[bytes, list[bytes]] = {}  # the values of the fields in _SPECIAL, by lower-case name
        self._fields = 0
        self._trailer_bytes = 0
        self._fresh = False  # a new parser took over in the piece being fed: the old one's end is no end

    # -- the public surface -------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Take bytes as they came; the events they complete are queued (none after an error)."""
        if self._error is not None:
            return
        try:
            if self._state == _CHUNKED and self._whole_chunks:
                # The common piece of a reply's chunked body (an event stream's next chunks): no CRLF
                # CRLF in it, nor one begun in the bytes before, so _feed would make one piece of it.
                # rfind: CPython's reverse search is the quicker one for this needle (docs/benchmarks.md).
                joined = self._tail + data
                if joined.rfind(_HEAD_END) < 0:
                    self._tail = joined[-3:]
                    self._parse(data, body=True)
                    return
            self._feed(data)
        except Malformed as exc:
            self._error = exc

    def next_event(self) -> Event | _NeedData:
        """The next event, or NEED_DATA; raises :class:`Malformed` once the events before it are out."""
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            raise self._error
        return NEED_DATA

    def take_body(self) -> tuple[bytes, bool]:
        """What has come of the current message's body (its pieces joined; b"" when none), and whether
        its END came too (taken with it).  A body found malformed before its END raises
        :class:`Malformed` at once, the pieces before the fault dropped.  Only between a head and its END."""
        events = self._events
        if self._error is not None and END not in events:
            raise self._error
        if not events:
            return b"", False
        first = events.popleft()
        if first is END:
            return b"", True
        assert isinstance(first, bytes), first
        if not events:
            return first, False
        if events[0] is END:  # the common whole body: one piece, and its end
            events.popleft()
            return first, True
        pieces = [first]
        while events:
            event = events.popleft()
            if event is END:
                return b"".join(pieces), True
            assert isinstance(event, bytes), event
            pieces.append(event)
        return b"".join(pieces), False

    @property
    def pending(self) -> bool:
        """Whether anything of a next message (or an error) has come beyond the events handed out."""
        return bool(self._events) or self._error is not None or self._state != _BOUNDARY or self._blank > 0

    @property
    def in_body(self) -> bool:
        return self._state in (_LENGTH, _CHUNKED, _EOF)

    # -- feeding ------------------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        pos, size = 0, len(data)
        while pos < size:
            state = self._state
            if state == _BOUNDARY:
                start = pos
                while pos < size and data[pos] in b"\r\n":
                    pos += 1
                self._blank += pos - start
                if self._blank > MAX_BLANK_BYTES:
                    raise Malformed(400, "bad_request", "too many blank lines before the request line")
                if pos < size:  # a message begins
                    self._state, self._head, self._tail = _HEAD, 0, b""
                    self._url = b""
                    self._headers = []
                    self._special = {}
                    self._fields = self._trailer_bytes = 0
            elif state == _HEAD:
                end = self._find_end(data, pos)
                stop = size if end < 0 else end
                room = self.max_head + len(_HEAD_END) - self._head
                if stop - pos > room:
                    self._parse(data[pos : pos + room], body=False)
                    raise self._too_large()
                piece = data[pos:stop] if pos or stop < size else data
                self._head += len(piece)
                self._tail = b"" if end >= 0 else _last3(self._tail, piece)
                self._parse(piece, body=False)
                pos = stop
            elif state == _LENGTH:
                stop = min(size, pos + self._left)
                self._left -= stop - pos
                self._parse(data[pos:stop] if pos or stop < size else data, body=True)
                pos = stop
            elif state == _CHUNKED:
                pos = self._feed_chunked(data, pos)
            else:  # _EOF: the body runs to the end of the connection
                self._parse(data[pos:] if pos else data, body=True)
                pos = size

    def _feed_chunked(self, data: bytes, pos: int) -> int:
        raise NotImplementedError

    def _find_end(self, data: bytes, pos: int) -> int:
        """Where the first CRLF CRLF from ``pos`` (with the tail before it) ends in ``data``; -1: none."""
        tail = self._tail
        if tail:
            joined = tail + data[pos : pos + 3]
            at = joined.find(_HEAD_END)
            if at >= 0:
                return pos + at + 4 - len(tail)
        at = data.find(_HEAD_END, pos)
        return at + 4 if at >= 0 else -1

    def _parse(self, piece: bytes, *, body: bool) -> None:
        self._fresh = False
        try:
            self._parser.feed_data(piece)
        except httptools.HttpParserUpgrade:
            pass  # the upgrade is not taken (see on_headers_complete): the parser goes on after the message
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, Malformed):
                raise exc.__context__ from None
            raise
        except httptools.HttpParserError as exc:
            raise _translate(exc, body or self.in_body) from None

    def _too_large(self) -> Malformed:
        return Malformed(431, "head_too_large", f"head over {self.max_head} bytes")

    # -- llhttp's callbacks -------------------------------------------------------------------------

    # No on_message_begin (a call less a message): _feed resets the message's state where it begins.

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._state == _HEAD:
            if self._fields > MAX_HEADERS:
                raise Malformed(431, "head_too_large", f"more than {MAX_HEADERS} header fields")
            lower = name.lower()
            value = value.rstrip(b" \t")
            self._headers.append((lower if self._lower else name, value))
            if lower in _SPECIAL:
                self._special.setdefault(lower, []).append(value)
        else:  # a trailer: checked by llhttp, counted here, and dropped
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > MAX_TRAILER_BYTES or self._fields > MAX_HEADERS:
                raise Malformed(400, "bad_chunked_body", "chunked trailers too large")

    def on_body(self, body: bytes) -> None:
        self._events.append(body)

    def on_message_complete(self) -> None:
        if self._fresh:
            return
        self._events.append(END)
        self._state, self._blank, self._line, self._tail = _BOUNDARY, 0, 0, b""

    def _framing(self, version: str) -> tuple[bool, int, list[bytes]]:
        """(chunked, length, Connection tokens) from the head's fields, by onebitd's rules."""
        special = self._special
        codings = special.get(b"transfer-encoding")
        lengths = special.get(b"content-length")
        connection = special.get(b"connection")
        chunked = False
        length = 0
        if codings:  # llhttp has refused it beside a Content-Length
            if tokens(codings) != [b"chunked"] or version != "1.1":
                raise Malformed(501, "transfer_encoding", "only Transfer-Encoding: chunked is supported")
            chunked = True
        elif lengths:  # llhttp has refused two, and any but digits
            if len(lengths[0]) > MAX_LENGTH_DIGITS:
                raise Malformed(400, "bad_request", "malformed Content-Length: too many digits")
            length = int(lengths[0])
        return chunked, length, tokens(connection) if connection else []

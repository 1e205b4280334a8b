"""The two readers: :class:`RequestReader` for the bytes a client sends the front,
:class:`ResponseReader` for the bytes llama-server sends the decoder client, each with the checks of
its own side (Host, the request target, CONNECT, Upgrade; a HEAD's bodiless reply)."""

from __future__ import annotations

from urllib.parse import unquote

import httptools

from ...errors import Malformed
from .reading import (
    _CHUNKED,
    _EOF,
    _LENGTH,
    MAX_CHUNK_LINE,
    MAX_HEAD_BYTES,
    RequestHead,
    ResponseHead,
    _last3,
    _Reader,
    tokens,
)


class RequestReader(_Reader):
    """The requests a client sends on one connection, in order (pipelined ones included)."""

    def __init__(self, max_head: int = MAX_HEAD_BYTES) -> None:
        super().__init__(max_head)
        self._parser = httptools.HttpRequestParser(self)

    def _feed_chunked(self, data: bytes, pos: int) -> int:
        # A line at a time: a size line is then exactly what was fed since the last LF when llhttp
        # reports its chunk, so its length is known whatever the reads were.
        end = data.find(b"\n", pos)
        stop = len(data) if end < 0 else end + 1
        self._line += stop - pos
        self._parse(data[pos:stop], body=True)
        if end >= 0:
            self._line = 0
        return stop

    def on_chunk_header(self) -> None:
        if self._line > MAX_CHUNK_LINE + 2:
            raise Malformed(400, "bad_chunked_body", "malformed chunked request body: chunk size line too long")

    def on_headers_complete(self) -> None:
        parser = self._parser
        version = parser.get_http_version()
        if version == "0.9":
            raise Malformed(400, "bad_request", "malformed request line")
        if version not in ("1.1", "1.0"):
            raise Malformed(505, "http_version", f"HTTP version {version} is not supported")
        method = parser.get_method().decode("ascii")  # type: ignore[union-attr]
        if method == "CONNECT":
            raise Malformed(501, "not_implemented", "CONNECT is not served here")
        special = self._special
        if version == "1.1" and len(special.get(b"host", ())) != 1:
            raise Malformed(400, "bad_request", "an HTTP/1.1 request needs exactly one Host header")
        chunked, length, connection = self._framing(version)
        expect = special.get(b"expect")
        if parser.should_upgrade() and (chunked or length):
            # llhttp would take the body for the new protocol's bytes; a bodiless one is served as
            # plain HTTP/1.1 (RFC 9110 section 7.8 lets a server ignore Upgrade; curl --http2 sends one).
            raise Malformed(501, "not_implemented", "an Upgrade with a request body is not served")
        path, raw_path, query = _target(self._url, method)
        self._events.append(
            RequestHead(
                method=method,
                path=path,
                raw_path=raw_path,
                query=query,
                version=version,
                headers=self._headers,
                keep_alive=version == "1.1" and b"close" not in connection,
                expect_continue=version == "1.1" and expect is not None and b"100-continue" in tokens(expect),
                chunked=chunked,
                length=length,
            )
        )
        self._state = _CHUNKED if chunked else _LENGTH
        self._left = length
        self._fields = 0  # trailers count their own


def _target(target: bytes, method: str) -> tuple[str, bytes, bytes]:
    """(path, raw path, query) of a request target: origin-form, absolute-form, or ``*`` for OPTIONS."""
    if target.startswith((b"http://", b"https://")):  # absolute-form (a proxy's)
        slash = target.find(b"/", target.find(b"//") + 2)
        target = target[slash:] if slash >= 0 else b"/"
    elif target == b"*" and method == "OPTIONS":
        return "*", b"*", b""
    elif not target.startswith(b"/"):
        raise Malformed(400, "bad_request", "malformed request target")
    raw_path, _, query = target.partition(b"?")
    raw_path = raw_path.partition(b"#")[0]
    try:
        path = raw_path.decode("ascii")  # llhttp let no byte over 0x7e through
        if "%" in path:
            path = unquote(path, errors="strict")
    except UnicodeDecodeError:
        raise Malformed(400, "bad_request", "request path is not UTF-8") from None
    return path, raw_path, query.partition(b"#")[0]


class ResponseReader(_Reader):
    """The replies on one connection to llama-server; :meth:`expect` says what each answers."""

    _whole_chunks = True

    def __init__(self, max_head: int) -> None:
        super().__init__(max_head)
        self._parser = httptools.HttpResponseParser(self)
        self._lower = False
        self._head_request = False

    def expect(self, method: str) -> None:
        """The next reply answers ``method`` (a HEAD's carries no body, whatever its head says)."""
        self._head_request = method == "HEAD"

    def _feed_chunked(self, data: bytes, pos: int) -> int:
        # A chunked body ends with a CRLF CRLF: fed up to each one, it ends where a piece ends.
        end = self._find_end(data, pos)
        stop = len(data) if end < 0 else end
        piece = data[pos:stop] if pos or stop < len(data) else data
        self._tail = b"" if end >= 0 else _last3(self._tail, piece)
        self._parse(piece, body=True)
        return stop

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert isinstance(parser, httptools.HttpResponseParser)
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise Malformed(400, "bad_request", f"malformed status line: HTTP version {version}")
        status = parser.get_status_code()
        chunked, length, connection = self._framing(version)
        keep_alive = b"close" not in connection if version == "1.1" else b"keep-alive" in connection
        bodiless = self._head_request or status < 200 or status in (204, 304)
        until_eof = not bodiless and not chunked and b"content-length" not in self._special
        self._events.append(
            ResponseHead(
                status=status,
                version=version,
                headers=self._headers,
                keep_alive=keep_alive and not until_eof,
                chunked=chunked and not bodiless,
                length=0 if bodiless else (None if chunked or until_eof else length),
                until_eof=until_eof,
            )
        )
        if bodiless:
            if self._head_request and status >= 200:
                # llhttp cannot be told that this reply has no body: it ends here, and the next
                # reply is read by a new parser (nothing after this head was fed to this one).
                self.on_message_complete()
                self._parser = httptools.HttpResponseParser(self)
                self._fresh = True
            self._head_request = False
            return
        self._state = _CHUNKED if chunked else (_EOF if until_eof else _LENGTH)
        self._left = length
        self._fields = 0  # trailers count their own

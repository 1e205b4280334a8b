"""supervisor/http/framing/writers.py without sockets: a response head's framing, decided from the head
the app gives, as a table; the bytes of a head and of a chunk."""

from __future__ import annotations

import pytest

from supervisor.http.framing import writers
from supervisor.http.framing.writers import Close

JSON = (b"Content-Type", b"application/json")
CHUNKED = (b"Transfer-Encoding", b"chunked")


@pytest.mark.parametrize(
    ("method", "version", "status", "given", "headers", "declared", "chunked", "bodiless", "close"),
    [
        ("GET", "1.1", 200, [JSON, (b"Content-Length", b"2")], [JSON], 2, False, False, None),
        ("GET", "1.1", 200, [JSON], [JSON, CHUNKED], None, True, False, None),
        ("GET", "1.0", 200, [JSON], [JSON], None, False, False, Close.UNTIL_EOF),
        ("GET", "1.1", 200, [(b"Connection", b"Keep-Alive, Close")], [CHUNKED], None, True, False, Close.APP_ASKED),
        ("GET", "1.1", 200, [(b"Transfer-Encoding", b"gzip")], [CHUNKED], None, True, False, None),
        ("HEAD", "1.1", 200, [(b"Content-Length", b"5")], [], 5, False, True, None),
        ("GET", "1.0", 204, [], [], None, False, True, None),
        ("GET", "1.1", 304, [], [], None, False, True, None),
        ("GET", "1.1", 101, [], [], None, False, True, None),
    ],
    ids=["length", "chunked", "until_eof", "app_closes", "app_coding_dropped", "head", "204", "304", "1xx"],
)
def test_a_response_s_framing_follows_from_its_head(
    method: str,
    version: str,
    status: int,
    given: list[tuple[bytes, bytes]],
    headers: list[tuple[bytes, bytes]],
    declared: int | None,
    chunked: bool,
    bodiless: bool,
    close: Close | None,
) -> None:
    assert writers.frame(method, version, status, given) == writers.Framing(headers, declared, chunked, bodiless, close)


@pytest.mark.parametrize(
    "given",
    [[(b"X-A", b"one\r\ntwo")], [(b"X\nA", b"one")], [(b"Content-Length", b"-1")], [(b"Content-Length", b"1a")]],
    ids=["value_line_break", "name_line_break", "negative_length", "non_digit_length"],
)
def test_a_head_that_cannot_go_out_is_the_app_s_error(given: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(RuntimeError):
        writers.frame("GET", "1.1", 200, given)


def test_a_head_is_its_status_line_headers_length_close_and_date() -> None:
    head = writers.head(404, [JSON], 7, close=True)
    status, content_type, length, close, date, *end = head.split(b"\r\n")
    assert [status, content_type, length, close] == [
        b"HTTP/1.1 404 Not Found",
        b"Content-Type: application/json",
        b"Content-Length: 7",
        b"Connection: close",
    ]
    assert date.startswith(b"Date: ")
    assert date.endswith(b" GMT")
    assert end == [b"", b""]


def test_a_kept_head_without_a_length_says_neither() -> None:
    assert writers.head(200, [], None, close=False).split(b"\r\n")[1].startswith(b"Date: ")


def test_no_body_is_sent_a_length_for_a_status_without_one() -> None:
    assert [writers.length_sent(status, 5) for status in (100, 200, 204, 304)] == [None, 5, None, None]


def test_a_chunk_is_its_size_in_hex_and_its_data() -> None:
    assert writers.chunk(b"x" * 26) + writers.LAST_CHUNK == b"1a\r\n" + b"x" * 26 + b"\r\n0\r\n\r\n"

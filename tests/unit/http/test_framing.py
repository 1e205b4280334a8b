"""supervisor/http/framing/ without sockets: a table of request and reply streams, each decided (the
requests seen, then the refusal) the same way whatever the reads it comes in, and valid streams cut
at random points that give the same messages as whole."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.errors import Malformed
from supervisor.http import framing
from supervisor.http.framing import END, MAX_HEAD_BYTES, MAX_HEADERS, NEED_DATA

H = b"Host: x\r\n"


@attrs.frozen
class Seen:
    """A message as the reader gave it: its head's essentials and its whole body."""

    head: tuple[object, ...]
    body: bytes


Decision = tuple[list[Seen], tuple[int, str] | None]  # the messages, then the refusal (status, code)


def decide(reader: framing.RequestReader | framing.ResponseReader, pieces: Iterator[bytes]) -> Decision:
    seen: list[Seen] = []
    head: tuple[object, ...] | None = None
    body = b""
    for piece in pieces:
        reader.feed(piece)
        while True:
            try:
                event = reader.next_event()
            except Malformed as exc:
                return seen, (exc.status, exc.code)
            if event is NEED_DATA:
                break
            if isinstance(event, framing.RequestHead):
                head = (event.method, event.path, event.query, event.version, tuple(event.headers))
            elif isinstance(event, framing.ResponseHead):
                head = (event.status, event.version, tuple(event.headers), event.length, event.until_eof)
            elif event is END:
                assert head is not None
                seen.append(Seen(head, body))
                head, body = None, b""
            else:
                assert isinstance(event, bytes)
                body += event
    return seen, None


def splits(data: bytes) -> Iterator[tuple[str, list[bytes]]]:
    """``data`` whole, a byte at a time, and cut in two at (nearly) every place."""
    yield "whole", [data]
    yield "bytewise", [data[i : i + 1] for i in range(len(data))]
    step = max(1, len(data) // 300)  # a 16 KiB head is cut at some 300 places, a short one at every byte
    for cut in range(1, len(data), step):
        yield f"cut at {cut}", [data[:cut], data[cut:]]


def requests(data: bytes) -> Decision:
    """How ``data`` is decided, checked to be the same for every way of splitting it."""
    decisions = {name: decide(framing.RequestReader(), iter(pieces)) for name, pieces in splits(data)}
    whole = decisions["whole"]
    differ = {name: decision for name, decision in decisions.items() if decision != whole}
    assert not differ, f"decided differently from whole ({whole}): {differ}"
    return whole


def paths(decision: Decision) -> tuple[list[tuple[str, str, bytes]], tuple[int, str] | None]:
    seen, refusal = decision
    return [(str(s.head[0]), str(s.head[1]), s.body) for s in seen], refusal


def get(path: str = "/", *headers: bytes) -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\n" + H + b"".join(headers) + b"\r\n"


def post(head: bytes, body: bytes) -> bytes:
    return b"POST /p HTTP/1.1\r\n" + H + head + b"\r\n" + body


CHUNKED = b"Transfer-Encoding: chunked\r\n"
OK: tuple[int, str] | None = None
BAD = (400, "bad_request")
BAD_BODY = (400, "bad_chunked_body")
TE = (501, "transfer_encoding")
LARGE = (431, "head_too_large")

# (id, stream, the requests seen as (method, path, body), then the refusal or None)
TABLE: list[tuple[str, bytes, list[tuple[str, str, bytes]], tuple[int, str] | None]] = [
    ("get", get(), [("GET", "/", b"")], OK),
    ("content_length_body", post(b"Content-Length: 5\r\n", b"hello"), [("POST", "/p", b"hello")], OK),
    ("cl_and_te", post(b"Content-Length: 3\r\n" + CHUNKED, b"0\r\n\r\n"), [], BAD),
    ("te_and_cl", post(CHUNKED + b"Content-Length: 3\r\n", b"0\r\n\r\n"), [], BAD),
    ("two_equal_lengths", post(b"Content-Length: 3\r\nContent-Length: 3\r\n", b"abc"), [], BAD),
    ("two_lengths", post(b"Content-Length: 3\r\nContent-Length: 4\r\n", b"abcd"), [], BAD),
    ("length_list", post(b"Content-Length: 3, 3\r\n", b"abc"), [], BAD),
    ("length_plus", post(b"Content-Length: +3\r\n", b"abc"), [], BAD),
    ("length_negative", post(b"Content-Length: -1\r\n", b""), [], BAD),
    ("length_hex", post(b"Content-Length: 0x3\r\n", b"abc"), [], BAD),
    ("length_empty", post(b"Content-Length: \r\n", b""), [], BAD),
    ("length_19_digits", post(b"Content-Length: 0000000000000000003\r\n", b"abc"), [], BAD),
    ("length_18_digits", post(b"Content-Length: 000000000000000003\r\n", b"abc"), [("POST", "/p", b"abc")], OK),
    ("te_gzip", post(b"Transfer-Encoding: gzip\r\n", b"abc"), [], TE),
    ("te_chunked_gzip", post(b"Transfer-Encoding: chunked, gzip\r\n", b"0\r\n\r\n"), [], TE),
    ("te_identity_chunked", post(b"Transfer-Encoding: identity, chunked\r\n", b"0\r\n\r\n"), [], TE),
    ("te_twice", post(CHUNKED + CHUNKED, b"0\r\n\r\n"), [], TE),
    ("te_xchunked", post(b"Transfer-Encoding: xchunked\r\n", b"0\r\n\r\n"), [], TE),
    ("te_on_1_0", b"POST /p HTTP/1.0\r\n" + CHUNKED + b"\r\n0\r\n\r\n", [], TE),
    ("te_upper_case", post(b"Transfer-Encoding: Chunked\r\n", b"1\r\na\r\n0\r\n\r\n"), [("POST", "/p", b"a")], OK),
    ("obs_fold", get("/", b"X: a\r\n b\r\n"), [], BAD),
    ("bare_lf_line_ends", b"GET / HTTP/1.1\nHost: x\n\n", [], BAD),
    ("bare_lf_at_head_end", b"GET / HTTP/1.1\r\nHost: x\r\n\n", [], BAD),
    ("bare_lf_in_header", b"GET / HTTP/1.1\r\nHost: x\nX: y\r\n\r\n", [], BAD),
    ("bare_cr_in_request_line", b"GET / HTTP/1.1\rHost: x\r\n\r\n", [], BAD),
    ("bare_cr_in_value", get("/", b"X: a\rb\r\n"), [], BAD),
    ("form_feed_in_value", get("/", b"X: a\x0cb\r\n"), [], BAD),
    ("x01_in_value", get("/", b"X: a\x01b\r\n"), [], BAD),
    ("del_in_value", get("/", b"X: a\x7fb\r\n"), [], BAD),
    ("nul_in_value", get("/", b"X: a\x00b\r\n"), [], BAD),
    ("tab_and_obs_text_in_value", get("/", b"X: a\tb\xff\r\n"), [("GET", "/", b"")], OK),
    ("space_before_colon", get("/", b"X : y\r\n"), [], BAD),
    ("no_colon", get("/", b"NoColon\r\n"), [], BAD),
    ("empty_name", get("/", b": y\r\n"), [], BAD),
    ("no_host", b"GET / HTTP/1.1\r\n\r\n", [], BAD),
    ("two_hosts", get("/", H), [], BAD),
    ("no_host_on_1_0", b"GET /old HTTP/1.0\r\n\r\n", [("GET", "/old", b"")], OK),
    ("http_2", b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", [], (505, "http_version")),
    ("http_1_2", b"GET / HTTP/1.2\r\nHost: x\r\n\r\n", [], (505, "http_version")),
    ("http_0_9", b"GET /\r\nHost: x\r\n\r\n", [], BAD),
    ("lower_case_version", b"GET / http/1.1\r\nHost: x\r\n\r\n", [], BAD),
    ("unknown_method", b"FETCH / HTTP/1.1\r\nHost: x\r\n\r\n", [], BAD),
    ("connect", b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n", [], (501, "not_implemented")),
    (
        "upgrade_with_body",
        post(b"Connection: upgrade\r\nUpgrade: h2c\r\nContent-Length: 3\r\n", b"abc"),
        [],
        (501, "not_implemented"),
    ),
    (
        "upgrade_without_body_is_plain_http",
        get(
            "/1", b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        )
        + get("/2"),
        [("GET", "/1", b""), ("GET", "/2", b"")],
        OK,
    ),
    ("absolute_form", get("http://example.com/a?b"), [("GET", "/a", b"")], OK),
    ("asterisk_for_options", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", [("OPTIONS", "*", b"")], OK),
    ("asterisk_for_get", get("*"), [], BAD),
    ("relative_target", get("a/b"), [], BAD),
    ("control_in_target", b"GET /a\x01 HTTP/1.1\r\nHost: x\r\n\r\n", [], BAD),
    ("not_utf8_path", get("/%ff"), [], BAD),
    (
        "chunked",
        post(CHUNKED, b"5;name=value\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
        [("POST", "/p", b"hello world")],
        OK,
    ),
    (
        "trailers_dropped",
        post(CHUNKED, b"1\r\na\r\n0\r\nX-Trailer: t\r\nX-Two: u\r\n\r\n") + get("/n"),
        [("POST", "/p", b"a"), ("GET", "/n", b"")],
        OK,
    ),
    ("request_line_as_trailer", post(CHUNKED, b"0\r\nGET /smuggled HTTP/1.1\r\n" + H + b"\r\n"), [], BAD_BODY),
    ("trailer_without_colon", post(CHUNKED, b"0\r\nNoColon\r\n\r\n"), [], BAD_BODY),
    ("trailer_space_before_colon", post(CHUNKED, b"0\r\nX-T : 1\r\n\r\n"), [], BAD_BODY),
    ("trailer_control_char", post(CHUNKED, b"0\r\nX-T: a\x01\r\n\r\n"), [], BAD_BODY),
    ("no_final_crlf_eats_next_request", post(CHUNKED, b"0\r\n") + get("/next"), [], BAD_BODY),
    ("trailers_too_large", post(CHUNKED, b"0\r\n" + b"X-T: " + b"a" * 16400 + b"\r\n\r\n"), [], BAD_BODY),
    ("chunk_size_0x", post(CHUNKED, b"0x5\r\nhello\r\n0\r\n\r\n"), [], BAD_BODY),
    ("chunk_size_leading_space", post(CHUNKED, b" 5\r\nhello\r\n0\r\n\r\n"), [], BAD_BODY),
    ("chunk_size_trailing_space", post(CHUNKED, b"5 \r\nhello\r\n0\r\n\r\n"), [], BAD_BODY),
    ("chunk_size_not_hex", post(CHUNKED, b"zz\r\nhello\r\n0\r\n\r\n"), [], BAD_BODY),
    ("chunk_size_negative", post(CHUNKED, b"-5\r\nhello\r\n0\r\n\r\n"), [], BAD_BODY),
    ("chunk_size_upper_hex", post(CHUNKED, b"A\r\n0123456789\r\n0\r\n\r\n"), [("POST", "/p", b"0123456789")], OK),
    ("chunk_size_bare_lf", post(CHUNKED, b"5\nhello\r\n0\r\n\r\n"), [], BAD_BODY),
    ("chunk_extension_bare_lf", post(CHUNKED, b"5;\nX\r\nhello\r\n0\r\n\r\n"), [], BAD_BODY),
    ("chunk_extension_quoted", post(CHUNKED, b'5;a="b c"\r\nhello\r\n0\r\n\r\n'), [("POST", "/p", b"hello")], OK),
    ("chunk_line_too_long", post(CHUNKED, b"5;" + b"x" * 2000 + b"\r\nhello\r\n0\r\n\r\n"), [], BAD_BODY),
    ("no_crlf_after_chunk_data", post(CHUNKED, b"5\r\nhelloXY0\r\n\r\n"), [], BAD_BODY),
    (
        "head_at_the_limit",
        b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (MAX_HEAD_BYTES - 28) + b"\r\n\r\n",
        [("GET", "/", b"")],
        OK,
    ),
    ("head_one_over", b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (MAX_HEAD_BYTES - 27) + b"\r\n\r\n", [], LARGE),
    ("head_never_ending", b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * MAX_HEAD_BYTES, [], LARGE),
    ("headers_at_the_cap", get("/", *[b"X-%d: y\r\n" % i for i in range(MAX_HEADERS - 1)]), [("GET", "/", b"")], OK),
    ("headers_over_the_cap", get("/", *[b"X-%d: y\r\n" % i for i in range(MAX_HEADERS)]), [], LARGE),
    ("blank_lines_allowed", b"\r\n" * 32 + get("/"), [("GET", "/", b"")], OK),
    ("blank_lines_too_many", b"\r\n" * 33 + get("/"), [], BAD),
    ("blank_lines_between_requests", get("/1") + b"\r\n" * 33 + get("/2"), [("GET", "/1", b"")], BAD),
    (
        "pipelined",
        post(b"Content-Length: 3\r\n", b"abc") + get("/2") + post(CHUNKED, b"2\r\nde\r\n0\r\n\r\n"),
        [("POST", "/p", b"abc"), ("GET", "/2", b""), ("POST", "/p", b"de")],
        OK,
    ),
    ("after_connection_close", get("/1", b"Connection: close\r\n") + get("/2"), [("GET", "/1", b"")], BAD),
    (
        "request_in_a_body",
        post(b"Content-Length: %d\r\n" % len(get("/hidden")), get("/hidden")),
        [("POST", "/p", get("/hidden"))],
        OK,
    ),
    (
        "request_in_a_chunk",
        post(CHUNKED, b"%x\r\n" % len(get("/hidden")) + get("/hidden") + b"\r\n0\r\n\r\n"),
        [("POST", "/p", get("/hidden"))],
        OK,
    ),
]


@pytest.mark.parametrize(
    ("stream", "expected", "refusal"), [case[1:] for case in TABLE], ids=[case[0] for case in TABLE]
)
def test_a_request_stream_is_decided_the_same_whatever_its_reads(
    stream: bytes, expected: list[tuple[str, str, bytes]], refusal: tuple[int, str] | None
) -> None:
    assert paths(requests(stream)) == (expected, refusal)


def test_the_head_s_fields_reach_the_request_with_names_lower_case_and_values_trimmed() -> None:
    [seen], refusal = requests(get("/a%20b?x=1", b"X-Two:  a b \t\r\n", b"Content-Length: 0\r\n"))
    assert refusal is None
    assert seen.head == ("GET", "/a b", b"x=1", "1.1", ((b"host", b"x"), (b"x-two", b"a b"), (b"content-length", b"0")))


def test_keep_alive_and_100_continue_follow_the_version_and_the_fields() -> None:
    def head(data: bytes) -> framing.RequestHead:
        reader = framing.RequestReader()
        reader.feed(data)
        event = reader.next_event()
        assert isinstance(event, framing.RequestHead)
        return event

    assert head(get()).keep_alive
    assert not head(get("/", b"Connection: keep-alive, close\r\n")).keep_alive
    assert not head(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").keep_alive
    assert head(post(b"Expect: 100-continue\r\nContent-Length: 1\r\n", b"")).expect_continue
    assert not head(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n").expect_continue


def test_a_refusal_comes_after_the_requests_before_it_and_pending_says_more_came() -> None:
    reader = framing.RequestReader()
    reader.feed(get("/1") + b"GET / HTTP/1.1\nHost: x\n\n")
    assert isinstance(reader.next_event(), framing.RequestHead)
    assert reader.next_event() is END
    assert reader.pending
    with pytest.raises(Malformed, match="malformed"):
        reader.next_event()


def test_a_client_that_sent_only_what_was_answered_has_nothing_pending() -> None:
    reader = framing.RequestReader()
    reader.feed(get("/1"))
    assert isinstance(reader.next_event(), framing.RequestHead)
    assert reader.next_event() is END
    assert not reader.pending
    assert reader.next_event() is NEED_DATA
    reader.feed(b"\r\n")
    assert reader.pending  # a blank line: the start of a next request


def test_take_body_hands_out_the_pieces_come_so_far_joined_and_then_the_end() -> None:
    reader = framing.ResponseReader(65536)
    reader.expect("GET")
    reader.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n")
    assert isinstance(reader.next_event(), framing.ResponseHead)
    assert reader.take_body() == (b"abcde", False)
    assert reader.take_body() == (b"", False)
    reader.feed(b"1\r\nf\r\n0\r\n\r\n")
    assert reader.take_body() == (b"f", True)
    assert not reader.pending


def test_take_body_raises_for_a_body_malformed_before_its_end_but_not_for_the_next_message() -> None:
    reader = framing.RequestReader()
    reader.feed(b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n")
    assert isinstance(reader.next_event(), framing.RequestHead)
    with pytest.raises(Malformed, match="chunk"):
        reader.take_body()
    reader = framing.RequestReader()
    reader.feed(b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 2\r\n\r\nokGET / HTTP/1.1\nHost: x\n\n")
    assert isinstance(reader.next_event(), framing.RequestHead)
    assert reader.take_body() == (b"ok", True)
    with pytest.raises(Malformed, match="malformed"):
        reader.next_event()


# -- replies --------------------------------------------------------------------------------------


def replies(data: bytes, method: str = "GET") -> Decision:
    decisions = {}
    for name, pieces in splits(data):
        reader = framing.ResponseReader(65536)
        reader.expect(method)
        decisions[name] = decide(reader, iter(pieces))
    whole = decisions["whole"]
    differ = {name: decision for name, decision in decisions.items() if decision != whole}
    assert not differ, f"decided differently from whole ({whole}): {differ}"
    return whole


def statuses(decision: Decision) -> tuple[list[tuple[object, bytes]], tuple[int, str] | None]:
    seen, refusal = decision
    return [(s.head[0], s.body) for s in seen], refusal


def reply(head: bytes, body: bytes = b"", status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\n" + head + b"\r\n" + body


REPLIES: list[tuple[str, bytes, list[tuple[object, bytes]], tuple[int, str] | None]] = [
    ("length", reply(b"Content-Length: 2\r\n", b"ok"), [(200, b"ok")], OK),
    (
        "chunked_then_next",
        reply(CHUNKED, b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nTrailer: t\r\n\r\n") + reply(b"Content-Length: 1\r\n", b"z"),
        [(200, b"abcde"), (200, b"z")],
        OK,
    ),
    ("sse_chunk", reply(CHUNKED, b"a\r\ndata: {}\n\n\r\n0\r\n\r\n"), [(200, b"data: {}\n\n")], OK),
    (
        "continue_then_reply",
        reply(b"", status=b"100 Continue") + reply(b"Content-Length: 1\r\n", b"a"),
        [(100, b""), (200, b"a")],
        OK,
    ),
    (
        "no_content",
        reply(b"", status=b"204 No Content") + reply(b"Content-Length: 1\r\n", b"a"),
        [(204, b""), (200, b"a")],
        OK,
    ),
    ("bad_status", b"HTTP/1.1 2xx OK\r\n\r\n", [], BAD),
    ("not_http", b"SSH-2.0\r\n\r\n", [], BAD),
    ("header_without_colon", reply(b"no colon here\r\n"), [], BAD),
    ("two_lengths", reply(b"Content-Length: 1\r\nContent-Length: 1\r\n", b"a"), [], BAD),
    ("length_19_digits", reply(b"Content-Length: 0000000000000000001\r\n", b"a"), [], BAD),
    ("te_gzip", reply(b"Transfer-Encoding: gzip\r\n", b"abc"), [], TE),
    ("te_and_length", reply(CHUNKED + b"Content-Length: 1\r\n", b"0\r\n\r\n"), [], BAD),
    ("bad_chunk_size", reply(CHUNKED, b"0x5\r\n"), [], BAD_BODY),
    ("no_crlf_after_chunk_data", reply(CHUNKED, b"1\r\nab\r\n"), [], BAD_BODY),
    ("status_line_as_trailer", reply(CHUNKED, b"0\r\nHTTP/1.1 200 OK\r\n\r\n"), [], BAD_BODY),
    ("bare_lf", b"HTTP/1.1 200 OK\nContent-Length: 1\n\na", [], BAD),
    ("head_too_large", reply(b"X: " + b"a" * 65536 + b"\r\n"), [], LARGE),
]


@pytest.mark.parametrize(
    ("stream", "expected", "refusal"), [case[1:] for case in REPLIES], ids=[case[0] for case in REPLIES]
)
def test_a_reply_stream_is_decided_the_same_whatever_its_reads(
    stream: bytes, expected: list[tuple[object, bytes]], refusal: tuple[int, str] | None
) -> None:
    assert statuses(replies(stream)) == (expected, refusal)


def test_a_reply_to_head_has_no_body_whatever_its_length_says() -> None:
    stream = reply(b"Content-Length: 5\r\n") + reply(b"Content-Length: 1\r\n", b"a")
    seen, refusal = replies(stream, "HEAD")
    assert refusal is None
    assert [(s.head[0], s.head[3], s.body) for s in seen] == [(200, 0, b""), (200, 1, b"a")]


def test_a_reply_without_a_length_runs_to_the_end_of_the_connection() -> None:
    [], refusal = replies(reply(b"X: y\r\n", b"abc"))  # no END before the connection's end
    reader = framing.ResponseReader(65536)
    reader.feed(reply(b"X: y\r\n", b"abc"))
    head = reader.next_event()
    assert isinstance(head, framing.ResponseHead)
    assert (head.until_eof, head.keep_alive, head.length, head.headers) == (True, False, None, [(b"X", b"y")])
    assert reader.next_event() == b"abc"
    assert refusal is None


# -- valid streams cut anywhere ---------------------------------------------------------------------


_token = st.text("abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12).map(str.encode)
_value = st.binary(max_size=20).map(lambda b: bytes(c for c in b if 0x20 < c < 0x7F or c >= 0x80).strip())
_body = st.binary(max_size=300)


@st.composite
def _chunked(draw: st.DrawFn, body: bytes) -> bytes:
    out = b""
    rest = body
    while rest:
        size = draw(st.integers(1, len(rest)))
        extension = draw(st.sampled_from([b"", b";a=b", b';q="x y"']))
        out += b"%x%s\r\n%s\r\n" % (size, extension, rest[:size])
        rest = rest[size:]
    trailers = draw(st.lists(st.tuples(_token, _value), max_size=3))
    return out + b"0\r\n" + b"".join(b"X-%s: %s\r\n" % pair for pair in trailers) + b"\r\n"


@st.composite
def request_streams(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str, bytes]]]:
    stream = b""
    expected = []
    for _ in range(draw(st.integers(1, 4))):
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
        path = "/" + draw(st.text("abcxyz/_-.", max_size=12))
        fields = draw(st.lists(st.tuples(_token, _value), max_size=5))
        head = b"%s %s HTTP/1.1\r\nHost: h\r\n" % (method.encode(), path.encode())
        head += b"".join(b"X-%s: %s\r\n" % pair for pair in fields)
        body = draw(_body)
        framing_ = draw(st.sampled_from(["length", "chunked"]) if body else st.sampled_from(["none", "length"]))
        if framing_ == "chunked":
            stream += head + CHUNKED + b"\r\n" + draw(_chunked(body))
        elif framing_ == "length":
            stream += head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        else:
            stream += head + b"\r\n"
        stream += draw(st.sampled_from([b"", b"\r\n"]))  # a blank line between requests
        expected.append((method, path, body))
    return stream, expected


def _cut(data: bytes, cuts: list[int]) -> Iterator[bytes]:
    points = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    for start, end in itertools.pairwise(points):
        yield data[start:end]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_streams(), st.lists(st.integers(0, 1 << 16), max_size=12))
def test_valid_request_streams_cut_at_random_places_give_the_same_requests(
    case: tuple[bytes, list[tuple[str, str, bytes]]], cuts: list[int]
) -> None:
    stream, expected = case
    whole = decide(framing.RequestReader(), iter([stream]))
    assert paths(whole) == (expected, None)
    assert decide(framing.RequestReader(), _cut(stream, cuts)) == whole


@st.composite
def reply_streams(draw: st.DrawFn) -> tuple[bytes, list[tuple[object, bytes]]]:
    stream = b""
    expected: list[tuple[object, bytes]] = []
    for _ in range(draw(st.integers(1, 4))):
        status = draw(st.sampled_from([200, 201, 400, 404, 500, 503]))
        fields = draw(st.lists(st.tuples(_token, _value), max_size=5))
        if draw(st.booleans()):
            stream += b"HTTP/1.1 100 Continue\r\n\r\n"
            expected.append((100, b""))
        head = b"HTTP/1.1 %d X\r\n" % status + b"".join(b"X-%s: %s\r\n" % pair for pair in fields)
        body = draw(_body)
        if draw(st.booleans()):
            stream += head + CHUNKED + b"\r\n" + draw(_chunked(body))
        else:
            stream += head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        expected.append((status, body))
    return stream, expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply_streams(), st.lists(st.integers(0, 1 << 16), max_size=12))
def test_valid_reply_streams_cut_at_random_places_give_the_same_replies(
    case: tuple[bytes, list[tuple[object, bytes]]], cuts: list[int]
) -> None:
    stream, expected = case
    whole = decide(framing.ResponseReader(65536), iter([stream]))
    assert statuses(whole) == (expected, None)
    assert decide(framing.ResponseReader(65536), _cut(stream, cuts)) == whole

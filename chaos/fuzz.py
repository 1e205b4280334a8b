"""scripts/chaos's ``fuzz`` scenario: malformed HTTP against onebitd's front, drawn by hypothesis.

Every case goes out on a bare socket (``Connection: close``): bad JSON, wrong types in the fields
onebitd and llama-server read, bodies nested 1,000 to 200,000 deep, bodies over
``server.max_body_bytes``, odd and malformed headers, broken chunked encoding, and slowloris heads
and bodies that stop half-way.  Each must get a 4xx, or the connection closed without an answer; a
well-formed JSON object that llama-server accepts may get its 200.  A 5xx, or a connection still
open after the front's timeouts, is a failure.  Meanwhile one good request after another must be
answered correctly: the daemon keeps serving others.

hypothesis runs in a worker thread (its ``@given`` is synchronous) and sends each case through
``trio.from_thread.run``.  This module draws and judges the cases; chaos/clients.py sends them and
serves the good requests (it imports this module, never the other way round).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PATHS = ["/v1/chat/completions", "/v1/completions", "/completion", "/tokenize", "/v1/models", "/nope"]
# Past the front's body and idle timeouts (1 s each in the fuzz config), a case that is still open hangs.
CASE_BOUND_S = 15.0

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
wrong_types = st.fixed_dictionaries(
    {},
    optional={
        "prompt": junk,
        "messages": st.one_of(junk, st.lists(junk, max_size=3), st.lists(st.dictionaries(st.text(max_size=8), junk))),
        "max_tokens": st.one_of(st.text(max_size=5), st.floats(allow_nan=False), st.none(), st.integers(-5, 4)),
        "n_predict": st.one_of(st.text(max_size=5), st.none(), st.integers(-5, 4)),
        "stream": junk,
        "temperature": junk,
        "id_slot": junk,
        "cache_prompt": junk,
        "model": junk,
    },
).map(lambda body: json.dumps(body).encode())
bad_json = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100).map(str.encode),
    st.sampled_from([b"{", b"[1,2", b'{"prompt": "x",}', b"null", b"[]", b'"x"', b'{"a": NaN}', b"\xff\xfe"]),
)
nested = st.integers(1_000, 200_000).map(lambda n: b"[" * n + b"]" * n)
huge = st.integers(65_537, 300_000).map(lambda n: b'{"prompt": "' + b"x" * n + b'"}')


def head(path: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: localhost", "Connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, bytes, float]:
    """``(kind, bytes to send, seconds to wait before expecting the end)``."""
    kind = draw(st.sampled_from(["body", "headers", "chunked", "slow-head", "slow-body"]))
    path = draw(st.sampled_from(PATHS))
    if kind == "body":
        body = draw(st.one_of(wrong_types, bad_json, nested, huge))
        return kind, head(path, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]) + body, 0
    if kind == "headers":
        length = draw(st.sampled_from(["abc", "-1", "99999999999999999999", "1, 2", "", "0"]))
        name = draw(st.from_regex(r"\A[A-Za-z][A-Za-z0-9-]{0,20}\Z"))
        value = draw(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40))
        extra = draw(
            st.sampled_from([b"", b"X-Bad Header: x\r\n", b"NoColonHere\r\n", b"X-Long: " + b"a" * 20_000 + b"\r\n"])
        )
        raw = head(path, [(name, value), ("Content-Length", length)])
        return kind, raw[:-2] + extra + b"\r\n" + b"{}", 0
    if kind == "chunked":
        chunk = draw(
            st.sampled_from(
                [b"zz\r\n{}\r\n0\r\n\r\n", b"5\r\n{}\r\n", b"-1\r\n", b"ffffffffffffffff\r\nx", b"2\r\n{}0\r\n\r\n"]
            )
        )
        return kind, head(path, [("Transfer-Encoding", "chunked")]) + chunk, 0
    if kind == "slow-head":
        return kind, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: localhost\r\nX-Slow: ", 0
    body = b'{"prompt": "hello", "max_tokens": 2}'
    return kind, head(path, [("Content-Length", str(len(body)))]) + body[: draw(st.integers(0, len(body) - 1))], 0


def judge(kind: str, raw: bytes, status: int | None, closed: bool) -> tuple[str, str]:
    """A case's verdict for the tally, and its note."""
    if not closed:
        return "lost", f"{kind}: still open after {CASE_BOUND_S:g}s: {raw[:80]!r}"
    if status is None or 400 <= status < 500:
        return "clean", ""
    if status == 200 and kind == "body" and raw.split(b"\r\n\r\n", 1)[1].startswith(b"{"):
        return "ok", ""  # a JSON object llama-server took as it was
    return "bad", f"{kind}: {status} for {raw[:120]!r}"


def run_cases(
    examples: int,
    send: Callable[[bytes], Awaitable[tuple[int | None, bool]]],
    record: Callable[[str, bytes, int | None, bool], None],
) -> None:
    """Draw ``examples`` cases; each goes out through ``send`` (in the trio run: call this in a
    worker thread) and its ``(status or None, closed)`` to ``record``."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def one(case: tuple[str, bytes, float]) -> None:
        kind, raw, _ = case
        status, closed = trio.from_thread.run(send, raw)
        record(kind, raw, status, closed)

    one()

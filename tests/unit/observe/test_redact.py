"""A route line's ``error`` as the status surface shows it (supervisor/observe/redact.py): the decoder's
status and llama-server's error type whole, a bounded message with nothing quoted from the request,
and the feed (supervisor/observe/routestats.py) sending that, never the line's own words."""

from __future__ import annotations

import pytest
import trio

from supervisor.observe import redact
from supervisor.observe.routestats import RouteStats
from supervisor.routeline import RequestOutcome, RouteLine
from supervisor.routes.relay import error_summary

SECRET = "my secret plan for Tuesday"


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        # nlohmann's parse error, as llama-server answers a body it cannot read: the end of what it read.
        (
            "decoder answered 400 (invalid_request_error): [json.exception.parse_error.101] parse error at "
            f"line 1, column 61: syntax error while parsing object - invalid literal; last read: '\"{SECRET}'",
            "decoder answered 400 (invalid_request_error): [json.exception.parse_error.101] parse error at "
            "line 1, column 61: syntax error while parsing object - invalid literal; last read: '…'",
        ),
        # A template's refusal quoting the message it failed on.
        (
            f'decoder answered 500 (server_error): Failed to format input: unknown role "{SECRET}" in message 0',
            'decoder answered 500 (server_error): Failed to format input: unknown role "…" in message 0',
        ),
        # The tools dumped after the message.
        (
            "decoder answered 400 (invalid_request_error): Failed to parse tools: [json.exception.type_error.302] "
            f'type must be string, but is null; tools = [\n  {{\n    "description": "{SECRET}"\n  }}\n]',
            "decoder answered 400 (invalid_request_error): Failed to parse tools: [json.exception.type_error.302] "
            "type must be string, but is null; tools = […",
        ),
        # A backquoted span and a typographic one.
        (f"bad tool call `{SECRET}` and “{SECRET}”", "bad tool call `…` and “…”"),
        # A quote the 2,000-byte bound (routes/relay.py) cut short: cut from its opening quote.
        (f'decoder answered 500: {{"error": "{SECRET}', "decoder answered 500: …"),
        (f"decoder answered 502: upstream said '{SECRET}", "decoder answered 502: upstream said '…"),
        # onebitd's own words, quoting what a client sent (a repr).
        (f"no such model: '{SECRET}'", "no such model: '…'"),
        # Apostrophes inside words open no quote.
        (
            "the decoder's slot can't hold it; 'x' was refused",
            "the decoder's slot can't hold it; '…' was refused",
        ),
        # llama-server's own sentence, with no quote: whole.
        (
            "decoder answered 400 (exceed_context_size_error): request (5000 tokens) exceeds the available "
            "context size (4096 tokens), try increasing it",
            "decoder answered 400 (exceed_context_size_error): request (5000 tokens) exceeds the available "
            "context size (4096 tokens), try increasing it",
        ),
        # Control and format characters (a terminal escape, a bidi override, a newline): spaces.
        ("the decoder stopped\n\x1b[31mmid-stream\u202e\x00now", "the decoder stopped [31mmid-stream now"),
    ],
)
def test_a_shown_error_keeps_the_status_and_type_and_drops_what_the_request_held(error: str, shown: str) -> None:
    assert redact.redact(error) == shown
    assert SECRET not in redact.redact(error)


def test_a_long_message_is_cut_to_its_bound_and_the_head_kept_whole() -> None:
    head = "decoder answered 500 (server_error)"
    shown = redact.redact(f"{head}: {'word ' * 200}")
    message = shown.removeprefix(f"{head}: ")
    assert message != shown
    assert len(message) == redact.MAX_MESSAGE
    assert message.endswith(redact.ELLIPSIS)


def test_a_head_with_an_odd_type_is_redacted_as_a_message() -> None:
    shown = redact.redact(f'decoder answered 400 ("{SECRET}"): x {"y" * 300}')
    assert SECRET not in shown
    assert len(shown) <= redact.MAX_MESSAGE


def test_the_decoders_error_type_and_message_make_the_route_lines_error() -> None:
    body = b'{"error": {"code": 400, "message": "bad \'' + SECRET.encode() + b'\'", "type": "invalid_request_error"}}'
    error = error_summary(400, body)
    assert error == f"decoder answered 400 (invalid_request_error): bad '{SECRET}'"  # the log: whole
    assert redact.redact(error) == "decoder answered 400 (invalid_request_error): bad '…'"
    assert error_summary(502, b"<html>gateway</html>") == "decoder answered 502: <html>gateway</html>"


async def test_the_feed_and_its_recent_lines_carry_the_redacted_error() -> None:
    stats = RouteStats()
    error = f"decoder answered 400 (invalid_request_error): unknown role '{SECRET}'"
    line = RouteLine(req="r1", endpoint="/v1/chat/completions", status=400, outcome=RequestOutcome.ERROR, error=error)
    with trio.fail_after(5), stats.watch() as feed:
        stats.record(line)
        event = await feed.receive()
    shown = "decoder answered 400 (invalid_request_error): unknown role '…'"
    assert event["line"]["error"] == shown
    assert stats.recent()[-1]["line"]["error"] == shown
    assert SECRET in line.logfmt()  # the operator's log keeps it whole
    ok = RouteLine(req="r2", endpoint="/v1/chat/completions", status=200)
    stats.record(ok)
    assert stats.recent()[-1]["line"] == ok.fields()

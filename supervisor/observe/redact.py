"""What of a route line's ``error`` the status surface shows: who failed and how, never what a client sent.

A route line's ``error`` is onebitd's own words, or the decoder's answer as
supervisor/routes/relay.py summarizes it: ``decoder answered 400 (exceed_context_size_error):
MESSAGE``, llama-server's ``error.type`` in brackets and its ``error.message`` after.  llama-server's
messages can quote the request: nlohmann's JSON errors end ``last read: '...'``, a chat template's
error quotes what it failed on, and "Failed to parse tools: ...; tools = {...}" dumps the tools.  The
status page's feed (supervisor/observe/routestats.py) shows :func:`redact` of it instead:

- the status and llama-server's error type, whole;
- of the message: a control or format character (a newline, a bidi override) becomes a space; each
  quoted span (``"..."``, ``'...'``, a backquoted one, typographic and guillemet quotes) becomes its
  quotes around an ellipsis, and an unclosed quote is cut from there to the end (a quote cut short
  by a bound still holds the request); from the first ``{`` on (a JSON dump) is cut; what is left is
  at most :data:`MAX_MESSAGE` characters.

An apostrophe inside a word (``model's``) opens no quote.  The log keeps the whole line: it is the
operator's, as it always was.  Pure: no I/O, unit-tested in tests/unit/observe/test_redact.py.
"""

from __future__ import annotations

import re
import unicodedata

# Enough for llama-server's own sentences ("the request exceeds the available context size, try
# increasing it": 59), short of any paragraph a request could smuggle in unquoted.
MAX_MESSAGE = 160
ELLIPSIS = "…"
# Each opening quote and the quote that closes it.
QUOTES = {'"': '"', "'": "'", "`": "`", "“": "”", "‘": "’", "«": "»", "„": "“"}  # noqa: RUF001 (quotes on purpose)
# ``decoder answered 400 (invalid_request_error): MESSAGE``: its head is kept whole.
DECODER = re.compile(r"(decoder answered \d{3}(?: \([a-z_]{1,64}\))?): (.*)", re.DOTALL)


def redact(error: str) -> str:
    """``error`` as the status surface shows it (this module's docstring)."""
    if (decoder := DECODER.fullmatch(error)) is not None:
        return f"{decoder[1]}: {message(decoder[2])}"
    return message(error)


def message(text: str) -> str:
    """``text`` with no control character, no quoted span and no JSON dump, bounded."""
    plain = "".join(" " if unicodedata.category(ch)[0] == "C" else ch for ch in text)
    head, dump, _ = plain.partition("{")
    words = " ".join(unquoted(head).split()) + (ELLIPSIS if dump else "")
    return words if len(words) <= MAX_MESSAGE else words[: MAX_MESSAGE - 1].rstrip() + ELLIPSIS


def unquoted(text: str) -> str:
    """``text`` with each quoted span's content an ellipsis, cut at a quote that is not closed."""
    out: list[str] = []
    at = 0
    while at < len(text):
        char = text[at]
        close = QUOTES.get(char)
        if close is None or (char == "'" and at and text[at - 1].isalnum()):  # an apostrophe: model's
            out.append(char)
            at += 1
            continue
        end = _closing(text, at + 1, close)
        if end is None:
            out.append(char + ELLIPSIS)
            break
        out.append(char + ELLIPSIS + close)
        at = end + 1
    return "".join(out)


def _closing(text: str, start: int, close: str) -> int | None:
    """Where the quote opened before ``start`` closes; a ``'`` followed by a letter is an apostrophe."""
    at = text.find(close, start)
    while at >= 0 and close == "'" and at + 1 < len(text) and text[at + 1].isalnum():
        at = text.find(close, at + 1)
    return at if at >= 0 else None

"""The relay: a decoder's reply on its way to the client, as the decoder wrote it.

Whole (read, then sent) or streamed (chunk by chunk as it comes, the stream's last event marked
final); an error reply relayed with its status, and summarized for the route line; a stream the
decoder dropped ends with an error event.  :class:`Timings` collects what the decoder says it did,
read from a whole reply or, by :class:`SseScanner`, from a stream's last events; :func:`relay`
returns them with how the reply ended (:class:`Relayed`).  After a handoff, the reply's usage
counts are rewritten on the way (routes/usage.py): a provider's prefill is no cache hit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import attrs

from ..errors import DecoderError
from ..http.respond import Responder
from ..http.wire import Headers
from ..llama import decoder as decoder_api
from ..llama.decoder import DecoderClient
from .usage import Prefill

log = logging.getLogger("onebit.hybrid")

SSE_HEADERS = [
    ("Content-Type", "text/event-stream"),
    ("Cache-Control", "no-cache"),
    ("X-Accel-Buffering", "no"),  # a reverse proxy in front must not buffer the stream either
]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.define
class Timings:
    """What the decoder says it did for a request: from ``timings`` (and ``usage``) in its reply.

    llama-server's Anthropic replies have no ``timings``: their ``usage`` says it instead
    (``input_tokens`` evaluated, ``cache_read_input_tokens`` reused), and so does a Responses reply's
    (``input_tokens`` in all, ``input_tokens_details.cached_tokens`` reused); ``timings`` win where
    both come."""

    prompt_n: int | None = None  # prompt tokens it evaluated
    cache_n: int | None = None  # prompt tokens it reused from the slot's cache
    prompt_ms: float | None = None
    predicted_n: int | None = None  # tokens it generated, and the time it took (timings.predicted_*)
    predicted_ms: float | None = None
    usage_prompt_tokens: int | None = None
    # The decoder sent its stream's first bytes: llama-server answers only once the whole prompt is
    # evaluated, so the slot holds all of it from here on, whatever becomes of the reply.
    began: bool = False
    _timed: bool = False  # prompt_n and cache_n came from ``timings``
    # Told once, when the stream's first bytes come (routes/contention.py's ``poke``).
    on_began: Callable[[], None] | None = attrs.field(default=None, eq=False, repr=False)

    def begin(self) -> None:
        """The decoder sent the stream's first bytes."""
        if not self.began:
            self.began = True
            if self.on_began is not None:
                self.on_began()

    def read(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        timings = data.get("timings")
        if isinstance(timings, dict):
            prompt_n = timings.get("prompt_n")
            cache_n = timings.get("cache_n")
            prompt_ms = timings.get("prompt_ms")
            if isinstance(prompt_n, int):
                self.prompt_n = prompt_n
                self._timed = True
            if isinstance(cache_n, int):
                self.cache_n = cache_n
            if isinstance(prompt_ms, int | float):
                self.prompt_ms = float(prompt_ms)
            predicted_n, predicted_ms = timings.get("predicted_n"), timings.get("predicted_ms")
            if _is_int(predicted_n) and isinstance(predicted_ms, int | float):
                self.predicted_n, self.predicted_ms = predicted_n, float(predicted_ms)
        usage = data.get("usage")
        for holder in ("message", "response"):  # Anthropic's message_start, Responses' response.completed
            inner = data.get(holder)
            if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
                usage = inner["usage"]
        if isinstance(usage, dict):
            self._read_usage(usage)

    def _read_usage(self, usage: dict[str, Any]) -> None:
        if _is_int(usage.get("prompt_tokens")):
            self.usage_prompt_tokens = usage["prompt_tokens"]
            return
        inputs, details = usage.get("input_tokens"), usage.get("input_tokens_details")
        if not _is_int(inputs):
            return
        if isinstance(details, dict) and _is_int(details.get("cached_tokens")):
            cached = details["cached_tokens"]
            evaluated = inputs - cached
        elif _is_int(usage.get("cache_read_input_tokens")):
            cached, evaluated = usage["cache_read_input_tokens"], inputs
        else:
            return
        self.usage_prompt_tokens = evaluated + cached
        if not self._timed:
            self.prompt_n, self.cache_n = evaluated, cached

    def prompt_tokens(self) -> int | None:
        """The prompt's length as the decoder saw it, for a request we did not tokenize."""
        if self.prompt_n is not None:
            return self.prompt_n + (self.cache_n or 0)
        return self.usage_prompt_tokens


@attrs.frozen
class Relayed:
    """What a relay returns: the decoder's timings, and its error where its reply was one."""

    timings: Timings
    error: str | None = None  # the decoder's error, summarized (its reply relayed as it was)


# The event that ends a stream, in each of llama-server's APIs: OpenAI's ``data: [DONE]``,
# Anthropic's ``message_stop``, the Responses API's ``response.completed``, and llama.cpp's own
# /completion and /infill, whose last event says ``"stop": true`` (every other one ``false``; inside a
# JSON string the quotes would be escaped).
_FINAL_EVENT = re.compile(rb'^data: ?\[DONE\]|^event: ?(?:message_stop|response\.completed)\b|"stop": ?true', re.M)


def has_final_event(chunk: bytes) -> bool:
    """Whether ``chunk`` of a relayed stream holds the stream's final event.  A chunk with none of
    the words (every token's) is answered without the pattern's search (rfind: CPython's reverse
    search is the quicker one for these words)."""
    rfind = chunk.rfind
    if rfind(b"true") < 0 and rfind(b"DONE") < 0 and rfind(b"message_stop") < 0 and rfind(b"completed") < 0:
        return False
    return _FINAL_EVENT.search(chunk) is not None


class SseScanner:
    """Watches a relayed event stream for the events that carry ``timings`` or ``usage``; changes
    nothing.  Only those are parsed: llama-server puts them in the last event or two, and decoding
    every token's JSON would cost the relay a parse per chunk."""

    def __init__(self, timings: Timings) -> None:
        self._timings = timings
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        if (
            not self._buffer
            and chunk.endswith(b"\n\n")
            and chunk.rfind(b'"timings"') < 0
            and chunk.rfind(b'"usage"') < 0
        ):
            return  # the common chunk: whole token events and nothing to read: no copy, no split
        self._buffer += chunk
        if b"\n\n" not in self._buffer and b"\r\n\r\n" not in self._buffer:
            return
        *events, self._buffer = self._buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            if b'"timings"' not in event and b'"usage"' not in event:
                continue
            for raw in event.split(b"\n"):
                if not raw.startswith(b"data:"):
                    continue
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    continue
                try:
                    self._timings.read(json.loads(payload))
                except ValueError:
                    continue


async def relay_reply(out: Responder, status: int, headers: Mapping[str, str], body: bytes) -> None:
    """A decoder's whole reply, success or error, as the decoder wrote it: status, body, content type."""
    await out.whole(status, body, headers.get("content-type", "application/json"), source="decoder")


def error_summary(status: int, body: bytes) -> str:
    """A decoder error for the route line and the log: ``decoder answered 400 (TYPE): MESSAGE``,
    its ``error.type`` and ``error.message`` where it has them (the status page's feed shows it
    redacted: supervisor/observe/redact.py)."""
    message = body.decode("utf-8", "replace")[:2000] or f"decoder answered {status}"
    kind = None
    with contextlib.suppress(ValueError):
        data = json.loads(body)
        words = decoder_api.error_message(data)
        if words is not None:
            message = words
        kind = decoder_api.error_type(data)
    return f"decoder answered {status}{f' ({kind})' if kind else ''}: {message}"


def sse_error(message: str, *, anthropic: bool = False) -> bytes:
    """The event that ends a stream the decoder dropped; Anthropic's ``error`` event on /v1/messages."""
    if anthropic:
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    payload = {"error": {"message": message, "type": "server_error", "code": "decoder_lost", "source": "decoder"}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def relay(
    client: DecoderClient,
    endpoint: str,
    body: dict[str, Any],
    out: Responder,
    timings: Timings,
    headers: Headers = (),
    *,
    req: str,
    prefilled: Prefill | None = None,
) -> Relayed:
    """The decoder's reply to ``body``: with ``"stream": true`` relayed chunk by chunk as it comes (its
    last events' ``timings`` into ``timings``, which a request cut short still reads), else read
    whole, then sent.  ``headers``: the client's that the decoder is given too (``X-Conversation-Id``).
    ``prefilled``: what a provider spent on the prompt handed over, the reply's usage rewritten with
    it (routes/usage.py; ``timings`` reads the decoder's own)."""
    if body.get("stream") is not True:
        reply = await client.request("POST", endpoint, body, headers)
        if 200 <= reply.status < 300:
            sent = reply.body
            with contextlib.suppress(ValueError):
                data = json.loads(reply.body)
                timings.read(data)
                if prefilled is not None:
                    sent = prefilled.reply(reply.body, data)
            content_type = reply.headers.get("content-type", "application/json")
            await out.whole(reply.status, sent, content_type, source="decoder")
            return Relayed(timings)
        return await _relay_error(reply.status, reply.headers, reply.body, out, timings)
    async with client.stream(endpoint, body, headers) as upstream:
        if upstream.status != 200:
            chunks = [chunk async for chunk in upstream.chunks]
            return await _relay_error(upstream.status, upstream.headers, b"".join(chunks), out, timings)
        return await _relay_chunks(upstream.chunks, out, timings, req, prefilled)


async def _relay_error(
    status: int, headers: Mapping[str, str], body: bytes, out: Responder, timings: Timings
) -> Relayed:
    await relay_reply(out, status, headers, body)
    return Relayed(timings, error_summary(status, body))


async def _relay_chunks(
    chunks: AsyncIterator[bytes], out: Responder, timings: Timings, req: str, prefilled: Prefill | None
) -> Relayed:
    """A 200 stream's chunks to the client as they come (a handed-over prompt's usage rewritten); a
    decoder lost mid-stream ends it with an error event."""
    await out.start(200, SSE_HEADERS, source="decoder")
    scanner = SseScanner(timings)
    usage = prefilled.stream() if prefilled is not None else None
    error = None
    try:
        async for chunk in chunks:
            timings.begin()
            scanner.feed(chunk)
            if usage is not None:
                chunk = usage.feed(chunk)
                if not chunk:
                    continue
            await out.body(chunk, more=True, final=has_final_event(chunk))
        # A line the stream ended without its newline.  (A decoder lost mid-line leaves its start
        # held and dropped: the error event below then reaches the client as a line of its own.)
        rest = usage.flush() if usage is not None else b""
        if rest:
            await out.body(rest, more=True, final=has_final_event(rest))
    except DecoderError as exc:
        # Headers are gone already: the client learns of the loss as an error event, and the
        # operator from a warning (the route line, at info, says it too).
        log.warning("%s: the decoder stopped mid-stream: %s", req, exc.message)
        error = exc.message
        await out.body(sse_error(f"the decoder stopped mid-stream ({exc.public})", anthropic=out.anthropic), more=True)
    await out.body(b"", more=False)
    return Relayed(timings, error)

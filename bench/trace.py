"""``scripts/bench overhead --trace``: where a stream's first token spends its time inside onebitd.

A benchmark's own instrument, patched onto the one in-process daemon it measures (onebitd itself
carries no tracing): per request, the moments it was accepted (the ASGI call), sent to the decoder,
answered by the decoder (headers, then the first chunk), and its first byte handed to the server.  The client's
first token and the decoder's own ``timings`` come from the benchmark's clients.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs

from supervisor.daemon import Daemon
from supervisor.llama.decoder import DecoderClient, Stream

Send = Callable[[dict[str, Any]], Awaitable[None]]

MARKS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("bench_marks", default=None)

# The moments of a request, in the order they happen (perf_counter seconds).
STEPS = ("accepted", "decoder_sent", "decoder_headers", "decoder_first_chunk", "first_write", "client_first")


@attrs.define
class Tracer:
    requests: list[dict[str, Any]] = attrs.Factory(list)

    def install(self, daemon: Daemon) -> None:
        front = daemon.front
        inner_http = front._http
        tracer = self

        async def traced_http(scope: dict[str, Any], receive: Any, send: Send) -> None:
            marks: dict[str, Any] = {"accepted": time.perf_counter()}
            token = MARKS.set(marks)

            async def traced_send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.body" and message.get("body") and "first_write" not in marks:
                    marks["first_write"] = time.perf_counter()
                await send(message)

            try:
                await inner_http(scope, receive, traced_send)
            finally:
                MARKS.reset(token)
                tracer.requests.append(marks)

        front._http = traced_http  # type: ignore[method-assign]
        daemon.models.default.completions.client = TracedClient(daemon.models.default.completions.client)  # type: ignore[assignment]

    def clear(self) -> None:
        self.requests.clear()


class TracedClient:
    """The daemon's decoder client, marking when a stream is sent and answered."""

    def __init__(self, inner: DecoderClient) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @asynccontextmanager
    async def stream(self, path: str, body: Any) -> AsyncIterator[Stream]:
        marks = MARKS.get()
        if marks is None:
            async with self._inner.stream(path, body) as upstream:
                yield upstream
            return
        marks["key"] = body.get("prompt") if isinstance(body, dict) else None
        marks["decoder_sent"] = time.perf_counter()
        async with self._inner.stream(path, body) as upstream:
            marks["decoder_headers"] = time.perf_counter()

            async def chunks() -> AsyncIterator[bytes]:
                async for chunk in upstream.chunks:
                    marks.setdefault("decoder_first_chunk", time.perf_counter())
                    yield chunk

            yield Stream(upstream.status, upstream.headers, chunks())


@attrs.define
class StreamRecord:
    """What a benchmark client saw of one stream."""

    key: str
    sent: float  # the round's start (perf_counter)
    first: float | None = None
    timings: dict[str, Any] = attrs.Factory(dict)


def ms(value: float | None, origin: float) -> str:
    return "-" if value is None else f"{(value - origin) * 1000:7.1f}"


def report(name: str, records: Sequence[StreamRecord], tracer: Tracer | None) -> None:
    """One line per stream of one round, in ms from the round's start."""
    by_key = {marks.get("key"): marks for marks in tracer.requests} if tracer else {}
    print(f"trace, one round {name}: ms from the round's start (the client sends every stream at once)")
    header = "  stream  accepted  to-decoder  headers  1st-chunk  1st-write  client-1st  prompt_n  prompt_ms"
    print(header)
    for record in sorted(records, key=lambda r: r.first or 0.0):
        marks = by_key.get(record.key, {})
        timings = record.timings
        print(
            f"  {record.key.split('.')[0][-2:]:>6}  {ms(marks.get('accepted'), record.sent):>8}"
            f"  {ms(marks.get('decoder_sent'), record.sent):>10}  {ms(marks.get('decoder_headers'), record.sent):>7}"
            f"  {ms(marks.get('decoder_first_chunk'), record.sent):>9}  {ms(marks.get('first_write'), record.sent):>9}"
            f"  {ms(record.first, record.sent):>10}  {timings.get('prompt_n', '-'):>8}"
            f"  {timings.get('prompt_ms', float('nan')):9.1f}"
        )

"""A completion request's path to the decoder: admission, a slot, the relay, the route line's numbers.

The HTTP front hands over a parsed JSON object; this module pins it to a slot we own (``id_slot``),
relays the decoder's answer (whole, or chunk by chunk for ``stream: true``) and fills the route line
from the decoder's own ``timings``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

import attrs

from .child import Child, ChildState
from .decoder import DecoderClient
from .errors import DecoderError, DecoderUnavailable
from .providers import Provider, Providers
from .respond import Responder
from .routeline import RouteLine
from .routes.decision import Choice, Reason, Route, choose, restore_used
from .routes.file import FileHandoff
from .routes.prompt import handoff_unsupported, tokens_for
from .routes.share import ShareHandoff
from .slots import SlotPool

log = logging.getLogger("onebit.hybrid")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/completion")

SSE_HEADERS = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
    ("x-accel-buffering", "no"),  # a reverse proxy in front must not buffer the stream either
]


def read_timings(data: Any, line: RouteLine) -> None:
    """Copy what the decoder says it evaluated into the route line."""
    if not isinstance(data, dict):
        return
    timings = data.get("timings")
    if isinstance(timings, dict):
        prompt_n = timings.get("prompt_n")
        cache_n = timings.get("cache_n")
        if isinstance(prompt_n, int):
            line.decoder_prompt_n = prompt_n
            if line.prompt_tokens is None:
                line.prompt_tokens = prompt_n + (cache_n if isinstance(cache_n, int) else 0)
        prompt_ms = timings.get("prompt_ms")
        if isinstance(prompt_ms, int | float):
            line.decoder_prompt_ms = float(prompt_ms)
    usage = data.get("usage")
    if line.prompt_tokens is None and isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        line.prompt_tokens = usage["prompt_tokens"]


class SseScanner:
    """Watches a relayed event stream for the chunk that carries ``timings``; changes nothing."""

    def __init__(self, line: RouteLine) -> None:
        self._line = line
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            for raw in event.split(b"\n"):
                if not raw.startswith(b"data:"):
                    continue
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    continue
                try:
                    read_timings(json.loads(payload), self._line)
                except ValueError:
                    continue


def decoder_error_envelope(status: int, body: bytes) -> tuple[str, str, str]:
    """``(message, type, code)`` from a llama-server error body, whatever its shape."""
    message = body.decode("utf-8", "replace")[:2000] or f"decoder answered {status}"
    type_ = "invalid_request_error" if status < 500 else "server_error"
    try:
        data = json.loads(body)
    except ValueError:
        return message, type_, f"decoder_http_{status}"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message", message))
        type_ = str(error.get("type", type_))
    return message, type_, f"decoder_http_{status}"


def sse_error(message: str) -> bytes:
    payload = {"error": {"message": message, "type": "server_error", "code": "decoder_lost", "source": "decoder"}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@attrs.define
class HybridSettings:
    """What the hybrid routes need beyond the plain one (absent: hybrid off)."""

    providers: Providers
    handoff: FileHandoff
    min_prompt_tokens: int
    restore_check_tokens: int
    share: ShareHandoff | None = None  # set when the share route is on (hybrid.mode / ONEBIT_KV_SHARE)


class Completions:
    def __init__(
        self,
        *,
        decoder: Child,
        client: DecoderClient,
        slots: SlotPool,
        hybrid: HybridSettings | None = None,
    ) -> None:
        self.decoder = decoder
        self.client = client
        self.slots = slots
        self.hybrid = hybrid
        # Hybrid requests whose decoder re-evaluated the prompt although the restore succeeded.
        self.restore_unused = 0

    def check_ready(self) -> None:
        state = self.decoder.state
        if state is ChildState.READY:
            return
        if state is ChildState.FAILED:
            raise DecoderUnavailable(
                f"the decoder has failed ({self.decoder.statistics().last_exit}); see onebitd's log"
            )
        raise DecoderUnavailable(f"the decoder is {state.value}; try again shortly")

    async def _plan(
        self, endpoint: str, body: dict[str, Any], line: RouteLine
    ) -> tuple[Choice, list[int], Provider | None]:
        """Pick the route; tokenizes the prompt only when a hybrid route is possible at all."""
        hybrid = self.hybrid
        if hybrid is None:
            return Choice(Route.PLAIN, Reason.DISABLED), [], None
        provider = hybrid.providers.pick()
        tokens: list[int] | None = None
        if provider is not None:
            why = handoff_unsupported(endpoint, body)
            if why is not None:
                log.info("hybrid: %s cannot be handed over (%s); the backend prefills it", line.req, why)
                return Choice(Route.PLAIN, Reason.UNSUPPORTED), [], None
            try:
                tokens = await tokens_for(self.client, endpoint, body)
            except DecoderError as exc:
                log.warning("hybrid: tokenizing %s failed (%s); the backend prefills it", line.req, exc.message)
            else:
                line.prompt_tokens = len(tokens)
        choice = choose(
            enabled=True,
            share=hybrid.share is not None,
            provider_ready=provider is not None,
            prompt_tokens=None if tokens is None else len(tokens),
            min_prompt_tokens=hybrid.min_prompt_tokens,
            share_refused=hybrid.share is not None and hybrid.share.refused_by(self.decoder.generation),
        )
        return choice, tokens or [], provider

    async def serve(self, endpoint: str, body: dict[str, Any], out: Responder, line: RouteLine) -> None:
        self.check_ready()
        choice, tokens, provider = await self._plan(endpoint, body, line)
        if choice.reason is not None and choice.reason is not Reason.DISABLED:
            line.fallback = choice.reason.value
        async with self.slots.hold() as slot:
            line.slot = slot
            self.check_ready()  # it may have died while we queued
            forwarded = {**body, "id_slot": slot}
            if provider is not None and self.hybrid is not None:
                route = await self._hand_over(choice.route, slot, tokens, provider, line)
                line.route = route.value
                if route is not Route.PLAIN:
                    # The handed-over cells are only reused by a request that may use its slot's cache.
                    forwarded["cache_prompt"] = True
            if body.get("stream") is True:
                await self._relay_stream(endpoint, forwarded, out, line)
            else:
                await self._relay_whole(endpoint, forwarded, out, line)
        self._verify_handoff(line)

    async def _hand_over(
        self, route: Route, slot: int, tokens: list[int], provider: Provider, line: RouteLine
    ) -> Route:
        """Run the hybrid route, degrading as routes.DEGRADE says; the route the request ends on."""
        hybrid = self.hybrid
        assert hybrid is not None
        if route is Route.SHARE and hybrid.share is not None:
            route = await hybrid.share.run(
                req=line.req,
                slot=slot,
                tokens=tokens,
                provider=provider,
                line=line,
                generation=self.decoder.generation,
            )
        if route is Route.FILE:
            done = await hybrid.handoff.run(req=line.req, slot=slot, tokens=tokens, provider=provider, line=line)
            route = Route.FILE if done else Route.PLAIN
        return route

    def _verify_handoff(self, line: RouteLine) -> None:
        """llama.cpp's restore can answer success and still re-prefill everything (#26676)."""
        if line.route == Route.PLAIN.value or self.hybrid is None:
            return
        if not restore_used(line.decoder_prompt_n, self.hybrid.restore_check_tokens):
            self.restore_unused += 1
            log.warning(
                "hybrid: restore was not used by the decoder: it evaluated %s of %s prompt tokens (%s)",
                line.decoder_prompt_n,
                line.prompt_tokens,
                line.req,
            )

    async def _relay_whole(self, endpoint: str, body: dict[str, Any], out: Responder, line: RouteLine) -> None:
        reply = await self.client.request("POST", endpoint, body)
        if 200 <= reply.status < 300:
            with contextlib.suppress(ValueError):
                read_timings(json.loads(reply.body), line)
            content_type = reply.headers.get("content-type", "application/json")
            await out.whole(reply.status, reply.body, content_type)
            return
        await self._relay_error(reply.status, reply.body, out, line)

    async def _relay_error(self, status: int, body: bytes, out: Responder, line: RouteLine) -> None:
        message, type_, code = decoder_error_envelope(status, body)
        line.outcome = "error"
        line.error = f"decoder answered {status}: {message}"
        await out.error(status, code, message, source="decoder", type_=type_)

    async def _relay_stream(self, endpoint: str, body: dict[str, Any], out: Responder, line: RouteLine) -> None:
        async with self.client.stream(endpoint, body) as upstream:
            if upstream.status != 200:
                chunks = [chunk async for chunk in upstream.chunks]
                await self._relay_error(upstream.status, b"".join(chunks), out, line)
                return
            await out.start(200, SSE_HEADERS)
            scanner = SseScanner(line)
            try:
                async for chunk in upstream.chunks:
                    scanner.feed(chunk)
                    await out.body(chunk, more=True)
            except DecoderError as exc:
                # Headers are gone already: the client learns of the loss as an error event.
                line.outcome = "error"
                line.error = exc.message
                await out.body(sse_error(f"the decoder stopped mid-stream: {exc.message}"), more=True)
            await out.body(b"", more=False)

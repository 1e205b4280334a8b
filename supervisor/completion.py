"""A completion request's path to the decoder: admission, a slot, the relay, the route line's numbers.

The HTTP front hands over a parsed JSON object; this module pins it to a slot we own (``id_slot``),
relays the decoder's answer (whole, or chunk by chunk for ``stream: true``) and fills the route line
from the decoder's own ``timings``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, Protocol

import attrs

from .child import ChildState, ChildStatistics
from .config import HybridConfig
from .decoder import DecoderClient
from .errors import DecoderError, DecoderUnavailable
from .providers import Provider, Providers
from .rates import Rates
from .respond import Responder
from .routeline import RouteLine
from .routes.decision import Choice, Costs, Policy, Reason, Route, choose, degrade, restore_used
from .routes.file import FileHandoff
from .routes.prompt import CHAT, handoff_unsupported, tokens_for
from .routes.share import ShareHandoff
from .slots import PromptKey, SlotPool

log = logging.getLogger("onebit.hybrid")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/completion")

SSE_HEADERS = [
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache"),
    ("x-accel-buffering", "no"),  # a reverse proxy in front must not buffer the stream either
]


@attrs.define
class Timings:
    """What the decoder says it did for a request: from ``timings`` (and ``usage``) in its reply."""

    prompt_n: int | None = None  # prompt tokens it evaluated
    cache_n: int | None = None  # prompt tokens it reused from the slot's cache
    prompt_ms: float | None = None
    usage_prompt_tokens: int | None = None

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
            if isinstance(cache_n, int):
                self.cache_n = cache_n
            if isinstance(prompt_ms, int | float):
                self.prompt_ms = float(prompt_ms)
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            self.usage_prompt_tokens = usage["prompt_tokens"]

    def prompt_tokens(self) -> int | None:
        """The prompt's length as the decoder saw it, for a request we did not tokenize."""
        if self.prompt_n is not None:
            return self.prompt_n + (self.cache_n or 0)
        return self.usage_prompt_tokens


class SseScanner:
    """Watches a relayed event stream for the events that carry ``timings`` or ``usage``; changes
    nothing.  Only those are parsed: llama-server puts them in the last event or two, and decoding
    every token's JSON would cost the relay a parse per chunk."""

    def __init__(self, timings: Timings) -> None:
        self._timings = timings
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        if not self._buffer and chunk.endswith(b"\n\n") and b'"timings"' not in chunk and b'"usage"' not in chunk:
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


class Decoder(Protocol):
    """What a request asks of the supervised decoder: a :class:`~supervisor.child.Child`."""

    @property
    def state(self) -> ChildState: ...

    @property
    def generation(self) -> int: ...

    def statistics(self) -> ChildStatistics: ...


@attrs.frozen
class Hybrid:
    """What the hybrid routes need beyond the plain one (absent: hybrid off)."""

    providers: Providers
    file: FileHandoff
    share: ShareHandoff | None = None  # set when the share route is on (hybrid.mode / ONEBIT_KV_SHARE)


@attrs.frozen
class Plan:
    """What is known before a slot is taken: the prompt's key, its tokens, a provider, and a reason
    the request cannot be handed over at all (then plain, whatever the costs)."""

    key: PromptKey
    tokens: list[int] | None
    provider: Provider | None
    reason: Reason | None = None


# The state one prompt token takes in a slot state file, until a handoff measures it: SmolLM2-135M's
# f16 cache (30 layers x K and V x 192 values x 2 bytes), about 22 KiB as measured.
STATE_BYTES_PER_TOKEN = 23_040


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    """A prompt's text for slot affinity, without a round trip to the tokenizer."""
    if endpoint == CHAT:
        return json.dumps(body.get("messages"), separators=(",", ":"), ensure_ascii=False)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))


# How a fallback is worded in the log, by the route the request goes on to.
_GOES_ON = {
    Route.PLAIN: "the backend prefills this request itself",
    Route.FILE: "the state-file route is used",
}


def fallback_chain(reasons: list[Reason]) -> str | None:
    """Every reason a request left a route, in order: ``share-refused>provider-failed``."""
    return ">".join(reason.value for reason in reasons) or None


class Completions:
    """The owner of a completion request's story: it plans the route, walks ``DEGRADE`` with the
    outcomes the handoffs return, relays the reply, and is the only writer of the route line's route
    fields.  ``settings`` is one frozen value, swapped whole by a reload and read once per request."""

    def __init__(
        self,
        *,
        decoder: Decoder,
        client: DecoderClient,
        slots: SlotPool,
        settings: HybridConfig,
        hybrid: Hybrid | None = None,
    ) -> None:
        self.decoder = decoder
        self.client = client
        self.slots = slots
        self.settings = settings
        self.hybrid = hybrid
        # Hybrid requests whose decoder re-evaluated the prompt although the restore succeeded.
        self.restore_unused = 0
        self.rates = Rates(
            decoder_ms_per_token=settings.decoder_ms_per_token,
            provider_ms_per_token=settings.provider_ms_per_token,
            handoff_ms_per_mib=settings.handoff_ms_per_mib,
            state_bytes_per_token=STATE_BYTES_PER_TOKEN,
        )
        # Requests whose reply the decoder is generating now: a plain prefill would stall them.
        self.decoding = 0

    def configure(self, settings: HybridConfig) -> None:
        """Swap in new settings; requests in flight keep the ones they started with."""
        self.settings = settings

    def check_ready(self) -> None:
        state = self.decoder.state
        if state is ChildState.READY:
            return
        if state is ChildState.FAILED:
            raise DecoderUnavailable(
                f"the decoder has failed ({self.decoder.statistics().last_exit}); see onebitd's log"
            )
        raise DecoderUnavailable(f"the decoder is {state.value}; try again shortly")

    async def _plan(self, endpoint: str, body: dict[str, Any], req: str) -> Plan:
        """Tokenize the prompt when a hybrid route is possible at all; the rest is decided once the
        request has its slot (what the slot holds is part of the cost)."""
        text = prompt_text(endpoint, body)
        hybrid = self.hybrid
        if hybrid is None:
            return Plan(PromptKey(text), None, None, Reason.DISABLED)
        provider = hybrid.providers.pick()
        if provider is None:
            return Plan(PromptKey(text), None, None, Reason.NO_PROVIDER)
        why = handoff_unsupported(endpoint, body)
        if why is not None:
            log.info("hybrid: %s cannot be handed over (%s); the backend prefills it", req, why)
            return Plan(PromptKey(text), None, None, Reason.UNSUPPORTED)
        try:
            tokens = await tokens_for(self.client, endpoint, body)
        except DecoderError as exc:
            log.warning("hybrid: tokenizing %s failed (%s); the backend prefills it", req, exc.message)
            return Plan(PromptKey(text), None, None, Reason.TOKENIZE_FAILED)
        return Plan(PromptKey(text, tuple(tokens)), tokens, provider)

    def _choose(self, plan: Plan, slot: int, settings: HybridConfig) -> Choice:
        hybrid = self.hybrid
        if plan.reason is not None or hybrid is None or plan.provider is None or plan.tokens is None:
            return Choice(Route.PLAIN, plan.reason)
        generation = self.decoder.generation
        n = len(plan.tokens)
        decoder_rate, provider_rate = self.rates.prefill(generation, plan.provider.name)
        costs = Costs(
            decoder_cached=self.slots.cached(slot, plan.key),
            provider_cached=plan.provider.cached_tokens(tuple(plan.tokens)),
            decoder_ms_per_token=decoder_rate,
            provider_ms_per_token=provider_rate,
            handoff_ms=self.rates.handoff_ms(n),
            streams_decoding=self.decoding,
        )
        return choose(
            enabled=True,
            share=hybrid.share is not None,
            provider_ready=plan.provider.ready,
            prompt_tokens=n,
            min_prompt_tokens=settings.min_prompt_tokens,
            share_refused=hybrid.share is not None and hybrid.share.refused_by(generation),
            costs=costs,
            policy=Policy(prefer_margin=settings.prefer_margin, max_stall_ms=settings.max_stall_ms),
        )

    async def serve(self, endpoint: str, body: dict[str, Any], out: Responder, line: RouteLine) -> None:
        settings = self.settings
        self.check_ready()
        plan = await self._plan(endpoint, body, line.req)
        if plan.tokens is not None:
            line.prompt_tokens = len(plan.tokens)
        reasons: list[Reason] = []
        timings = Timings()
        async with self.slots.hold(plan.key) as slot:
            line.slot = slot
            self.check_ready()  # it may have died while we queued
            choice = self._choose(plan, slot, settings)
            if choice.reason is not None and choice.reason is not Reason.DISABLED:
                reasons.append(choice.reason)
            if choice.estimate is not None:
                line.est_plain_ms = choice.estimate.plain_ms
                line.est_hybrid_ms = choice.estimate.hybrid_ms
            line.fallback = fallback_chain(reasons)
            forwarded = {**body, "id_slot": slot}
            route = Route.PLAIN
            if choice.route is not Route.PLAIN and plan.provider is not None:
                route = await self._hand_over(choice.route, slot, plan, line, reasons, settings)
                line.fallback = fallback_chain(reasons)
            line.route = route.value
            if route is not Route.PLAIN:
                # The handed-over cells are only reused by a request that may use its slot's cache.
                forwarded["cache_prompt"] = True
            self.decoding += 1
            try:
                if body.get("stream") is True:
                    await self._relay_stream(endpoint, forwarded, out, line, timings)
                else:
                    await self._relay_whole(endpoint, forwarded, out, line, timings)
            finally:
                self.decoding -= 1
                self._record(timings, line)
        # After the last byte: this runs whether or not the client is still there (the front cancels
        # a request only while its response is unfinished), and awaits nothing.
        if out.finished and line.outcome == "ok":
            self.rates.observe_decoder(self.decoder.generation, timings.prompt_n, timings.prompt_ms)
            if route is not Route.PLAIN:
                self._verify_handoff(line, reasons, settings)

    async def _hand_over(
        self,
        route: Route,
        slot: int,
        plan: Plan,
        line: RouteLine,
        reasons: list[Reason],
        settings: HybridConfig,
    ) -> Route:
        """Try ``route``, then whatever ``DEGRADE`` says each failure leads to; the route reached."""
        hybrid = self.hybrid
        assert hybrid is not None
        assert plan.provider is not None
        while route is not Route.PLAIN:
            if route is Route.SHARE and hybrid.share is not None:
                outcome = await hybrid.share.run(
                    req=line.req,
                    slot=slot,
                    tokens=plan.tokens or [],
                    provider=plan.provider,
                    generation=self.decoder.generation,
                    timeout_s=settings.prefill_timeout_s,
                )
            else:
                outcome = await hybrid.file.run(
                    req=line.req,
                    slot=slot,
                    tokens=plan.tokens or [],
                    provider=plan.provider,
                    timeout_s=settings.prefill_timeout_s,
                )
            if outcome.prefill_ms is not None:
                line.prefill_ms = outcome.prefill_ms
            if outcome.restore_ms is not None:
                line.restore_ms = outcome.restore_ms
            if outcome.share_ms is not None:
                line.share_ms = outcome.share_ms
            if outcome.ok:
                line.provider_prompt_n = outcome.evaluated
                self.rates.observe_provider(plan.provider.name, outcome.evaluated, outcome.prefill_ms)
                self.rates.observe_handoff(len(plan.tokens or ()), outcome.state_bytes, outcome.handoff_ms)
                return route
            assert outcome.reason is not None
            reasons.append(outcome.reason)
            route = degrade(outcome)
            level = logging.INFO if outcome.reason is Reason.SHARE_UNSUPPORTED else logging.WARNING
            log.log(level, "hybrid: %s; %s", outcome.why, _GOES_ON[route])
        return route

    @staticmethod
    def _record(timings: Timings, line: RouteLine) -> None:
        line.decoder_prompt_n = timings.prompt_n
        line.decoder_prompt_ms = timings.prompt_ms
        line.cached_tokens = timings.cache_n
        if line.prompt_tokens is None:
            line.prompt_tokens = timings.prompt_tokens()

    def _verify_handoff(self, line: RouteLine, reasons: list[Reason], settings: HybridConfig) -> None:
        """llama.cpp's restore can answer success and still re-prefill everything (#26676)."""
        if restore_used(line.decoder_prompt_n, settings.restore_check_tokens):
            return
        self.restore_unused += 1
        reasons.append(Reason.RESTORE_UNUSED)
        line.fallback = fallback_chain(reasons)
        log.warning(
            "hybrid: restore was not used by the decoder: it evaluated %s of %s prompt tokens (%s)",
            line.decoder_prompt_n,
            line.prompt_tokens,
            line.req,
        )

    async def _relay_whole(
        self, endpoint: str, body: dict[str, Any], out: Responder, line: RouteLine, timings: Timings
    ) -> None:
        reply = await self.client.request("POST", endpoint, body)
        if 200 <= reply.status < 300:
            with contextlib.suppress(ValueError):
                timings.read(json.loads(reply.body))
            content_type = reply.headers.get("content-type", "application/json")
            await out.whole(reply.status, reply.body, content_type)
            return
        await self._relay_error(reply.status, reply.body, out, line)

    async def _relay_error(self, status: int, body: bytes, out: Responder, line: RouteLine) -> None:
        message, type_, code = decoder_error_envelope(status, body)
        line.outcome = "error"
        line.error = f"decoder answered {status}: {message}"
        await out.error(status, code, message, source="decoder", type_=type_)

    async def _relay_stream(
        self, endpoint: str, body: dict[str, Any], out: Responder, line: RouteLine, timings: Timings
    ) -> None:
        async with self.client.stream(endpoint, body) as upstream:
            if upstream.status != 200:
                chunks = [chunk async for chunk in upstream.chunks]
                await self._relay_error(upstream.status, b"".join(chunks), out, line)
                return
            await out.start(200, SSE_HEADERS)
            scanner = SseScanner(timings)
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

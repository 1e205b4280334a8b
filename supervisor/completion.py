"""A completion request's path to the decoder: admission, a slot, the relay, the route line's numbers.

The HTTP front hands over a parsed JSON object; this module pins it to a slot we own (``id_slot``),
relays the decoder's answer (whole, or chunk by chunk for ``stream: true``) and fills the route line
from the decoder's own ``timings``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from . import decoder as decoder_api
from .child import ChildState, ChildStatistics
from .config import HybridConfig, source
from .decoder import DecoderClient
from .errors import ChatFormRefused, DecoderError, DecoderUnavailable
from .prefix_store import Entry
from .providers import Provider, Providers
from .rates import MIB, Rates
from .relay import Timings, relay_stream, relay_whole
from .respond import Responder
from .routeline import RouteLine
from .routes.decision import (
    Choice,
    Costs,
    Outcome,
    Policy,
    Reason,
    Route,
    choose,
    degrade,
    restore_used,
    worth_restoring,
)
from .routes.file import FileHandoff
from .routes.prompt import CHAT, MESSAGES, RESPONSES, chat_form, handoff_unsupported, tokens_for
from .routes.share import ShareHandoff
from .routes.stored import StoredPrefixes
from .slots import PromptKey, SlotPool
from .wire import Headers

log = logging.getLogger("onebit.hybrid")

# What the model runs for on these is no prompt to hand over: no fallback is logged for them.
EMBEDDING_ENDPOINTS = ("/embeddings", "/v1/embeddings", "/rerank")


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
    # False for a prompt the decoder will refuse: its slot keeps the memory of what it holds.
    remember: bool = True
    n_tokens: int | None = None  # the prompt's length where it was tokenized


# The state one prompt token takes in a slot state file, until a handoff measures it: SmolLM2-135M's
# f16 cache (30 layers x K and V x 192 values x 2 bytes), about 22 KiB as measured.
STATE_BYTES_PER_TOKEN = 23_040


# A request that leaves its slot unfinished keeps it until the decoder says the slot is idle, for at
# most this long: llama-server finishes a prefill it has begun before it notices the hang-up, and an
# abandoned prefill of a full 1024-token slot took 50 to 80 s on this project's loaded 2-core machine
# (docs/reliability.md).  Polled this often: the decoder's state is another process's.
SETTLE_TIMEOUT_S = 120.0
SETTLE_POLL_S = 0.05


def prompt_text(endpoint: str, body: dict[str, Any]) -> str:
    """A prompt's text for slot affinity, without a round trip to the tokenizer."""
    if endpoint in (CHAT, MESSAGES):
        return json.dumps(body.get("messages"), separators=(",", ":"), ensure_ascii=False)
    if endpoint == RESPONSES:
        return json.dumps(body.get("input"), separators=(",", ":"), ensure_ascii=False)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))


# A decoder state, as a client is told it in a 503.
_WORDS = {
    ChildState.STOPPED: "not started yet",
    ChildState.STARTING: "starting (loading its model)",
    ChildState.BACKOFF: "restarting after a crash",
    ChildState.STOPPING: "stopping",
}

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
        settings: HybridConfig | Callable[[], HybridConfig],
        hybrid: Hybrid | None = None,
        slot_context: int | None = None,
    ) -> None:
        self.decoder = decoder
        self.client = client
        self.slots = slots
        self._settings = source(settings)
        self.hybrid = hybrid
        # The tokens one decoder slot holds, prompt and reply: model.ctx_size / model.parallel, as
        # llama-server divides its context (None: not checked here, the decoder still is).
        self.slot_context = slot_context
        # Requests whose decoder re-evaluated the prompt although the restore (a handoff's, or the
        # prefix store's) succeeded.
        self.restore_unused = 0
        self.rates = Rates(
            decoder_ms_per_token=self.settings.decoder_ms_per_token,
            provider_ms_per_token=self.settings.provider_ms_per_token,
            handoff_ms_per_mib=self.settings.handoff_ms_per_mib,
            state_bytes_per_token=STATE_BYTES_PER_TOKEN,
        )
        # Requests whose reply the decoder is generating now: a plain prefill would stall them.
        self.decoding = 0
        # The decoder process the slots' memory is about: a restarted decoder holds nothing.
        self._slots_generation = decoder.generation
        # The prefix store, and the nursery its writes run in off the requests' path: set by run().
        self.stored: StoredPrefixes | None = None
        self._background: trio.Nursery | None = None

    async def run(
        self, stored: StoredPrefixes | None = None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Hold the nursery that work after a reply runs in (the prefix store's writes), for as
        long as the daemon serves."""
        async with trio.open_nursery() as nursery:
            self.stored, self._background = stored, nursery
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self.stored, self._background = None, None

    @property
    def settings(self) -> HybridConfig:
        """The settings now: a request reads them once, at its start, and keeps them."""
        return self._settings()

    def configure(self, settings: HybridConfig) -> None:
        """Fixed settings in place of the source it was given (a test's, or a tool's)."""
        self._settings = source(settings)

    def check_ready(self) -> None:
        state = self.decoder.state
        if state is ChildState.READY:
            return
        if state is ChildState.FAILED:
            failed = f"the decoder has failed ({self.decoder.statistics().last_exit}); see onebitd's log"
            raise DecoderUnavailable(failed, public=failed)
        words = f"the decoder is {_WORDS.get(state, state.value)}; try again shortly"
        raise DecoderUnavailable(words, public=words)

    async def _plan(self, endpoint: str, body: dict[str, Any], req: str) -> Plan:
        """Tokenize the prompt when a hybrid route is possible, or the prefix store may hold or keep
        it; the rest is decided once the request has its slot (what the slot holds is a cost).  A
        Messages or Responses request is read in the chat form llama-server converts it into."""
        hybrid = self.hybrid
        provider = hybrid.providers.pick() if hybrid is not None else None
        reason: Reason | None = None
        if hybrid is None:
            reason = Reason.DISABLED
        elif provider is None:
            reason = Reason.NO_PROVIDER
        try:
            endpoint, body = chat_form(endpoint, body)
        except ChatFormRefused as exc:
            # llama-server refuses it too, with its own 400, which is relayed: nothing to route.
            log.info("hybrid: %s is not a request llama-server converts (%s); relayed for its answer", req, exc)
            return Plan(
                PromptKey(prompt_text(endpoint, body)), None, None, reason or Reason.UNSUPPORTED, remember=False
            )
        text = prompt_text(endpoint, body)
        why = handoff_unsupported(endpoint, body)
        if why is not None:
            if reason is None:
                log.info("hybrid: %s cannot be handed over (%s); the backend prefills it", req, why)
            return Plan(PromptKey(text), None, None, reason or Reason.UNSUPPORTED)
        stored = self.stored
        # A prompt's text is at least as long as its tokens: a short text cannot make an entry.
        for_store = stored is not None and stored.enabled and len(text) >= stored.store.min_tokens
        if reason is not None and not for_store:
            return Plan(PromptKey(text), None, None, reason)
        try:
            tokens = await tokens_for(self.client, endpoint, body)
        except DecoderError as exc:
            log.warning("hybrid: tokenizing %s failed (%s); the backend prefills it", req, exc.message)
            return Plan(PromptKey(text), None, None, reason or Reason.TOKENIZE_FAILED)
        if self.slot_context is not None and len(tokens) >= self.slot_context:
            # No room for the prompt and a token of reply: the decoder refuses it with its own 400
            # (exceed_context_size_error, with n_prompt_tokens and n_ctx), which is relayed.  Before
            # any handoff or store restore, so neither a provider nor a slot's memory takes it.
            log.info(
                "hybrid: %s has %d prompt tokens, over a slot's context of %d (model.ctx_size / model.parallel)",
                req,
                len(tokens),
                self.slot_context,
            )
            return Plan(PromptKey(text), None, None, Reason.OVER_CONTEXT, remember=False, n_tokens=len(tokens))
        return Plan(PromptKey(text, tuple(tokens)), tokens, provider if reason is None else None, reason)

    async def _from_store(self, plan: Plan, slot: int, line: RouteLine) -> Entry | None:
        """Restore the longest stored prefix of the prompt into the slot, when that spares more
        prefill than it costs; the entry restored."""
        stored = self.stored
        if stored is None or plan.tokens is None or not stored.enabled:
            return None
        entry = stored.lookup(plan.tokens)
        if entry is None:
            return None
        decoder_rate = self.rates.decoder.get(self.decoder.generation)
        restore_ms = self.rates.handoff.get(0) * entry.state_bytes / MIB
        worth = worth_restoring(
            entry_tokens=entry.n_tokens,
            decoder_cached=self.slots.cached(slot, plan.key),
            decoder_ms_per_token=decoder_rate,
            restore_ms=restore_ms,
        )
        if not worth:
            return None
        restored = await stored.restore(slot, entry)
        line.restore_ms += restored.ms
        if restored.entry is None:
            if restored.why:
                log.warning("prefix store: %s; the request goes on without it (%s)", restored.why, line.req)
            self.slots.forget(slot)
            return None
        self.slots.remember(slot, PromptKey(tokens=entry.tokens))
        line.restored_tokens = entry.n_tokens
        return entry

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
            costs=costs if settings.route_by == "cost" else None,
            policy=Policy(prefer_margin=settings.prefer_margin, max_stall_ms=settings.max_stall_ms),
        )

    async def serve(
        self, endpoint: str, body: dict[str, Any], out: Responder, line: RouteLine, headers: Headers = ()
    ) -> None:
        """``headers``: the client's that the decoder is given too (``X-Conversation-Id``)."""
        settings = self.settings
        self.check_ready()
        if self.decoder.generation != self._slots_generation:
            self._slots_generation = self.decoder.generation
            self.slots.forget_all()
        plan = await self._plan(endpoint, body, line.req)
        if plan.tokens is not None:
            line.prompt_tokens = len(plan.tokens)
        elif plan.n_tokens is not None:
            line.prompt_tokens = plan.n_tokens
        reasons: list[Reason] = []
        timings = Timings()
        async with self.slots.hold(plan.key if plan.remember else None, settle=self._settle) as slot:
            line.slot = slot
            self.check_ready()  # it may have died while we queued
            entry = await self._from_store(plan, slot, line)
            choice = self._choose(plan, slot, settings)
            if choice.reason is not None and choice.reason is not Reason.DISABLED:
                reasons.append(choice.reason)
            if entry is not None and choice.route is Route.PLAIN:
                # The store served: say so, after what else kept the request plain (no provider ready,
                # a short prompt); "cached" is then the store's doing, not the slot's.
                reasons[:] = [*(reason for reason in reasons if reason is not Reason.CACHED), Reason.STORED]
            if choice.estimate is not None:
                line.est_plain_ms = choice.estimate.plain_ms
                line.est_hybrid_ms = choice.estimate.hybrid_ms
            line.fallback = fallback_chain(reasons)
            forwarded = {**body, "id_slot": slot}
            route = Route.PLAIN
            if choice.route is not Route.PLAIN and plan.provider is not None:
                # The route attempted, until the handoff says where it ended: a request cancelled
                # mid-handoff is logged on the route it was taking.
                line.route = choice.route.value
                route = await self._hand_over(choice.route, slot, plan, line, reasons, settings)
                line.fallback = fallback_chain(reasons)
            line.route = route.value
            if route is not Route.PLAIN:
                # The handed-over cells are only reused by a request that may use its slot's cache.
                forwarded["cache_prompt"] = True
            self.decoding += 1
            try:
                if body.get("stream") is True:
                    await relay_stream(self.client, endpoint, forwarded, out, line, timings, headers)
                else:
                    await relay_whole(self.client, endpoint, forwarded, out, line, timings, headers)
            except trio.Cancelled:
                # The client hung up mid-stream (a user pressed stop, an agent cancelled).  Once the
                # decoder began its reply the slot holds the whole prompt: it is kept for the prefix
                # store as after a finished reply, or it is lost across a restart.
                if timings.began:
                    await self._keep_after_hang_up(plan, slot, line, entry)
                raise
            finally:
                self.decoding -= 1
                self._record(timings, line)
            # After the last byte: this runs whether or not the client is still there (the front
            # cancels a request only while its response is unfinished); the slot is still ours.
            if out.finished and line.outcome == "ok":
                self.rates.observe_decoder(self.decoder.generation, timings.prompt_n, timings.prompt_ms)
                if route is not Route.PLAIN:
                    self._verify_handoff(line, reasons, settings)
                elif entry is not None and self.stored is not None and self.stored.unused(entry, timings.cache_n):
                    # A conversion of the prompt that differs from the decoder's lands here too.
                    self.restore_unused += 1
                    log.warning("prefix store: the decoder did not use the restored prefix (%s)", line.req)
                # Saved after the reply, on every route: the slot then holds the reply's tokens too,
                # which a conversation's next turn starts with (a handed-over state file lacks them).
                await self._keep_slot(plan, slot, line, entry)

    async def _keep_after_hang_up(self, plan: Plan, slot: int, line: RouteLine, restored: Entry | None) -> None:
        """Save a slot its client left mid-stream for the prefix store: once the decoder has
        stopped in it (it notices the closed connection at its next token), while the request still
        holds it.  Shielded from the cancellation that brought us here; bounded by ``_settle``'s
        and the save's own timeouts."""
        with trio.CancelScope(shield=True):
            if self.stored is None or plan.tokens is None or not self.stored.enabled:
                return
            await self._settle(slot)
            if self.decoder.state is ChildState.READY:
                await self._keep_slot(plan, slot, line, restored)

    async def _settle(self, slot: int) -> None:
        """The request left ``slot`` unfinished (its client hung up, or something failed): llama-server
        may still be prefilling it, and a request pinned to the slot would wait behind that work, or
        see its restore deferred.  Keep the slot until the decoder reports it idle; the next request
        meanwhile takes another free slot, or waits in our queue.  Shielded from the cancellation that
        brought us here, bounded by ``SETTLE_TIMEOUT_S``, and over as soon as the decoder is not ready
        (a new decoder's slots are idle)."""
        with trio.CancelScope(shield=True, deadline=trio.current_time() + SETTLE_TIMEOUT_S) as scope:
            while self.decoder.state is ChildState.READY:
                try:
                    busy = await decoder_api.slot_busy(self.client, slot)
                except DecoderError:
                    return
                if not busy:
                    return
                await trio.sleep(SETTLE_POLL_S)  # another process's state: polled
        if scope.cancelled_caught:
            log.warning("slot %d still busy in the decoder after %gs; handing it out anyway", slot, SETTLE_TIMEOUT_S)

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
        line.provider, line.engine, line.device = plan.provider.name, plan.provider.engine, plan.provider.device
        while route is not Route.PLAIN:
            line.route = route.value
            began = trio.current_time()
            try:
                outcome = await self._attempt(route, slot, plan, line, settings)
            except trio.Cancelled:
                # The client left mid-handoff: the job was cancelled (and its files removed); the
                # line says how long it ran.
                line.prefill_ms = (trio.current_time() - began) * 1000
                raise
            if outcome.prefill_ms is not None:
                line.prefill_ms = outcome.prefill_ms
            if outcome.restore_ms is not None:
                line.restore_ms += outcome.restore_ms
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

    async def _attempt(self, route: Route, slot: int, plan: Plan, line: RouteLine, settings: HybridConfig) -> Outcome:
        """One handoff on ``route``: what it returned."""
        hybrid = self.hybrid
        assert hybrid is not None
        assert plan.provider is not None
        if route is Route.SHARE and hybrid.share is not None:
            return await hybrid.share.run(
                req=line.req,
                slot=slot,
                tokens=plan.tokens or [],
                provider=plan.provider,
                generation=self.decoder.generation,
                timeout_s=settings.prefill_timeout_s,
            )
        return await hybrid.file.run(
            req=line.req,
            slot=slot,
            tokens=plan.tokens or [],
            provider=plan.provider,
            timeout_s=settings.prefill_timeout_s,
        )

    def _spawn_keep(self, tokens: Sequence[int], path: Path) -> None:
        if self.stored is None or self._background is None:
            path.unlink(missing_ok=True)
            return
        self._background.start_soon(self.stored.keep, tuple(tokens), path)

    async def _keep_slot(self, plan: Plan, slot: int, line: RouteLine, restored: Entry | None) -> None:
        """Save a plain request's slot for the prefix store when it holds a prompt worth keeping."""
        stored = self.stored
        if stored is None or self._background is None or plan.tokens is None or not stored.enabled:
            return
        shared, extends = self.slots.shared(plan.key)
        if restored is not None:
            # It went on from a stored prefix, as a conversation's next turn goes on from the last:
            # kept whole, the next turn finds all of it (the store makes one entry of repeats).
            shared, extends = restored.n_tokens, True
        tokens = stored.candidate(plan.tokens, shared, extends)
        if tokens is None:
            return
        path = await stored.save(slot, line.req)
        if path is not None:
            self._spawn_keep(tokens, path)

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

    async def relay(
        self,
        endpoint: str,
        body: dict[str, Any],
        out: Responder,
        line: RouteLine,
        headers: Headers = (),
        *,
        pinned: bool,
    ) -> None:
        """A request that runs the model but that no hybrid route takes (embeddings, rerank, infill):
        plain, on a slot of its own, whole or streamed.  (Anthropic's Messages and OpenAI's Responses
        are routed by :meth:`serve`, in the chat form llama-server converts them into.)

        ``pinned``: llama-server honours ``id_slot`` on this endpoint.  Where it does not, holding a
        slot still keeps the requests onebitd lets through at the decoder's slot count, but
        llama-server picks the slot: which one is not known, so no slot's prompt is recorded."""
        self.check_ready()
        if self.hybrid is not None and endpoint not in EMBEDDING_ENDPOINTS:
            # A generative request a provider could in principle prefill, but onebitd does not
            # template these APIs itself: the decoder prefills it.
            line.fallback = fallback_chain([Reason.UNSUPPORTED])
            log.info(
                "hybrid: %s cannot be handed over (%s is relayed as is); the backend prefills it", line.req, endpoint
            )
        timings = Timings()
        async with self.slots.hold(settle=self._settle if pinned else None) as slot:
            self.check_ready()  # it may have died while we queued
            forwarded = body
            if pinned:
                line.slot = slot
                forwarded = {**body, "id_slot": slot}
            try:
                if body.get("stream") is True:
                    await relay_stream(self.client, endpoint, forwarded, out, line, timings, headers)
                else:
                    await relay_whole(self.client, endpoint, forwarded, out, line, timings, headers)
            finally:
                if pinned:
                    # Its cache now holds a prompt onebitd did not key: nothing to match a next one on.
                    self.slots.forget(slot)
                self._record(timings, line)

"""A completion request's story: admission, a slot, the route, the relay, the route line's numbers.

The HTTP front hands over a parsed JSON object; this module has it planned (routes/plan.py: a provider,
the prompt's tokens), pins it to a slot we own (``id_slot``), lets the prefix store restore a prefix into
the slot (routes/stored.py), has routes/decision.py's ``choose`` pick the route and the reasons, walks
``DEGRADE`` with what the handoffs return (routes/handover.py) and relays the decoder's answer
(routes/relay.py: whole, or chunk by chunk for ``stream: true``); each step's value goes to the
request's story (routes/story.py), which builds the route line from them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import trio

from ..config import HybridConfig, source
from ..errors import DecoderUnavailable
from ..http.respond import Responder
from ..http.wire import Headers
from ..llama import decoder as decoder_api
from ..llama.decoder import DecoderClient
from ..llama.slots import SlotPool
from ..prefix.store import Entry
from ..reasons import Reason
from ..supervise.child import ChildState, ChildStatistics
from . import boundary
from .capability import Capability
from .contention import DECODER, Contention
from .decision import Choice, Costs, Offer, Policy, Route, choose, restore_used
from .handover import Hybrid, Walk, hand_over
from .plan import Plan, plan
from .rates import Rates
from .relay import Relayed, Timings, relay
from .stored import StoredPrefixes
from .story import Story
from .usage import Prefill

__all__ = ["STATE_BYTES_PER_TOKEN", "Completions", "Decoder", "Hybrid"]

log = logging.getLogger("onebit.hybrid")


class Decoder(Protocol):
    """What a request asks of the supervised decoder: a :class:`~supervisor.supervise.child.Child`."""

    @property
    def state(self) -> ChildState: ...

    @property
    def generation(self) -> int: ...

    def statistics(self) -> ChildStatistics: ...


# The state one prompt token takes in a slot state file, until a handoff measures it: SmolLM2-135M's
# f16 cache (30 layers x K and V x 192 values x 2 bytes), about 22 KiB as measured.
STATE_BYTES_PER_TOKEN = 23_040

# How long a request that may be handed over waits for its model's load-time probe (routes/capability.py).
PROBE_WAIT_S = 30.0


class Completions:
    """The owner of a completion request's story: it plans the route, walks ``DEGRADE`` with the
    outcomes the handoffs return, relays the reply, and tells the request's story what each step
    returned.  ``settings`` is one frozen value, swapped whole by a reload and read once per request."""

    def __init__(
        self,
        *,
        decoder: Decoder,
        client: DecoderClient,
        slots: SlotPool,
        settings: HybridConfig | Callable[[], HybridConfig],
        hybrid: Hybrid | None = None,
        slot_context: int | Callable[[], int | None] | None = None,
        capability: Capability | None = None,
        prompt_cache_mib: int = 0,
    ) -> None:
        """``capability``: what the model's restores can do (routes/capability.py); None: whole, never
        withdrawn (a test's fakes).  ``prompt_cache_mib``: the decoder's own cache (``cache.ram_mib``)."""
        self.decoder = decoder
        self.capability = capability
        self.client = client
        self.slots = slots
        self._settings = source(settings)
        self.hybrid = hybrid
        # The tokens one decoder slot holds, prompt and reply, as its source (the load) knows them at
        # each request: what llama-server said it got (None: not checked here, the decoder still is).
        self.slot_context = source(slot_context)
        self.prompt_cache_mib = prompt_cache_mib
        self.restore_unused = 0  # requests whose decoder re-evaluated the prompt after a restore succeeded
        self.rates = Rates(
            decoder_ms_per_token=self.settings.decoder_ms_per_token,
            provider_ms_per_token=self.settings.provider_ms_per_token,
            handoff_ms_per_mib=self.settings.handoff_ms_per_mib,
            state_bytes_per_token=STATE_BYTES_PER_TOKEN,
        )
        self.decoding = 0  # replies the decoder is generating now: a plain prefill would stall them
        # Requests here whose reply is not over (planned, queued for a slot, handed over, prefilling
        # or decoding), by id: what a provider's prefill on the decoder's cores will run beside.
        self.answering: set[str] = set()
        self.contention = Contention()  # the prefills running on each child now: an estimate shares them
        self._slots_generation = decoder.generation  # the decoder process the slots' memory is about
        self.stored: StoredPrefixes | None = None  # the prefix store: set by run()

    async def run(
        self, stored: StoredPrefixes | None = None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve with the prefix store ``stored``, its writes running off the requests' path, for as
        long as the daemon serves."""
        async with trio.open_nursery() as nursery:
            if stored is not None:
                await nursery.start(stored.run)
            self.stored = stored
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self.stored = None

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
        words = f"the decoder is {state.words}; try again shortly"
        raise DecoderUnavailable(words, public=words)

    async def _plan(self, endpoint: str, body: dict[str, Any], req: str) -> Plan:
        return await plan(
            endpoint,
            body,
            req,
            client=self.client,
            providers=self.hybrid.providers if self.hybrid is not None else None,
            stored=self.stored,
            slot_context=self.slot_context(),
        )

    async def _from_store(self, plan: Plan, slot: int, story: Story) -> Entry | None:
        """The prefix store's longest prefix of the prompt, restored into the slot when worth it."""
        if self.stored is None or plan.key.tokens is None:
            return None  # an untokenized prompt (most short ones) has no stored prefix to look up
        restored = await self.stored.before(
            slot,
            plan.key,
            self.slots,
            decoder_ms_per_token=self.rates.decoder_ms_per_token(self.decoder.generation),
            restore_ms=self.rates.restore_ms,
            req=story.req,
            prompt_cache=self.rates.tokens_in(self.prompt_cache_mib),
        )
        story.restored(restored)
        return restored.entry

    async def _store_and_choose(
        self, plan: Plan, slot: int, story: Story, settings: HybridConfig
    ) -> tuple[Entry | None, Choice]:
        """The prefix store's restore, if any, and the route chosen knowing of it."""
        if settings.route_by == "length":
            # Every prompt long enough is handed over whatever the slot holds: a stored prefix
            # restored into the slot would be overwritten by the handoff's state, so the store is
            # asked only for a prompt that stays plain.
            choice = self._choose(plan, slot, False, settings)
            if choice.route is not Route.PLAIN:
                return None, choice
        entry = await self._from_store(plan, slot, story)
        return entry, self._choose(plan, slot, entry is not None, settings)

    def _choose(self, plan: Plan, slot: int, restored: bool, settings: HybridConfig) -> Choice:
        """The route and every reason for it (routes.decision.choose), from the plan and the slot."""
        hybrid, provider, tokens = self.hybrid, plan.provider, plan.tokens
        generation = self.decoder.generation
        costs, share_refused = None, None
        # Only a prompt a provider could take is priced and has the share refusal asked (logged once).
        if hybrid is not None and provider is not None and tokens is not None:
            share_refused = None if hybrid.share is None else hybrid.share.refused_by(generation)
            if settings.route_by == "cost":
                decoder_cost, provider_cost = self.rates.prefill(generation, provider.name)
                ram = self.rates.tokens_in(self.prompt_cache_mib)  # what llama-server's prompt cache holds
                costs = Costs(
                    decoder_cached=self.slots.reusable(slot, plan.key, prompt_cache=ram),  # a restore's included
                    provider_cached=provider.cached_tokens(tokens),
                    decoder=decoder_cost,
                    provider=provider_cost,
                    handoff_ms=self.rates.handoff_ms(len(tokens)),
                    streams_decoding=self.decoding,
                    others=len(self.answering) - 1,
                    apart=hybrid.placement.apart(provider),
                    busy=self.contention.busy(provider.name),
                    shared=self.rates.shared(),
                )
        offer = Offer(
            enabled=hybrid is not None,
            share=hybrid is not None and hybrid.share is not None,
            provider_ready=provider is not None and provider.ready,
            share_refused=share_refused,
            restorable=self.capability is None or self.capability.handoff,
            store=self.stored is not None,
        )
        policy = Policy(settings.prefer_margin, settings.max_stall_ms, settings.min_prompt_tokens)
        return choose(plan.ask(restored=restored), offer, costs, policy)

    async def _known(self, plan: Plan) -> None:
        """A request that may be handed over waits for its model's probe (a load's first second)."""
        capability = self.capability
        if capability is not None and plan.provider is not None and not capability.known.is_set():
            with trio.move_on_after(PROBE_WAIT_S):
                await capability.known.wait()

    async def serve(
        self, endpoint: str, body: dict[str, Any], out: Responder, story: Story, headers: Headers = ()
    ) -> None:
        """``headers``: the client's that the decoder is given too (``X-Conversation-Id``)."""
        settings = self.settings
        self.check_ready()
        if self.decoder.generation != self._slots_generation:
            self._slots_generation = self.decoder.generation
            self.slots.forget_all()
        self.answering.add(story.req)
        try:
            await self._serve(endpoint, body, out, story, headers, settings)
        finally:
            self.answering.discard(story.req)

    async def _serve(
        self,
        endpoint: str,
        body: dict[str, Any],
        out: Responder,
        story: Story,
        headers: Headers,
        settings: HybridConfig,
    ) -> None:
        plan = await self._plan(endpoint, body, story.req)
        story.planned(plan.n_tokens)
        async with self.slots.hold(plan.key if plan.remember else None, settle=self._settle) as slot:
            story.holds(slot)
            self.check_ready()  # it may have died while we queued
            await self._known(plan)
            plan = await boundary.bounded(self.client, self.capability, plan, story)
            entry, choice = await self._store_and_choose(plan, slot, story, settings)
            story.chose(choice)
            forwarded = {**body, "id_slot": slot}
            route, prefilled = Route.PLAIN, None
            if choice.route is not Route.PLAIN and plan.provider is not None:
                # The walk says the route attempted until it is over (a request cancelled mid-handoff
                # is logged on it).  On shared cores the decoder's prefills may go first (contention.py).
                walk = Walk(plan.provider, choice.route)
                story.walks(walk)
                if choice.estimate is not None and choice.estimate.wait_ms:
                    await self.contention.settle(DECODER, choice.estimate.wait_ms, told=story.waited)
                with self.contention.running(plan.provider.name, *story.job(provider=True)):
                    route = await hand_over(
                        self.hybrid,
                        walk,
                        slot,
                        plan,
                        settings,
                        req=story.req,
                        generation=self.decoder.generation,
                        rates=self.rates,
                    )
                prefilled = walk.prefilled()
            story.reached(route)
            async with boundary.keeping(self.stored, plan, slot, route, story) as keep:
                if route is not Route.PLAIN or keep.marked is not None:
                    forwarded["cache_prompt"] = True  # the cells handed over or up to the boundary: the slot's cache
                prefilled = prefilled or keep.prefilled()  # its own prefill to the boundary: no cache hit
                relayed = await self._relay(
                    endpoint, forwarded, out, story, headers, plan=plan, slot=slot, entry=entry, prefilled=prefilled
                )
                keep.done = out.finished and relayed.error is None
            self.answering.discard(story.req)  # what follows is no work the other requests run beside
            # After the last byte, the client there or not (the front cancels only an unfinished reply).
            if out.finished and relayed.error is None:
                timings = relayed.timings
                self.rates.observe_decoder(
                    self.decoder.generation, timings.prompt_n, timings.prompt_ms, cache_n=timings.cache_n
                )
                self.rates.observe_shared(story.shared_sample(timings.prompt_ms))
                if route is not Route.PLAIN:
                    self._verify_handoff(story, timings, settings, plan)
                elif entry is not None and self.stored is not None and self.stored.unused(entry, timings.cache_n):
                    self._store_unused(story, entry, timings.cache_n)
                # Saved after the reply, every route, up to where the next turn matches (routes/boundary.py).
                await boundary.keep_after(
                    self.client,
                    plan,
                    self.stored,
                    slot,
                    self.slots,
                    req=story.req,
                    restored=entry,
                    settle=self._out_of_the_way,
                )

    async def _relay(
        self,
        endpoint: str,
        forwarded: dict[str, Any],
        out: Responder,
        story: Story,
        headers: Headers,
        *,
        plan: Plan,
        slot: int,
        entry: Entry | None,
        prefilled: Prefill | None,
    ) -> Relayed:
        """The decoder's reply relayed, the story told what it did, even when the client hung up;
        ``prefilled``: what this request prefilled before it (the reply's usage told with it)."""
        timings, relayed = Timings(on_began=self.contention.poke), None
        self.decoding += 1
        try:
            with self.contention.running(DECODER, *story.job(), over=lambda: timings.began):
                relayed = await relay(
                    self.client, endpoint, forwarded, out, timings, headers, req=story.req, prefilled=prefilled
                )
            return relayed
        except trio.Cancelled:
            self.answering.discard(story.req)
            # The client hung up mid-stream (a user pressed stop, an agent cancelled).  Once the
            # decoder began its reply the slot holds the whole prompt: it is kept for the prefix
            # store as after a finished reply, or it is lost across a restart.
            if timings.began and self.stored is not None:
                await self.stored.after_hang_up(
                    slot, plan.key, self.slots, req=story.req, restored=entry, settle=self._settle, ready=self._ready
                )
            raise
        finally:
            self.decoding -= 1
            story.relayed(relayed or Relayed(timings))

    async def _out_of_the_way(self) -> None:
        """Before a save after a reply: until the decoder's prefills in flight are answered, bounded
        (Contention.settle).  A save runs on the decoder's loop between its batches, and a request
        sent meanwhile waited for it: on the fleet benchmark's first blocks, 110 ms at the median
        between its sending and its first token beyond its own prefill, against 22 for the others."""
        if self.contention.tokens(DECODER):
            await self.contention.settle(DECODER, self.contention.remaining_ms(DECODER), told=lambda ms: None)

    def _ready(self) -> bool:
        return self.decoder.state is ChildState.READY

    async def _settle(self, slot: int) -> None:
        """The request left ``slot`` unfinished (its client hung up, or something failed): a request
        pinned to the slot would wait behind what llama-server still does there, or see its restore
        deferred.  Keep the slot until the decoder reports it idle (:func:`decoder.wait_slot_idle`);
        the next request meanwhile takes another free slot, or waits in our queue."""
        if not await decoder_api.wait_slot_idle(self.client, slot, running=self._ready):
            log.warning(
                "slot %d still busy in the decoder after %gs; handing it out anyway", slot, decoder_api.SETTLE_TIMEOUT_S
            )

    def _verify_handoff(self, story: Story, timings: Timings, settings: HybridConfig, plan: Plan) -> None:
        """llama.cpp's restore can answer success and still re-prefill everything (#26676): the
        route line says so, and the model's capability is withdrawn for the rest of its load."""
        if restore_used(timings.prompt_n, settings.restore_check_tokens + plan.beyond_boundary):
            return
        self.restore_unused += 1
        story.fell_back(Reason.RESTORE_UNUSED)
        words = f"it evaluated {timings.prompt_n} of {story.prompt_tokens} prompt tokens"
        log.warning("hybrid: restore was not used by the decoder: %s (%s)", words, story.req)
        if self.capability is not None:
            self.capability.withdraw(f"after a handoff the decoder re-evaluated the prompt: {words} ({story.req})")

    def _store_unused(self, story: Story, entry: Entry, cache_n: int | None) -> None:
        """The decoder did not use a prefix the store restored (a conversion of the prompt that
        differs from the decoder's lands here too): said on the route line; withdrawn when the
        decoder kept almost nothing of it (its memory, not the prompt, was at fault)."""
        self.restore_unused += 1
        story.fell_back(Reason.RESTORE_UNUSED)
        log.warning("prefix store: the decoder did not use the restored prefix (%s)", story.req)
        if self.capability is not None and (cache_n or 0) < entry.n_tokens // 2:
            self.capability.withdraw(
                f"the decoder kept {cache_n} of the {entry.n_tokens} tokens the prefix store restored ({story.req})"
            )

    async def relay(
        self,
        endpoint: str,
        body: dict[str, Any],
        out: Responder,
        story: Story,
        headers: Headers = (),
        *,
        pinned: bool,
        generates: bool = True,
    ) -> None:
        """A request that runs the model but that no hybrid route takes (embeddings, rerank, infill):
        plain, on a slot of its own, whole or streamed.  (Anthropic's Messages and OpenAI's Responses
        are routed by :meth:`serve`, in the chat form llama-server converts them into.)

        ``pinned``: llama-server honours ``id_slot`` on this endpoint.  Where it does not, holding a
        slot still keeps the requests onebitd lets through at the decoder's slot count, but
        llama-server picks the slot: which one is not known, so no slot's prompt is recorded."""
        self.check_ready()
        if self.hybrid is not None and generates:  # embeddings and rerank have no prompt to hand over
            # A generative request a provider could in principle prefill, but onebitd does not
            # template these APIs itself: the decoder prefills it.
            story.fell_back(Reason.UNSUPPORTED)
            log.info(
                "hybrid: %s cannot be handed over (%s is relayed as is); the backend prefills it", story.req, endpoint
            )
        timings = Timings()
        relayed: Relayed | None = None
        async with self.slots.hold(settle=self._settle if pinned else None) as slot:
            self.check_ready()  # it may have died while we queued
            forwarded = body
            if pinned:
                story.holds(slot)
                forwarded = {**body, "id_slot": slot}
            self.answering.add(story.req)
            try:
                relayed = await relay(self.client, endpoint, forwarded, out, timings, headers, req=story.req)
            finally:
                self.answering.discard(story.req)
                if pinned:
                    # Its cache now holds a prompt onebitd did not key: nothing to match a next one on.
                    self.slots.forget(slot)
                story.relayed(relayed or Relayed(timings))

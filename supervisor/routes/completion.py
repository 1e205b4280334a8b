"""A completion request's story: admission, a slot, the route, the relay, the route line's numbers.

The HTTP front hands over a parsed JSON object; this module has it planned (routes/plan.py: a provider,
the prompt's tokens), pins it to a slot we own (``id_slot``), lets the prefix store restore a prefix into
the slot (routes/stored.py), has routes/decision.py's ``choose`` pick the route and the reasons, walks
``DEGRADE`` with what the handoffs return (routes/handover.py) and relays the decoder's answer
(routes/relay.py: whole, or chunk by chunk for ``stream: true``); each step's value goes to the
request's story (routes/story.py), which builds the route line from them.

A prompt whose free slot holds most of it by its text (a chat's next turn, a question on a system
prompt a slot holds), where the route chosen on its text's guess (routes/guess.py) is plain, is
sent at once and planned once its reply is over: its tokens then key the slot, feed the prefix
store's keep and price the route line's estimates.  Such a request looks up no stored prefix: it
goes at once only where none can hold more of it than its slot (routes/guess.py's ``unstored``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from ..config import HybridConfig, source
from ..errors import DecoderUnavailable
from ..http.respond import Responder
from ..http.wire import Headers
from ..llama import decoder as decoder_api
from ..llama.decoder import DecoderClient
from ..llama.slots import PromptKey, SlotPool
from ..prefix.store import Entry
from ..providers import Provider
from ..reasons import Reason
from ..supervise.child import ChildState, ChildStatistics
from . import boundary
from .capability import Capability
from .contention import DECODER, Contention
from .decision import Ask, Choice, Costs, Offer, Policy, Route, choose, estimate, restore_used
from .guess import guess, readable, unstored, within
from .handover import Hybrid, Walk, hand_over
from .plan import Plan, plan_prompt, plan_with
from .prompt import Chat, Prompt, Text, parse
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
# How long a request sent at once waits for its planning after its reply (two calls to the decoder,
# a few ms), its slot held meanwhile.
LATE_PLAN_S = 5.0


@attrs.frozen
class Early:
    """A request sent to the decoder before it is planned (routes/guess.py): the slot it was guessed
    against, its key there (its text), the plain route chosen on the guess, and the costs that
    guess was priced with, the tokens' counts left to fill in once it is tokenized."""

    key: PromptKey
    slot: int
    held: PromptKey  # what the slot held when guessed against: a slot that holds anything else now is not it
    provider: Provider | None  # picked when guessed: planned with it (no other is asked for, no seat claimed)
    choice: Choice
    costs: Costs | None


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

    async def _plan_prompt(self, prompt: Prompt, req: str) -> Plan:
        return await plan_prompt(
            prompt,
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
        provider, tokens, costs = plan.provider, plan.tokens, None
        # Only a prompt a provider could take is priced, and only where the cost decides.
        if provider is not None and tokens is not None and self._by_cost(settings):
            ram = self.rates.tokens_in(self.prompt_cache_mib)  # what llama-server's prompt cache holds
            costs = self._costs(
                provider,
                len(tokens),
                decoder_cached=self.slots.reusable(slot, plan.key, prompt_cache=ram),  # a restore's included
                provider_cached=provider.cached_tokens(tokens),
            )
        return self._decide(plan.ask(restored=restored), provider, costs, settings)

    def _by_cost(self, settings: HybridConfig) -> bool:
        """The route is chosen by cost (else by length, or the hybrid routes are off: nothing priced)."""
        return self.hybrid is not None and settings.route_by == "cost"

    def _costs(self, provider: Provider, tokens: int, *, decoder_cached: int, provider_cached: int) -> Costs:
        """What each route costs a prompt of ``tokens`` now (the hybrid routes on)."""
        hybrid = self.hybrid
        assert hybrid is not None
        decoder_cost, provider_cost = self.rates.prefill(self.decoder.generation, provider.name)
        return Costs(
            decoder_cached=decoder_cached,
            provider_cached=provider_cached,
            decoder=decoder_cost,
            provider=provider_cost,
            handoff_ms=self.rates.handoff_ms(tokens),
            streams_decoding=self.decoding,
            others=len(self.answering) - 1,
            apart=hybrid.placement.apart(provider),
            busy=self.contention.busy(provider.name),
            shared=self.rates.shared(),
        )

    def _decide(self, ask: Ask, provider: Provider | None, costs: Costs | None, settings: HybridConfig) -> Choice:
        hybrid = self.hybrid
        share_refused = None
        # The share refusal is asked (logged once) only for a prompt a provider could take.
        if hybrid is not None and hybrid.share is not None and provider is not None and ask.prompt_tokens is not None:
            share_refused = hybrid.share.refused_by(self.decoder.generation)
        offer = Offer(
            enabled=hybrid is not None,
            share=hybrid is not None and hybrid.share is not None,
            provider_ready=provider is not None and provider.ready,
            share_refused=share_refused,
            restorable=self.capability is None or self.capability.handoff,
            store=self.stored is not None,
        )
        policy = Policy(settings.prefer_margin, settings.max_stall_ms, settings.min_prompt_tokens)
        return choose(ask, offer, costs, policy)

    def _early(self, prompt: Prompt, settings: HybridConfig) -> Early | None:
        """The request sent before it is planned, where the route chosen on its text's guess
        (routes/guess.py) is plain with its slot holding half of it or more; None: planned first."""
        capability, hybrid, stored = self.capability, self.hybrid, self.stored
        if not isinstance(prompt, Chat | Text) or not readable(prompt):
            return None
        if capability is not None and (capability.at_boundary or not capability.known.is_set()):
            return None  # a hybrid model's plain route prefills to the prompt's boundary first
        provider = hybrid.providers.pick() if hybrid is not None else None
        if hybrid is not None and provider is None:
            return None  # planned: why no provider goes with it is the plan's to say
        if provider is None and (stored is None or not stored.may_hold(prompt.text)):
            return None  # planned without a round trip: nothing to spare
        key = PromptKey(prompt.text)
        slot = self.slots.peek(key)
        if slot is None:
            return None
        held = self.slots.holds(slot)
        guessed = guess(held, prompt.text)
        if guessed is None or not guessed.holds_most:
            return None
        if not within(guessed, prompt.text, self.slot_context()):
            return None  # the decoder may refuse it: planned, so its slot keeps its memory
        if stored is not None and stored.enabled and not unstored(prompt, guessed):
            return None  # the prefix store may hold more of it than the slot: planned, and looked up
        costs = None
        if provider is not None and self._by_cost(settings):
            provider_cached = provider.cached_tokens(guessed.held)
            costs = self._costs(
                provider, guessed.tokens, decoder_cached=guessed.cached, provider_cached=provider_cached
            )
        choice = self._decide(Ask(guessed.tokens), provider, costs, settings)
        if choice.route is not Route.PLAIN:
            return None
        if costs is not None:
            # Decided on the counts that lean to plain's cost; priced at the likelier ones (the
            # prefill it puts in flight, for the requests beside it) until its tokens are known.
            likely = attrs.evolve(costs, decoder_cached=guessed.likely_cached)
            choice = attrs.evolve(choice, estimate=estimate(guessed.likely_tokens, likely))
        return Early(key, slot, held, provider, choice, costs)

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
        prompt = parse(endpoint, body)
        early = self._early(prompt, settings)
        if early is not None:
            async with self.slots.hold(early.key, settle=self._settle) as slot:
                if slot == early.slot and self.slots.holds(slot) is early.held:
                    await self._at_once(prompt, early, endpoint, body, out, story, headers, settings)
                    return
                # Another request took the slot meanwhile: planned now, in the slot it got, which
                # holds what it held until this request reaches the decoder.
                self.slots.will_hold(slot, None)
                plan = await self._plan_prompt(prompt, story.req)
                story.planned(plan.n_tokens)
                self.slots.will_hold(slot, plan.key if plan.remember else None)
                await self._in_slot(plan, slot, endpoint, body, out, story, headers, settings)
            return
        plan = await self._plan_prompt(prompt, story.req)
        story.planned(plan.n_tokens)
        async with self.slots.hold(plan.key if plan.remember else None, settle=self._settle) as slot:
            await self._in_slot(plan, slot, endpoint, body, out, story, headers, settings)

    async def _in_slot(
        self,
        plan: Plan,
        slot: int,
        endpoint: str,
        body: dict[str, Any],
        out: Responder,
        story: Story,
        headers: Headers,
        settings: HybridConfig,
    ) -> None:
        """A planned request in its slot: the store's restore, the route, the handoff, the relay,
        and what follows the reply."""
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
        if route is Route.PLAIN:  # llama-server moves what it loads from its prompt cache into the slot
            self.slots.loads(slot, plan.key, prompt_cache=self.rates.tokens_in(self.prompt_cache_mib))
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
            await self._after_reply(plan, slot, story, relayed, route, settings, entry=entry)

    async def _at_once(
        self,
        prompt: Prompt,
        early: Early,
        endpoint: str,
        body: dict[str, Any],
        out: Responder,
        story: Story,
        headers: Headers,
        settings: HybridConfig,
    ) -> None:
        """A request sent before it is planned (routes/guess.py): relayed plain, then planned once
        its reply is over, the client's connection free meanwhile; its tokens then key the slot,
        price the route line's estimates and feed the prefix store's keep.  A reply cut short or
        refused is planned all the same: its slot keyed as a planned request's would be, a hang-up's
        kept for the store."""
        slot = early.slot
        story.holds(slot)
        self.check_ready()  # it may have died while we queued
        story.chose(early.choice)
        story.reached(Route.PLAIN)
        forwarded = {**body, "id_slot": slot}
        try:
            relayed = await self._relay(
                endpoint,
                forwarded,
                out,
                story,
                headers,
                plan=Plan(early.key, None),
                slot=slot,
                entry=None,
                prefilled=None,
            )
        except trio.Cancelled:
            # Keyed and kept as a planned request would have been (its own save needs the tokens);
            # a decoder that is stopping forgets its slots anyway.
            with trio.CancelScope(shield=True):
                plan = await self._plan_late(prompt, early, story) if self._ready() else None
                if plan is not None and story.began and self.stored is not None:
                    await self.stored.after_hang_up(
                        slot, plan.key, self.slots, req=story.req, restored=None, settle=self._settle, ready=self._ready
                    )
            raise
        self.answering.discard(story.req)
        if not out.finished or relayed.error is not None:
            plan = await self._plan_late(prompt, early, story)
            if plan is not None:
                story.chose(self._priced(plan, early, settings, story.req))
            return
        # A next turn sent the moment the reply ended waits for this slot meanwhile, as it does
        # while the slot is saved for the prefix store (SlotPool.keeping).
        self.slots.keeping(slot, early.key)
        plan = await self._plan_late(prompt, early, story)
        if plan is None:
            return
        self.slots.keeping(slot, plan.key)  # matched by its tokens now
        story.chose(self._priced(plan, early, settings, story.req))
        await self._after_reply(plan, slot, story, relayed, Route.PLAIN, settings, entry=None)

    async def _plan_late(self, prompt: Prompt, early: Early, story: Story) -> Plan | None:
        """A request sent at once, planned after its reply (bounded): its slot keyed by its tokens,
        or left with what it held where the decoder refused it; None where the planning did not
        answer in time (the slot stays known by the prompt's text)."""
        with trio.move_on_after(LATE_PLAN_S):
            plan = await plan_with(
                early.provider,
                prompt,
                story.req,
                client=self.client,
                stored=self.stored,
                slot_context=self.slot_context(),
            )
            story.planned(plan.n_tokens)
            self.slots.will_hold(early.slot, plan.key if plan.remember else None)
            return plan
        log.warning(
            "hybrid: planning %s after its reply took over %gs; its slot is known by its text", story.req, LATE_PLAN_S
        )
        return None

    def _priced(self, plan: Plan, early: Early, settings: HybridConfig, req: str) -> Choice:
        """The choice a request sent at once would have had from its tokens, with the load it was
        sent under (``early.costs``): its estimates are the route line's.  Where its tokens would
        have chosen a handoff, the plain route and reasons stay and that is logged."""
        provider, tokens, costs = plan.provider, plan.tokens, early.costs
        if plan.kept is not None:
            return self._decide(plan.ask(restored=False), provider, None, settings)  # over-context, most likely
        if provider is None or tokens is None or costs is None:
            return early.choice
        costs = attrs.evolve(
            costs,
            decoder_cached=self.slots.reusable(
                early.slot, plan.key, prompt_cache=self.rates.tokens_in(self.prompt_cache_mib)
            ),
            provider_cached=provider.cached_tokens(tokens),
            handoff_ms=self.rates.handoff_ms(len(tokens)),
        )
        choice = self._decide(plan.ask(restored=False), provider, costs, settings)
        if choice.route is Route.PLAIN:
            return choice
        log.info(
            "hybrid: %s went plain at once on its text (slot %d); its %d tokens would have gone %s",
            req,
            early.slot,
            len(tokens),
            choice.route.value,
        )
        return attrs.evolve(early.choice, estimate=choice.estimate)

    async def _after_reply(
        self,
        plan: Plan,
        slot: int,
        story: Story,
        relayed: Relayed,
        route: Route,
        settings: HybridConfig,
        *,
        entry: Entry | None,
    ) -> None:
        """Once a reply ended whole: the rates told what it cost, the handoff or the restore checked,
        and the slot kept for the prefix store."""
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

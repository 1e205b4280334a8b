"""Route decisions, the fallback table, the cost decision and the slot choice, without sockets or processes."""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from supervisor.llama.slots import KEEP_WAIT_S, PromptKey, SlotPool, common_prefix
from supervisor.reasons import Reason
from supervisor.routes.decision import (
    DEGRADE,
    Ask,
    Choice,
    Costs,
    Estimate,
    Offer,
    Policy,
    Route,
    Step,
    choose,
    claim_matches,
    restore_used,
    state_claimed,
)
from supervisor.routes.rates import PrefillCost, linear

# A request that could take a hybrid route: each test changes one input.
HYBRID: dict[str, Any] = {
    "enabled": True,
    "share": False,
    "provider_ready": True,
    "prompt_tokens": 300,
    "min_prompt_tokens": 256,
    "share_refused": False,
}


# The memory layout of a decoder that refused to share (a Qwen3.5's).
REFUSED_MEMORY = "kv+recurrent"


def choose_from(
    *,
    enabled: bool,
    share: bool,
    provider_ready: bool,
    prompt_tokens: int | None,
    min_prompt_tokens: int,
    share_refused: bool,
    costs: Costs | None = None,
    policy: Policy | None = None,
    provider_picked: bool | None = None,
    unsupported: bool = False,
    over_context: bool = False,
    restored: bool = False,
    provider_away: Reason | None = None,
    restorable: bool = True,
    store: bool = False,
) -> Choice:
    """``choose`` over its table's columns, one keyword each (``provider_picked`` None: as
    ``provider_ready``), put into the values it takes."""
    picked = provider_ready if provider_picked is None else provider_picked
    kept = Reason.OVER_CONTEXT if over_context else Reason.UNSUPPORTED if unsupported else None
    unpicked = None if picked else provider_away or Reason.NO_PROVIDER
    ask = Ask(prompt_tokens, kept=kept, unpicked=unpicked, restored=restored)
    refused = REFUSED_MEMORY if share_refused else None
    offer = Offer(enabled, share, provider_ready, refused, restorable, store)
    return choose(ask, offer, costs, attrs.evolve(policy or Policy(), min_prompt_tokens=min_prompt_tokens))


def choice(**changes: Any) -> Choice:
    return choose_from(**{**HYBRID, **changes})


def test_a_long_prompt_with_a_ready_provider_takes_the_file_route() -> None:
    assert choice() == Choice(Route.FILE, None)


def test_a_prompt_of_exactly_the_minimum_length_takes_the_file_route() -> None:
    assert choice(prompt_tokens=256) == Choice(Route.FILE, None)


def test_share_mode_takes_the_share_route() -> None:
    assert choice(share=True) == Choice(Route.SHARE, None)


def test_hybrid_off_is_plain_and_says_disabled() -> None:
    assert choice(enabled=False) == Choice(Route.PLAIN, Reason.DISABLED)


def test_no_ready_provider_is_plain_and_says_so() -> None:
    assert choice(provider_ready=False) == Choice(Route.PLAIN, Reason.NO_PROVIDER)


def test_a_prompt_that_could_not_be_tokenized_is_plain() -> None:
    assert choice(prompt_tokens=None) == Choice(Route.PLAIN, Reason.TOKENIZE_FAILED)


def test_a_prompt_below_the_minimum_is_plain_and_says_short_prompt() -> None:
    assert choice(prompt_tokens=255) == Choice(Route.PLAIN, Reason.SHORT_PROMPT)


def test_a_decoder_that_refused_to_share_before_gets_the_file_route() -> None:
    expected = Choice(Route.FILE, Reason.SHARE_REMEMBERED, memory=REFUSED_MEMORY)
    assert choice(share=True, share_refused=True) == expected


def test_a_remembered_share_refusal_does_not_matter_in_file_mode() -> None:
    assert choice(share_refused=True) == Choice(Route.FILE, None)


def test_disabled_wins_over_every_other_reason() -> None:
    assert choice(enabled=False, provider_ready=False, prompt_tokens=None).reason is Reason.DISABLED


def test_a_missing_provider_is_named_before_the_prompt_is_looked_at() -> None:
    assert choice(provider_ready=False, prompt_tokens=None).reason is Reason.NO_PROVIDER


def test_the_degrade_table_sends_handshake_failures_to_the_file_route_and_the_rest_plain() -> None:
    assert DEGRADE == {
        Step.SHARE_HANDSHAKE: Route.FILE,
        Step.FILE_PREFILL: Route.PLAIN,
        Step.RESTORE: Route.PLAIN,
        Step.SHARE_PREFILL: Route.PLAIN,
        Step.ADOPT: Route.PLAIN,
    }


@pytest.mark.parametrize("step", [s for s in Step if s is not Step.SHARE_HANDSHAKE])
def test_no_failure_after_a_provider_ran_degrades_to_another_hybrid_route(step: Step) -> None:
    # Another hybrid route there would pay for the prefill twice.
    assert DEGRADE[step] is Route.PLAIN


def test_a_claim_that_does_not_say_how_many_tokens_matches() -> None:
    assert claim_matches(None, 30)


def test_a_claim_of_every_token_matches() -> None:
    assert claim_matches(30, 30)


@pytest.mark.parametrize("claimed", [29, 31, 0, -1])
def test_a_wrong_or_negative_claim_does_not_match(claimed: int) -> None:
    assert not claim_matches(claimed, 30)


@pytest.mark.parametrize(
    ("claimed", "lent", "adopt"),
    [(None, 0, True), (3, 0, True), (4, 4, True), (None, 4, False), (3, 4, False), (5, 4, False), (0, 4, False)],
    ids=["dense-unsaid", "dense-said", "every-row", "hybrid-unsaid", "a-row-short", "a-row-over", "none"],
)
def test_a_share_lending_state_rows_is_adopted_only_when_the_claim_names_every_one(
    claimed: int | None, lent: int, adopt: bool
) -> None:
    assert state_claimed(claimed, lent) is adopt


def test_a_decoder_that_evaluated_at_most_the_check_tokens_used_the_restore() -> None:
    assert restore_used(1, 2)
    assert restore_used(2, 2)


def test_a_decoder_that_evaluated_more_than_the_check_tokens_did_not_use_the_restore() -> None:
    assert not restore_used(3, 2)
    assert not restore_used(300, 2)


def test_a_reply_without_timings_is_not_counted_as_an_unused_restore() -> None:
    assert restore_used(None, 2)


inputs = st.fixed_dictionaries(
    {
        "enabled": st.booleans(),
        "share": st.booleans(),
        "provider_ready": st.booleans(),
        "prompt_tokens": st.none() | st.integers(min_value=0, max_value=1 << 20),
        "min_prompt_tokens": st.integers(min_value=1, max_value=1 << 20),
        "share_refused": st.booleans(),
    }
)


@given(inputs)
def test_choose_never_shares_when_share_is_off(kwargs: dict[str, Any]) -> None:
    if not kwargs["share"]:
        assert choose_from(**kwargs).route is not Route.SHARE


@given(inputs)
def test_choose_never_picks_a_hybrid_route_when_off_or_without_a_provider(kwargs: dict[str, Any]) -> None:
    if not kwargs["enabled"] or not kwargs["provider_ready"]:
        assert choose_from(**kwargs).route is Route.PLAIN


@given(inputs)
def test_choose_gives_a_reason_whenever_it_does_not_take_the_configured_route(kwargs: dict[str, Any]) -> None:
    result = choose_from(**kwargs)
    configured = Route.SHARE if kwargs["share"] else Route.FILE
    assert (result.route is configured) == (result.reason is None)


# -- the cost decision ------------------------------------------------------------------------------

# A 600-token prompt on a decoder and a provider that prefill at the same rate, the provider on
# compute apart from the decoder's (its own cores), with a handoff that costs 2% of the prefill.
COLD = Costs(
    decoder_cached=0,
    provider_cached=0,
    decoder=linear(5.0),
    provider=linear(5.0),
    handoff_ms=60.0,
    streams_decoding=0,
    apart=True,
)


def priced(costs: Costs = COLD, **changes: Any) -> Choice:
    return choose_from(**{**HYBRID, "prompt_tokens": 600, **changes}, costs=costs, policy=Policy())


def test_cold_priors_with_equal_rates_hand_a_long_prompt_over_as_a_near_tie() -> None:
    picked = priced()
    assert (picked.route, picked.reason) == (Route.FILE, None)
    assert picked.estimate == Estimate(plain_ms=3000.0, hybrid_ms=3000.0 + 60.0 + 5.0)


def test_a_prompt_the_decoder_already_holds_stays_plain_and_says_cached() -> None:
    # A chat's next turn: the slot holds all but 17 tokens, the provider's cache nothing.
    picked = priced(attrs.evolve(COLD, decoder_cached=583))
    assert (picked.route, picked.reason) == (Route.PLAIN, Reason.CACHED)
    assert picked.estimate is not None
    assert picked.estimate.plain_ms == 17 * 5.0


def test_a_provider_that_holds_the_prefix_too_still_loses_to_the_decoders_cache_by_the_handoff() -> None:
    picked = priced(attrs.evolve(COLD, decoder_cached=583, provider_cached=583))
    assert (picked.route, picked.reason) == (Route.PLAIN, Reason.CACHED)


def test_what_the_decoder_lacks_must_reach_the_floor_even_when_the_handoff_looks_cheap() -> None:
    # The provider holds the conversation too, and an NPU would prefill the new turn faster: still,
    # 50 tokens are under the floor (256), so there is no prefill worth moving.
    fast = attrs.evolve(COLD, decoder_cached=550, provider_cached=550, provider=linear(0.1))
    assert (priced(fast).route, priced(fast).reason) == (Route.PLAIN, Reason.CACHED)
    # 300 tokens lacking: the floor is met and the cost decides.
    assert priced(attrs.evolve(fast, decoder_cached=300, provider_cached=300)).route is Route.FILE


def test_a_much_faster_provider_wins_even_against_a_partly_warm_decoder() -> None:
    # An NPU at 0.2 ms/token against a CPU at 5: holding a third of the prompt does not save plain.
    picked = priced(attrs.evolve(COLD, decoder_cached=200, provider=linear(0.2)))
    assert (picked.route, picked.reason) == (Route.FILE, None)


def test_a_slow_provider_loses_to_a_cold_decoder_and_says_plain_cheaper() -> None:
    picked = priced(attrs.evolve(COLD, provider=linear(8.0)))
    assert (picked.route, picked.reason) == (Route.PLAIN, Reason.PLAIN_CHEAPER)


def test_the_margin_decides_near_ties() -> None:
    slower = attrs.evolve(COLD, provider=linear(5.7))  # hybrid 3485 ms against plain 3000
    assert priced(slower).route is Route.PLAIN
    wide = choose_from(**{**HYBRID, "prompt_tokens": 600}, costs=slower, policy=Policy(prefer_margin=0.2))
    assert wide.route is Route.FILE


def test_a_busy_decoder_hands_over_a_prefill_that_would_stall_its_streams() -> None:
    slower = attrs.evolve(COLD, provider=linear(8.0), streams_decoding=3)
    assert (priced(slower).route, priced(slower).reason) == (Route.FILE, None)
    # ... but not one whose stall is short enough to bear.
    short = attrs.evolve(slower, decoder_cached=550)  # 50 tokens: 250 ms < max_stall_ms 500
    assert priced(short).route is Route.PLAIN


def test_the_cost_decision_never_overrides_the_floor_or_a_missing_provider() -> None:
    assert priced(prompt_tokens=100).reason is Reason.SHORT_PROMPT
    assert priced(provider_ready=False).reason is Reason.NO_PROVIDER


def test_a_remembered_share_refusal_still_applies_after_the_cost_decision() -> None:
    picked = priced(share=True, share_refused=True)
    assert (picked.route, picked.reason) == (Route.FILE, Reason.SHARE_REMEMBERED)


def test_on_shared_compute_streams_decoding_do_not_send_a_prompt_away_and_near_ties_stay_plain() -> None:
    # A provider on the decoder's own cores takes the same CPU: sparing the streams spares nothing.
    slower = attrs.evolve(COLD, provider=linear(8.0), streams_decoding=3, apart=False)
    assert (priced(slower).route, priced(slower).reason) == (Route.PLAIN, Reason.PLAIN_CHEAPER)
    # A near-tie (hybrid 3065 ms against plain 3000) is a loss for this request, and nothing else gains.
    assert (priced(attrs.evolve(COLD, apart=False)).route, priced(attrs.evolve(COLD, apart=False)).reason) == (
        Route.PLAIN,
        Reason.PLAIN_CHEAPER,
    )
    # A provider truly faster still wins on the first token's cost alone.
    assert priced(attrs.evolve(COLD, provider=linear(4.0), apart=False)).route is Route.FILE


def test_a_prompt_the_store_restored_is_not_handed_over_to_spare_the_streams() -> None:
    # The case: 769 tokens restored into the slot, 36-43 new, streams decoding, and a decoder rate
    # learnt high (56.87 ms a token) that puts plain's estimate past max_stall_ms.  The handoff would
    # overwrite the restore and prefill all 810 tokens again: plain evaluates the 41.
    case = attrs.evolve(COLD, decoder_cached=769, decoder=linear(56.87), handoff_ms=200.0, streams_decoding=2)
    policy = Policy(min_prompt_tokens=32)
    picked = choose(Ask(810, restored=True), Offer(enabled=True, store=True), case, policy)
    assert picked.estimate is not None
    assert picked.estimate.plain_ms == pytest.approx(41 * 56.87)  # past max_stall_ms, and streams decode
    assert (picked.route, picked.reasons) == (Route.PLAIN, (Reason.STORED,))
    # Without the restore the same slot would be handed over to spare the streams.
    assert choose(Ask(810), Offer(enabled=True), case, policy).route is Route.FILE
    # A handoff cheaper than the decoder's evaluating the rest is still taken after a restore.
    cheap = attrs.evolve(case, provider_cached=800, provider=linear(0.1), handoff_ms=10.0)
    assert choose(Ask(810, restored=True), Offer(enabled=True, store=True), cheap, policy).route is Route.FILE


def test_an_unsure_estimate_keeps_plain_a_prompt_the_slot_holds_most_of() -> None:
    # Nothing measured near 400 new tokens: a provider that looks twice as fast on its prior might be
    # far slower under load; plain evaluates 400 of 1,000 tokens at the decoder's known rate.
    unsure = attrs.evolve(COLD, decoder_cached=600, provider=PrefillCost(1.0))
    picked = priced(unsure, prompt_tokens=1000)
    assert picked.estimate is not None
    assert not picked.estimate.sure
    assert (picked.route, picked.reason) == (Route.PLAIN, Reason.CACHED)
    # Sure of both, the provider's speed decides as before.
    assert priced(attrs.evolve(unsure, provider=linear(1.0)), prompt_tokens=1000).route is Route.FILE
    # Unsure, but the slot holds little: the estimates (priors) decide.
    assert priced(attrs.evolve(unsure, decoder_cached=0), prompt_tokens=1000).route is Route.FILE


def test_plain_is_estimated_on_what_the_decoder_evaluates_with_its_context() -> None:
    # The decoder's cost has a fixed part and an attention term: plain pays them on the 300 new
    # tokens after the 700 it reuses, the hybrid route on the last token after 999.
    cost = PrefillCost(5.0, fixed_ms=40.0, ms_per_token=3.0, ms_per_context=0.001, everywhere=True)
    guess = priced(attrs.evolve(COLD, decoder=cost, decoder_cached=700), prompt_tokens=1000).estimate
    assert guess is not None
    assert guess.plain_ms == pytest.approx(40.0 + 3.0 * 300 + 0.001 * 300 * (700 + 150))
    assert guess.hybrid_ms == pytest.approx(5.0 * 1000 + 60.0 + 40.0 + 3.0 + 0.001 * (999 + 0.5))


# -- every plain reason, in one table ----------------------------------------------------------------

# The cost of a prompt the decoder's slot holds most of (cached) and of one a slow provider would take
# longer over (plain-cheaper), for the 300-token prompt of HYBRID.
HOLDS_MOST = attrs.evolve(COLD, decoder_cached=150, provider=linear(8.0))
SLOWER = attrs.evolve(COLD, provider=linear(8.0))
FASTER = attrs.evolve(COLD, provider=linear(2.0))
R = Reason


@pytest.mark.parametrize(
    ("changes", "route", "reasons"),
    [
        ({}, Route.FILE, ()),
        ({"share": True}, Route.SHARE, ()),
        ({"share": True, "share_refused": True}, Route.FILE, (R.SHARE_REMEMBERED,)),
        ({"over_context": True, "enabled": False}, Route.PLAIN, (R.OVER_CONTEXT,)),
        ({"over_context": True, "provider_ready": False}, Route.PLAIN, (R.OVER_CONTEXT,)),
        ({"enabled": False}, Route.PLAIN, ()),
        ({"enabled": False, "restored": True}, Route.PLAIN, (R.STORED,)),
        ({"enabled": False, "unsupported": True, "prompt_tokens": None}, Route.PLAIN, ()),
        ({"provider_ready": False}, Route.PLAIN, (R.NO_PROVIDER,)),
        ({"provider_ready": False, "restored": True}, Route.PLAIN, (R.NO_PROVIDER, R.STORED)),
        ({"provider_ready": False, "unsupported": True, "prompt_tokens": None}, Route.PLAIN, (R.NO_PROVIDER,)),
        ({"unsupported": True, "prompt_tokens": None}, Route.PLAIN, (R.UNSUPPORTED,)),
        ({"prompt_tokens": None}, Route.PLAIN, (R.TOKENIZE_FAILED,)),
        ({"provider_ready": False, "prompt_tokens": None}, Route.PLAIN, (R.NO_PROVIDER,)),
        # A provider picked at the request's start that is gone once it holds its slot:
        ({"provider_picked": True, "provider_ready": False}, Route.PLAIN, (R.NO_PROVIDER,)),
        ({"provider_picked": True, "provider_ready": False, "prompt_tokens": None}, Route.PLAIN, (R.TOKENIZE_FAILED,)),
        (
            {"provider_picked": True, "provider_ready": False, "unsupported": True, "prompt_tokens": None},
            Route.PLAIN,
            (R.UNSUPPORTED,),
        ),
        ({"provider_picked": False, "unsupported": True, "prompt_tokens": None}, Route.PLAIN, (R.NO_PROVIDER,)),
        ({"prompt_tokens": 255}, Route.PLAIN, (R.SHORT_PROMPT,)),
        ({"prompt_tokens": 255, "restored": True}, Route.PLAIN, (R.SHORT_PROMPT, R.STORED)),
        ({"costs": HOLDS_MOST}, Route.PLAIN, (R.CACHED,)),
        ({"costs": HOLDS_MOST, "restored": True}, Route.PLAIN, (R.STORED,)),
        ({"costs": SLOWER}, Route.PLAIN, (R.PLAIN_CHEAPER,)),
        ({"costs": SLOWER, "restored": True}, Route.PLAIN, (R.PLAIN_CHEAPER, R.STORED)),
        # After a restore only a handoff cheaper than plain is taken: no near-tie goes hybrid.
        ({"costs": COLD, "restored": True}, Route.PLAIN, (R.PLAIN_CHEAPER, R.STORED)),
        ({"costs": FASTER, "restored": True}, Route.FILE, ()),
        ({"share": True, "share_refused": True, "restored": True}, Route.FILE, (R.SHARE_REMEMBERED,)),
    ],
)
def test_choose_decides_the_route_and_every_reason_the_route_line_prints(
    changes: dict[str, Any], route: Route, reasons: tuple[Reason, ...]
) -> None:
    picked = choice(**changes)
    assert (picked.route, picked.reasons) == (route, reasons)


# -- the slot choice --------------------------------------------------------------------------------


def key(*tokens: int) -> PromptKey:
    return PromptKey(text="", tokens=tuple(tokens))


SYSTEM = tuple(range(100, 140))  # a 40-token system prompt


async def test_a_request_gets_the_free_slot_holding_the_longest_prefix_of_its_prompt() -> None:
    pool = SlotPool(3, queue_limit=8)
    for prompt in (key(1, 2, 3), key(*SYSTEM, 7), key(9, 9, 9)):
        async with pool.hold(prompt):
            pass
    async with pool.hold(key(*SYSTEM, 7, 8, 9)) as slot:
        assert pool.holds(slot) == key(*SYSTEM, 7)
        assert pool.cached(slot, key(*SYSTEM, 7, 8, 9)) == 41
    assert pool.statistics().affinity_hits == 1


async def test_with_its_prompt_cache_the_decoder_reuses_what_another_slot_holds_when_its_own_keeps_little() -> None:
    # llama-server with --cache-ram saves its idle slots into its prompt cache and, for a request
    # whose slot would keep less than half of what it holds, loads the best match from there.
    pool = SlotPool(2, queue_limit=8)
    async with pool.hold(key(*SYSTEM, 7)) as other:
        pass
    asked = key(*SYSTEM, 8)
    async with pool.hold() as slot:
        assert slot != other
        pool.remember(slot, key(9, 9, 9, 9))
        assert pool.cached(slot, asked) == 0
        assert pool.reusable(slot, asked, prompt_cache=0) == 0
        assert pool.reusable(slot, asked, prompt_cache=1000) == len(SYSTEM)
        # A slot that keeps half of its prompt or more is used as it is: nothing loaded from the cache.
        pool.remember(slot, key(*SYSTEM[:30], 5, 5))
        assert pool.reusable(slot, asked, prompt_cache=1000) == 30


async def hold_and_say(pool: SlotPool, got: list[int], prompt: PromptKey) -> None:
    """A request for ``prompt``: the slot it is given goes into ``got``."""
    async with pool.hold(prompt) as slot:
        got.append(slot)


async def test_a_next_turn_sent_while_its_slot_is_being_saved_waits_for_that_slot_not_a_cold_one() -> None:
    pool = SlotPool(2, queue_limit=8)
    turn1 = key(*SYSTEM, 1, 2, 3)
    got: list[int] = []
    next_turn = partial(hold_and_say, pool, got)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery, pool.hold(turn1) as first:
            pool.keeping(first, turn1)  # the reply is out; the slot is being saved
            nursery.start_soon(next_turn, key(*SYSTEM, 1, 2, 3, 4, 5))
            await trio.testing.wait_all_tasks_blocked()
            # The other slot is free, and cold: the next turn waits for its own.
            assert got == []
            assert (pool.statistics().keep_waiting, pool.statistics().free) == (1, 1)
    assert got == [first]
    assert (pool.statistics().keep_waits, pool.statistics().keep_waiting) == (1, 0)


async def test_a_slot_told_twice_it_is_being_saved_wakes_the_next_turn_when_it_is_let_go() -> None:
    # keep_after tells it before the chat's end is asked, StoredPrefixes.after again before its save:
    # the turn that waits from the first must be woken by the release, not by its wait's bound.
    pool = SlotPool(2, queue_limit=8)
    turn1 = key(*SYSTEM, 1, 2, 3)
    got: list[int] = []
    next_turn = partial(hold_and_say, pool, got)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            async with pool.hold(turn1) as first:
                pool.keeping(first, turn1)
                nursery.start_soon(next_turn, key(*SYSTEM, 1, 2, 3, 4, 5))
                await trio.testing.wait_all_tasks_blocked()
                pool.keeping(first, turn1)
                assert got == []
            await trio.testing.wait_all_tasks_blocked()
            assert got == [first]  # at once (the bound is KEEP_WAIT_S)


async def test_a_request_that_does_not_continue_the_slot_being_saved_takes_a_free_slot_at_once() -> None:
    pool = SlotPool(2, queue_limit=8)
    async with pool.hold(key(*SYSTEM, 5)) as warm:
        pass
    turn1 = key(*SYSTEM, 1, 2, 3)
    with trio.fail_after(5):
        async with pool.hold() as saving:
            assert saving != warm
            pool.keeping(saving, turn1)
            # A free slot holds as much of it (the system prompt) as the slot being saved.
            async with pool.hold(key(*SYSTEM, 9)) as slot:
                assert slot == warm
            # Nothing in common with the slot being saved.
            async with pool.hold(key(7, 7, 7)) as slot:
                assert slot == warm
    assert pool.statistics().keep_waits == 0


async def test_a_wait_for_a_slot_being_saved_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    pool = SlotPool(2, queue_limit=8)
    turn1 = key(*SYSTEM, 1, 2, 3)
    with trio.fail_after(KEEP_WAIT_S * 2):
        async with pool.hold(turn1) as first:
            pool.keeping(first, turn1)
            started = trio.current_time()
            async with pool.hold(key(*SYSTEM, 1, 2, 3, 4)) as slot:
                assert slot != first
            assert trio.current_time() - started == pytest.approx(KEEP_WAIT_S)


async def test_without_a_useful_match_the_least_recently_used_free_slot_is_taken() -> None:
    pool = SlotPool(3, queue_limit=8)
    used = []
    for prompt in (key(*SYSTEM), key(1), key(2)):
        async with pool.hold(prompt) as slot:
            used.append(slot)
    assert sorted(used) == [0, 1, 2]  # three prompts, three slots: none was evicted
    async with pool.hold(key(5, 5)) as slot:
        assert slot == used[0]  # the oldest
    # A prefix shorter than a template's worth of tokens is no match.
    async with pool.hold(key(*SYSTEM[:8], 0)) as slot:
        assert slot == used[1]


async def test_interleaved_conversations_keep_their_slots() -> None:
    pool = SlotPool(2, queue_limit=8)
    a, b = tuple(range(200, 260)), tuple(range(300, 360))
    seen: dict[str, set[int]] = {"a": set(), "b": set()}
    for turn in range(4):
        for name, system in (("a", a), ("b", b)):
            async with pool.hold(key(*system, *range(turn))) as slot:
                seen[name].add(slot)
    assert len(seen["a"]) == len(seen["b"]) == 1
    assert seen["a"] != seen["b"]


async def test_text_keys_match_conversations_when_tokens_are_unknown() -> None:
    pool = SlotPool(2, queue_limit=8)
    first = PromptKey('[{"role":"system","content":"' + "You are a pirate. " * 10)
    other = PromptKey('[{"role":"system","content":"' + "You are a lawyer. " * 10)
    async with pool.hold(first) as slot_a:
        pass
    async with pool.hold(other) as slot_b:
        assert slot_b != slot_a
    async with pool.hold(PromptKey(first.text + '"},{"role":"user"}]')) as slot:
        assert slot == slot_a


async def test_waiters_still_get_slots_in_arrival_order() -> None:
    pool = SlotPool(1, queue_limit=8)
    order: list[str] = []

    async def wait(name: str, prompt: PromptKey) -> None:
        async with pool.hold(prompt):
            order.append(name)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery, pool.hold(key(*SYSTEM)):
            nursery.start_soon(wait, "first", key(1))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(wait, "second", key(*SYSTEM))  # matches the held slot's prompt
            await trio.testing.wait_all_tasks_blocked()
    assert order == ["first", "second"]


@given(
    st.lists(st.integers(0, 2), max_size=12),
    st.lists(st.integers(0, 2), max_size=12),
    st.lists(st.integers(0, 2), max_size=12),
)
def test_common_prefix_is_the_length_both_sequences_share_element_by_element(
    shared: list[int], a: list[int], b: list[int]
) -> None:
    a, b = shared + a, shared + b
    expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert common_prefix(a, b) == expected
    assert common_prefix(tuple(a), tuple(b)) == expected
    assert common_prefix("".join(map(str, a)), "".join(map(str, b))) == expected

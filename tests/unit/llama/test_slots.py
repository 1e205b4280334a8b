"""SlotPool's settle step: a slot left by an exception (a client that hung up) is held until
``settle`` returns, so the next request takes another slot meanwhile; a slot left normally is not.
And what a pinned request reuses through llama-server's prompt cache (``reusable``)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from supervisor.llama.decoder import slot_processing
from supervisor.llama.slots import PromptKey, SlotPool


async def test_a_slot_left_by_a_cancellation_is_settled_before_anyone_else_gets_it() -> None:
    pool = SlotPool(2, queue_limit=4)
    settled: list[int] = []
    let_go = trio.Event()

    async def settle(slot: int) -> None:
        with trio.CancelScope(shield=True):
            await let_go.wait()
        settled.append(slot)

    async def hang_up(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            async with pool.hold(settle=settle):
                task_status.started(scope)
                await trio.sleep_forever()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            scope = await nursery.start(hang_up)
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            # Still settling: the slot is not free, so the next request gets the other one.
            assert pool.statistics().busy == 1
            async with pool.hold() as other:
                assert other == 1
            let_go.set()
    assert settled == [0]
    assert pool.statistics().busy == 0


async def test_a_slot_left_normally_is_not_settled() -> None:
    pool = SlotPool(1, queue_limit=4)
    calls: list[int] = []

    async def settle(slot: int) -> None:
        calls.append(slot)

    async with pool.hold(settle=settle):
        pass
    assert calls == []


@pytest.mark.parametrize(
    ("status", "slots", "expected"),
    [
        (200, [{"id": 0, "is_processing": False}, {"id": 1, "is_processing": True}], True),
        (200, [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}], False),
        (200, [], False),
        (501, {"error": "slots disabled"}, False),
        (200, "not a list", False),
    ],
)
def test_slot_processing_reads_the_decoders_slots_answer(status: int, slots: object, expected: bool) -> None:
    assert slot_processing(status, slots, 1) is expected


def prompt(*tokens: int) -> PromptKey:
    return PromptKey(tokens=tokens)


GROUPS = [tuple(range(1000 * g, 1000 * g + 700)) for g in range(6)]  # an agent fleet's system prompts


async def test_a_prompt_a_slot_held_before_it_moved_on_is_reused_from_the_prompt_cache() -> None:
    # The fleet benchmark: 6 system prompts over 4 slots.  llama-server saved each prompt into its
    # prompt cache when its slot moved on, and loads it for the group's next request whatever
    # slot it is pinned to: the decoder evaluates only the question, not 700 tokens.
    pool = SlotPool(4, queue_limit=8)
    for group in GROUPS:
        async with pool.hold(prompt(*group, 1)):
            pass
    asked = prompt(*GROUPS[0], 2, 3)
    async with pool.hold(asked) as slot:
        assert pool.cached(slot, asked) == 0  # no slot holds group 0 now
        assert pool.best_cached(asked) == 0
        assert pool.reusable(slot, asked, prompt_cache=10_000) == len(GROUPS[0])
        assert pool.reusable(slot, asked, prompt_cache=0) == 0  # no prompt cache
        # A cache that holds only the newest prompts has lost group 0's (llama-server drops the oldest).
        assert pool.reusable(slot, asked, prompt_cache=701) == 0


async def test_a_prompt_loaded_from_the_prompt_cache_leaves_it_until_its_slot_moves_on() -> None:
    # llama-server's cache hands the prompt it loads to the slot (server_prompt_cache::load erases
    # it): a question on the same system prompt pinned to another slot meanwhile finds nothing.
    pool = SlotPool(4, queue_limit=8)
    for group in GROUPS:
        async with pool.hold(prompt(*group, 1)):
            pass
    first, second = prompt(*GROUPS[0], 2), prompt(*GROUPS[0], 3)
    async with pool.hold(first) as one:
        assert pool.reusable(one, first, prompt_cache=10_000) == len(GROUPS[0])
        pool.loads(one, first, prompt_cache=10_000)
        async with pool.hold(second) as two:
            assert pool.reusable(two, second, prompt_cache=10_000) == 0
            pool.loads(two, second, prompt_cache=10_000)  # nothing to load: nothing changes
    # Both moved on from what they held, and hold the system prompt now.
    third = prompt(*GROUPS[0], 4)
    async with pool.hold(third) as slot:
        assert pool.reusable(slot, third, prompt_cache=10_000) == len(GROUPS[0])
    # Group 1's prompt is still in the cache: a load of group 0's took nothing else.
    async with pool.hold(prompt(*GROUPS[2], 9)) as slot:
        assert pool.reusable(slot, prompt(*GROUPS[1], 5), prompt_cache=10_000) == len(GROUPS[1])


async def test_a_slot_that_loads_from_the_prompt_cache_saves_its_own_prompt_there_first() -> None:
    # llama-server saves the slot before it loads into it: a request on the slot's old prompt,
    # pinned elsewhere while the first one runs, loads that prompt from the cache.
    pool = SlotPool(2, queue_limit=8)
    pool.remember(0, prompt(*GROUPS[0], 1))
    pool.remember(0, prompt(*GROUPS[1], 1))  # group 0's prompt to the cache; slot 0 holds group 1's
    pool.remember(1, prompt(*GROUPS[2], 1))
    asked = prompt(*GROUPS[0], 2)
    async with pool.hold(asked) as slot:
        assert slot == 0
        pool.loads(slot, asked, prompt_cache=10_000)
        again = prompt(*GROUPS[1], 5)
        async with pool.hold(again) as other:
            assert pool.reusable(other, again, prompt_cache=10_000) == len(GROUPS[1])


async def test_a_slot_that_keeps_half_of_its_prompt_loads_nothing_from_the_prompt_cache() -> None:
    pool = SlotPool(2, queue_limit=8)
    pool.remember(0, prompt(*GROUPS[0], 1))
    pool.remember(0, prompt(*GROUPS[1], 1))  # group 0's prompt to the cache
    pool.remember(1, prompt(*GROUPS[2], 1))
    asked = prompt(*GROUPS[1], 2)
    pool.loads(0, asked, prompt_cache=10_000)  # slot 0 keeps its own: llama-server loads nothing
    assert pool.reusable(1, prompt(*GROUPS[0], 2), prompt_cache=10_000) == len(GROUPS[0])


async def test_a_prompt_the_cache_would_keep_less_than_a_quarter_of_is_not_loaded() -> None:
    pool = SlotPool(1, queue_limit=8)
    async with pool.hold(prompt(*GROUPS[0], *GROUPS[1])):
        pass
    async with pool.hold(prompt(*GROUPS[2])):
        pass
    # The first prompt is in the cache, but a request sharing 700 of its 1,400 tokens keeps half:
    # loaded; one sharing 300 keeps under a quarter: llama-server leaves it there.
    async with pool.hold() as slot:
        assert pool.reusable(slot, prompt(*GROUPS[0], 5), prompt_cache=10_000) == 700
        assert pool.reusable(slot, prompt(*GROUPS[0][:300], 5), prompt_cache=10_000) == 0


async def test_the_prompt_cache_is_forgotten_with_a_restart() -> None:
    pool = SlotPool(1, queue_limit=8)
    for group in GROUPS[:2]:
        async with pool.hold(prompt(*group)):
            pass
    pool.forget_all()
    async with pool.hold() as slot:
        assert pool.reusable(slot, prompt(*GROUPS[0], 5), prompt_cache=10_000) == 0


async def test_an_empty_slot_loads_nothing_from_the_prompt_cache() -> None:
    # llama-server consults its cache for a pinned slot that would keep less than half of what it
    # holds; for an empty one that share is 0/0 (NaN), never below a half: it prefills from scratch.
    pool = SlotPool(2, queue_limit=8)
    pool.remember(0, prompt(*GROUPS[0], 1))
    pool.remember(0, prompt(*GROUPS[2], 1))  # group 0's prompt moves to the cache
    asked = prompt(*GROUPS[0], 2)
    assert pool.reusable(0, asked, prompt_cache=10_000) == len(GROUPS[0])
    assert pool.holds(1) == PromptKey()
    assert pool.reusable(1, asked, prompt_cache=10_000) == 0


async def test_a_question_on_a_system_prompt_no_slot_holds_now_branches_off_the_questions_before_it() -> None:
    # More system prompts than slots (the fleet benchmark's 6 over 4): the prompts slots held before
    # count as recent, so a new question on group 0 keeps only group 0's prompt, not itself whole.
    pool = SlotPool(2, queue_limit=8)
    pool.remember(0, prompt(*GROUPS[0], 1))
    pool.remember(0, prompt(*GROUPS[2], 1))
    pool.remember(1, prompt(*GROUPS[1], 1))
    assert pool.shared(prompt(*GROUPS[0], 2)) == (len(GROUPS[0]), False)
    assert pool.shared(prompt(*GROUPS[0], 1, 5)) == (len(GROUPS[0]) + 1, True)  # it goes on from it
    assert pool.shared(prompt(*GROUPS[3], 1)) == (0, False)


async def test_peek_names_the_slot_hold_gives_and_takes_nothing() -> None:
    pool = SlotPool(2, queue_limit=8)
    system = "a system prompt long enough to be worth matching by its text alone, then "
    chat = PromptKey(system + "a first question", (1, 2, 3))
    async with pool.hold(chat) as first:
        pass
    asked = PromptKey(system + "a second question")
    peeked = pool.peek(asked)
    assert peeked == first
    assert pool.statistics().free == 2  # nothing taken
    async with pool.hold(asked) as slot:
        assert slot == peeked
        assert pool.peek(asked) == 1 - first  # the other slot, the only one free
        async with pool.hold():
            assert pool.peek(asked) is None  # none free


async def test_will_hold_replaces_the_key_a_slot_is_held_for() -> None:
    # A prompt held by its text and tokenized after its reply: the slot is known by its tokens.
    pool = SlotPool(1, queue_limit=8)
    text = PromptKey("a prompt known by its text")
    tokens = PromptKey(text.text, (5, 6, 7))
    async with pool.hold(text) as slot:
        pool.will_hold(slot, tokens)
    assert pool.holds(slot) == tokens
    # None: the slot keeps what it held before (a prompt the decoder refused).
    async with pool.hold(PromptKey("another prompt altogether")) as slot:
        pool.will_hold(slot, None)
    assert pool.holds(slot) == tokens
    pool.will_hold(slot, PromptKey("not held now"))  # a slot not held: nothing changes
    assert pool.holds(slot) == tokens


async def test_peek_names_no_slot_while_a_request_is_queued_or_every_slot_is_held() -> None:
    # A slot released with a request waiting is that request's: trio hands the permit over.
    pool = SlotPool(1, queue_limit=8)
    key = PromptKey("a prompt")
    released = trio.Event()
    async with trio.open_nursery() as nursery:
        async with pool.hold(key):
            assert pool.peek(key) is None  # every slot held

            async def waiter() -> None:
                async with pool.hold(key):
                    assert pool.peek(key) is None
                    await released.wait()

            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
        # Released: the waiter's now, though it has not run yet.
        assert pool.peek(key) is None
        released.set()
    assert pool.peek(key) == 0

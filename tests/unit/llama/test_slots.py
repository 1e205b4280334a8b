"""SlotPool's settle step: a slot left by an exception (a client that hung up) is held until
``settle`` returns, so the next request takes another slot meanwhile; a slot left normally is not."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from supervisor.llama.decoder import slot_processing
from supervisor.llama.slots import SlotPool


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

"""The decoder's slots, owned by onebitd.

Every request is pinned to a slot we handed out (``id_slot``), so a hybrid route can restore a
prompt's state into a slot that nobody else will take.  Waiters queue in arrival order (trio's
Semaphore is FIFO); past ``queue_limit`` waiters a request is refused at once with 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from .errors import Overloaded


@attrs.frozen
class SlotStatistics:
    total: int
    busy: int
    free: int
    queued: int
    queue_limit: int


class SlotPool:
    def __init__(self, n_slots: int, queue_limit: int) -> None:
        self.n_slots = n_slots
        self.queue_limit = queue_limit
        self._semaphore = trio.Semaphore(n_slots)
        self._free = list(range(n_slots))

    def configure(self, queue_limit: int) -> None:
        """A reload's new ``server.queue_limit``: waiters already queued stay queued."""
        self.queue_limit = queue_limit

    def statistics(self) -> SlotStatistics:
        queued = self._semaphore.statistics().tasks_waiting
        return SlotStatistics(
            total=self.n_slots,
            busy=self.n_slots - len(self._free),
            free=len(self._free),
            queued=queued,
            queue_limit=self.queue_limit,
        )

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[int]:
        """Wait for a free slot, in arrival order, and hold it for the block."""
        if self._semaphore.value == 0 and self._semaphore.statistics().tasks_waiting >= self.queue_limit:
            raise Overloaded()
        await self._semaphore.acquire()
        # The lowest free slot, so a lightly loaded decoder keeps reusing warm slots.
        self._free.sort()
        slot = self._free.pop(0)
        try:
            yield slot
        finally:
            self._free.append(slot)
            self._semaphore.release()

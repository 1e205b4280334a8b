"""A lifecycle's state, as one owner task keeps it: an ``Enum`` value, the table of the moves
allowed from each, and an event for those who wait on it (a child's ``ChildState``, a model's
``ModelState``).  A move the table does not allow is a bug in the owner: ``AssertionError``."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from typing import Generic, TypeVar

import trio

S = TypeVar("S", bound=enum.Enum)


class StateMachine(Generic[S]):
    def __init__(self, who: str, table: Mapping[S, frozenset[S]], initial: S) -> None:
        """``who`` names the owner in the error of an illegal move."""
        self.who = who
        self.table = table
        self.state = initial  # written by move() only
        self.since = time.time()  # the wall clock of the last move (or of the start)
        self.moves = 0
        self._changed = trio.Event()

    def move(self, new: S) -> S:
        """Take the state to ``new`` and wake those waiting; the state it left."""
        old = self.state
        if new not in self.table[old]:
            raise AssertionError(f"{self.who}: illegal transition {old.value} -> {new.value}")
        self.state = new
        self.since = time.time()
        self.moves += 1
        self._changed.set()
        self._changed = trio.Event()
        return old

    async def wait_for(self, *states: S) -> S:
        """Until the state is one of ``states``: that state."""
        while self.state not in states:
            await self._changed.wait()
        return self.state

    async def wait_changed(self) -> None:
        await self._changed.wait()

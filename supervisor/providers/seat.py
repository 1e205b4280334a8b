"""A provider several models name: one device, held by one model's process at a time.

A ``[[provider]]`` named by two ``[[model]]`` tables is a pool of one device (an NPU that holds one
model): its process runs with one model's parameters, those of the model it was last started for,
and never takes a job of another (its state files would be refused by that model's decoder, or
worse, wrong).  The daemon keeps one :class:`Seat` per such provider; each loaded model that names
it has a :class:`Tenant` in its providers, which wraps the model's own provider (its process, built
from that model's one-model config) and is its one owner task:

- at its model's load it takes the seat when nobody wants it (one loaded model: as before);
- a request of a model whose tenant does not hold the seat asks :meth:`Tenant.claim`: the pure
  :func:`decide` says whether the seat swaps to the asker (its holder is idle: no job of its own in
  flight and no request of its model), and the request itself takes the plain route with
  ``provider-swapping`` (a swap under way) or ``provider-other-model`` (its holder is busy);
- a swap: the holder's tenant stops its process once its jobs are done, then the new holder's
  tenant starts its own; its start time is measured (``start_ms``) and logged.

A model unloaded lets go of the seat, and hands it to another loaded model that names it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import trio

from ..errors import ProviderError
from ..reasons import Reason
from ..supervise.child import Child
from .base import Claim, Job, Provider, ProviderStatistics

log = logging.getLogger("onebit.provider")


class Action(enum.Enum):
    USE = "use"  # the seat is the asker's: its provider takes the job if it is ready
    TAKE = "take"  # nobody holds or wants it: the asker's provider starts
    SWAP = "swap"  # its holder is idle: it stops, and the asker's provider starts
    SWAPPING = "swapping"  # a swap to the asker is under way
    OTHER_MODEL = "other-model"  # another model holds (or is being handed) it and is busy


# What a request that cannot use the seat says on its route line (USE: none of these).
REASONS: dict[Action, Reason] = {
    Action.TAKE: Reason.PROVIDER_SWAPPING,
    Action.SWAP: Reason.PROVIDER_SWAPPING,
    Action.SWAPPING: Reason.PROVIDER_SWAPPING,
    Action.OTHER_MODEL: Reason.PROVIDER_OTHER_MODEL,
}


def decide(me: str, *, holder: str | None, wanted: str | None, started: bool, wanted_idle: bool) -> Action:
    """What a request of model ``me`` does with the seat: ``holder`` runs its process now (None:
    none), ``started``: that process's start is over, ``wanted`` is the model it is for (None:
    nobody asked), ``wanted_idle``: that model has no request and no job in flight.  Pure.

        wanted me, holder me, started      use
        wanted me, holder me, starting     swapping (its process is starting)
        wanted me, holder another or none  swapping (the other's process is stopping)
        wanted nobody                      take
        wanted another, idle               swap
        wanted another, busy               other-model
    """
    if wanted == me:
        return Action.USE if holder == me and started else Action.SWAPPING
    if wanted is None:
        return Action.TAKE
    return Action.SWAP if wanted_idle else Action.OTHER_MODEL


class Seat:
    """One shared provider's device: which model's process runs (``holder``), which model it is
    for (``wanted``), and the tenants of the loaded models that name it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.holder: str | None = None
        self.wanted: str | None = None
        self.tenants: dict[str, Tenant] = {}
        self.swaps = 0
        self.start_ms: float | None = None  # the last start's spawn to settled
        self._changed = trio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def idle(self, model: str | None) -> bool:
        tenant = self.tenants.get(model) if model is not None else None
        return tenant is None or tenant.idle()

    def want(self, model: str | None, why: str) -> None:
        if self.wanted != model:
            log.info(
                "provider %s: for model %s from now on (%s)%s",
                self.name,
                model or "none",
                why,
                f"; model {self.holder}'s process stops first" if self.holder not in (None, model) else "",
            )
            self.wanted = model
            self.changed()


class Seats:
    """The daemon's seats, one per provider that several models name, made when first asked for."""

    def __init__(self) -> None:
        self._seats: dict[str, Seat] = {}

    def get(self, name: str) -> Seat:
        seat = self._seats.get(name)
        if seat is None:
            seat = self._seats[name] = Seat(name)
        return seat


class Tenant:
    """One model's provider on a shared seat: the Provider protocol over that model's own provider,
    which runs only while the model holds the seat.  ``make`` builds a fresh one per start (a
    provider's child lives for one start); ``model_idle``: the model has no request in flight."""

    def __init__(self, seat: Seat, model: str, make: Callable[[], Provider], model_idle: Callable[[], bool]) -> None:
        self.seat = seat
        self.model = model
        self.name = seat.name
        self._make = make
        self._model_idle = model_idle
        self.inner: Provider | None = None
        self._started = False  # its process's start is over (ready, failed or refused)
        self._jobs = 0
        self.last = make()  # the running one, or the one that ran last (statistics, the layout)
        self.kind = self.last.kind
        self.supports_share = self.last.supports_share
        # What it computes on, for the route line: the running one's, once its start is over.
        self.engine = self.last.engine
        self.device = self.last.device

    @property
    def child(self) -> Child | None:
        return self.inner.child if self.inner is not None else None

    @property
    def admitted(self) -> str | None:
        return self.last.admitted

    @property
    def holds(self) -> bool:
        return self.seat.holder == self.model and self.seat.wanted == self.model

    @property
    def ready(self) -> bool:
        return self.holds and self.inner is not None and self.inner.ready

    @property
    def busy(self) -> int:
        return self._jobs

    def idle(self) -> bool:
        return self._jobs == 0 and self._model_idle()

    def claim(self) -> Reason | None:
        """A request of this model found no ready provider: ask for the seat (the swap starts
        here when :func:`decide` says so).  The reason for its route line, None when it holds it."""
        seat = self.seat
        action = decide(
            self.model,
            holder=seat.holder,
            wanted=seat.wanted,
            started=self._started,
            wanted_idle=seat.idle(seat.wanted),
        )
        if action is Action.TAKE:
            seat.want(self.model, "a request asked and it was free")
        elif action is Action.SWAP:
            seat.swaps += 1
            seat.want(self.model, f"a request asked and model {seat.wanted} was idle")
        return REASONS.get(action)

    async def wait_settled(self) -> None:
        while self.seat.wanted == self.model and (self.inner is None or self.seat.holder != self.model):
            await self.seat.wait_changed()
        if self.inner is not None and self.seat.wanted == self.model:
            await self.inner.wait_settled()

    def cached_tokens(self, tokens: tuple[int, ...]) -> int:
        return self.inner.cached_tokens(tokens) if self.inner is not None and self.holds else 0

    async def prefill(self, job: Job) -> Claim:
        inner = self.inner
        if inner is None or not self.holds:
            raise ProviderError(f"provider {self.name} runs for model {self.seat.holder or 'none'} now")
        self._jobs += 1
        try:
            return await inner.prefill(job)
        finally:
            self._jobs -= 1
            self.seat.changed()  # its holder's tenant may wait for its last job to stop

    def statistics(self) -> ProviderStatistics:
        stats = self.last.statistics()
        return ProviderStatistics(
            name=stats.name,
            kind=stats.kind,
            ready=self.ready,
            busy=self._jobs,
            jobs=stats.jobs,
            failures=stats.failures,
            child=stats.child,
            engine=stats.engine,
            device=stats.device,
            refused=stats.refused,
            admitted=stats.admitted,
        )

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        """The owner of this model's process on the seat, for one load of the model."""
        seat = self.seat
        seat.tenants[self.model] = self
        if seat.wanted is None:
            seat.want(self.model, "its model loaded and it was free")
        try:
            task_status.started()
            while True:
                while not (seat.wanted == self.model and seat.holder is None):
                    await seat.wait_changed()
                await self._hold()
        finally:
            seat.tenants.pop(self.model, None)
            if seat.holder == self.model:
                seat.holder = None
            if seat.wanted == self.model:
                # Another loaded model that names it gets it (the one loaded next, with one at a time).
                seat.want(next(iter(seat.tenants), None), f"model {self.model} unloaded")
            seat.changed()

    async def _hold(self) -> None:
        """Run this model's process until the seat is wanted for another and its jobs are done."""
        seat = self.seat
        seat.holder = self.model
        inner = self._make()
        self._started = False
        began = trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(inner.run)
                self.inner = inner
                self.last = inner
                seat.changed()
                nursery.start_soon(self._timed, inner, began)
                while seat.wanted == self.model or self._jobs:
                    await seat.wait_changed()
                log.info(
                    "provider %s: model %s's process stops (the seat goes to model %s)",
                    self.name,
                    self.model,
                    seat.wanted,
                )
                nursery.cancel_scope.cancel()
        finally:
            self.inner = None
            self._started = False
            seat.holder = None
            seat.changed()

    async def _timed(self, inner: Provider, began: float) -> None:
        await inner.wait_settled()
        if inner.child is not None:  # a provider without a start-time check is settled at its spawn
            await inner.child.wait_first_start()
        self._started = True
        self.engine, self.device = inner.engine, inner.device
        self.seat.start_ms = (trio.current_time() - began) * 1000
        log.info(
            "provider %s: started for model %s in %.0f ms (%s)",
            self.name,
            self.model,
            self.seat.start_ms,
            "ready" if inner.ready else "not ready",
        )
        self.seat.changed()

"""The completion requests in flight at the front, and whether it takes new ones.

A drain (SIGTERM, ``onebitctl drain``) refuses new completions with 503 ``draining`` while those in
flight go on; the daemon waits for them (:meth:`Inflight.wait_idle`), and ``onebitctl status`` lists
them with the route each is on so far (its story's, supervisor/routes/story.py).
"""

from __future__ import annotations

import attrs
import trio

from ..errors import ClientError
from ..observe.status import FrontStatistics, InflightStatistics
from ..routes.story import Story


@attrs.frozen
class InflightRequest:
    req: str
    endpoint: str
    started: float  # trio clock
    wall_started: float
    story: Story  # told as the request goes: its route so far

    def statistics(self, now: float) -> InflightStatistics:
        return InflightStatistics(
            req=self.req,
            endpoint=self.endpoint,
            route=self.story.route,
            slot=self.story.slot,
            age_s=round(now - self.started, 3),
        )


class Inflight:
    """The requests in flight, by id, and the drain; the one owner of both."""

    def __init__(self) -> None:
        self.requests: dict[str, InflightRequest] = {}
        self._changed: trio.Event | None = None  # made by the first waiter: most requests have none
        self.draining = False

    def drain(self) -> None:
        """Refuse new completion requests (503 ``draining``, and /health says so); those in flight go on."""
        self.draining = True

    def resume(self) -> None:
        """Take new completion requests again."""
        self.draining = False

    def add(self, request: InflightRequest) -> None:
        self.requests[request.req] = request
        self._wake()

    def remove(self, req: str) -> None:
        del self.requests[req]
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_changed(self) -> None:
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    async def wait_idle(self) -> None:
        while self.requests:
            await self.wait_changed()

    def check_open(self, retry_after_s: int) -> None:
        """ClientError 503 ``draining`` while draining: a new completion is refused."""
        if self.draining:
            raise ClientError(
                503, "draining", "onebitd is draining: not taking new requests", retry_after=retry_after_s
            )

    def statistics(self) -> FrontStatistics:
        now = trio.current_time()
        return FrontStatistics(
            draining=self.draining,
            inflight=tuple(request.statistics(now) for request in self.requests.values()),
        )

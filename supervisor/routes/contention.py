"""The prefill work running now on each child (the decoder, each provider): what a new request's
prefill would share.

llama-server evaluates the prompts of all its busy slots in the same batches, so a prompt that
arrives while another is being evaluated waits for the other's tokens too (a 41-token continuation
beside a 756-token prompt finishes with it); a provider's jobs queue or batch the same way.  An
estimate made as if the child were idle misses by the whole of the other's time.  A request's
prefill is counted here from when it is sent until its child answers, or it fails or is cancelled
(:meth:`Contention.running`'s ``finally``); ``Completions`` owns the one instance and routes/decision.py's
:func:`~supervisor.routes.decision.estimate` adds what is still to run (:class:`Busy`).

On cores the two children share, a handoff waits for the decoder's prefills in flight before its
provider begins (:meth:`Contention.settle`): run together, each slows the other (two processes'
threads on the same cores), and a short continuation on the decoder took 2x to 3x as long beside a
provider's cold prefill on the fleet benchmark, while the wait costs the handoff about what that
slowdown cost it (routes/decision.py's ``estimate``).  A slot save for the prefix store after a
reply waits the same way (routes/completion.py's ``_out_of_the_way``): it runs on the decoder's loop,
between its batches, and held back the requests sent while it waited there for one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs
import trio

# The key the decoder's prefills are counted under (a provider's are under its name).
DECODER = ""
# What is counted still to run of a prefill past its estimate: it runs on, for as long as is not known.
# Counted as done, it let the requests priced meanwhile believe its child idle: on the fleet benchmark
# a provider's cold prefill estimated at 1.3 s took 2.9 s, and the continuations priced on the decoder
# after 1.3 s were estimated as if alone and took 2x to 4x that.
OVERDUE = 0.5
# How much longer than 1.5 times its estimate a wait for prefills in flight may last (Contention.settle).
SETTLE_SLACK_S = 0.25


@attrs.frozen
class Job:
    """One prefill running on a child: its tokens, its estimated time, when it was sent."""

    tokens: int
    ms: float
    started: float  # trio's clock, seconds
    over: Callable[[], bool]  # the child answered (a stream's first bytes: the prompt is evaluated)


@attrs.frozen
class Busy:
    """The estimated time still to run on the decoder and on a provider, at one moment (0: idle)."""

    decoder_ms: float = 0.0
    provider_ms: float = 0.0


class Contention:
    """The prefills in flight per child: written by the requests that send them, read by estimates."""

    def __init__(self, clock: Callable[[], float] = trio.current_time) -> None:
        self._clock = clock
        self._jobs: dict[str, dict[int, Job]] = {}
        self._ids = itertools.count()
        self._changed = trio.Event()  # set when a prefill ends or its child answers, then replaced

    @contextmanager
    def running(self, child: str, tokens: int, ms: float, over: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Count a prefill of ``tokens`` estimated at ``ms`` on ``child`` while the block runs."""
        key = next(self._ids)
        jobs = self._jobs.setdefault(child, {})
        jobs[key] = Job(tokens, ms, self._clock(), over)
        try:
            yield
        finally:
            del jobs[key]
            self.poke()

    def poke(self) -> None:
        """A prefill's child answered (its ``over`` turned true), or a prefill ended: wake :meth:`settle`."""
        self._changed.set()
        self._changed = trio.Event()

    async def settle(self, child: str, estimated_ms: float, told: Callable[[float], None]) -> None:
        """Until no prefill on ``child`` is still to be answered, or 1.5 times the ``estimated_ms``
        of what is left and :data:`SETTLE_SLACK_S` have passed (a reply that is not streamed is
        answered only once it is whole); ``told`` the ms it waited, a cancelled wait's too."""
        start = self._clock()
        try:
            with trio.move_on_after(1.5 * estimated_ms / 1000.0 + SETTLE_SLACK_S):
                while self.tokens(child):
                    await self._changed.wait()
        finally:
            told(1000.0 * (self._clock() - start))

    def tokens(self, child: str) -> int:
        """The prompt tokens being prefilled on ``child`` now."""
        return sum(job.tokens for job in self._jobs.get(child, {}).values() if not job.over())

    def remaining_ms(self, child: str) -> float:
        """The estimated time until ``child`` is through the prefills it runs now.  They are batched
        (or queued) together and finish about when the longest does: the longest estimate's rest.
        A prefill past its estimate is still running: :data:`OVERDUE` of its estimate is counted."""
        now = self._clock()
        jobs = self._jobs.get(child, {}).values()
        left = [max(job.ms - 1000.0 * (now - job.started), OVERDUE * job.ms) for job in jobs if not job.over()]
        return max([0.0, *left])

    def busy(self, provider: str | None) -> Busy:
        """What a request choosing between the decoder and ``provider`` would share now."""
        provider_ms = self.remaining_ms(provider) if provider is not None else 0.0
        return Busy(self.remaining_ms(DECODER), provider_ms)

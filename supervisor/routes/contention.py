"""The prefill work running now on each child (the decoder, each provider): what a new request's
prefill would share.

llama-server evaluates the prompts of all its busy slots in the same batches, so a prompt that
arrives while another is being evaluated waits for the other's tokens too (a 41-token continuation
beside a 756-token prompt finishes with it); a provider's jobs queue or batch the same way.  An
estimate made as if the child were idle misses by the whole of the other's time.  A request's
prefill is counted here from when it is sent until its child answers, or it fails or is cancelled
(:meth:`Contention.running`'s ``finally``); ``Completions`` owns the one instance and routes/decision.py's
:func:`~supervisor.routes.decision.estimate` adds what is still to run (:class:`Busy`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs
import trio

# The key the decoder's prefills are counted under (a provider's are under its name).
DECODER = ""


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

    def tokens(self, child: str) -> int:
        """The prompt tokens being prefilled on ``child`` now."""
        return sum(job.tokens for job in self._jobs.get(child, {}).values() if not job.over())

    def remaining_ms(self, child: str) -> float:
        """The estimated time until ``child`` is through the prefills it runs now.  They are batched
        (or queued) together and finish about when the longest does: the longest estimate's rest."""
        now = self._clock()
        left = [job.ms - 1000.0 * (now - job.started) for job in self._jobs.get(child, {}).values() if not job.over()]
        return max([0.0, *left])

    def busy(self, provider: str | None) -> Busy:
        """What a request choosing between the decoder and ``provider`` would share now."""
        provider_ms = self.remaining_ms(provider) if provider is not None else 0.0
        return Busy(self.remaining_ms(DECODER), provider_ms)

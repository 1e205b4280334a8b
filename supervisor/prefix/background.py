"""The prefix store's heavy work off the requests' path, in one thread of its own at nice 19: a state
file's hash and its copy into the store take little of the cores the decoder and the providers use.

A state file is tens of MiB: its hash and its copy are tens of ms of CPU each put, and they start
the moment a reply ends, when the request beside it is prefilling.  The decoder's threads wait for
each other at every step, so one that loses its core holds all of them back.  Measured on the
reference machine (docs/benchmarks.md, "Figures the code cites"), 16 MiB puts one
after another slowed a reply beside them from 11.6 to 16.5 ms a token at normal priority, and not
measurably at nice 19 (11.7), which still got 0.4 to 0.6 puts a second done beside the busy decoder
(``SCHED_IDLE`` slowed it no less and got 0 to 0.2 done: a store under steady load would keep
nothing).  A put is not urgent: its entry serves a later request.  The thread is one of its own:
trio's worker threads are shared, and a thread cannot take back a priority it gave up."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")

NICE = 19


def lower_priority() -> None:
    """The calling thread at nice :data:`NICE` (Linux: ``setpriority`` of one thread); where that
    cannot be done it runs as it is."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, 0, NICE)


class Background:
    """One worker thread at nice 19, started at its first job, jobs run in turn; :meth:`close` lets
    it go (a job in progress finishes)."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the thread: its result, or its exception raised here.  Cancelled while
        it waits, the job still runs to its end and its result is lost: a caller that must know it
        shields itself (the store's puts do)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="onebit-store", initializer=lower_priority
            )
        future = self._executor.submit(fn, *args)
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def tell(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):  # nobody waits any more
                token.run_sync_soon(done.set)

        future.add_done_callback(tell)
        await done.wait()
        return future.result()

    def close(self) -> None:
        """Let the thread go once its job in progress is done (a later job starts another)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

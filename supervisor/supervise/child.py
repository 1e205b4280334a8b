"""A supervised child: started, health-gated, restarted with backoff, marked failed, stopped.

The child's lifecycle is :class:`ChildState` plus the ``TRANSITIONS`` table, owned by the one task
that runs :meth:`Child.run`.  Everyone else reads :attr:`Child.state`, waits with :meth:`wait_state`,
or reads :meth:`statistics`.  Every transition is logged and counted.

Every line of a child's output, whatever level it was logged at (supervisor/supervise/llama_log.py),
is kept in a ring of its last :data:`RECENT_LINES` across its lives, for an operator to read on demand
(:meth:`Child.recent`, ``onebitctl logs``).  When a child exits by itself, the lines it wrote in its
last moments that were ``info`` on their own but logged at ``debug`` (below ``log.children``: an
assertion's message has no llama.cpp level mark, so it is ``info``) are logged again as warnings
before the transition, so the log says why it died.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import attrs
import trio

from ..config import HealthPolicy, RestartPolicy
from ..errors import ChildError
from .llama_log import level_of, relayed
from .process import ChildProcess, describe_exit
from .states import StateMachine

log = logging.getLogger("onebit.child")

# How long the output of a dead child may take to reach EOF: the pipe holds at most 64 KiB.
_DRAIN_S = 1.0
# A long-lived child's log lines are read in gatherings this far apart (ChildProcess.pump_output):
# each gathering costs onebitd a wake-up, a read and a timer, so this caps what a child's logging
# costs at ten of them a second whatever the request rate.  The pipe (64 KiB) holds far more than a
# tenth of a second of llama-server's lines (about 1 KiB a request).
_GATHER_S = 0.1
# A child's lines kept for onebitctl logs: llama-server writes 100 to 200 lines loading a model and 5
# to 10 a request, so this holds a start and the requests after it, or the last 50 or so requests;
# about 100 KiB a child.
RECENT_LINES = 500
# The lines of a child that exited by itself logged again as its last words: at most this many (an
# assertion's message and the backtrace ggml prints after it), written at most this long before its
# exit was seen (its output is read every _GATHER_S, and drained within _DRAIN_S).
_LAST_WORDS = 10
_LAST_WORDS_S = 2.0


class ChildState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"  # spawned, /health not yet 200
    READY = "ready"  # healthy: requests may go to it
    BACKOFF = "backoff"  # died or unhealthy; waiting before the next start
    FAILED = "failed"  # too many failures in the window: requests get 503 at once
    STOPPING = "stopping"

    @property
    def words(self) -> str:
        """The state as a client is told it: ``the decoder is <words>``."""
        return _WORDS.get(self, self.value)


S = ChildState
# The states whose name alone does not tell a client what is going on.
_WORDS = {
    S.STOPPED: "not started yet",
    S.STARTING: "starting (loading its model)",
    S.BACKOFF: "restarting after a crash",
}
TRANSITIONS: dict[ChildState, frozenset[ChildState]] = {
    S.STOPPED: frozenset({S.STARTING, S.STOPPING}),
    S.STARTING: frozenset({S.READY, S.BACKOFF, S.FAILED, S.STOPPING}),
    S.READY: frozenset({S.BACKOFF, S.FAILED, S.STOPPING}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPING}),
    S.FAILED: frozenset({S.STOPPING}),
    S.STOPPING: frozenset({S.STOPPED}),
}


# What an operator must hear of (``journalctl -p warning``): a life that ended unasked (a crash, a
# kill, failed health checks, a start that never became healthy) is a warning, giving up an error.
_LEVEL = {S.BACKOFF: logging.WARNING, S.FAILED: logging.ERROR}


class Launcher(Protocol):
    """What a child needs to know about the program it supervises."""

    name: str

    def argv(self) -> Sequence[str]: ...

    def prepare(self) -> None:
        """Runs before every spawn (remove a stale socket file, ...)."""

    async def healthy(self) -> bool:
        """One health check; False for anything but a clear yes."""

    @property
    def env(self) -> Mapping[str, str] | None:
        """The child's environment, read at every spawn (None: onebitd's own)."""

    @property
    def pass_fds(self) -> Sequence[int]:
        """Descriptors the child inherits at their numbers (a worker's end of its socketpair)."""

    def spawned(self) -> None:
        """Runs right after every spawn attempt, to close the parent's copies of what it passed."""

    def fatal(self, line: str) -> str | None:
        """Why no restart can help, when a line of its output before it was healthy says so (a
        model file it cannot load); else None."""


@attrs.frozen
class ChildStatistics:
    name: str
    state: str
    pid: int | None
    restarts: int
    generation: int
    last_exit: str | None
    state_since: float  # wall-clock seconds since the epoch
    transitions: int


@attrs.frozen
class HeardLine:
    """One line of a child's output, as onebitd read it."""

    at: float  # wall-clock seconds since the epoch
    line: str
    life: int  # which start of the child wrote it (its statistics' restarts, then)
    unshown: bool  # info or more on its own, logged at debug (below log.children)


# Told of each move of a child's state: (the child, from, to, why).
OnTransition = Callable[["Child", ChildState, ChildState, str], None]


class Child:
    def __init__(
        self,
        launcher: Launcher,
        health: HealthPolicy,
        restart: RestartPolicy,
        *,
        cpu_affinity: Sequence[int] = (),
        on_transition: OnTransition | None = None,
        sleep: Callable[[float], Awaitable[None]] = trio.sleep,
    ) -> None:
        self.launcher = launcher
        self.name = launcher.name
        self.health = health
        self.restart = restart
        self.cpu_affinity = tuple(cpu_affinity)
        self._on_transition = on_transition
        self._sleep = sleep
        self._lifecycle = StateMachine(self.name, TRANSITIONS, ChildState.STOPPED)
        self._process: ChildProcess | None = None
        self._restarts = 0
        self._last_exit: str | None = None
        # What its output said no restart can help with (Launcher.fatal), in the life now ending.
        self._fatal: str | None = None
        # Set when the first start is over, healthy or not: what readiness waits for.
        self._first_start = trio.Event()
        self._recent: deque[HeardLine] = deque(maxlen=RECENT_LINES)
        # Bumped on every READY: a fact learnt about one decoder process (it cannot share its KV,
        # say) is valid for that generation only.
        self.generation = 0

    # -- what others may ask ------------------------------------------------------------------

    @property
    def state(self) -> ChildState:
        return self._lifecycle.state

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def wait_state(self, *states: ChildState) -> ChildState:
        return await self._lifecycle.wait_for(*states)

    async def wait_first_start(self) -> None:
        """Until the first start is over: the child became healthy, or that life ended."""
        await self._first_start.wait()

    def recent(self) -> tuple[HeardLine, ...]:
        """Its last lines of output, oldest first, across its lives."""
        return tuple(self._recent)

    def statistics(self) -> ChildStatistics:
        return ChildStatistics(
            name=self.name,
            state=self._lifecycle.state.value,
            pid=self.pid,
            restarts=self._restarts,
            generation=self.generation,
            last_exit=self._last_exit,
            state_since=self._lifecycle.since,
            transitions=self._lifecycle.moves,
        )

    # -- the owner task -------------------------------------------------------------------------

    def _set(self, new: ChildState, why: str = "") -> None:
        old = self._lifecycle.move(new)
        if old is ChildState.STARTING:
            self._first_start.set()
        log.log(
            _LEVEL.get(new, logging.INFO), "%s: %s -> %s%s", self.name, old.value, new.value, f" ({why})" if why else ""
        )
        if self._on_transition is not None:
            self._on_transition(self, old, new, why)

    async def run(self, *, task_status: trio.TaskStatus[Child] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise until cancelled.  ``started`` once the first spawn was attempted."""
        failures: deque[float] = deque()
        backoff = self.restart.backoff_initial_s
        started = False
        try:
            while True:
                self._set(ChildState.STARTING)
                generation = self.generation
                why = await self._one_life(task_status if not started else None)
                started = True
                if self.generation != generation:
                    backoff = self.restart.backoff_initial_s  # it was healthy: a fresh crash, not a loop
                now = trio.current_time()
                failures.append(now)
                while failures and now - failures[0] > self.restart.window_s:
                    failures.popleft()
                if self._fatal is not None:
                    # Another start would fail the same way: no crash loop, one line that says why.
                    self._last_exit = f"{self._fatal} ({why})"
                    self._set(ChildState.FAILED, f"{self._fatal}; not started again")
                    await trio.sleep_forever()
                if len(failures) >= self.restart.max_failures:
                    self._set(
                        ChildState.FAILED,
                        f"{why}; {len(failures)} failures within {self.restart.window_s:g}s",
                    )
                    await trio.sleep_forever()
                self._set(ChildState.BACKOFF, f"{why}; next start in {backoff:g}s")
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.restart.backoff_max_s)
                self._restarts += 1
        finally:
            if self._lifecycle.state is not ChildState.STOPPING:
                self._set(ChildState.STOPPING)
            self._set(ChildState.STOPPED)

    async def _one_life(self, task_status: trio.TaskStatus[Child] | None) -> str:
        """Spawn, gate on health, watch; return why this life ended.  Always reaps."""
        self.launcher.prepare()
        try:
            process = await ChildProcess.spawn(
                self.name,
                self.launcher.argv(),
                cpu_affinity=self.cpu_affinity,
                env=self.launcher.env,
                pass_fds=self.launcher.pass_fds,
            )
        except ChildError as exc:
            if task_status is not None:
                task_status.started(self)
            self._last_exit = str(exc)
            return str(exc)
        finally:
            self.launcher.spawned()
        self._process = process
        if task_status is not None:
            task_status.started(self)
        why = ""
        code: int | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(process.pump_output, self._heard, gather_s=_GATHER_S))
                why = await self._live(process)
                code = await process.stop(self.health.stop_grace_s)
                # Its group is dead, so the output reaches EOF once the last lines (often why it died)
                # are logged; a grandchild that left the group could hold the pipe open: bounded.
                nursery.cancel_scope.deadline = trio.current_time() + _DRAIN_S
        finally:
            if code is None:  # we are being cancelled: the daemon is stopping
                self._set(ChildState.STOPPING, f"stopping pid {process.pid}")
                code = await process.stop(self.health.stop_grace_s)
            self._last_exit = describe_exit(code)
            self._process = None
        if not why:
            self._say_last_words()
        return why or f"pid {process.pid} exited: {self._last_exit}"

    def _heard(self, line: str) -> None:
        """Each line of its output: kept among the recent ones; before its first healthy answer of
        a life, one that says no restart can help is kept (the first such)."""
        if line:
            level = level_of(line)
            unshown = level >= logging.INFO > relayed(level)
            self._recent.append(HeardLine(time.time(), line, self._restarts, unshown))
        if self._fatal is None and self._lifecycle.state is ChildState.STARTING:
            self._fatal = self.launcher.fatal(line)

    def _say_last_words(self) -> None:
        """Its last lines before it exited by itself that the log has not shown, as warnings."""
        since = time.time() - _LAST_WORDS_S
        unshown = [
            heard.line for heard in self._recent if heard.life == self._restarts and heard.at >= since and heard.unshown
        ]
        for line in unshown[-_LAST_WORDS:]:
            log.warning("%s| %s", self.name, line)

    async def _live(self, process: ChildProcess) -> str:
        """Gate on health, then watch; return why it must be stopped, or "" when it exited."""
        exited = trio.Event()

        async def watch_exit() -> None:
            # Not reaped yet: stop() can still reach whatever the process left in its group.
            await process.wait_exited()
            exited.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_exit)
            with trio.move_on_after(self.health.start_timeout_s) as start_scope:
                while not await self._check(exited):
                    if exited.is_set():
                        nursery.cancel_scope.cancel()
                        return ""
                    # Loading a model takes from a second to minutes; poll often so READY is prompt.
                    await self._wait_or_exit(exited, min(0.05, self.health.interval_s))
            if start_scope.cancelled_caught:
                nursery.cancel_scope.cancel()
                return f"not healthy within {self.health.start_timeout_s:g}s"
            self.generation += 1
            self._fatal = None  # it answered: whatever it said was not the end
            self._set(ChildState.READY, f"pid {process.pid} healthy")
            misses = 0
            while not exited.is_set():
                await self._wait_or_exit(exited, self.health.interval_s)
                if exited.is_set():
                    break
                if await self._check(exited):
                    misses = 0
                    continue
                if exited.is_set():
                    break
                misses += 1
                log.warning("%s: health check failed (%d of %d)", self.name, misses, self.health.failures)
                if misses >= self.health.failures:
                    nursery.cancel_scope.cancel()
                    return f"{misses} health checks failed in a row"
            nursery.cancel_scope.cancel()
        return ""

    async def _check(self, exited: trio.Event) -> bool:
        if exited.is_set():
            return False
        with trio.move_on_after(self.health.timeout_s):
            return await self.launcher.healthy()
        return False

    async def _wait_or_exit(self, exited: trio.Event, seconds: float) -> None:
        if math.isfinite(seconds):
            with trio.move_on_after(seconds):
                await exited.wait()

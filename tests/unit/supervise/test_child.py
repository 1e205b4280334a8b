"""Child: spawn, health gate, restart with backoff, give up, stop; against tests/fakes/fake_child.py.

Each test drives real processes whose health is a file the fake child writes (and the test deletes),
so a health check is an atomic look at the file system.  Backoff sleeps are recorded, not slept.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from supervisor.config import HealthPolicy, RestartPolicy
from supervisor.supervise import child as child_module
from supervisor.supervise.child import TRANSITIONS, Child, ChildState, HeardLine
from tests.fakes.fake_child import grandchild, kill_grandchild, running, wait_gone

FAKE_CHILD = Path(__file__).parents[2] / "fakes" / "fake_child.py"

S = ChildState


class FakeLauncher:
    """A Launcher running tests/fakes/fake_child.py, one ``modes`` entry per life (the last one repeats)."""

    def __init__(self, directory: Path, *modes: str, program: str = sys.executable) -> None:
        self.name = "fake"
        self.health_file = directory / "healthy"
        self.modes = modes
        self.program = program
        self.spawns = 0
        self.checks: list[bool] = []
        self.transitions: list[tuple[ChildState, ChildState, str]] = []
        self.checks_at: list[int] = []  # len(checks) at each transition
        self._changed = trio.Event()

    # -- the Launcher protocol

    def argv(self) -> list[str]:
        mode = self.modes[min(self.spawns, len(self.modes) - 1)]
        self.spawns += 1
        self._poke()
        return [self.program, str(FAKE_CHILD), str(self.health_file), *mode.split()]

    def prepare(self) -> None:
        self.health_file.unlink(missing_ok=True)

    env = None
    pass_fds = ()

    def spawned(self) -> None:
        return

    def fatal(self, line: str) -> str | None:
        # As llama-server's "error loading model": the fake's exit status 9 is one no restart helps.
        return "status 9 is fatal" if "exiting with status 9" in line else None

    async def healthy(self) -> bool:
        await trio.lowlevel.checkpoint()
        ok = self._published()
        self.checks.append(ok)
        self._poke()
        return ok

    # -- what tests look at

    def on_transition(self, _child: Child, old: ChildState, new: ChildState, why: str) -> None:
        self.transitions.append((old, new, why))
        self.checks_at.append(len(self.checks))
        self._poke()

    def path(self) -> list[ChildState]:
        """Every state the child went through, in order."""
        return [S.STOPPED] + [new for _old, new, _why in self.transitions]

    def entered(self, state: ChildState) -> bool:
        """Whether the child ever was in ``state`` (wait_state can miss a state already left)."""
        return state in self.path()

    def served_pid(self) -> int:
        """The pid the fake child wrote when it became healthy."""
        return int(self.health_file.read_text())

    def sicken(self) -> None:
        self.health_file.unlink()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition`` holds; it is looked at after each spawn, check and transition."""
        while not condition():
            await self._changed.wait()

    def _published(self) -> bool:
        # Synchronous on purpose: a check cannot interleave with a test deleting the file.
        return self.health_file.exists()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class Backoffs:
    """An injected ``sleep``: records what the child asked for and returns at once."""

    def __init__(self, clock: trio.testing.MockClock | None = None, *, hold: bool = False) -> None:
        self.requested: list[float] = []
        self._clock = clock
        self._hold = hold  # never wake: the child stays in BACKOFF until cancelled

    async def __call__(self, seconds: float) -> None:
        self.requested.append(seconds)
        if self._clock is not None:
            self._clock.jump(seconds)
        if self._hold:
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()


FAST_HEALTH = HealthPolicy(interval_s=0.01, timeout_s=10.0, failures=3, start_timeout_s=30.0, stop_grace_s=5.0)
PATIENT_RESTART = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=4.0, max_failures=100, window_s=300.0)


def supervised(
    launcher: FakeLauncher,
    backoffs: Backoffs,
    health: HealthPolicy = FAST_HEALTH,
    restart: RestartPolicy = PATIENT_RESTART,
) -> Child:
    return Child(launcher, health, restart, on_transition=launcher.on_transition, sleep=backoffs)


def assert_legal(launcher: FakeLauncher) -> None:
    """Every transition is in TRANSITIONS, and each starts where the previous one ended."""
    path = launcher.path()
    for old, new in itertools.pairwise(path):
        assert new in TRANSITIONS[old], f"{old.value} -> {new.value}"
    assert [old for old, _new, _why in launcher.transitions] == path[:-1]


async def test_a_healthy_child_goes_from_stopped_through_ready_and_back_to_stopped(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "serve")
    child = supervised(launcher, Backoffs())
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.READY)
            pid = launcher.served_pid()
            nursery.cancel_scope.cancel()
    assert launcher.path() == [S.STOPPED, S.STARTING, S.READY, S.STOPPING, S.STOPPED]
    assert_legal(launcher)
    assert child.state is S.STOPPED
    assert not running(pid)
    assert child.statistics().last_exit == "killed by SIGTERM"


async def test_a_child_that_keeps_exiting_backs_off_exponentially_up_to_the_cap(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "exit 1")
    backoffs = Backoffs()
    child = supervised(launcher, backoffs)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await launcher.until(lambda: len(backoffs.requested) >= 6)
            nursery.cancel_scope.cancel()
    assert backoffs.requested[:6] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert all(
        why.startswith("pid ") and "exited: exit status 1" in why
        for _o, new, why in launcher.transitions
        if new is S.BACKOFF
    )
    assert S.READY not in launcher.path()
    assert_legal(launcher)


async def test_the_backoff_starts_over_after_a_healthy_life(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "exit 1", "exit 1", "serve", "exit 1", "serve")
    backoffs = Backoffs()
    child = supervised(launcher, backoffs)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.READY)
            os.kill(launcher.served_pid(), signal.SIGKILL)  # a crash after a healthy life
            await launcher.until(lambda: child.generation == 2)
            nursery.cancel_scope.cancel()
    assert backoffs.requested == [0.5, 1.0, 0.5, 1.0]
    assert launcher.spawns == 5
    assert_legal(launcher)


async def test_a_child_that_fails_its_health_check_n_times_in_a_row_is_restarted(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "serve")
    child = supervised(launcher, Backoffs())
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.READY)
            first = launcher.served_pid()
            sick_from = len(launcher.checks)
            launcher.sicken()
            await launcher.until(lambda: launcher.entered(S.BACKOFF))
            # stop() reaped it before the child left READY.
            assert not running(first)
            await launcher.until(lambda: child.generation == 2)
            assert launcher.served_pid() != first
            nursery.cancel_scope.cancel()
    (restart,) = [i for i, (old, new, _why) in enumerate(launcher.transitions) if (old, new) == (S.READY, S.BACKOFF)]
    assert launcher.transitions[restart][2].startswith("3 health checks failed in a row")
    assert launcher.checks[sick_from : launcher.checks_at[restart]] == [False, False, False]
    assert_legal(launcher)


async def test_failed_health_checks_count_only_when_in_a_row(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "serve")
    child = supervised(launcher, Backoffs())
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.READY)
            pid = launcher.served_pid()
            sick_from = len(launcher.checks)
            launcher.sicken()
            await launcher.until(lambda: launcher.checks[sick_from:] == [False, False])
            launcher.health_file.write_text(str(pid))  # better again before the third miss
            await launcher.until(lambda: launcher.checks[-1])
            assert child.state is S.READY
            launcher.sicken()
            await launcher.until(lambda: launcher.entered(S.BACKOFF))
            nursery.cancel_scope.cancel()
    restart = launcher.path().index(S.BACKOFF) - 1
    seen = "".join("T" if ok else "F" for ok in launcher.checks[sick_from : launcher.checks_at[restart]])
    assert re.fullmatch("FFT+FFF", seen), seen
    assert_legal(launcher)


async def test_k_failures_within_the_window_mark_it_failed_and_it_is_not_started_again(
    short_dir: Path,
) -> None:
    launcher = FakeLauncher(short_dir, "exit 1")
    backoffs = Backoffs()
    restart = attrs.evolve(PATIENT_RESTART, max_failures=3)
    child = supervised(launcher, backoffs, restart=restart)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.FAILED)
            # Everything that could still happen has had its chance: the child waits for the end.
            await trio.testing.wait_all_tasks_blocked()
            assert child.state is S.FAILED
            assert launcher.spawns == 3
            nursery.cancel_scope.cancel()
    assert backoffs.requested == [0.5, 1.0]
    (why,) = [why for _old, new, why in launcher.transitions if new is S.FAILED]
    assert why.endswith("; 3 failures within 300s")
    assert launcher.path()[-3:] == [S.FAILED, S.STOPPING, S.STOPPED]
    assert_legal(launcher)


async def test_a_child_whose_output_says_no_restart_can_help_fails_at_once(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "exit 9", "serve")
    backoffs = Backoffs()
    child = supervised(launcher, backoffs, restart=PATIENT_RESTART)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.FAILED)
            await trio.testing.wait_all_tasks_blocked()
            assert (child.state, launcher.spawns) == (S.FAILED, 1)
            nursery.cancel_scope.cancel()
    assert backoffs.requested == []
    (why,) = [why for _old, new, why in launcher.transitions if new is S.FAILED]
    assert why == "status 9 is fatal; not started again"
    last_exit = child.statistics().last_exit
    assert last_exit is not None
    assert last_exit.startswith("status 9 is fatal (pid ")
    assert last_exit.endswith(" exited: exit status 9)")
    assert_legal(launcher)


@pytest.mark.parametrize(
    ("window_s", "failed_after"),
    [pytest.param(20.0, 3, id="within-window"), pytest.param(10.0, None, id="spread-wider-than-window")],
)
async def test_only_failures_within_the_window_count_towards_failed(
    short_dir: Path, mock_clock: trio.testing.MockClock, window_s: float, failed_after: int | None
) -> None:
    # Real time runs on (health polls need it); each backoff jumps the clock by 6 s, so the
    # failures are about 6 s apart: three fit in a 20 s window, never more than two in 10 s.
    mock_clock.rate = 1.0
    launcher = FakeLauncher(short_dir, "exit 1")
    restart = RestartPolicy(backoff_initial_s=6.0, backoff_max_s=6.0, max_failures=3, window_s=window_s)
    child = supervised(launcher, Backoffs(mock_clock), restart=restart)
    with trio.fail_after(200):  # clock jumps included: at most 8 x 6 s
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await launcher.until(lambda: child.state is S.FAILED or launcher.spawns >= 8)
            nursery.cancel_scope.cancel()
    if failed_after is None:
        assert S.FAILED not in launcher.path()
    else:
        assert S.FAILED in launcher.path()
        assert launcher.spawns == failed_after
    assert_legal(launcher)


async def test_a_child_not_healthy_within_start_timeout_is_stopped_and_restarted(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "hang", "serve")
    # Every life gets the same timeout; the fake child is healthy within it unless a loaded machine
    # delays its start, which costs another life, not the test.
    health = attrs.evolve(FAST_HEALTH, start_timeout_s=0.5)
    child = supervised(launcher, Backoffs(), health=health)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.READY)
            assert child.statistics().last_exit == "killed by SIGTERM"  # the first, hung life
            nursery.cancel_scope.cancel()
    assert launcher.path()[:4] == [S.STOPPED, S.STARTING, S.BACKOFF, S.STARTING]
    assert launcher.transitions[1][2].startswith("not healthy within 0.5s")
    assert_legal(launcher)


async def test_cancelling_stops_a_child_that_ignores_sigterm_with_sigkill(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "stubborn")
    health = attrs.evolve(FAST_HEALTH, stop_grace_s=0.2)
    child = supervised(launcher, Backoffs(), health=health)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.READY)
            pid = launcher.served_pid()
            nursery.cancel_scope.cancel()
    assert child.statistics().last_exit == "killed by SIGKILL"
    assert not running(pid)
    assert launcher.path()[-2:] == [S.STOPPING, S.STOPPED]


async def test_cancelling_a_child_in_backoff_stops_it_without_another_spawn(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "exit 1")
    backoffs = Backoffs(hold=True)
    child = supervised(launcher, backoffs)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.BACKOFF)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert backoffs.requested == [0.5]
    assert launcher.spawns == 1
    assert launcher.path() == [S.STOPPED, S.STARTING, S.BACKOFF, S.STOPPING, S.STOPPED]


async def test_statistics_tell_pid_restarts_generation_and_last_exit(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "exit 3", "serve")
    child = supervised(launcher, Backoffs())
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.READY)
            ready = child.statistics()
            pid = launcher.served_pid()
            nursery.cancel_scope.cancel()
    assert ready.name == "fake"
    assert ready.state == "ready"
    assert ready.pid == pid
    assert ready.restarts == 1
    assert ready.generation == 1
    assert ready.last_exit == "exit status 3"
    assert ready.transitions == 4  # stopped>starting>backoff>starting>ready
    stopped = child.statistics()
    assert (stopped.state, stopped.pid, stopped.restarts, stopped.generation) == ("stopped", None, 1, 1)
    assert stopped.last_exit == "killed by SIGTERM"
    assert stopped.transitions == 6
    assert stopped.state_since >= ready.state_since


async def test_a_program_that_cannot_be_started_counts_as_a_failed_life(short_dir: Path) -> None:
    missing = short_dir / "no-such-program"
    launcher = FakeLauncher(short_dir, "serve", program=str(missing))
    restart = attrs.evolve(PATIENT_RESTART, max_failures=2)
    child = supervised(launcher, Backoffs(), restart=restart)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.FAILED)
            nursery.cancel_scope.cancel()
    assert launcher.spawns == 2
    assert child.statistics().last_exit == f"fake: cannot start {missing}: No such file or directory"
    assert_legal(launcher)


async def test_the_last_lines_of_a_child_that_exits_are_logged_as_warnings(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Lines with no llama.cpp mark (an assertion's message) are info, below log.children's default:
    # logged at debug as they come, and again, as warnings, once the child has exited by itself.
    caplog.set_level(logging.INFO, logger="onebit.child")
    launcher = FakeLauncher(short_dir, "exit 3")
    child = supervised(launcher, Backoffs(hold=True))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.BACKOFF)
            nursery.cancel_scope.cancel()
    said = [r for r in caplog.records if r.getMessage().startswith("fake| ") or "-> backoff" in r.getMessage()]
    assert [(re.sub(r"pid \d+", "pid N", r.getMessage().split(" (")[0]), r.levelno) for r in said] == [
        ("fake| fake_child: pid N exiting with status 3", logging.WARNING),
        ("fake| fake_child: last words of pid N", logging.WARNING),
        ("fake: starting -> backoff", logging.WARNING),
    ]


async def ready_until_heard(launcher: FakeLauncher, condition: Callable[[tuple[HeardLine, ...]], bool]) -> Child:
    """Supervise until the child is ready and its recent lines meet ``condition``, then stop it."""
    child = supervised(launcher, Backoffs())
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.READY)
            # Looked at after each health check: a line is read within 0.1 s of being written.
            await launcher.until(lambda: condition(child.recent()))
            nursery.cancel_scope.cancel()
    return child


async def test_a_child_stopped_by_onebitd_says_no_last_words(short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="onebit.child")
    launcher = FakeLauncher(short_dir, "serve")
    child = await ready_until_heard(launcher, lambda heard: bool(heard))
    assert [line.line for line in child.recent()] == [f"fake_child: pid {launcher.served_pid()} healthy"]
    assert not [r for r in caplog.records if r.getMessage().startswith("fake| ")]


async def test_a_childs_recent_lines_span_its_lives_and_keep_the_last_ones(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(child_module, "RECENT_LINES", 2)
    launcher = FakeLauncher(short_dir, "exit 3", "serve")
    child = await ready_until_heard(launcher, lambda heard: bool(heard) and heard[-1].life == 1)
    recent = child.recent()
    # The first life's first line is gone: two are kept.
    assert [(re.sub(r"pid \d+", "pid N", line.line), line.life) for line in recent] == [
        ("fake_child: last words of pid N", 0),
        ("fake_child: pid N healthy", 1),
    ]
    assert recent[0].at <= recent[-1].at


async def test_what_an_exited_child_left_in_its_process_group_is_killed(short_dir: Path) -> None:
    launcher = FakeLauncher(short_dir, "orphan 1", "serve")
    child = supervised(launcher, Backoffs())
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(child.run)
                await child.wait_state(S.READY)
                # The grandchild ignores SIGTERM and has no parent-death signal: only stop()'s
                # SIGKILL of the group, sent while the exited leader was still unreaped, ends it.
                await wait_gone(grandchild(launcher.health_file))
                nursery.cancel_scope.cancel()
    finally:
        kill_grandchild(launcher.health_file)
    assert re.fullmatch(r"pid \d+ exited: exit status 1; next start in 0.5s", launcher.transitions[1][2])


async def test_an_unexpected_exit_is_a_warning_with_its_reason_and_failed_an_error(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="onebit.child")
    launcher = FakeLauncher(short_dir, "exit 3")
    restart = attrs.evolve(PATIENT_RESTART, max_failures=2)
    child = supervised(launcher, Backoffs(), restart=restart)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(child.run)
            await child.wait_state(S.FAILED)
            nursery.cancel_scope.cancel()
    levels = {r.getMessage().split(" (")[0]: r.levelno for r in caplog.records if r.name == "onebit.child"}
    assert levels["fake: starting -> backoff"] == logging.WARNING
    assert levels["fake: starting -> failed"] == logging.ERROR
    assert levels["fake: stopped -> starting"] == logging.INFO
    backoff = next(r.getMessage() for r in caplog.records if "-> backoff" in r.getMessage())
    assert "exited: exit status 3" in backoff, backoff

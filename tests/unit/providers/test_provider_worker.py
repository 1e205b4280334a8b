"""The worker provider against a real tests/fakes/fake_provider.py --worker: readiness, jobs, cancels, restarts,
pings; and its wire against an in-process worker (a socketpair end this test speaks for)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from supervisor.config import HealthPolicy, RestartPolicy, WorkerProviderConfig
from supervisor.errors import ProviderError
from supervisor.providers import Claim, PrefillJob
from supervisor.providers.base import Checked
from supervisor.providers.worker import WorkerProvider
from supervisor.supervise.child import Child, ChildState
from tests.fakes.fake_provider import PATH as FAKE_PROVIDER
from tests.rigs.helpers import reaped, wait_until
from tests.rigs.rig import Control, ProviderModes

# Starting Python a few times on two busy cores; nothing here waits for anything slower.
DEADLINE_S = 30
TOKENS = tuple(range(100, 130))


def worker_provider(*, backoff_s: float = 0.0, health: HealthPolicy | None = None) -> WorkerProvider:
    return WorkerProvider(
        WorkerProviderConfig(
            name="npu0",
            command=(sys.executable, str(FAKE_PROVIDER), "--worker"),
            health=health or HealthPolicy(start_timeout_s=DEADLINE_S, stop_grace_s=2.0),
            restart=RestartPolicy(backoff_initial_s=backoff_s),
        )
    )


@asynccontextmanager
async def running(provider: WorkerProvider, *, wait_ready: bool = True) -> AsyncIterator[WorkerProvider]:
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.run)
        if wait_ready:
            await provider.child.wait_state(ChildState.READY)
        yield provider
        nursery.cancel_scope.cancel()


def job(directory: Path, name: str = "req-1") -> PrefillJob:
    return PrefillJob(name, "fake-model", 4096, TOKENS, directory / f"{name}.state")


async def until_child(child: Child, condition: Callable[[], bool]) -> None:
    """Wait state change by state change until ``condition`` holds."""
    while not condition():
        await child.wait_state(*(s for s in ChildState if s is not child.state))


async def test_a_worker_is_not_ready_before_its_ready_line(tmp_path: Path, control: Control) -> None:
    control.set(provider=ProviderModes(ready_on_signal=True))
    provider = worker_provider()
    with trio.fail_after(DEADLINE_S):
        async with running(provider, wait_ready=False):
            await wait_until(lambda: bool(control.events("provider", "waiting")))  # running, its socket open, not ready
            assert provider.child.state is ChildState.STARTING
            assert not provider.ready
            with pytest.raises(ProviderError, match="no ready worker"):
                await provider.prefill(job(tmp_path))
            pid = provider.child.pid
            assert pid is not None
            os.kill(pid, signal.SIGUSR1)  # the fake's go-ahead for {"ready": true}
            await provider.child.wait_state(ChildState.READY)
            assert provider.ready
            assert await provider.prefill(job(tmp_path)) == Claim(30, 7.25)


async def test_a_worker_answers_each_job_with_its_claim_from_one_long_lived_process(
    tmp_path: Path, control: Control
) -> None:
    first, second = job(tmp_path, "req-1"), job(tmp_path, "req-2")
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider()) as provider:
            assert await provider.prefill(first) == Claim(n_tokens=30, prefill_ms=7.25)
            assert await provider.prefill(second) == Claim(n_tokens=30, prefill_ms=7.25)
            assert (provider.busy, provider.statistics().jobs) == (0, 2)
    assert [e["job"] for e in control.events("provider", "job")] == [first.wire(), second.wire()]
    assert len(control.events("provider", "start")) == 1
    assert json.loads(first.state_file.read_text()) == {"fake_state": True, "tokens": list(TOKENS)}


@pytest.mark.parametrize(("mode", "n_tokens"), [("short", 29), ("negative", -1)])
async def test_a_workers_wrong_count_is_returned_as_claimed_for_the_handoff_to_judge(
    tmp_path: Path, control: Control, mode: str, n_tokens: int
) -> None:
    control.set(provider=ProviderModes(mode=mode))
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider()) as provider:
            assert await provider.prefill(job(tmp_path)) == Claim(n_tokens=n_tokens, prefill_ms=7.25)


async def test_an_answer_without_an_id_is_the_one_job_in_flights_and_claims_nothing(
    tmp_path: Path, control: Control
) -> None:
    control.set(provider=ProviderModes(mode="garbage"))
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider()) as provider:
            assert await provider.prefill(job(tmp_path)) == Claim()


async def test_an_error_answer_fails_the_job_and_the_worker_takes_the_next(tmp_path: Path, control: Control) -> None:
    control.set(provider=ProviderModes(mode=["fail", "ok"]))
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider()) as provider:
            with pytest.raises(ProviderError, match="job req-1: fake provider: told to fail"):
                await provider.prefill(job(tmp_path, "req-1"))
            assert provider.ready
            assert await provider.prefill(job(tmp_path, "req-2")) == Claim(30, 7.25)
            assert provider.statistics().failures == 1


async def test_a_cancelled_job_is_told_to_the_worker_which_stays_ready_for_the_next(
    tmp_path: Path, control: Control
) -> None:
    control.set(provider=ProviderModes(mode=["hang", "ok"]))
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider()) as provider:
            pid = provider.child.pid
            async with trio.open_nursery() as nursery:
                nursery.start_soon(provider.prefill, job(tmp_path, "req-1"))
                await wait_until(lambda: bool(control.events("provider", "job")))
                assert provider.busy == 1
                nursery.cancel_scope.cancel()
            assert provider.ready
            # The worker reads its socket in order: the cancel was read before this job was.
            assert await provider.prefill(job(tmp_path, "req-2")) == Claim(30, 7.25)
            assert (provider.child.pid, provider.child.statistics().restarts) == (pid, 0)
            assert (provider.busy, provider.statistics().failures) == (0, 0)
    assert [
        (e["event"], e.get("id") or e["job"]["id"])
        for e in control.events("provider")
        if e["event"] in ("job", "cancel")
    ] == [
        ("job", "req-1"),
        ("cancel", "req-1"),
        ("job", "req-2"),
    ]


async def test_a_worker_that_dies_fails_its_job_and_is_restarted_by_its_child(tmp_path: Path, control: Control) -> None:
    control.set(provider=ProviderModes(mode=["crash", "ok"]))
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider()) as provider:
            with pytest.raises(ProviderError, match="job req-1"):
                await provider.prefill(job(tmp_path, "req-1"))
            child = provider.child
            await until_child(child, lambda: child.state is ChildState.READY and child.statistics().restarts == 1)
            assert provider.ready
            assert await provider.prefill(job(tmp_path, "req-2")) == Claim(30, 7.25)
    first, second = control.events("provider", "job")
    assert first["pid"] != second["pid"]
    assert [e["pid"] for e in control.events("provider", "start")] == [first["pid"], second["pid"]]


async def test_a_worker_that_dies_fails_its_job_at_once_not_at_its_restart(tmp_path: Path, control: Control) -> None:
    control.set(provider=ProviderModes(mode="crash"))
    # A restart this far off is never reached: only the closed socket can fail the job in time.
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider(backoff_s=DEADLINE_S * 10)) as provider:
            with pytest.raises(ProviderError, match="closed its socket"):
                await provider.prefill(job(tmp_path))
            await provider.child.wait_state(ChildState.BACKOFF)
            assert not provider.ready
            assert provider.child.statistics().restarts == 0


# -- pings ------------------------------------------------------------------------------------------


async def test_a_stopped_worker_that_answers_pings_is_killed_and_restarted(tmp_path: Path, control: Control) -> None:
    # A ping every 50 ms, two missed pongs of 1 s each, then stopped: well inside DEADLINE_S.
    health = HealthPolicy(interval_s=0.05, timeout_s=1.0, failures=2, start_timeout_s=DEADLINE_S, stop_grace_s=0.5)
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider(health=health)) as provider:
            child = provider.child
            stopped = child.pid
            assert stopped is not None
            os.kill(stopped, signal.SIGSTOP)  # its socket stays open: only a missed pong tells
            try:
                await until_child(child, lambda: child.state is ChildState.READY and child.statistics().restarts == 1)
            finally:
                if not reaped(stopped):
                    os.kill(stopped, signal.SIGCONT)
            restarted = child.pid
            assert restarted not in (None, stopped)
            assert (child.statistics().last_exit or "").startswith("killed by")
            assert await provider.prefill(job(tmp_path)) == Claim(30, 7.25)
    assert [e["pid"] for e in control.events("provider", "start")] == [stopped, restarted]


async def test_a_worker_that_does_not_say_ping_is_never_pinged(
    tmp_path: Path, control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    control.set(provider=ProviderModes(ping=False))
    provider = worker_provider(health=HealthPolicy(interval_s=0.01, failures=1, start_timeout_s=DEADLINE_S))
    healthy, passed, enough = provider.launcher.healthy, 0, trio.Event()

    async def counted() -> bool:
        nonlocal passed
        if ok := await healthy():
            passed += 1
            if passed == 10:
                enough.set()
        return ok

    monkeypatch.setattr(provider.launcher, "healthy", counted)
    with trio.fail_after(DEADLINE_S):
        async with running(provider):
            await enough.wait()
            # The worker reads its socket in order: answering this job, it had read every line before it.
            assert await provider.prefill(job(tmp_path)) == Claim(30, 7.25)
            assert provider.child.statistics().restarts == 0
    assert [e["event"] for e in control.events("provider")] == ["start", "job"]


async def test_a_worker_answering_pings_while_it_runs_a_job_stays_healthy(tmp_path: Path, control: Control) -> None:
    control.set(provider=ProviderModes(mode="hold"))
    # One missed pong would restart it: pings answered during the job are what keep its pid.
    health = HealthPolicy(interval_s=0.01, timeout_s=5.0, failures=1, start_timeout_s=DEADLINE_S)
    claims: list[Claim] = []
    with trio.fail_after(DEADLINE_S):
        async with running(worker_provider(health=health)) as provider:
            pid = provider.child.pid

            def pings() -> int:
                return sum(e["pid"] == pid for e in control.events("provider", "ping"))

            async with trio.open_nursery() as nursery:

                async def prefill() -> None:
                    claims.append(await provider.prefill(job(tmp_path)))

                nursery.start_soon(prefill)
                await wait_until(lambda: bool(control.events("provider", "holding")))
                before = pings()
                # A ping goes out once the one before it was answered: three read, two answered mid-job.
                await wait_until(lambda: pings() >= before + 3)
                assert not claims
                assert (provider.child.state, provider.child.pid) == (ChildState.READY, pid)
                assert pid is not None
                os.kill(pid, signal.SIGUSR1)  # the fake's go-ahead to answer the job
            assert claims == [Claim(30, 7.25)]
            assert provider.child.statistics().restarts == 0


class InProcessWorker:
    """The worker's end of a life's socketpair, spoken by the test itself."""

    def __init__(self, sock: socket.socket) -> None:
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self.buffer = b""

    async def send(self, data: dict[str, Any]) -> None:
        await self.stream.send_all(json.dumps(data).encode() + b"\n")

    async def receive(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some(65536)
            assert chunk, "onebitd closed the socket"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        found: dict[str, Any] = json.loads(line)
        return found


@asynccontextmanager
async def in_process_life(provider: WorkerProvider) -> AsyncIterator[InProcessWorker]:
    """One life of ``provider`` without a process: its reader on our end, the worker's end yielded."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    provider._begin_life(ours)
    life = provider._life
    assert life is not None
    worker = InProcessWorker(theirs)
    async with worker.stream, trio.open_nursery() as nursery:
        nursery.start_soon(provider._read, life)
        await worker.send({"ready": True, "ping": True})
        await trio.testing.wait_all_tasks_blocked()
        assert life.ready
        yield worker
        nursery.cancel_scope.cancel()


async def test_a_pong_is_not_taken_for_the_answer_of_the_one_job_in_flight(tmp_path: Path) -> None:
    provider = worker_provider()
    claims: list[Claim] = []
    health: list[bool] = []
    with trio.fail_after(DEADLINE_S):
        async with in_process_life(provider) as worker, trio.open_nursery() as nursery:

            async def prefill() -> None:
                claims.append(await provider.prefill(job(tmp_path)))

            async def check() -> None:
                health.append(await provider.launcher.healthy())

            nursery.start_soon(prefill)
            assert (await worker.receive())["id"] == "req-1"
            nursery.start_soon(check)
            assert await worker.receive() == {"ping": "1"}
            await worker.send({"pong": "1"})  # no id, one job in flight: still not that job's answer
            await trio.testing.wait_all_tasks_blocked()
            assert (health, claims) == ([True], [])
            await worker.send({"id": "req-1", "n_tokens": 30, "prefill_ms": 1.5})
    assert claims == [Claim(30, 1.5)]


async def test_a_pong_for_an_earlier_ping_does_not_answer_the_current_one() -> None:
    provider = worker_provider()
    health: list[bool] = []
    scopes: list[trio.CancelScope] = []
    with trio.fail_after(DEADLINE_S):
        async with in_process_life(provider) as worker, trio.open_nursery() as nursery:

            async def check() -> None:
                with trio.CancelScope() as scope:
                    scopes.append(scope)
                    health.append(await provider.launcher.healthy())
                    return
                health.append(False)  # cancelled, as the Child's health.timeout_s cancels a check

            nursery.start_soon(check)
            assert await worker.receive() == {"ping": "1"}
            scopes[0].cancel()  # no pong in time
            await trio.testing.wait_all_tasks_blocked()
            assert health == [False]
            nursery.start_soon(check)
            assert await worker.receive() == {"ping": "2"}
            await worker.send({"pong": "1"})
            await trio.testing.wait_all_tasks_blocked()
            assert health == [False]
            await worker.send({"pong": "2"})
            await trio.testing.wait_all_tasks_blocked()
            assert health == [False, True]


# -- the start-time check: a worker's state is measured before its first job --------------------------


def gated_worker(gate: Callable[[Any], Any]) -> WorkerProvider:
    provider = worker_provider()
    return WorkerProvider(provider.spec, gate=gate)


async def test_a_worker_the_fidelity_check_admits_takes_jobs_only_after_the_verdict(
    tmp_path: Path, control: Control
) -> None:
    asked = trio.Event()
    verdict_given = trio.Event()
    seen: list[WorkerProvider] = []

    async def gate(provider: WorkerProvider) -> Checked:
        seen.append(provider)
        assert provider.child.state is ChildState.READY  # measured once healthy
        asked.set()
        await verdict_given.wait()
        return Checked()

    provider = gated_worker(gate)
    with trio.fail_after(DEADLINE_S):
        async with running(provider):
            await asked.wait()
            assert not provider.ready  # healthy, not yet admitted: no job
            settled = False

            async def settle() -> None:
                nonlocal settled
                await provider.wait_settled()
                settled = True

            async with trio.open_nursery() as nursery:
                nursery.start_soon(settle)
                await trio.testing.wait_all_tasks_blocked()
                assert not settled  # the daemon's readiness waits for the verdict
                verdict_given.set()
            assert provider.ready
            claim = await provider.prefill(job(tmp_path))
    assert seen == [provider]
    assert claim.n_tokens == len(TOKENS)
    assert provider.statistics().refused is None


async def test_a_worker_the_fidelity_check_refuses_is_stopped_and_takes_no_job(
    tmp_path: Path, control: Control, caplog: pytest.LogCaptureFixture
) -> None:
    async def gate(provider: WorkerProvider) -> Checked:
        return Checked(refused="next-token TV distance over 6 prompts: ...: over the bound")

    provider = gated_worker(gate)
    with trio.fail_after(DEADLINE_S):
        async with running(provider, wait_ready=False):
            await provider.wait_settled()
            pid = provider.child.pid
            await until_child(provider.child, lambda: provider.child.state is ChildState.STOPPED)
            with pytest.raises(ProviderError, match="no ready worker"):
                await provider.prefill(job(tmp_path))
            stats = provider.statistics()
    assert not provider.ready
    assert stats.refused == "next-token TV distance over 6 prompts: ...: over the bound"
    assert pid is None or reaped(pid)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"provider npu0: refused for this model, the other providers go on: {stats.refused}"]

"""The worker provider against a real tests/fake_provider.py --worker: readiness, jobs, cancels, restarts."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from supervisor.child import Child, ChildState
from supervisor.config import HealthPolicy, RestartPolicy
from supervisor.config import WorkerProvider as WorkerProviderConfig
from supervisor.errors import ProviderError
from supervisor.providers import Claim, PrefillJob
from supervisor.providers.worker import WorkerProvider

from .fake_provider import PATH as FAKE_PROVIDER
from .helpers import wait_until
from .rig import Control, ProviderModes

# Starting Python a few times on two busy cores; nothing here waits for anything slower.
DEADLINE_S = 30
TOKENS = tuple(range(100, 130))


def worker_provider(*, backoff_s: float = 0.0) -> WorkerProvider:
    return WorkerProvider(
        WorkerProviderConfig(
            name="npu0",
            command=(sys.executable, str(FAKE_PROVIDER), "--worker"),
            health=HealthPolicy(start_timeout_s=DEADLINE_S, stop_grace_s=2.0),
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
        (e["event"], e.get("id") or e["job"]["id"]) for e in control.events("provider") if e["event"] != "start"
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

"""The exec provider against real processes of tests/fakes/fake_provider.py: the job, the claim, failures, kills."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from supervisor.config import ExecProviderConfig
from supervisor.errors import ProviderError
from supervisor.providers import Claim, PrefillJob, base, parse_claim
from supervisor.providers.base import Checked
from supervisor.providers.exec import ExecProvider
from tests.fakes.fake_provider import PATH as FAKE_PROVIDER
from tests.rigs.helpers import gone, reaped, wait_until
from tests.rigs.rig import Control, ProviderModes

# Starting Python a few times on two busy cores; nothing here waits for anything slower.
DEADLINE_S = 30
TOKENS = tuple(range(100, 130))


def exec_provider(*command: str) -> ExecProvider:
    return ExecProvider(ExecProviderConfig(name="npu0", command=command or (sys.executable, str(FAKE_PROVIDER))))


def job_in(directory: Path) -> PrefillJob:
    return PrefillJob("req-1", "fake-model", 4096, TOKENS, directory / "req-1.state")


@pytest.mark.parametrize(
    ("line", "claim"),
    [
        ('{"n_tokens": 30, "prefill_ms": 12.5}', Claim(30, 12.5)),
        ('{"n_tokens": 30, "prefill_ms": 12}', Claim(30, 12.0)),
        ('{"n_tokens": 30}', Claim(30, None)),
        ('{"n_tokens": -1, "prefill_ms": 1}', Claim(-1, 1.0)),
        ('{"n_tokens": true, "prefill_ms": false}', Claim()),
        ('{"n_tokens": "30", "prefill_ms": "12"}', Claim()),
        ("[30, 12.5]", Claim()),
        ("prefilled 30 tokens", Claim()),
        ("", Claim()),
    ],
)
def test_a_claim_line_is_parsed_and_anything_it_does_not_say_is_none(line: str, claim: Claim) -> None:
    assert parse_claim(line) == claim


@pytest.mark.parametrize(
    ("line", "state_rows"),
    [
        ('{"n_tokens": 30, "state_rows": 4}', 4),
        ('{"n_tokens": 30, "state_rows": 0}', 0),
        ('{"n_tokens": 30}', None),
        ('{"n_tokens": 30, "state_rows": "4"}', None),
        ('{"n_tokens": 30, "state_rows": true}', None),
        ('{"n_tokens": 30, "state_rows": 4.0}', None),
    ],
    ids=["four", "zero", "unsaid", "string", "bool", "float"],
)
def test_a_claims_state_rows_are_an_integer_or_unsaid(line: str, state_rows: int | None) -> None:
    # A hybrid's share is adopted only when its claim names every recurrent state row it wrote.
    assert parse_claim(line) == Claim(30, state_rows=state_rows)


async def test_the_job_goes_to_stdin_and_the_last_stdout_line_is_the_claim(tmp_path: Path, control: Control) -> None:
    job = job_in(tmp_path)
    with trio.fail_after(DEADLINE_S):
        claim = await exec_provider().prefill(job)
    # The fake prints a decoy {"n_tokens": 0} line first and logs on stderr after its claim.
    assert claim == Claim(n_tokens=30, prefill_ms=7.25)
    [received] = control.events("provider", "job")
    assert received["job"] == job.wire()
    assert received["job"]["route"] == "file"
    assert json.loads(job.state_file.read_text()) == {"fake_state": True, "tokens": list(TOKENS)}


async def test_a_provider_process_is_reaped_when_its_job_is_done(tmp_path: Path, control: Control) -> None:
    provider = exec_provider()
    with trio.fail_after(DEADLINE_S):
        await provider.prefill(job_in(tmp_path))
    [start] = control.events("provider", "start")
    assert reaped(start["pid"])
    assert (provider.busy, provider.statistics().jobs, provider.statistics().failures) == (0, 1, 0)


@pytest.mark.parametrize(("mode", "n_tokens"), [("short", 29), ("negative", -1)])
async def test_a_wrong_count_is_returned_as_claimed_for_the_handoff_to_judge(
    tmp_path: Path, control: Control, mode: str, n_tokens: int
) -> None:
    control.set(provider=ProviderModes(mode=mode))
    with trio.fail_after(DEADLINE_S):
        claim = await exec_provider().prefill(job_in(tmp_path))
    assert claim == Claim(n_tokens=n_tokens, prefill_ms=7.25)


async def test_a_last_line_that_is_not_json_claims_nothing_and_is_not_an_error(
    tmp_path: Path, control: Control
) -> None:
    control.set(provider=ProviderModes(mode="garbage"))
    job = job_in(tmp_path)
    with trio.fail_after(DEADLINE_S):
        claim = await exec_provider().prefill(job)
    assert claim == Claim()
    assert job.state_file.is_file()


async def test_a_non_zero_exit_is_a_provider_error(tmp_path: Path, control: Control) -> None:
    control.set(provider=ProviderModes(mode="fail"))
    provider = exec_provider()
    with trio.fail_after(DEADLINE_S), pytest.raises(ProviderError, match="job req-1: exit status 3"):
        await provider.prefill(job_in(tmp_path))
    assert (provider.busy, provider.statistics().failures) == (0, 1)


async def test_a_provider_that_crashes_after_writing_is_a_provider_error(tmp_path: Path, control: Control) -> None:
    control.set(provider=ProviderModes(mode="crash"))
    job = job_in(tmp_path)
    with trio.fail_after(DEADLINE_S), pytest.raises(ProviderError, match="killed by SIGKILL"):
        await exec_provider().prefill(job)
    assert job.state_file.is_file()  # written: the exit status, not the file, says it failed


async def test_a_program_that_cannot_start_is_a_provider_error(tmp_path: Path) -> None:
    provider = exec_provider(str(tmp_path / "no-such-provider"))
    with trio.fail_after(DEADLINE_S), pytest.raises(ProviderError, match="cannot start"):
        await provider.prefill(job_in(tmp_path))
    assert provider.statistics().failures == 1


async def test_cancelling_a_job_kills_the_providers_whole_process_group(tmp_path: Path, control: Control) -> None:
    control.set(provider=ProviderModes(mode="hang"))
    provider = exec_provider()
    # The control fixture ends a grandchild that outlived a failing test.
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(provider.prefill, job_in(tmp_path))
            await wait_until(control.pidfile.exists)  # written once its grandchild runs
            assert provider.busy == 1
            nursery.cancel_scope.cancel()
        [start] = control.events("provider", "start")
        assert reaped(start["pid"])  # killed and reaped
        grandchild = int(control.pidfile.read_text())
        # Not our child: its new parent reaps it, so wait for it to be gone (or a zombie).
        await wait_until(lambda: gone(grandchild))
    assert (provider.busy, provider.statistics().failures) == (0, 0)


# -- the start-time check: a program's state is measured before its first job --------------------------


async def run_gated(gate: Any) -> ExecProvider:
    """An exec provider run with ``gate`` until its first start is over (its verdict)."""
    spec = ExecProviderConfig(name="npu0", command=(sys.executable, str(FAKE_PROVIDER)))
    provider = ExecProvider(spec, gate=gate)
    assert not provider.ready  # before its verdict: no job is sent to it
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.run)
        await provider.wait_settled()
        nursery.cancel_scope.cancel()
    return provider


async def test_an_exec_program_the_fidelity_check_admits_is_ready_and_says_what_admitted_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    measured: list[ExecProvider] = []
    words = "next-token TV distance over 6 prompts: handoff mean 0.0100"

    async def gate(provider: ExecProvider) -> Checked:
        measured.append(provider)
        return Checked(admitted=words)

    with trio.fail_after(DEADLINE_S):
        provider = await run_gated(gate)
    assert measured == [provider]
    assert provider.ready
    assert (provider.statistics().refused, provider.statistics().admitted) == (None, words)
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []


async def test_an_exec_program_the_fidelity_check_refuses_is_never_ready(caplog: pytest.LogCaptureFixture) -> None:
    async def gate(provider: ExecProvider) -> Checked:
        return Checked(refused="the decoder refused its state: a state file of another model")

    with trio.fail_after(DEADLINE_S):
        provider = await run_gated(gate)
    stats = provider.statistics()
    assert (provider.ready, stats.ready, stats.refused) == (
        False,
        False,
        "the decoder refused its state: a state file of another model",
    )
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"provider npu0: refused for this model, the other providers go on: {stats.refused}"]


async def test_a_check_that_could_not_finish_is_run_again(autojump_clock: trio.testing.MockClock) -> None:
    tries: list[float] = []

    async def gate(provider: ExecProvider) -> Checked:
        tries.append(trio.current_time())
        if len(tries) == 1:
            raise ProviderError("fidelity: the decoder went away")
        return Checked()

    with trio.fail_after(DEADLINE_S):
        provider = await run_gated(gate)
    assert provider.ready
    assert len(tries) == 2
    assert tries[1] - tries[0] >= base.GATE_RETRY_S

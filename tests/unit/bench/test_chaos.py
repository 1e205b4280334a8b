"""scripts/chaos's short form, one test per scenario: each guarantee of docs/reliability.md fails its
own test when it breaks.  Each runs ``python -m chaos --quick --only NAME`` as a process of its own
(it starts, faults and reaps its own onebitd, llama-servers and providers; run_process reaps it), and
its report is the failure message; a scenario that cannot run here (its line says ``skip``) skips
its test with the reason.  Two tests without the real parts hold the report to that: a scenario
that cannot run is no ``ok``, nor is one that sent nothing."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest
import trio

from chaos import cli
from chaos.resources import disk_full
from chaos.rig import Run, Skipped
from chaos.traffic import Tally
from tests.rigs.rig import real_llama_server

ROOT = Path(__file__).parents[3]
# A scenario's own time limit, and ours a little beyond it: a loaded 2-core machine runs the real
# model at a fraction of its speed.
LIMIT_S = 420

SCENARIOS = [
    "decoder-hang",
    "decoder-kill",
    "provider-llama-server",
    "provider-exec",
    "provider-worker",
    "disk-full",
    "hang-ups",
    "slow-readers",
    "burst",
    "cancelled-prefill",
    "soak",
    "fuzz",
]


@pytest.mark.real
@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_chaos_scenario_loses_nothing_and_leaves_nothing_behind(scenario: str) -> None:
    real_llama_server()
    with trio.fail_after(LIMIT_S + 60):
        result = await trio.run_process(
            [sys.executable, "-m", "chaos", "--quick", "--only", scenario, "--time-limit", str(LIMIT_S)],
            cwd=ROOT,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()[-3000:]
    name, verdict, *_ = out.split()
    assert name == scenario, out
    if verdict == "skip":
        pytest.skip(out.splitlines()[1].strip())
    assert verdict == "ok", out


async def report_of(scenario: object, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """scripts/chaos's exit status and report of one scenario, run as its command line runs it."""
    args = argparse.Namespace(quick=True, only=["stand-in"], time_limit=10.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(cli.SCENARIOS, "stand-in", scenario)
        status = await cli.main_async(args)
    lines = capsys.readouterr().out.splitlines()
    return [str(status), *lines]


async def test_a_scenario_that_cannot_run_here_says_skip_and_why_not_ok(capsys: pytest.CaptureFixture[str]) -> None:

    async def cannot_mount(run: object, tally: object) -> None:
        await trio.lowlevel.checkpoint()
        raise Skipped("cannot mount a tmpfs (needs root and CAP_SYS_ADMIN): permission denied")

    status, line, *rest = await report_of(cannot_mount, capsys)
    assert line.split()[:4] == ["stand-in", "skip", "sent", "0"]
    assert rest == ["    skipped: cannot mount a tmpfs (needs root and CAP_SYS_ADMIN): permission denied"]
    assert status == "0"  # a skip is no failure


async def test_a_scenario_that_sent_no_request_fails(capsys: pytest.CaptureFixture[str]) -> None:

    async def does_nothing(run: object, tally: object) -> None:
        await trio.lowlevel.checkpoint()

    status, line, *rest = await report_of(does_nothing, capsys)
    assert line.split()[:4] == ["stand-in", "FAIL", "sent", "0"]
    assert rest == ["    failed: the scenario sent no request"]
    assert status == "1"


async def test_disk_full_where_mount_is_refused_skips_in_the_refusals_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing = tmp_path / "bin"
    refusing.mkdir()
    (refusing / "mount").write_text("#!/bin/sh\necho 'mount: only root can use \"--types\" option' >&2\nexit 1\n")
    (refusing / "mount").chmod(0o755)
    monkeypatch.setenv("PATH", f"{refusing}:{os.environ['PATH']}")
    tally = Tally()
    with trio.fail_after(10), pytest.raises(Skipped) as skipped:
        await disk_full(Run(True, tmp_path), tally)
    assert str(skipped.value) == (
        'cannot mount a tmpfs (needs root and CAP_SYS_ADMIN): mount: only root can use "--types" option'
    )
    assert tally.sent == 0

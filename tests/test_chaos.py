"""scripts/chaos's short form, one test per scenario: each guarantee of docs/reliability.md fails its
own test when it breaks.  Each runs ``scripts/chaos.py --quick --only NAME`` as a process of its own
(it starts, faults and reaps its own onebitd, llama-servers and providers; run_process reaps it), and
its report is the failure message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from .rig import real_llama_server

pytestmark = pytest.mark.real

CHAOS = Path(__file__).parent.parent / "scripts" / "chaos.py"
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


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_chaos_scenario_loses_nothing_and_leaves_nothing_behind(scenario: str) -> None:
    real_llama_server()
    with trio.fail_after(LIMIT_S + 60):
        result = await trio.run_process(
            [sys.executable, str(CHAOS), "--quick", "--only", scenario, "--time-limit", str(LIMIT_S)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()[-3000:]
    assert out.startswith(f"{scenario} "), out
    assert " ok " in out.splitlines()[0], out

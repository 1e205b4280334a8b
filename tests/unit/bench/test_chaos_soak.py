"""scripts/soak (chaos/soak.py): the boundedness judgement, held to what it must tell apart,
and the soak's short form on the real parts."""

from __future__ import annotations

import csv
import importlib
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.rigs.rig import real_llama_server

ROOT = Path(__file__).parents[3]
SOAK_MODULE: Any = importlib.import_module("chaos.soak")
MINUTES = [60.0 * i for i in range(121)]  # two hours sampled each minute


def noise(seed: int, scale: float) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(-scale, scale) for _ in MINUTES]


@pytest.mark.parametrize("seed", range(5))
def test_a_series_that_keeps_growing_is_unbounded(seed: int) -> None:
    # 10 MiB an hour over ~300 MiB, with 2 MiB of noise: what a slow leak looks like.
    values = [300 + t / 360 + e for t, e in zip(MINUTES, noise(seed, 2.0), strict=True)]
    verdict = SOAK_MODULE.judge(MINUTES, values, 4.0)
    assert not verdict.bounded, verdict
    assert verdict.growth > verdict.spread


@pytest.mark.parametrize("seed", range(5))
def test_a_flat_series_with_noise_is_bounded(seed: int) -> None:
    values = [300 + e for e in noise(seed, 5.0)]
    assert SOAK_MODULE.judge(MINUTES, values, 4.0).bounded


def test_a_series_that_grows_in_the_warm_up_then_holds_is_bounded() -> None:
    # The store filling to its budget in the first quarter, then evicting as it stores: a sawtooth.
    values = [min(t / 30, 128) if t < 1800 else 128 - (i % 5) * 9 for i, t in enumerate(MINUTES)]
    assert SOAK_MODULE.judge(MINUTES, values, 1.0).bounded


def test_a_lone_spike_is_no_growth_but_a_step_up_late_is() -> None:
    spike = [20.0] * len(MINUTES)
    spike[-1] = 30.0
    assert SOAK_MODULE.judge(MINUTES, spike, 4.0).bounded
    step = [20.0 if t < 5400 else 30.0 for t in MINUTES]
    assert not SOAK_MODULE.judge(MINUTES, step, 4.0).bounded


def test_a_change_within_the_measures_resolution_is_bounded() -> None:
    # fds 20, then 22 for the last half hour: two pooled connections, within the floor of 4.
    values = [20.0 if t < 5400 else 22.0 for t in MINUTES]
    assert SOAK_MODULE.judge(MINUTES, values, 4.0).bounded


def figure(line: str, name: str) -> str:
    """The number after ``name`` in a line of the soak's report (``correct 42  lost 0``)."""
    found = re.search(rf"\b{name} (\d+)", line)
    assert found is not None, line
    return found[1]


@pytest.mark.real
async def test_the_quick_soak_samples_serves_survives_its_kills_and_draws(tmp_path: Path) -> None:
    real_llama_server()
    with trio.fail_after(600):
        result = await trio.run_process(
            [sys.executable, "-m", "chaos.soak", "--quick", "--out", str(tmp_path)],
            cwd=ROOT,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    report = out + result.stderr.decode()[-3000:]
    lines = out.splitlines()
    # Three minutes are too short to judge a trend: the verdicts are printed, not held to.
    for series in SOAK_MODULE.SERIES:
        assert any(line.split()[:1] == [series.name] for line in lines), report
    tally = next(line for line in lines if line.startswith("requests sent"))
    assert int(figure(tally, "correct")) > 10, report
    assert figure(tally, "lost") == figure(tally, "bad") == "0", report
    kills = next(line for line in lines if line.startswith("decoder kills"))
    assert int(figure(kills, "kills")) >= 1, report
    assert "none" not in kills, report  # each kill's restart was seen
    assert not [line for line in lines if line.strip().startswith("failed:")], report
    with (tmp_path / "samples.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) >= 10, report
    assert int(rows[-1]["swaps"]) >= 2, report
    assert (tmp_path / "samples.png").read_bytes().startswith(b"\x89PNG"), report

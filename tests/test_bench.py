"""scripts/bench.py runs end to end in quick mode: it measures, prints its ratios, and exits 0.

Speed is not checked: a quick run's figures are noise.  What is checked is that the benchmark can
still start onebitd, talk to both sides, and report, so docs/benchmarks.md can be rerun.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import trio

from .rig import real_llama_server

BENCH = Path(__file__).parent.parent / "scripts" / "bench.py"
NUMBER = r"[-+]?\d+\.\d+"


@pytest.mark.real
async def test_the_overhead_benchmark_in_quick_mode_exits_0_and_prints_its_ratios() -> None:
    real_llama_server()
    # The benchmark starts (and reaps) its own onebitd and llama-server; run_process reaps it.  A
    # quick run takes ~15 s on an idle machine; the bound is for a loaded one.
    with trio.fail_after(300):
        result = await trio.run_process(
            [sys.executable, str(BENCH), "overhead", "--quick"], capture_stdout=True, capture_stderr=True, check=False
        )
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    for measure in ("(a) latency median, ms", "(a) latency p99, ms", "(b) aggregate tokens/s"):
        # measure, direct, onebitd, onebitd/direct
        row = rf"^{re.escape(measure)}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$"
        assert re.search(row, out, re.MULTILINE), f"no {measure!r} row in:\n{out}"
    assert re.search(rf"^added at the median: {NUMBER} ms", out, re.MULTILINE), out
    assert re.search(rf"^token rate: {NUMBER}x direct", out, re.MULTILINE), out
    assert re.search(rf"^first token median: {NUMBER}x direct", out, re.MULTILINE), out
    # onebitd's CPU, not only its time: a regression shows even on a machine with cores to spare.
    cpu = rf"^onebitd cpu: {NUMBER} s per 1000 requests\s+{NUMBER} s per 1000 relayed chunks \((\d+) chunks\)$"
    found = re.search(cpu, out, re.MULTILINE)
    assert found, out
    assert int(found.group(1)) > 0, out
    # onebitd ran in a process of its own, as in service; the benchmark stopped and reaped it.
    rss = rf"^rss, the onebitd process \(pid (\d+)\): ({NUMBER}) MiB before, ({NUMBER}) MiB after$"
    found = re.search(rss, out, re.MULTILINE)
    assert found, out
    assert float(found.group(2)) > 0, out
    assert float(found.group(3)) > 0, out
    gone = not await trio.Path(f"/proc/{found.group(1)}").exists()
    assert gone, f"onebitd (pid {found.group(1)}) outlived the benchmark"


@pytest.mark.real
async def test_the_prefix_benchmark_in_quick_mode_exits_0_and_prints_its_ratios() -> None:
    real_llama_server()
    with trio.fail_after(300):
        result = await trio.run_process(
            [sys.executable, str(BENCH), "prefix", "--quick"], capture_stdout=True, capture_stderr=True, check=False
        )
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert re.search(rf"^first after the crash, \(b\)/\(a\): {NUMBER}x", out, re.MULTILINE), out
    assert re.search(rf"^\(a\) store\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+[1-9]", out, re.MULTILINE), out


@pytest.mark.real
async def test_the_models_benchmark_in_quick_mode_exits_0_and_leaves_nothing() -> None:
    real_llama_server()
    with trio.fail_after(600):
        result = await trio.run_process(
            [sys.executable, str(BENCH), "models", "--quick"], capture_stdout=True, capture_stderr=True, check=False
        )
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert re.search(rf"^\(a\) swap-back / warm, medians: {NUMBER}x; without load_ms {NUMBER}x", out, re.MULTILINE), out
    assert out.count("left after the stop: files none, children none") == 2, out


@pytest.mark.real
async def test_the_versus_benchmark_in_quick_mode_exits_0_and_prints_both_trees() -> None:
    real_llama_server()
    # This tree against itself: what is checked is that both onebitds start, alternate and report.
    with trio.fail_after(300):
        result = await trio.run_process(
            [sys.executable, str(BENCH), "versus", "--quick", "--tree", str(BENCH.parent.parent)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    for measure in ("(a) latency median, ms", "(a) onebitd cpu per request, ms", "(b) onebitd cpu per chunk, us"):
        row = rf"^{re.escape(measure)}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$"
        assert re.search(row, out, re.MULTILINE), f"no {measure!r} row in:\n{out}"
    found = re.search(r"^\(b\) chunks relayed: this tree (\d+), other tree (\d+)$", out, re.MULTILINE)
    assert found, out
    assert int(found.group(1)) > 0, out
    assert int(found.group(2)) > 0, out


@pytest.mark.real
async def test_the_agent_benchmark_in_quick_mode_exits_0_and_prints_its_ratios() -> None:
    real_llama_server()
    # Five sides, two SDKs, three turns each: about two minutes on a busy 2-core machine.
    with trio.fail_after(600):
        result = await trio.run_process(
            [sys.executable, str(BENCH), "agent", "--quick"], capture_stdout=True, capture_stderr=True, check=False
        )
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    for client in ("anthropic", "responses"):
        assert re.search(rf"^{client}:$", out, re.MULTILINE), out
    assert len(re.findall(rf"^turns 2-3, summed: plain/direct {NUMBER}x, hybrid/direct {NUMBER}x", out, re.M)) == 2
    assert len(re.findall(rf"^after the restart, turn 1: direct' cold / onebitd {NUMBER}x", out, re.M)) == 2
    # Routed: every turn through onebitd has its slot and its cached tokens in its route line.
    assert (
        len(re.findall(r"^ +plain slot:route:cached/prompt tokens per turn( +\d+:plain:\d+/\d+){3}$", out, re.M)) == 2
    )
    assert (
        len(re.findall(r"^ +at-once slot:route:cached/prompt tokens per turn( +\d+:plain:\d+/\d+){3}$", out, re.M)) == 2
    )
    kept = rf"^plain's slot kept after the reply \(the save for the prefix store\), turns 2-3: median {NUMBER} ms"
    assert len(re.findall(kept, out, re.M)) == 2, out

"""scripts/bench (python -m bench) runs end to end in quick mode: it measures, prints its ratios, draws its
figures (``--plot``), and exits 0.

Speed is not checked: a quick run's figures are noise.  What is checked is that the benchmark can
still start onebitd, talk to both sides, and report, so docs/benchmarks.md can be rerun; and that
its picture parses as SVG and names the routes and sides it measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

import bench.cli
from bench import agent, hosts, rig, routes
from bench.routes import Block, paired
from tests.rigs.rig import openvino_llama_server, real_llama_server
from tests.unit.bench.test_bench_plot import svg_texts

ROOT = Path(__file__).parents[3]
NUMBER = r"[-+]?\d+\.\d+"


def test_every_subcommand_has_a_quick_form_and_a_test_here_that_runs_it() -> None:
    subcommands = {command.name for command in bench_subcommands()}
    tested = set(re.findall(r'quick_run\(\s*"([a-z]+)", "--quick"', Path(__file__).read_text()))
    assert tested == subcommands


def test_every_python_package_is_in_mypys_file_list() -> None:
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages - set(files) == set()


def bench_subcommands() -> list[Any]:
    """bench's SUBCOMMANDS, each with a ``--quick`` in its arguments."""
    commands: list[Any] = bench.cli.SUBCOMMANDS
    for command in commands:
        parser = argparse.ArgumentParser()
        command.arguments(parser)
        assert "[--quick]" in parser.format_usage(), command.name
    return commands


async def quick_run(*args: str, timeout_s: float) -> str:
    """``scripts/bench *args``'s standard output, once it exited 0 within ``timeout_s`` (the benchmark
    starts and reaps its own onebitd and llama-server; run_process reaps the benchmark)."""
    with trio.fail_after(timeout_s):
        result = await trio.run_process(
            [sys.executable, "-m", "bench", *args], cwd=ROOT, capture_stdout=True, capture_stderr=True, check=False
        )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return result.stdout.decode()


@pytest.mark.real
async def test_the_overhead_benchmark_in_quick_mode_exits_0_and_prints_its_ratios(tmp_path: Path) -> None:
    real_llama_server()
    # The benchmark starts (and reaps) its own onebitd and llama-server; run_process reaps it.  A
    # quick run takes ~15 s on an idle machine; the bound is for a loaded one.
    picture = tmp_path / "overhead.svg"
    out = await quick_run("overhead", "--quick", "--plot", str(picture), timeout_s=300)
    texts = svg_texts(picture)
    assert {"(a) short completions: latency", "(b) concurrent streams: first token", "round 1"} <= set(texts), texts
    assert {"direct", "onebitd"} <= {text.split(" (median")[0] for text in texts}, texts
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
async def test_the_families_benchmark_in_quick_mode_exits_0_with_each_model_on_the_file_route(
    openvino_binary: Path, tmp_path: Path
) -> None:
    real_llama_server()
    picture = tmp_path / "families.svg"
    out = await quick_run("families", "--quick", "--plot", str(picture), timeout_s=600)
    assert {"llama-dense", "qwen35-dense", "plain", "file route", "file route, openvino"} <= set(svg_texts(picture))
    # model, verdict, tokens; plain, ggml and OpenVINO ms, each with its spread; the two ratios;
    # prompt_n; the fidelity distances (none in a quick run); memory
    cell = r"\d+ +\d+-\d+"
    row = (
        rf"^(\S+) +(whole|prefix) +\d+ +{cell} +{cell} +{cell} +{NUMBER}x +{NUMBER}x +(\d+) +- +- +\d+ +\d+ +\d+ +\d+$"
    )
    rows = re.findall(row, out, re.MULTILINE)
    assert [(name, verdict) for name, verdict, _ in rows] == [("llama-dense", "whole"), ("qwen35-dense", "prefix")], out
    # Both on both file routes: the decoder evaluated a token or two after each restore.
    assert all(int(prompt_n) <= 2 for *_, prompt_n in rows), out
    assert "machine noise: " in out, out


@pytest.mark.real
async def test_the_prefix_benchmark_in_quick_mode_exits_0_and_prints_its_ratios(tmp_path: Path) -> None:
    real_llama_server()
    picture = tmp_path / "prefix.svg"
    out = await quick_run("prefix", "--quick", "--plot", str(picture), timeout_s=300)
    assert {"(a) store", "(b) no store", "decoder kill -9", "first after the crash"} <= set(svg_texts(picture))
    assert re.search(
        rf"^first after a crash, \(b\)/\(a\): {NUMBER}x of the medians; crash by crash {NUMBER}", out, re.M
    ), out
    # cold; warm, first after the crash and later, each a median and its spread; the store's entries
    cell = r"\d+ +\d+-\d+"
    assert re.search(rf"^\(a\) store +\d+ +{cell} +{cell} +{cell} +[1-9]", out, re.MULTILINE), out
    assert re.search(r"^\(b\) no store +\d+ +(\d+ +\d+-\d+ +){3}0$", out, re.MULTILINE), out
    assert "machine: " in out, out
    assert "machine noise: " in out, out


@pytest.mark.real
async def test_the_models_benchmark_in_quick_mode_exits_0_and_leaves_nothing(tmp_path: Path) -> None:
    real_llama_server()
    picture = tmp_path / "models.svg"
    out = await quick_run("models", "--quick", "--plot", str(picture), timeout_s=600)
    assert {"swap-back", "warm", "cold (first turn)", "(a) store", "(b) no store"} <= set(svg_texts(picture))
    assert re.search(rf"^\(a\) swap-back / warm, medians: {NUMBER}x; without load_ms {NUMBER}x", out, re.MULTILINE), out
    assert out.count("left after the stop: files none, children none") == 2, out
    # Side by side: a swap-back turn per model after the cold round, on each side, paired.
    assert re.search(rf"^swap-back \(b\) / \(a\), turn by turn: {NUMBER} {NUMBER}$", out, re.MULTILINE), out
    assert "machine noise: " in out, out


@pytest.mark.real
async def test_the_hosts_benchmark_in_quick_mode_exits_0_with_both_sides_and_no_cold_turn_before_the_drain(
    tmp_path: Path,
) -> None:
    real_llama_server()
    picture = tmp_path / "hosts.svg"
    out = await quick_run("hosts", "--quick", "--plot", str(picture), timeout_s=600)
    assert {"(a) affinity", "(b) before", "one host drained"} <= set(svg_texts(picture))
    for side in ("(a) affinity", "(b) before"):
        found = re.search(rf"^{re.escape(side)}: turns 2\.\.4 .* drained onebit[123];", out, re.MULTILINE)
        assert found, f"no {side!r} summary in:\n{out}"
    assert re.search(rf"^summed first-token time, turns 2\.\.4: \(a\)/\(b\) {NUMBER}$", out, re.MULTILINE), out
    # Turn 2 comes before the drain: with affinity each session meets the host that holds its prompt.
    row = re.search(rf"^2\s+{NUMBER}\s+(\d+)\s+{NUMBER}\s+\d+$", out, re.MULTILINE)
    assert row, out
    assert row.group(1) == "0", out


def test_the_hosts_benchmark_refuses_a_shared_store_that_holds_anything_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Side (b)'s stores start empty; an earlier run's entries in (a)'s would serve this run's greedy,
    identical turns, the ones after the drain included."""
    used = tmp_path / "shared"
    (used / "prefix-v3").mkdir(parents=True)
    assert bench.cli.main(["hosts", "--quick", "--shared-dir", str(used)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"scripts/bench: --shared-dir {used} holds 1 entries (prefix-v3): each side starts from"), err
    assert "onebit hosts:" not in out  # refused before anything started
    assert hosts.used_store(tmp_path / "new") is None  # absent: onebitd makes it
    (tmp_path / "empty").mkdir()
    assert hosts.used_store(tmp_path / "empty") is None


def test_the_agent_benchmarks_restart_headline_says_what_it_compares(capsys: pytest.CaptureFixture[str]) -> None:
    """A restore against the cold side's prefill on this machine, not a speed-up: the times, the
    tokens and the threads, one value each (the medians over the restarts)."""
    sides: dict[tuple[str, str], agent.Side] = {}
    for client in agent.CLIENTS:
        restored = [{"decoder_prompt_n": 1, "prompt_tokens": 3044}]
        sides["restart", client] = agent.Side(
            "restart", cast(Any, None), cast(Any, None), first_ms=[130.0], again=[120.0, 140.0], lines=restored
        )
        sides["restart", client].again_lines += restored * 2
        sides["direct'", client] = agent.Side(
            "direct'", cast(Any, None), cast(Any, None), first_ms=[36000.0], again=[35000.0, 37000.0]
        )
    agent.report_restarts(sides, 1)
    out = capsys.readouterr().out
    for client in agent.CLIENTS:
        headline = (
            f"{client}: the first turn after a restart: restored in 130 ms against a prefill of 3044 tokens in"
            " 36.0 s on this machine (the decoder's flags, 1 thread)"
        )
        assert headline in out.splitlines(), out


@pytest.mark.real
async def test_the_versus_benchmark_in_quick_mode_exits_0_and_prints_both_trees(tmp_path: Path) -> None:
    real_llama_server()
    # This tree against itself: what is checked is that both onebitds start, alternate and report.
    picture = tmp_path / "versus.svg"
    out = await quick_run("versus", "--quick", "--tree", str(ROOT), "--plot", str(picture), timeout_s=300)
    assert {"this tree", "other tree"} <= {text.split(" (median")[0] for text in svg_texts(picture)}
    for measure in ("(a) latency median, ms", "(a) onebitd cpu per request, ms", "(b) onebitd cpu per chunk, us"):
        row = rf"^{re.escape(measure)}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$"
        assert re.search(row, out, re.MULTILINE), f"no {measure!r} row in:\n{out}"
    found = re.search(r"^\(b\) chunks relayed: this tree (\d+), other tree (\d+)$", out, re.MULTILINE)
    assert found, out
    assert int(found.group(1)) > 0, out
    assert int(found.group(2)) > 0, out


@pytest.mark.real
async def test_the_agent_benchmark_in_quick_mode_exits_0_and_prints_its_ratios(tmp_path: Path) -> None:
    real_llama_server()
    # Five sides, two SDKs, three turns each: about two minutes on a busy 2-core machine.
    picture = tmp_path / "agent.svg"
    out = await quick_run("agent", "--quick", "--plot", str(picture), timeout_s=600)
    texts = set(svg_texts(picture))
    assert {"anthropic: plain, and at once", "responses: hybrid", "plain", "at-once", "hybrid", "restart"} <= texts
    for client in ("anthropic", "responses"):
        assert re.search(rf"^{client}:$", out, re.MULTILINE), out
    assert len(re.findall(rf"^turns 2-3, summed: plain/direct {NUMBER}x, hybrid/direct {NUMBER}x", out, re.M)) == 2
    assert len(re.findall(rf"^after the restart, turn 1: direct' cold / onebitd {NUMBER}x", out, re.M)) == 2
    # The headline from every restart (two in a quick run), each restoring what the store kept.
    restarts = rf"^(anthropic|responses): after 2 full restarts, turn 1: .* restart by restart {NUMBER} {NUMBER} .*"
    assert len(re.findall(restarts + r"evaluated \d+ \d+ prompt tokens$", out, re.M)) == 2, out
    # Routed: every turn through onebitd has its slot and its cached tokens in its route line.
    assert (
        len(re.findall(r"^ +plain slot:route:cached/prompt tokens per turn( +\d+:plain:\d+/\d+){3}$", out, re.M)) == 2
    )
    assert (
        len(re.findall(r"^ +at-once slot:route:cached/prompt tokens per turn( +\d+:plain:\d+/\d+){3}$", out, re.M)) == 2
    )
    kept = rf"^plain's slot kept after the reply \(the save for the prefix store\), turns 2-3: median {NUMBER} ms"
    assert len(re.findall(kept, out, re.M)) == 2, out


@pytest.mark.real
async def test_the_handoff_benchmark_in_quick_mode_exits_0_and_shows_the_file_route_taken(tmp_path: Path) -> None:
    real_llama_server()
    # Two sizes, one round, then the decode-isolation streams and share against file: about two
    # minutes on a busy 2-core machine.
    picture = tmp_path / "handoff.svg"
    out = await quick_run("handoff", "--quick", "--plot", str(picture), timeout_s=600)
    assert {"plain route", "file route", "prompt tokens", "restore (file)"} <= set(svg_texts(picture))
    # tokens, provider prefill, save, restore, MiB, decoder prefill, prompt_n plain and hybrid, first
    # bytes, (save+restore) / decoder prefill
    five = "".join(rf"  +{NUMBER}" for _ in range(5))
    row = rf"^ *(\d+){five}  +(\d+)  +(\d+)  +{NUMBER} +{NUMBER} +{NUMBER}% \({NUMBER}% to {NUMBER}%\)$"
    rows = re.findall(row, out, re.MULTILINE)
    assert len(rows) == 2, out
    for tokens, plain_n, hybrid_n in rows:
        # The plain route's decoder prefills the prompt; the file route's evaluates a token or two.
        assert int(plain_n) >= int(tokens) - 8, out
        assert int(hybrid_n) <= 2, out
    for route in ("plain route", "file route"):
        assert re.search(rf"^  {route} +{NUMBER} ms   \({NUMBER} to {NUMBER}\)$", out, re.MULTILINE), out
    assert re.search(rf"^  ratio file/plain: {NUMBER}$", out, re.MULTILINE), out
    # tokens, restore, share, worker write, adopt (ms), adopt/restore, prompt_n after each, same reply
    share = rf"^ *\d+  +{NUMBER}  +{NUMBER}  +{NUMBER}  +{NUMBER}  +{NUMBER}%  +(\d+)  +(\d+)   (yes|NO)$"
    shares = re.findall(share, out, re.MULTILINE)
    assert len(shares) == 2, out
    assert all(int(restored) <= 2 and int(adopted) <= 2 and same == "yes" for restored, adopted, same in shares), out
    assert re.search(r"^\d+ CPUs \(.*python probe [\d.]+ ms$", out, re.MULTILINE), out
    assert "machine noise: " in out, out


@pytest.mark.real
async def test_the_multiturn_benchmark_in_quick_mode_exits_0_and_prints_every_turn_and_its_ratios(
    tmp_path: Path,
) -> None:
    real_llama_server()
    # Three sides up at once (two onebitd and a llama-server), 2 chats of 3 turns each, request by
    # request in rotating order.
    picture = tmp_path / "multiturn.svg"
    out = await quick_run("multiturn", "--quick", "--plot", str(picture), timeout_s=600)
    assert {"(c) direct", "(a) plain", "(b) hybrid", "first token per turn, each chat"} <= set(svg_texts(picture))
    # turn, then ttft ms and the decoder's prompt tokens for (c), (a), (b), the provider's, routes (b)
    side = rf" +{NUMBER} +(?:\d+|nan)"
    turns = re.findall(rf"^(\d){side}{side}{side} +(?:\d+|nan)  ([a-z,-]+)$", out, re.MULTILINE)
    assert [turn for turn, _ in turns] == ["1", "2", "3"], out
    assert all(len(routes.split(",")) == 2 for _, routes in turns), out  # a route line per chat
    assert re.search(rf"^turn 1, summed first-token time: +\(b\)/\(a\) {NUMBER} ", out, re.MULTILINE), out
    assert re.search(rf"^turns 2\.\.3, summed first-token time: \(b\)/\(a\) {NUMBER} ", out, re.MULTILINE), out
    assert re.search(rf"^\(a\)/\(c\), all turns: {NUMBER} ", out, re.MULTILINE), out
    median = rf"^turns 2\.\.3, median of 4 request ratios: \(b\)/\(a\) {NUMBER} \({NUMBER} to {NUMBER}\)   \(a\)/\(c\) "
    assert re.search(median, out, re.MULTILINE), out
    assert re.search(r"^\d+ CPUs \(.*python probe [\d.]+ ms$", out, re.MULTILINE), out
    assert "machine noise: " in out, out


@pytest.mark.real
async def test_the_turns_benchmark_in_quick_mode_exits_0_with_every_turn_and_the_restart_restored(
    tmp_path: Path,
) -> None:
    real_llama_server()
    # Two families, a session of 4 turns each: the swap before turn 2, the restart before turn 4.
    picture = tmp_path / "turns.svg"
    out = await quick_run("turns", "--quick", "--plot", str(picture), timeout_s=600)
    assert {"dense", "hybrid recurrent", "prompt tokens the decoder evaluated per turn"} <= set(svg_texts(picture))
    # family, turn, event; onebitd's ms and load, direct's ms, the ratio; restored, both sides' prompt_n, fallback
    row = rf"^(dense|hybrid recurrent) +(\d) (\S+) +\d+ +\d+ +\d+ +{NUMBER}x +(\d+|-) +\d+ +\d+  (\S+)$"
    rows = re.findall(row, out, re.MULTILINE)
    events = ["cold", "swap-back", "warm", "restart"]
    assert [(f, int(t), e) for f, t, e, *_ in rows] == [
        (family, t, event) for family in ("dense", "hybrid recurrent") for t, event in enumerate(events, 1)
    ], out
    # After the full restart onebitd restored the conversation from its prefix store, on either family.
    assert all(restored != "-" and fallback == "stored" for _, _, e, restored, fallback in rows if e == "restart"), out
    # cold, warm, swap, restart, session: direct / onebitd
    summary = r"^(dense|hybrid recurrent) +(llama-dense|qwen35-dense)" + rf" +{NUMBER}x" * 5 + "$"
    assert [family for family, _ in re.findall(summary, out, re.MULTILINE)] == ["dense", "hybrid recurrent"], out
    assert re.search(r"^machine: \d+ CPUs \(.*python probe [\d.]+ ms$", out, re.MULTILINE), out
    assert "machine noise: " in out, out


@pytest.fixture
def openvino_binary() -> Path:
    """A sync fixture, so that a missing binary fails (or skips) with its reason before the trio run starts."""
    return openvino_llama_server()


@pytest.mark.real
async def test_the_providers_benchmark_in_quick_mode_exits_0_with_both_engines_on_the_file_route(
    openvino_binary: Path, tmp_path: Path
) -> None:
    real_llama_server()
    # Two daemons (ggml, OpenVINO) at two sizes, one round, and OpenVINO started again on its
    # compile cache: a few minutes on a busy 2-core machine.
    picture = tmp_path / "providers.svg"
    out = await quick_run("providers", "--quick", "--plot", str(picture), timeout_s=900)
    assert {"plain", "file route, ggml", "file route, openvino-CPU"} <= set(svg_texts(picture))
    assert "machine: " in out, out
    assert "machine noise: " in out, out
    # tokens; plain, file route ggml and OpenVINO (ms, each with its spread); the two ratios; the
    # decoder's prompt_n on each file route
    cell = r"\d+ +\d+-\d+"
    row = rf"^ *\d+ +{cell} +{cell} +{cell} +{NUMBER}x +{NUMBER}x +(-?\d+) +(-?\d+)$"
    rows = re.findall(row, out, re.MULTILINE)
    assert len(rows) == 2, out
    # Both file routes were taken: the decoder evaluated a token or two of each prompt, not all of it.
    assert all(int(ggml) <= 2 and int(openvino) <= 2 for ggml, openvino in rows), out
    for engine in ("ggml", "openvino"):
        assert re.search(rf"^  {engine} +plain +{NUMBER} +file route +{NUMBER}$", out, re.MULTILINE), out
        assert re.search(rf"^  {engine} +device CPU  start +{NUMBER} s", out, re.MULTILINE), out
    assert re.search(rf"^  openvino started again on its compile cache: {NUMBER} s$", out, re.MULTILINE), out


# What onebitd's cost model believed at the end of a run: its rates and the slowdown on shared cores.
COSTS = (
    r"^onebitd's costs at the end: prefill ms a token: decoder \d+\.\d\d.*; on shared cores a prefill takes \d\.\d\d"
)


@pytest.mark.real
async def test_the_routes_benchmark_in_quick_mode_exits_0_with_every_side_and_the_routes_taken(tmp_path: Path) -> None:
    real_llama_server()
    # The shipped config (an OpenVINO provider where one is built: minutes to start on a busy
    # 2-core machine), two sizes, one round of four sides.
    picture = tmp_path / "routes.svg"
    out = await quick_run("routes", "--quick", "--plot", str(picture), timeout_s=1800)
    assert {"default", "plain", "file", "default again"} <= set(svg_texts(picture))
    # tokens; default, plain, file (median ms); default over the better of plain and file, over
    # plain, over itself (A/A); the routes the default side took
    row = r"^ *(\d+) +\d+ +\d+ +\d+ +\d+\.\d\d +\d+\.\d\d +\d+\.\d\d +((?:plain|file|share) \d+(?:, )?)+$"
    assert [size for size, _ in re.findall(row, out, re.MULTILINE)] == ["256", "1024"], out
    assert re.search(r"^default side's estimates within 1\.5x of the actual prefill: (\d+% of \d+|-)$", out, re.M), out
    assert re.search(COSTS, out, re.M), out
    assert "machine noise: " in out, out


@pytest.mark.real
async def test_the_fleet_benchmark_in_quick_mode_exits_0_with_both_sides_and_onebitds_route_lines(
    tmp_path: Path,
) -> None:
    real_llama_server()
    picture, lines = tmp_path / "fleet.svg", tmp_path / "fleet.lines"
    out = await quick_run("fleet", "--quick", "--plot", str(picture), "--lines", str(lines), timeout_s=1800)
    assert {"direct", "onebitd"} <= set(svg_texts(picture))
    # The warm-up's 4 requests a side come first and are not counted: 24 route lines, not 28.
    assert "  warm-up: 4 requests a side on system prompts of their own, not counted" in out, out
    assert len(lines.read_text().splitlines()) == 24
    # Both sides' requests, each block's asks each once, with what the decoder said of its prompt.
    requests = [json.loads(line) for line in lines.with_suffix(".requests").read_text().splitlines()]
    for side, block in itertools.product(("direct", "onebitd"), (0, 1)):
        asks = sorted(r["ask"] for r in requests if (r["side"], r["block"]) == (side, block))
        assert asks == list(range(12)), requests
    assert all(r["first_ms"] > 0 and r["prompt_n"] is not None for r in requests), requests
    for side in ("direct", "onebitd"):
        assert re.search(rf"^{side} +\d+ ms +\d+ ms +{NUMBER}$", out, re.MULTILINE), out
    assert re.search(rf"^onebitd / direct: median {NUMBER}x, p90 {NUMBER}x, throughput {NUMBER}x$", out, re.M), out
    paired = r"^onebitd less direct, the same ask, median: first blocks [+-]\d+ ms, second blocks [+-]\d+ ms$"
    assert re.search(paired, out, re.M), out
    # Every request of onebitd's two blocks logged its route line.
    found = re.search(r"^onebitd's (\d+) requests: (\d+) handed over, (\d+) restored from the prefix store", out, re.M)
    assert found is not None, out
    assert int(found.group(1)) == 24, out
    assert re.search(COSTS, out, re.M), out
    assert "machine noise: " in out, out


def test_the_fleets_paired_figure_takes_each_ask_against_the_same_ask_on_the_other_side() -> None:
    """The blocks finish out of order: each side's asks are matched by ask, not by place."""
    direct = Block([100.0, 300.0, 200.0], 0, 1.0, [{}, {}, {}], asked=[0, 2, 1])
    onebitd = Block([210.0, 90.0, 305.0], 0, 1.0, [{}, {}, {}], asked=[1, 0, 2])
    assert paired(direct, onebitd) == 5.0  # +10, -10, +5 (by place: +110, -210, +105)


async def test_a_spawned_onebitds_route_lines_are_read_from_its_json_log_as_they_come(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fleet's onebitd runs in a process of its own (as in service): its route lines come back
    through the pipe it logs into, each once its line is whole, every line is kept, and its
    warnings reach the benchmark's standard error."""
    line = {"route": "plain", "req": "ab-1", "prompt_tokens": 42}
    with (tmp_path / "onebitd.log").open("w") as keep, trio.fail_after(10):
        async with rig.piped_lines(keep) as (pipe, lines):
            record = json.dumps({"ts": 1.5, "level": "info", "logger": "onebit.route", **line})
            other = json.dumps({"ts": 1.6, "level": "info", "logger": "onebit.daemon", "msg": "ready"})
            warned = json.dumps({"ts": 1.7, "level": "warning", "logger": "onebit.daemon", "msg": "a warning"})
            written = f"{other}\nnot json\n{warned}\n{record}"
            cut = written.index(record) + 20
            pipe.write(written[:cut])  # the route line in two writes: read once it is whole
            pipe.flush()
            await trio.testing.wait_all_tasks_blocked()
            assert lines.lines == []
            pipe.write(written[cut:] + "\n")
            pipe.flush()
            assert await lines.wait(1) == line
            assert lines.lines == [line]
    assert (tmp_path / "onebitd.log").read_text() == written + "\n"
    assert capsys.readouterr().err == warned + "\n"


def test_the_fleets_warm_up_takes_a_count_of_requests() -> None:
    parser = argparse.ArgumentParser()
    routes.fleet_arguments(parser)
    assert parser.parse_args(["--warmup", "0"]).warmup == 0
    assert parser.parse_args([]).warmup is None  # a block's worth, or 4 with --quick
    with pytest.raises(SystemExit):
        parser.parse_args(["--warmup", "-3"])


@pytest.mark.real
async def test_the_fleet_benchmarks_a_a_runs_a_second_direct_side_in_onebitds_place(tmp_path: Path) -> None:
    real_llama_server()
    out = await quick_run("fleet", "--quick", "--aa", timeout_s=1800)
    assert "A/A: the onebitd side is a second llama-server direct" in out, out
    assert "  warm-up: 4 requests a side on system prompts of their own, not counted" in out, out
    assert re.search(rf"^onebitd / direct: median {NUMBER}x, p90 {NUMBER}x, throughput {NUMBER}x$", out, re.M), out
    # No request went through an onebitd front: no route line, no cost model.
    assert re.search(r"^onebitd's 0 requests: 0 handed over", out, re.M), out
    assert not re.search(COSTS, out, re.M), out

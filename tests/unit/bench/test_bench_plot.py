"""bench/plot.py draws each kind of panel, and each subcommand's figures, from samples made
up here: an SVG that parses, with its titles, axis labels and series named in it as text.

No benchmark runs here (tests/unit/bench/test_bench.py runs them, with ``--plot``, on real parts): the samples
are synthetic, so a figure that lost a series or an axis shows in a second."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

import bench.agent
import bench.cli
import bench.engines
import bench.families
import bench.handoff
import bench.hosts
import bench.models
import bench.multiturn
import bench.plot
import bench.prefix
import bench.providers
import bench.workloads

ROOT = Path(__file__).parents[3]
SVG = "{http://www.w3.org/2000/svg}"


PLOT: Any = bench.plot


def svg_texts(path: Path) -> list[str]:
    """Every text element of the SVG at ``path``, which must parse as XML and be an <svg>."""
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    return ["".join(element.itertext()) for element in root.iter(f"{SVG}text")]


def drawn(tmp_path: Path, panels: list[Any], **kwargs: Any) -> list[str]:
    path = tmp_path / "figure.svg"
    PLOT.write(path, "scripts/bench test", panels, quick=kwargs.pop("quick", False), **kwargs)
    return svg_texts(path)


def test_each_kind_of_panel_names_its_title_axes_and_series_in_the_svg(tmp_path: Path) -> None:
    panels = [
        PLOT.XY(
            "first token against prompt length",
            "prompt tokens",
            "first token, ms",
            {"plain route": [(256, 40.0), (256, 44.0), (1024, 160.0)], "file route": [(256, 30.0), (1024, 70.0)]},
            marks=[(600, "decoder kill -9")],
        ),
        PLOT.Distribution("short completions: latency", "latency, ms", {"direct": [1.0, 2.0, 3.0], "onebitd": [1.5]}),
        PLOT.Bars(
            "swap-back against warm",
            "ms",
            {"swap-back": {"(a) store": [10.0, 12.0], "(b) no store": [90.0]}, "warm": {"(a) store": [8.0]}},
            reference=1.0,
        ),
    ]
    texts = drawn(tmp_path, panels, quick=True)
    for expected in (
        "scripts/bench test",
        "first token against prompt length",
        "prompt tokens",
        "first token, ms",
        "plain route",
        "file route",
        "decoder kill -9",
        "short completions: latency",
        "latency, ms",
        "fraction of samples at or below",
        "swap-back against warm",
        "swap-back",
        "warm",
        "(a) store",
        "(b) no store",
    ):
        assert expected in texts, f"{expected!r} not among {texts}"
    # A distribution's legend gives each series' median; a quick run says what it is.
    assert "direct (median 2)" in texts, texts
    assert any("--quick" in text for text in texts), texts


def test_the_same_figures_drawn_twice_are_the_same_bytes(tmp_path: Path) -> None:
    panels = [PLOT.XY("per turn", "turn", "ms", {"a": [(1, 2.0), (2, 3.0)]}, integer_x=True, log_y=True)]
    first, second = tmp_path / "first.svg", tmp_path / "second.svg"
    PLOT.write(first, "t", panels, quick=False)
    PLOT.write(second, "t", panels, quick=False)
    assert first.read_bytes() == second.read_bytes()
    assert b"<dc:date>" not in first.read_bytes()


@pytest.mark.parametrize("given", ["figure.png", "no-such-folder/figure.svg"])
def test_plot_refuses_a_path_that_is_not_an_svg_in_a_folder_that_exists(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        bench.cli.parser().parse_args(["prefix", "--quick", "--plot", given])
    assert exited.value.code == 2
    assert "--plot" in capsys.readouterr().err


def test_every_subcommand_takes_plot(tmp_path: Path) -> None:
    picture = tmp_path / "figure.svg"
    for command in bench.cli.SUBCOMMANDS:
        required = ["--tree", str(ROOT)] if command.name == "versus" else []
        args = bench.cli.parser().parse_args([command.name, "--quick", *required, "--plot", str(picture)])
        assert args.plot == picture, command.name


def side(latencies: list[float], firsts: list[float], rates: list[float]) -> Any:
    return bench.workloads.Side(latencies=latencies, first_tokens=firsts, round_rates=rates)


def test_overhead_draws_both_sides_latencies_first_tokens_and_rounds(tmp_path: Path) -> None:
    sides = {"direct": side([0.010, 0.012], [0.05, 0.06], [90.0, 95.0]), "onebitd": side([0.011], [0.07], [88.0])}
    texts = drawn(tmp_path, bench.workloads.relay_figures(sides))
    assert "(a) short completions: latency" in texts
    assert "(b) concurrent streams: first token" in texts
    assert {"round 1", "round 2", "direct", "onebitd"} <= set(texts), texts
    assert any(text.startswith("onebitd (median ") for text in texts), texts


def test_handoff_draws_first_byte_against_prompt_length_per_route(tmp_path: Path) -> None:
    step = {"prefill_ms": 50.0, "save_ms": 2.0, "restore_ms": 3.0, "bytes": 1}
    rows = [
        {"tokens": n, "samples": {"plain": [n / 5], "file": [n / 9], "steps": [step], "decoder": [n / 6]}}
        for n in (256, 1024)
    ]
    shares = [{"tokens": 256, "restore_ms": 3.0, "share_ms": 0.1, "write_ms": 1.0, "adopt_ms": 0.1}]
    texts = drawn(tmp_path, bench.handoff.handoff_figures(rows, {"plain route": [9.0], "file route": [2.0]}, shares))
    assert {"plain route", "file route", "prompt tokens", "256 tokens", "1024 tokens", "restore (file)"} <= set(texts)
    assert {"provider prefill", "save", "restore", "decoder prefill (plain)", "longest inter-token gap"} <= set(texts)


def test_providers_draws_plain_and_each_engines_file_route(tmp_path: Path) -> None:
    rows = {n: {"tokens": n + 1, "plain": [n / 4], "ggml": [n / 5], "openvino": [n / 8]} for n in (256, 1024)}
    engines = {
        engine: {"engine": engine, "device": "CPU", "gaps": {"plain": [30.0], "file route": [5.0]}}
        for engine in ("ggml", "openvino")
    }
    texts = drawn(tmp_path, bench.providers.provider_figures(rows, engines))
    expected = {"plain", "file route, ggml", "file route, openvino-CPU"}
    assert expected | {"ggml", "openvino", "prompt tokens"} <= set(texts), texts


def test_families_draws_the_table_as_bars_per_model(tmp_path: Path) -> None:
    rows = {
        "llama-dense": {"tokens": 200, "plain": [40.0, 44.0], "ggml": [20.0], "openvino": [10.0]},
        "gemma3-dense": {"tokens": 200, "plain": [40.0], "ggml": [21.0]},  # OpenVINO refused it
    }
    texts = drawn(tmp_path, bench.families.family_figures(rows))
    expected = {"llama-dense", "gemma3-dense", "plain", "file route", "file route, openvino"}
    assert expected | {"plain / file route", "plain / file route, openvino"} <= set(texts), texts


def test_multiturn_draws_each_sides_first_token_per_turn(tmp_path: Path) -> None:
    sample = bench.multiturn.Sample
    sides = {
        name: [
            [sample(10.0 * (t + 1), 100, 90 if "hybrid" in name else None, "plain") for _ in range(2)] for t in range(3)
        ]
        for name in ("(c) direct", "(a) plain", "(b) hybrid")
    }
    texts = drawn(tmp_path, bench.multiturn.multiturn_figures(sides, "(b) hybrid"))
    assert {"(c) direct", "(a) plain", "(b) hybrid", "turn", "(b) hybrid, provider", "(a) plain, decoder"} <= set(texts)


def test_prefix_draws_every_request_with_the_crash_marked(tmp_path: Path) -> None:
    sides = {
        "(a) store": {"cold": [300.0], "warm": [30.0, 31.0], "first": [40.0, 41.0], "after": [30.0, 31.0]},
        "(b) no store": {"cold": [300.0], "warm": [30.0, 29.0], "first": [310.0, 305.0], "after": [30.0, 32.0]},
    }
    texts = drawn(tmp_path, bench.prefix.prefix_figures(sides))
    assert {"(a) store", "(b) no store", "decoder kill -9", "request", "first after the crash"} <= set(texts), texts


def test_models_draws_swap_back_against_warm_and_cold(tmp_path: Path) -> None:
    def run(ttft: float) -> dict[str, Any]:
        return {"swapback": [{"ttft_ms": ttft, "load_ms": 200.0}], "warm": [30.0, 32.0], "cold": [400.0]}

    texts = drawn(tmp_path, bench.models.model_figures({"(a) store": run(260.0), "(b) no store": run(700.0)}))
    assert {"swap-back", "warm", "cold (first turn)", "(a) store", "(b) no store", "swap-back, (b) / (a)"} <= set(texts)


def test_agent_draws_each_client_and_side_per_turn(tmp_path: Path) -> None:
    agent = bench.agent
    first_ms = {
        (name, client): [100.0, 20.0, 21.0] for client in agent.CLIENTS for _, names in agent.PANELS for name in names
    }
    texts = drawn(tmp_path, agent.agent_figures(first_ms), columns=3)
    assert {"anthropic: hybrid", "responses: after a full restart", "at-once", "restart", "direct'"} <= set(texts)


def test_engines_draws_each_builds_prefill_rate_against_prompt_length(tmp_path: Path) -> None:
    engines: Any = bench.engines
    run = {
        "speeds": {200: (900.0, 850.0, 450.0), 700: (800.0, 790.0, 400.0)},
        "runs": {200: [850.0, 900.0], 700: [800.0]},
    }
    static: dict[str, dict[int, Any]] = {"speeds": {}, "runs": {}}  # the static path measures no sizes: no series
    texts = drawn(tmp_path, engines.engine_figures({"ggml": run, "openvino": run, "openvino-static": static}))
    assert {"ggml", "openvino", "prompt tokens", "tokens/s", "tokens per CPU-second"} <= set(texts), texts
    assert "openvino-static" not in texts


def test_plot_without_matplotlib_is_a_set_up_problem_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    # exit 2 at once: no onebitd started (the quick prefix run takes minutes), no picture written
    assert bench.cli.main(["prefix", "--quick", "--plot", str(tmp_path / "prefix.svg")]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "prefix.svg").exists()


def test_hosts_draws_each_sides_first_token_per_turn_with_the_drain_marked(tmp_path: Path) -> None:
    hosts = bench.hosts
    samples = [
        hosts.Sample(side, turn, session, "onebit1", 100.0 / turn, 500, 400, 0 if turn < 3 else 120)
        for side in hosts.SIDES
        for turn in range(1, 5)
        for session in range(2)
    ]
    texts = drawn(tmp_path, hosts.hosts_figures(samples, 2))
    assert {*hosts.SIDES, "one host drained", "turn", "first token per turn, every session"} <= set(texts), texts

"""The cost decision's estimates against what the requests took, per route and engine, over the last
requests: what ``onebitctl status`` shows so that an operator sees when the model is wrong."""

from __future__ import annotations

from pathlib import Path

import attrs

from supervisor.admin import render
from supervisor.observe.routestats import EstimateAccuracy, RouteStats
from supervisor.routeline import RequestOutcome, RouteLine
from supervisor.routes.rates import Rates
from tests.unit.admin.test_ctl_admin import busy_statistics


def plain(est_ms: float, took_ms: float) -> RouteLine:
    return RouteLine(
        req="1-1", endpoint="/completion", est_plain_ms=est_ms, est_hybrid_ms=1.0, decoder_prompt_ms=took_ms
    )


def handed(est_ms: float, prefill_ms: float) -> RouteLine:
    return RouteLine(
        route="file",
        req="1-2",
        endpoint="/completion",
        est_plain_ms=1.0,
        est_hybrid_ms=est_ms,
        prefill_ms=prefill_ms,
        restore_ms=10.0,
        decoder_prompt_ms=5.0,
        provider="prefill0",
        engine="openvino",
    )


def test_each_route_and_engine_says_how_far_its_estimates_were_from_the_actual_prefill() -> None:
    stats = RouteStats()
    for est, took in [(1000.0, 1100.0), (1000.0, 900.0), (1000.0, 3000.0)]:
        stats.record(plain(est, took))
    # A file route: the provider's prefill, the restore and the decoder's last token, 4x the estimate.
    for _ in range(2):
        stats.record(handed(1000.0, 3985.0))
    stats.record(RouteLine(req="1-3", endpoint="/completion", decoder_prompt_ms=50.0))  # not estimated
    stats.record(attrs.evolve(plain(10.0, 1000.0), outcome=RequestOutcome.ERROR))  # ended badly
    assert stats.snapshot().estimates == (
        EstimateAccuracy(route="file", engine="openvino", n=2, median_ratio=4.0, within_1_5=0.0),
        EstimateAccuracy(route="plain", engine="decoder", n=3, median_ratio=1.1, within_1_5=0.667),
    )


async def test_onebitctl_status_shows_the_estimates_against_the_actuals(short_dir: Path) -> None:
    stats = attrs.evolve(
        busy_statistics(short_dir),
        estimates=(EstimateAccuracy("plain", "decoder", 40, 0.93, 0.875),),
    )
    lines = render.render_status(stats).splitlines()
    assert "estimates: plain/decoder actual 0.93x the estimate (median), 88% within 1.5x, over 40" in lines
    idle = render.render_status(busy_statistics(short_dir)).splitlines()
    assert "estimates: none yet (no request was routed by cost)" in idle


async def test_onebitctl_status_shows_what_the_cost_decision_believes(short_dir: Path) -> None:
    """The rates the estimates are made from, beside how they held: a wrong rate is seen there."""
    rates = Rates(decoder_ms_per_token=4.0, provider_ms_per_token=3.0, handoff_ms_per_mib=6.0, state_bytes_per_token=1)
    prior = attrs.evolve(busy_statistics(short_dir), costs=rates.statistics(0))
    assert (
        "costs: prefill ms a token: decoder 4.00; handoff 6.0 ms a MiB; on shared cores a prefill takes 0.50 of"
        " its overlap with the other child's prefill more (the prior, none measured yet), a provider's 1.00 of"
        " its overlap with the decoder's other requests (the prior, none measured yet)"
    ) in render.render_status(prior).splitlines()
    rates.observe_provider("prefill0", 1000, 2500.0)
    for actual in (600.0, 500.0, 550.0):
        rates.observe_shared((200.0, 200.0, 0.0, actual))
    for actual in (800.0, 700.0, 750.0):
        rates.observe_shared((200.0, 0.0, 200.0, actual))
    rates.observe_shared((200.0, 200.0, 200.0, 2000.0))  # beside both: says neither
    measured = attrs.evolve(busy_statistics(short_dir), costs=rates.statistics(0))
    assert (
        "costs: prefill ms a token: decoder 4.00, prefill0 2.50; handoff 6.0 ms a MiB; on shared cores a prefill"
        " takes 1.75 of its overlap with the other child's prefill more (measured over 3), a provider's 2.75 of"
        " its overlap with the decoder's other requests (measured over 3)"
    ) in render.render_status(measured).splitlines()
    older = attrs.evolve(busy_statistics(short_dir), costs=None)
    assert "costs: not reported (an older onebitd)" in render.render_status(older).splitlines()

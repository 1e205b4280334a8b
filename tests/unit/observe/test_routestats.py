"""The cost decision's estimates against what the requests took, per route and engine, over the last
requests: what ``onebitctl status`` shows so that an operator sees when the model is wrong."""

from __future__ import annotations

from pathlib import Path

import attrs

from supervisor.admin import render
from supervisor.observe.routestats import EstimateAccuracy, RouteStats
from supervisor.routeline import RequestOutcome, RouteLine
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

"""The prefills in flight per child (routes/contention.py), and what an estimate adds for them
(routes/decision.py's ``estimate``)."""

from __future__ import annotations

import attrs
import pytest

from supervisor.routes.contention import DECODER, Busy, Contention
from supervisor.routes.decision import Choice, Costs, Route, estimate
from supervisor.routes.rates import OVERLAP_MS, SHARED, SHARED_MAX, Rates, Slowdown, linear
from supervisor.routes.story import Story

# A 600-token prompt, decoder and provider at 5 ms a token, the provider on the decoder's cores.
COSTS = Costs(0, 0, linear(5.0), linear(5.0), handoff_ms=60.0, streams_decoding=0, apart=False)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_prefill_counts_on_its_child_until_its_block_ends_even_when_it_fails() -> None:
    contention = Contention(Clock())
    seen = []

    def fail() -> None:
        with contention.running("ov", 600, 3000.0):
            seen.append((contention.tokens("ov"), contention.tokens(DECODER)))
            raise RuntimeError

    with pytest.raises(RuntimeError):
        fail()
    assert seen == [(600, 0)]
    assert contention.tokens("ov") == 0
    assert contention.busy("ov") == Busy()


def test_what_is_left_is_the_longest_estimate_less_the_time_it_has_run() -> None:
    clock = Clock()
    contention = Contention(clock)
    with contention.running(DECODER, 600, 3000.0), contention.running(DECODER, 40, 500.0):
        clock.now = 1.0
        assert contention.busy("ov") == Busy(decoder_ms=2000.0)
        clock.now = 4.0
        assert contention.busy(None) == Busy()  # over its estimate: nothing more is counted


def test_a_prefill_whose_child_answered_is_no_longer_counted() -> None:
    contention, answered = Contention(Clock()), [False]
    with contention.running(DECODER, 600, 3000.0, over=lambda: answered[0]):
        assert contention.tokens(DECODER) == 600
        answered[0] = True
        assert (contention.tokens(DECODER), contention.busy(None)) == (0, Busy())


def test_with_nothing_in_flight_the_estimate_is_the_idle_one() -> None:
    idle = estimate(600, COSTS)
    assert (idle.plain_ms, idle.hybrid_ms) == (3000.0, 3000.0 + 60.0 + 5.0)
    assert estimate(600, attrs.evolve(COSTS, busy=Busy())) == idle


def test_a_prefill_waits_for_what_its_own_child_runs_and_shares_the_other_childs_cores() -> None:
    busy = estimate(600, attrs.evolve(COSTS, busy=Busy(decoder_ms=1000.0, provider_ms=2000.0)))
    assert busy.plain_ms == 3000.0 + 1000.0 + SHARED * 2000.0
    # The provider's prefill outlasts the decoder's work: the restore does not wait for it.
    assert busy.provider_ms == 3000.0 + 2000.0 + SHARED * 1000.0
    assert busy.hybrid_ms == busy.provider_ms + 60.0 + 5.0


def test_on_compute_apart_only_the_childs_own_work_is_waited_for() -> None:
    apart = attrs.evolve(COSTS, apart=True, busy=Busy(decoder_ms=1000.0, provider_ms=2000.0))
    busy = estimate(600, apart)
    assert busy.plain_ms == 3000.0 + 1000.0
    assert busy.hybrid_ms == 3000.0 + 2000.0 + 60.0 + 5.0


def test_a_handoffs_restore_waits_for_the_decoders_longer_prefill() -> None:
    # The provider's own prefill is short; the decoder is still on another request's long prompt.
    busy = estimate(600, attrs.evolve(COSTS, provider_cached=560, busy=Busy(decoder_ms=5000.0)))
    assert busy.provider_ms == 200.0 + SHARED * 200.0
    assert busy.hybrid_ms == 5000.0 + 60.0 + 5.0


# -- the slowdown on shared cores, measured (routes/rates.py's Slowdown) ------------------------


def test_the_slowdown_is_the_prior_until_measured_then_the_median_of_what_prefills_showed() -> None:
    slowdown = Slowdown(SHARED)
    slowdown.observe(alone_ms=200.0, overlap_ms=OVERLAP_MS - 1, actual_ms=900.0)  # too little overlap to say
    slowdown.observe(alone_ms=200.0, overlap_ms=200.0, actual_ms=500.0)  # 1.5
    slowdown.observe(alone_ms=200.0, overlap_ms=200.0, actual_ms=450.0)  # 1.25
    assert slowdown.factor == SHARED
    slowdown.observe(alone_ms=200.0, overlap_ms=200.0, actual_ms=150.0)  # faster than alone: 0
    assert slowdown.factor == 1.25
    slowdown.observe(alone_ms=100.0, overlap_ms=100.0, actual_ms=10_000.0)  # capped
    slowdown.observe(alone_ms=100.0, overlap_ms=100.0, actual_ms=10_000.0)
    assert max(slowdown.window) == SHARED_MAX
    assert slowdown.factor == 1.5


def test_each_side_is_slowed_by_the_measured_share_and_the_estimate_says_its_parts() -> None:
    busy_both = Busy(decoder_ms=1000.0, provider_ms=2000.0)
    costs = attrs.evolve(COSTS, busy=busy_both, shared=2.0)
    busy = estimate(600, costs)
    assert (busy.plain_alone, busy.plain_overlap) == (3000.0 + 1000.0, 2000.0)
    assert busy.plain_ms == 3000.0 + 1000.0 + 2.0 * 2000.0
    assert (busy.provider_alone, busy.provider_overlap) == (3000.0 + 2000.0, 1000.0)
    assert busy.provider_ms == 3000.0 + 2000.0 + 2.0 * 1000.0
    apart = estimate(600, attrs.evolve(costs, apart=True))
    assert (apart.plain_overlap, apart.provider_overlap, apart.plain_ms) == (0.0, 0.0, 4000.0)


def test_continuations_beside_a_providers_prefill_are_estimated_within_1_5x_once_three_were_measured() -> None:
    """The fleet workload on a 2-core Zen 4 VM (docs/benchmarks.md): 30 to 55 token continuations run
    beside an OpenVINO prefill on the same cores took 2.2x to 2.7x their estimate with the prior 0.2.
    What they showed is learnt, and the next one's estimate is within 1.5x."""
    rates = Rates(decoder_ms_per_token=5.0, provider_ms_per_token=5.0, handoff_ms_per_mib=10.0, state_bytes_per_token=1)
    # A 40-token continuation of a 600-token prompt, 209 ms alone, a provider's prefill 2 s from its end.
    continuation = attrs.evolve(COSTS, decoder_cached=560, decoder=linear(209.0 / 40), busy=Busy(provider_ms=2000.0))
    before = estimate(600, attrs.evolve(continuation, shared=rates.shared()))
    assert not 1 / 1.5 <= 490.0 / before.plain_ms <= 1.5  # the prior misses
    for alone, actual in [(189.0, 501.0), (248.0, 570.0), (277.0, 604.0)]:  # measured (alone, prompt_ms)
        rates.observe_shared((alone, alone, actual))
    after = estimate(600, attrs.evolve(continuation, shared=rates.shared()))
    assert 1 / 1.5 <= 490.0 / after.plain_ms <= 1.5
    # A provider's prefill beside the decoder's is slowed alike: same cores, same kind of work.
    beside = attrs.evolve(COSTS, busy=Busy(decoder_ms=1000.0))
    assert estimate(600, attrs.evolve(beside, shared=rates.shared())).provider_ms == 3000.0 + rates.shared() * 1000.0
    assert rates.shared() > 1.0


def test_a_request_tells_the_slowdown_only_on_the_route_it_was_priced_for() -> None:
    guess = estimate(600, attrs.evolve(COSTS, busy=Busy(provider_ms=2000.0)))
    story = Story("1a-1", "/completion")
    story.chose(Choice(Route.PLAIN, estimate=guess))
    story.reached(Route.PLAIN)
    assert story.shared_sample(3400.0) == (3000.0, 2000.0, 3400.0)
    assert story.shared_sample(None) is None
    handed = Story("1a-2", "/completion")
    handed.chose(Choice(Route.FILE, estimate=guess))
    handed.reached(Route.PLAIN)  # the handoff failed and the decoder prefilled: not what was priced
    assert handed.shared_sample(3400.0) is None
    unpriced = Story("1a-3", "/completion")
    unpriced.chose(Choice(Route.PLAIN))
    unpriced.reached(Route.PLAIN)
    assert unpriced.shared_sample(3400.0) is None

"""The prefills in flight per child (routes/contention.py), and what an estimate adds for them
(routes/decision.py's ``estimate``)."""

from __future__ import annotations

import attrs
import pytest

from supervisor.routes.contention import DECODER, Busy, Contention
from supervisor.routes.decision import SHARED, Costs, estimate
from supervisor.routes.rates import linear

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

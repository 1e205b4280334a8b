"""Measured rates: moving averages per child generation, priors until measured, and a one-sided
measurement compared fairly."""

from __future__ import annotations

import pytest

from supervisor.routes.rates import MIB, Rates


def rates() -> Rates:
    return Rates(decoder_ms_per_token=5.0, provider_ms_per_token=2.5, handoff_ms_per_mib=1.0, state_bytes_per_token=MIB)


def test_priors_stand_in_until_a_measurement() -> None:
    assert rates().prefill(1, "npu") == (5.0, 2.5)


def test_a_measurement_moves_the_average_and_a_restart_forgets_it() -> None:
    r = rates()
    r.observe_decoder(1, prompt_n=100, prompt_ms=1000.0)
    r.observe_decoder(1, prompt_n=100, prompt_ms=2000.0)
    assert r.decoder.get(1) == pytest.approx(10 * 0.8 + 20 * 0.2)
    assert r.decoder.get(2) == 5.0  # a new decoder process: the prior again


def test_tiny_prefills_say_nothing_about_the_rate() -> None:
    r = rates()
    r.observe_decoder(1, prompt_n=1, prompt_ms=40.0)  # one token behind a handoff: fixed costs
    assert r.decoder.get(1) == 5.0


def test_a_side_measured_alone_is_compared_with_the_others_prior_scaled_alike() -> None:
    # A loaded machine: the provider measured at 4x its prior; the decoder, unmeasured, is assumed
    # 4x slower too, not as fast as its prior claims.
    r = rates()
    r.observe_provider("npu", evaluated=100, prefill_ms=1000.0)
    assert r.prefill(1, "npu") == (20.0, 10.0)
    r.observe_decoder(1, prompt_n=100, prompt_ms=700.0)
    assert r.prefill(1, "npu") == (7.0, 10.0)


def test_the_handoff_cost_scales_with_the_state_it_moves() -> None:
    r = rates()
    r.observe_handoff(n_tokens=100, state_bytes=50 * MIB, handoff_ms=100.0)  # 2 ms/MiB, 0.5 MiB/token
    assert r.handoff_ms(1000) == pytest.approx(1000 * 0.5 * 2.0)

"""Measured costs: a prefill model fitted per child generation that is never extrapolated from short
prefills, priors where nothing near the size was measured, a one-sided measurement compared fairly,
and handoffs as a fixed cost plus one per MiB."""

from __future__ import annotations

import random

import pytest

from supervisor.routes.rates import FLOOR, MIB, PrefillCost, Rates, linear, nnls


def rates() -> Rates:
    return Rates(decoder_ms_per_token=5.0, provider_ms_per_token=2.5, handoff_ms_per_mib=1.0, state_bytes_per_token=MIB)


def true_ms(n_new: int, n_cached: int = 0) -> float:
    """A decoder that costs 40 ms a prefill, 3 ms a token, and 0.0005 ms per token and token of
    context before it (attention)."""
    return 40.0 + 3.0 * n_new + 0.0005 * n_new * (n_cached + n_new / 2)


def test_priors_stand_in_until_a_measurement() -> None:
    decoder, provider = rates().prefill(1, "npu")
    assert (decoder.ms(100), provider.ms(100)) == (500.0, 250.0)
    assert not decoder.sure(100)


def test_a_fit_from_short_prefills_with_a_large_fixed_cost_does_not_set_the_rate_for_long_prompts() -> None:
    # Under load: 26-38-token prefills of about 1.7 s each, nearly all of it fixed cost.  A rate of
    # ms/token (~57) learnt from them would estimate 8,000 tokens at 7.5 minutes.
    r = rates()
    for n in (26, 30, 38, 27, 33, 29, 36, 31):
        r.observe_decoder(1, prompt_n=n, prompt_ms=1500.0 + 5.0 * n)
    decoder, _ = r.prefill(1, "npu")
    assert not decoder.sure(8000)
    assert decoder.ms(8000) == pytest.approx(1500.0 + 5.0 * 8000, rel=0.01)  # the fixed cost, then the prior
    assert decoder.ms(8000) < 1500.0 / 30 * 8000 / 5


def test_the_fit_finds_the_fixed_per_token_and_context_terms_from_prefills_of_many_sizes() -> None:
    r = rates()
    for n, cached in [
        (300, 0),
        (600, 0),
        (1200, 0),
        (2400, 0),
        (3200, 0),
        (500, 2000),
        (800, 1000),
        (1600, 400),
        (64, 3000),
    ]:
        r.observe_decoder(1, prompt_n=n, prompt_ms=true_ms(n, cached), cache_n=cached)
    decoder, _ = r.prefill(1, "npu")
    assert decoder.sure(8000)  # 2,400 and 3,200 are within 4x of it
    assert not decoder.sure(12_000)  # only 3,200 is
    assert decoder.ms(8000) == pytest.approx(true_ms(8000), rel=0.02)
    # A continuation costs more a token than a cold prompt of its size: attention over the context.
    assert decoder.ms(563, 3000) == pytest.approx(true_ms(563, 3000), rel=0.02)
    assert decoder.ms(563, 3000) > decoder.ms(563, 0)


def test_one_prefill_slowed_by_a_burst_of_decoding_does_not_move_the_fit() -> None:
    r = rates()
    noise = random.Random(7)
    for _ in range(4):
        for n in (300, 700, 1500):
            r.observe_decoder(1, prompt_n=n, prompt_ms=true_ms(n) * noise.uniform(0.97, 1.03))
    r.observe_decoder(1, prompt_n=700, prompt_ms=true_ms(700) * 8)
    decoder, _ = r.prefill(1, "npu")
    assert decoder.ms(1000) == pytest.approx(true_ms(1000), rel=0.05)


def test_short_prefills_set_only_the_fixed_cost() -> None:
    r = rates()
    for n in (400, 800, 1600):
        r.observe_decoder(1, prompt_n=n, prompt_ms=3.0 * n)
    for _ in range(5):
        r.observe_decoder(1, prompt_n=1, prompt_ms=43.0)  # the one token behind a handoff
    decoder, _ = r.prefill(1, "npu")
    assert decoder.rate == pytest.approx(3.0, rel=0.05)
    assert decoder.fixed_ms == pytest.approx(40.0, abs=2.0)


def test_a_restart_forgets_the_fit() -> None:
    r = rates()
    for n in (400, 800):
        r.observe_decoder(1, prompt_n=n, prompt_ms=10.0 * n)
    assert r.prefill(1, "npu")[0].ms(600) == pytest.approx(6000.0)
    assert r.prefill(2, "npu")[0].ms(600) == 3000.0  # a new decoder process: the prior again


def test_a_side_measured_alone_is_compared_with_the_others_prior_scaled_alike() -> None:
    # A loaded machine: the provider measured at 4x its prior; the decoder, unmeasured, is assumed
    # 4x slower too, not as fast as its prior claims.
    r = rates()
    for n in (100, 200):
        r.observe_provider("npu", evaluated=n, prefill_ms=10.0 * n)
    decoder, provider = r.prefill(1, "npu")
    assert decoder.ms(100) == pytest.approx(2000.0)
    assert provider.ms(100) == pytest.approx(1000.0)
    for n in (100, 200):
        r.observe_decoder(1, prompt_n=n, prompt_ms=7.0 * n)
    decoder, provider = r.prefill(1, "npu")
    assert decoder.ms(100) == pytest.approx(700.0)
    assert provider.ms(100) == pytest.approx(1000.0)


def test_the_handoff_cost_is_a_fixed_cost_and_one_per_mib_of_the_state_it_moves() -> None:
    r = rates()
    assert r.handoff_ms(1000) == pytest.approx(1000.0)  # the prior: 1 ms/MiB, 1 MiB a token
    for n in (100, 400, 1600):
        r.observe_handoff(n_tokens=n, state_bytes=n * MIB // 2, handoff_ms=30.0 + 2.0 * n / 2)
    assert r.handoff_ms(1000) == pytest.approx(30.0 + 2.0 * 500, rel=0.01)
    assert r.restore_ms(100 * MIB) == pytest.approx(30.0 + 200.0, rel=0.01)


def test_a_single_measurement_is_all_per_token_cost() -> None:
    assert nnls([[500.0, 0.0, 1.0]], [2500.0]) == [pytest.approx(5.0), 0.0, 0.0]


def test_nnls_never_fits_a_negative_term() -> None:
    # Falling times with size (noise, or load that eased): no negative per-token cost.
    x = nnls([[n, 0.0, 1.0] for n in (FLOOR, 2 * FLOOR, 4 * FLOOR)], [900.0, 800.0, 700.0])
    assert min(x) >= 0


def test_a_linear_cost_is_sure_everywhere() -> None:
    cost = linear(2.0)
    assert (cost.sure(10_000), cost.ms(10_000)) == (True, 20_000.0)
    assert not PrefillCost(2.0).sure(10)


def test_prefills_of_a_few_close_sizes_fit_a_line_not_a_curve_that_zeroes_the_other_side() -> None:
    """A provider measured at 70 to 256 tokens (a fidelity check's prompts, then one size) on a
    loaded machine: a context-only fit went through these as well as a line, estimated 1,024 tokens
    quadratically (15x the 256-token time) and, its per-token term 0, scaled the unmeasured decoder's
    prior to 0 ms: every prompt stayed plain (bench handoff's 1,024-token row)."""
    r = rates()
    for n, ms in [(90, 900.0), (110, 1000.0), (70, 800.0), (120, 1100.0), (100, 950.0), (95, 900.0)]:
        r.observe_provider("ov", evaluated=n, prefill_ms=ms)
    for ms in (5800.0, 5877.0):
        r.observe_provider("ov", evaluated=256, prefill_ms=ms)
    decoder, provider = r.prefill(0, "ov")
    assert provider.ms_per_context == 0.0
    assert provider.ms(1024) < 5 * provider.ms(256)
    assert decoder.ms(1024) > 0.5 * provider.ms(1024) * 5.0 / 2.5  # the decoder's prior, scaled alike


def test_an_unmeasured_side_follows_the_measured_sides_curve_not_a_line_at_its_middle_size() -> None:
    """bench handoff's 1,024-token row on a loaded machine: the provider measured at 256 tokens twice
    and at 1,022 once, slower a token there (load, or attention), so its fit has a context term; the
    decoder, served plain only outside onebitd, has no fit.  A straight line for the decoder at the
    provider's rate at 256 tokens put plain at 0.68x the hybrid estimate at 1,024, and the cost
    decision took plain for a prompt both sides prefill alike."""
    r = rates()
    for n, cached, ms in [(256, 0, 4653.0), (256, 0, 5584.0), (1022, 2, 29643.0)]:
        r.observe_provider("bench", evaluated=n, prefill_ms=ms, cached=cached)
    decoder, provider = r.prefill(1, "bench")
    assert provider.sure(1024)
    assert not decoder.sure(1024)
    # The decoder's prior is twice the provider's: at every size the provider's fit holds, the
    # decoder's estimate is the provider's curve, twice over.
    for n in (256, 512, 1024):
        assert decoder.ms(n) == pytest.approx(2 * (provider.ms(n) - provider.fixed_ms), rel=0.001)
    # Where neither fit holds, the scaled prior's straight line, as before.
    assert decoder.ms(8000) == pytest.approx(8000 * 5.0 * provider.rate / 2.5)

"""Route decisions and the fallback table, without sockets or processes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.routes.decision import DEGRADE, Choice, Reason, Route, Step, choose, claim_matches, restore_used

# A request that could take a hybrid route: each test changes one input.
HYBRID: dict[str, Any] = {
    "enabled": True,
    "share": False,
    "provider_ready": True,
    "prompt_tokens": 300,
    "min_prompt_tokens": 256,
    "share_refused": False,
}


def choice(**changes: Any) -> Choice:
    return choose(**{**HYBRID, **changes})


def test_a_long_prompt_with_a_ready_provider_takes_the_file_route() -> None:
    assert choice() == Choice(Route.FILE, None)


def test_a_prompt_of_exactly_the_minimum_length_takes_the_file_route() -> None:
    assert choice(prompt_tokens=256) == Choice(Route.FILE, None)


def test_share_mode_takes_the_share_route() -> None:
    assert choice(share=True) == Choice(Route.SHARE, None)


def test_hybrid_off_is_plain_and_says_disabled() -> None:
    assert choice(enabled=False) == Choice(Route.PLAIN, Reason.DISABLED)


def test_no_ready_provider_is_plain_and_says_so() -> None:
    assert choice(provider_ready=False) == Choice(Route.PLAIN, Reason.NO_PROVIDER)


def test_a_prompt_that_could_not_be_tokenized_is_plain() -> None:
    assert choice(prompt_tokens=None) == Choice(Route.PLAIN, Reason.TOKENIZE_FAILED)


def test_a_prompt_below_the_minimum_is_plain_and_says_short_prompt() -> None:
    assert choice(prompt_tokens=255) == Choice(Route.PLAIN, Reason.SHORT_PROMPT)


def test_a_decoder_that_refused_to_share_before_gets_the_file_route() -> None:
    assert choice(share=True, share_refused=True) == Choice(Route.FILE, Reason.SHARE_REMEMBERED)


def test_a_remembered_share_refusal_does_not_matter_in_file_mode() -> None:
    assert choice(share_refused=True) == Choice(Route.FILE, None)


def test_disabled_wins_over_every_other_reason() -> None:
    assert choice(enabled=False, provider_ready=False, prompt_tokens=None).reason is Reason.DISABLED


def test_a_missing_provider_is_named_before_the_prompt_is_looked_at() -> None:
    assert choice(provider_ready=False, prompt_tokens=None).reason is Reason.NO_PROVIDER


def test_the_degrade_table_sends_handshake_failures_to_the_file_route_and_the_rest_plain() -> None:
    assert DEGRADE == {
        Step.SHARE_HANDSHAKE: Route.FILE,
        Step.FILE_PREFILL: Route.PLAIN,
        Step.RESTORE: Route.PLAIN,
        Step.SHARE_PREFILL: Route.PLAIN,
        Step.ADOPT: Route.PLAIN,
    }


@pytest.mark.parametrize("step", [s for s in Step if s is not Step.SHARE_HANDSHAKE])
def test_no_failure_after_a_provider_ran_degrades_to_another_hybrid_route(step: Step) -> None:
    # Another hybrid route there would pay for the prefill twice.
    assert DEGRADE[step] is Route.PLAIN


def test_a_claim_that_does_not_say_how_many_tokens_matches() -> None:
    assert claim_matches(None, 30)


def test_a_claim_of_every_token_matches() -> None:
    assert claim_matches(30, 30)


@pytest.mark.parametrize("claimed", [29, 31, 0, -1])
def test_a_wrong_or_negative_claim_does_not_match(claimed: int) -> None:
    assert not claim_matches(claimed, 30)


def test_a_decoder_that_evaluated_at_most_the_check_tokens_used_the_restore() -> None:
    assert restore_used(1, 2)
    assert restore_used(2, 2)


def test_a_decoder_that_evaluated_more_than_the_check_tokens_did_not_use_the_restore() -> None:
    assert not restore_used(3, 2)
    assert not restore_used(300, 2)


def test_a_reply_without_timings_is_not_counted_as_an_unused_restore() -> None:
    assert restore_used(None, 2)


inputs = st.fixed_dictionaries(
    {
        "enabled": st.booleans(),
        "share": st.booleans(),
        "provider_ready": st.booleans(),
        "prompt_tokens": st.none() | st.integers(min_value=0, max_value=1 << 20),
        "min_prompt_tokens": st.integers(min_value=1, max_value=1 << 20),
        "share_refused": st.booleans(),
    }
)


@given(inputs)
def test_choose_never_shares_when_share_is_off(kwargs: dict[str, Any]) -> None:
    if not kwargs["share"]:
        assert choose(**kwargs).route is not Route.SHARE


@given(inputs)
def test_choose_never_picks_a_hybrid_route_when_off_or_without_a_provider(kwargs: dict[str, Any]) -> None:
    if not kwargs["enabled"] or not kwargs["provider_ready"]:
        assert choose(**kwargs).route is Route.PLAIN


@given(inputs)
def test_choose_gives_a_reason_whenever_it_does_not_take_the_configured_route(kwargs: dict[str, Any]) -> None:
    result = choose(**kwargs)
    configured = Route.SHARE if kwargs["share"] else Route.FILE
    assert (result.route is configured) == (result.reason is None)

"""A provider several models name (supervisor/providers/seat.py): the pure decision of what a
request does with it, and the route it then takes (routes/decision.py's ``choose``)."""

from __future__ import annotations

import pytest

from supervisor.providers.seat import REASONS, Action, decide
from supervisor.reasons import Reason
from supervisor.routes.decision import Ask, Offer, Route, choose


@pytest.mark.parametrize(
    ("holder", "wanted", "started", "wanted_idle", "action"),
    [
        ("b", "b", True, False, Action.USE),
        ("b", "b", False, False, Action.SWAPPING),  # its process is starting
        ("a", "b", True, True, Action.SWAPPING),  # a's process stops first
        (None, "b", False, True, Action.SWAPPING),  # a's stopped, b's not started yet
        (None, None, False, True, Action.TAKE),
        ("a", "a", True, True, Action.SWAP),  # a holds it and has nothing to do
        ("a", "a", True, False, Action.OTHER_MODEL),  # a's request or job in flight
        ("c", "a", False, False, Action.OTHER_MODEL),  # being handed to a, which is busy
        ("c", "a", False, True, Action.SWAP),
    ],
)
def test_what_a_request_of_model_b_does_with_a_shared_provider(
    holder: str | None, wanted: str | None, started: bool, wanted_idle: bool, action: Action
) -> None:
    assert decide("b", holder=holder, wanted=wanted, started=started, wanted_idle=wanted_idle) is action


def test_only_a_request_whose_model_holds_the_seat_says_nothing_of_it() -> None:
    assert REASONS.get(Action.USE) is None
    assert {REASONS[a] for a in Action if a is not Action.USE} == {
        Reason.PROVIDER_SWAPPING,
        Reason.PROVIDER_OTHER_MODEL,
    }


@pytest.mark.parametrize("away", [Reason.PROVIDER_SWAPPING, Reason.PROVIDER_OTHER_MODEL, None])
def test_a_request_without_its_shared_provider_is_plain_and_says_why(away: Reason | None) -> None:
    choice = choose(Ask(None, unpicked=away or Reason.NO_PROVIDER), Offer(enabled=True, provider_ready=False))
    assert choice.route is Route.PLAIN
    assert choice.reasons == ((away or Reason.NO_PROVIDER),)


def test_over_context_still_comes_first() -> None:
    choice = choose(
        Ask(None, kept=Reason.OVER_CONTEXT, unpicked=Reason.PROVIDER_SWAPPING),
        Offer(enabled=True, provider_ready=False),
    )
    assert choice.reasons == (Reason.OVER_CONTEXT,)

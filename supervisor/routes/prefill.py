"""A provider's prefill under a deadline, its claim checked: the step both hybrid routes share.

The result says how long the prefill took (the provider's own figure where it gave one, so both
routes report the same number for the same work) and, when it failed, the reason and the words for
the log.  A provider that does not say how many tokens it prefilled is taken at its word (the state
it wrote is the result); a wrong count is a failure, and so is a share job's claim that does not say
it wrote every recurrent state row the decoder lent (``state_rows``).
"""

from __future__ import annotations

import attrs
import trio

from ..errors import ProviderAnswered, ProviderError
from ..providers import Job, Provider, ShareJob
from ..reasons import Reason
from .decision import claim_matches, state_claimed


@attrs.frozen
class Prefilled:
    prefill_ms: float | None = None
    reason: Reason | None = None  # None: the claim matches the job
    why: str = ""
    wall_ms: float = 0.0  # the whole job as we saw it: prefill, save and the round trips
    evaluated: int | None = None  # tokens the provider evaluated
    answered: bool = False  # the provider answered with an error of its own (ProviderAnswered)


async def prefill(provider: Provider, job: Job, *, timeout_s: float, where: str = "") -> Prefilled:
    """Run ``job`` on ``provider`` for at most ``timeout_s``; ``where`` completes the short-claim and
    state-unclaimed words (" into the shared region").  Cancelling it cancels the job."""
    expected = len(job.tokens)
    started = trio.current_time()
    try:
        with trio.fail_after(timeout_s):
            claim = await provider.prefill(job)
    except trio.TooSlowError:
        return Prefilled(None, Reason.PROVIDER_FAILED, f"provider {provider.name} took over {timeout_s:g}s")
    except ProviderError as exc:
        answered = isinstance(exc, ProviderAnswered)
        return Prefilled(None, Reason.PROVIDER_FAILED, f"provider failed: {exc}", answered=answered)
    measured_ms = (trio.current_time() - started) * 1000
    prefill_ms = claim.prefill_ms if claim.prefill_ms is not None else measured_ms
    if not claim_matches(claim.n_tokens, expected):
        why = f"provider prefilled {claim.n_tokens} of {expected} tokens{where}"
        return Prefilled(prefill_ms, Reason.SHORT_CLAIM, why, measured_ms)
    lent = job.state_rows if isinstance(job, ShareJob) else 0
    if not state_claimed(claim.state_rows, lent):
        said = "none" if claim.state_rows is None else claim.state_rows
        why = f"provider claimed {said} of the {lent} recurrent state rows it had to write{where}"
        return Prefilled(prefill_ms, Reason.SHARE_STATE_UNCLAIMED, why, measured_ms)
    evaluated = claim.evaluated if claim.evaluated is not None else expected
    return Prefilled(prefill_ms, wall_ms=measured_ms, evaluated=evaluated)

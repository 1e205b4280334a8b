"""A request's walk down the hybrid routes: the handoff on the route chosen, then on whatever
``DEGRADE`` says each failure leads to, until one works or the request is plain.  The walk is a
record this module alone writes (:class:`Walk`: the outcomes the handoffs returned, the route being
tried, how long an attempt the client cut short ran); routes/story.py reads the route line's handoff
fields and fallback reasons off it."""

from __future__ import annotations

import logging

import attrs
import trio

from ..config import HybridConfig
from ..providers import Provider, Providers
from ..reasons import Reason
from .compute import Placement
from .decision import Outcome, Route, degrade
from .file import FileHandoff
from .plan import Plan
from .rates import Rates
from .share import ShareHandoff
from .usage import Prefill

log = logging.getLogger("onebit.hybrid")


@attrs.frozen
class Hybrid:
    """What the hybrid routes need beyond the plain one (absent: hybrid off)."""

    providers: Providers
    file: FileHandoff
    share: ShareHandoff | None = None  # set when the share route is on (hybrid.mode / ONEBIT_KV_SHARE)
    # Where the decoder and the providers are pinned: whether a provider computes apart.
    placement: Placement = attrs.field(factory=Placement)


@attrs.define
class Walk:
    """One request's walk down the hybrid routes, as it goes: written by :func:`hand_over` only."""

    provider: Provider  # the provider asked to prefill
    trying: Route  # the route being tried (the one reached, once it is over)
    outcomes: list[Outcome] = attrs.Factory(list)  # what each handoff returned, in order
    reached: Route | None = None  # None: not over (the client cut it short)
    cut_ms: float | None = None  # how long the attempt the client cut short ran

    def reasons(self) -> list[Reason]:
        """Why each handoff that failed did, in order."""
        return [outcome.reason for outcome in self.outcomes if outcome.reason is not None]

    def ms(self) -> tuple[float, float, float]:
        """The provider's prefill (the last attempt's), the restores (all of them) and the share."""
        prefill_ms = restore_ms = share_ms = 0.0
        for outcome in self.outcomes:
            if outcome.prefill_ms is not None:
                prefill_ms = outcome.prefill_ms
            if outcome.restore_ms is not None:
                restore_ms += outcome.restore_ms
            if outcome.share_ms is not None:
                share_ms = outcome.share_ms
        if self.cut_ms is not None:
            prefill_ms = self.cut_ms
        return prefill_ms, restore_ms, share_ms

    def memory(self) -> str | None:
        """The memory layout of a decoder that refused to share, where one did."""
        return next((outcome.memory for outcome in self.outcomes if outcome.memory is not None), None)

    def worked(self) -> Outcome | None:
        """The handoff that worked, where one did."""
        return next((outcome for outcome in self.outcomes if outcome.ok), None)

    def evaluated(self) -> int | None:
        """The prompt tokens the provider evaluated, where a handoff worked."""
        done = self.worked()
        return None if done is None else done.evaluated

    def prefilled(self) -> Prefill | None:
        """What the provider spent on the prompt it handed over, where a handoff worked: the
        reply's usage is told with it (routes/usage.py)."""
        done = self.worked()
        return None if done is None else Prefill(done.evaluated, done.prefill_ms)


# How a fallback is worded in the log, by the route the request goes on to.
_GOES_ON = {
    Route.PLAIN: "the backend prefills this request itself",
    Route.FILE: "the state-file route is used",
}


async def hand_over(
    hybrid: Hybrid | None,
    walk: Walk,
    slot: int,
    plan: Plan,
    settings: HybridConfig,
    *,
    req: str,
    generation: int,
    rates: Rates,
) -> Route:
    """Try ``walk.trying``, then whatever ``DEGRADE`` says each failure leads to; the route reached.
    ``generation``: the decoder process's (a share refused is remembered for it); ``rates`` learn
    from every handoff that worked."""
    assert hybrid is not None
    provider = walk.provider
    route = walk.trying
    while route is not Route.PLAIN:
        walk.trying = route
        began = trio.current_time()
        try:
            outcome = await _attempt(hybrid, route, slot, plan, provider, settings, req, generation)
        except trio.Cancelled:
            # The client left mid-handoff: the job was cancelled (and its files removed); the
            # walk says how long it ran.
            walk.cut_ms = (trio.current_time() - began) * 1000
            raise
        walk.outcomes.append(outcome)
        if outcome.ok:
            learn(rates, provider.name, len(plan.tokens or ()), outcome)
            break
        assert outcome.reason is not None
        route = degrade(outcome)
        level = logging.INFO if outcome.reason is Reason.SHARE_UNSUPPORTED else logging.WARNING
        log.log(level, "hybrid: %s; %s", outcome.why, _GOES_ON[route])
    walk.trying = walk.reached = route
    return route


def learn(rates: Rates, provider: str, n_tokens: int, outcome: Outcome) -> None:
    """What a handoff of ``n_tokens`` that worked teaches the rates: the provider's prefill of what
    its cache lacked, and the state's move."""
    evaluated = n_tokens if outcome.evaluated is None else outcome.evaluated
    rates.observe_provider(provider, evaluated, outcome.prefill_ms, cached=n_tokens - evaluated)
    rates.observe_handoff(n_tokens, outcome.state_bytes, outcome.handoff_ms)


async def _attempt(
    hybrid: Hybrid,
    route: Route,
    slot: int,
    plan: Plan,
    provider: Provider,
    settings: HybridConfig,
    req: str,
    generation: int,
) -> Outcome:
    """One handoff on ``route``: what it returned."""
    if route is Route.SHARE and hybrid.share is not None:
        return await hybrid.share.run(
            req=req,
            slot=slot,
            tokens=list(plan.tokens or ()),
            provider=provider,
            generation=generation,
            timeout_s=settings.prefill_timeout_s,
            end=plan.boundary,
        )
    return await hybrid.file.run(
        req=req,
        slot=slot,
        tokens=list(plan.tokens or ()),
        provider=provider,
        timeout_s=settings.prefill_timeout_s,
        end=plan.boundary,
    )

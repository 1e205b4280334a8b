"""A request's walk down the hybrid routes: the handoff on the route chosen, then on whatever
``DEGRADE`` says each failure leads to, until one works or the request is plain.  The route line's
handoff fields are filled from the outcomes; the reasons are appended for its fallback chain."""

from __future__ import annotations

import logging

import attrs
import trio

from ..config import HybridConfig
from ..providers import Providers
from ..reasons import Reason
from ..routeline import RouteLine
from .decision import Outcome, Route, degrade
from .file import FileHandoff
from .plan import Plan
from .rates import Rates
from .share import ShareHandoff

log = logging.getLogger("onebit.hybrid")


@attrs.frozen
class Hybrid:
    """What the hybrid routes need beyond the plain one (absent: hybrid off)."""

    providers: Providers
    file: FileHandoff
    share: ShareHandoff | None = None  # set when the share route is on (hybrid.mode / ONEBIT_KV_SHARE)


# How a fallback is worded in the log, by the route the request goes on to.
_GOES_ON = {
    Route.PLAIN: "the backend prefills this request itself",
    Route.FILE: "the state-file route is used",
}


async def hand_over(
    hybrid: Hybrid | None,
    route: Route,
    slot: int,
    plan: Plan,
    line: RouteLine,
    reasons: list[Reason],
    settings: HybridConfig,
    *,
    generation: int,
    rates: Rates,
) -> Route:
    """Try ``route``, then whatever ``DEGRADE`` says each failure leads to; the route reached.
    ``generation``: the decoder process's (a share refused is remembered for it); ``rates`` learn
    from every handoff that worked."""
    assert hybrid is not None
    assert plan.provider is not None
    line.provider, line.engine, line.device = plan.provider.name, plan.provider.engine, plan.provider.device
    while route is not Route.PLAIN:
        line.route = route.value
        began = trio.current_time()
        try:
            outcome = await _attempt(hybrid, route, slot, plan, line, settings, generation)
        except trio.Cancelled:
            # The client left mid-handoff: the job was cancelled (and its files removed); the
            # line says how long it ran.
            line.prefill_ms = (trio.current_time() - began) * 1000
            raise
        if outcome.prefill_ms is not None:
            line.prefill_ms = outcome.prefill_ms
        if outcome.restore_ms is not None:
            line.restore_ms += outcome.restore_ms
        if outcome.share_ms is not None:
            line.share_ms = outcome.share_ms
        if outcome.ok:
            line.provider_prompt_n = outcome.evaluated
            rates.observe_provider(plan.provider.name, outcome.evaluated, outcome.prefill_ms)
            rates.observe_handoff(len(plan.tokens or ()), outcome.state_bytes, outcome.handoff_ms)
            return route
        assert outcome.reason is not None
        reasons.append(outcome.reason)
        route = degrade(outcome)
        level = logging.INFO if outcome.reason is Reason.SHARE_UNSUPPORTED else logging.WARNING
        log.log(level, "hybrid: %s; %s", outcome.why, _GOES_ON[route])
    return route


async def _attempt(
    hybrid: Hybrid, route: Route, slot: int, plan: Plan, line: RouteLine, settings: HybridConfig, generation: int
) -> Outcome:
    """One handoff on ``route``: what it returned."""
    assert plan.provider is not None
    if route is Route.SHARE and hybrid.share is not None:
        return await hybrid.share.run(
            req=line.req,
            slot=slot,
            tokens=plan.tokens or [],
            provider=plan.provider,
            generation=generation,
            timeout_s=settings.prefill_timeout_s,
        )
    return await hybrid.file.run(
        req=line.req,
        slot=slot,
        tokens=plan.tokens or [],
        provider=plan.provider,
        timeout_s=settings.prefill_timeout_s,
    )

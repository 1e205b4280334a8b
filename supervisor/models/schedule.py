"""The models scheduler's decisions: pure functions over :class:`Candidate` snapshots, with table tests
(tests/unit/models/test_models.py):

- :func:`victims`: which loaded models to unload so that another fits within ``max_loaded`` and
  ``memory_budget_mib`` (least recently used first; never a pinned one, never one in use);
- :func:`starving`: whether a waiting model has waited past its bound, so that new requests for the
  models in its way wait too (no model starves);
- :func:`expired`: the idle models past their ``ttl_s``;
- :func:`plan`: a round's loads and unloads for the waiting models, oldest first, each one's claim
  on what it loads or waits to unload kept from the younger ones.

No thrash: a request for a loaded model is served at once, so the requests already queued for a
model are served before it is swapped out; a swap is made once the models in the way are idle, or,
past :data:`STARVE_S` of waiting, once the requests already in them are done.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

# A model waiting for its load has waited this long: new requests for the models in its way wait
# behind it, so that a stream of requests for a loaded model cannot keep another out for ever.
# Long enough for a burst of requests for the loaded model to be served together (one swap per
# burst), short against models.load_timeout_s (120 s).
STARVE_S = 10.0


@attrs.frozen
class Candidate:
    """A model as the scheduler sees it, at one moment."""

    name: str
    resident: bool  # loaded, loading or unloading: it takes memory now
    users: int = 0  # requests holding it
    pin: bool = False
    last_used: float = 0.0  # trio clock: idle since (Model.idle_since)
    memory_mib: float = 0.0  # measured when loaded, else estimated
    ttl_s: float = 0.0
    blocked: bool = False  # a starving model waits for it: it takes no new requests

    @property
    def evictable(self) -> bool:
        return self.resident and not self.pin and self.users == 0


def victims(
    want: Candidate, models: Sequence[Candidate], *, max_loaded: int, budget_mib: float
) -> tuple[str, ...] | None:
    """The models to unload before ``want`` is loaded (least recently used first): () when it fits
    now, None when it cannot fit until a model in use (or pinned) lets go."""
    others = [m for m in models if m.resident and m.name != want.name]
    count = len(others)
    memory = sum(m.memory_mib for m in others)

    def fits() -> bool:
        within_count = max_loaded <= 0 or count + 1 <= max_loaded
        within_memory = budget_mib <= 0 or memory + want.memory_mib <= budget_mib
        return within_count and within_memory

    chosen: list[str] = []
    for model in sorted((m for m in others if m.evictable), key=lambda m: m.last_used):
        if fits():
            break
        chosen.append(model.name)
        count -= 1
        memory -= model.memory_mib
    if not fits():
        if budget_mib > 0 and not others and want.memory_mib > budget_mib:
            return ()  # alone it is over the budget: loaded anyway, the budget cannot be kept otherwise
        return None
    return tuple(chosen)


def in_the_way(want: Candidate, models: Sequence[Candidate], *, max_loaded: int, budget_mib: float) -> tuple[str, ...]:
    """The models ``want`` waits to unload, busy or not: what :func:`victims` would take were every
    model idle.  Those of a starving model take no new requests."""
    idle = [attrs.evolve(m, users=0) for m in models]
    return victims(want, idle, max_loaded=max_loaded, budget_mib=budget_mib) or ()


def starving(waited_s: float, bound_s: float = STARVE_S) -> bool:
    """A model whose oldest request has waited this long blocks new requests for those in its way."""
    return waited_s >= bound_s


def expired(models: Sequence[Candidate], now: float) -> tuple[str, ...]:
    """The idle loaded models past their ``ttl_s`` (0: never); pinned ones stay."""
    return tuple(
        m.name
        for m in models
        if m.resident and m.ttl_s > 0 and m.users == 0 and not m.pin and now - m.last_used >= m.ttl_s
    )


@attrs.frozen
class Moves:
    """One round's decisions: the models to load now, and those to unload to make room."""

    load: tuple[str, ...] = ()
    unload: tuple[str, ...] = ()


def plan(
    waiting: Sequence[str], models: Sequence[Candidate], wanted: frozenset[str], *, max_loaded: int, budget_mib: float
) -> Moves:
    """What to do for the models requests wait for (``waiting``: oldest waiter first), given the
    models now and those already ``wanted`` loaded.  A model fits now: it is loaded.  Idle models in
    its way: they are unloaded, and it is loaded once they are gone.  Busy ones in its way: it waits.
    Whatever an older waiter loads, unloads or waits to unload is claimed: a younger one neither
    evicts nor re-loads it (no thrash)."""
    pool = {m.name: m for m in models}
    claimed: set[str] = set()
    load: list[str] = []
    unload: list[str] = []
    for name in waiting:
        if name in wanted or name in claimed or name not in pool:
            claimed.add(name)
            continue
        candidates = [m if m.name not in claimed else attrs.evolve(m, pin=True) for m in pool.values()]
        want = pool[name]
        chosen = victims(want, candidates, max_loaded=max_loaded, budget_mib=budget_mib)
        if chosen is None:
            claimed.update(in_the_way(want, candidates, max_loaded=max_loaded, budget_mib=budget_mib))
            continue
        claimed.add(name)
        claimed.update(chosen)
        unload += [victim for victim in chosen if victim in wanted and victim not in unload]
        if not chosen:
            load.append(name)
            pool[name] = attrs.evolve(want, resident=True)  # it takes its room from the next waiter
    return Moves(tuple(load), tuple(unload))

"""The scheduler's decisions, as tables: which models an unload makes room with, when a waiting
model starves, which idle models are past their ttl_s."""

from __future__ import annotations

import pytest

from supervisor.models.schedule import Candidate, Moves, expired, in_the_way, plan, starving, victims


def c(name: str, **kw: object) -> Candidate:
    return Candidate(name=name, **{"resident": True, **kw})  # type: ignore[arg-type]


# (the models now, the one wanted, max_loaded, budget_mib, what victims() says)
VICTIMS = [
    pytest.param([c("a")], c("b", resident=False), 0, 0, (), id="no-limits-nothing-to-unload"),
    pytest.param([c("a")], c("b", resident=False), 2, 0, (), id="room-under-max-loaded"),
    pytest.param([c("a", last_used=5), c("b", last_used=1)], c("x", resident=False), 2, 0, ("b",), id="lru-goes"),
    pytest.param([c("a", users=1)], c("b", resident=False), 1, 0, None, id="in-use-never-unloaded"),
    pytest.param([c("a", pin=True)], c("b", resident=False), 1, 0, None, id="pinned-never-unloaded"),
    pytest.param(
        [c("a", pin=True), c("b", last_used=9)], c("x", resident=False), 2, 0, ("b",), id="pinned-skipped-for-lru"
    ),
    pytest.param(
        [c("a", memory_mib=400, last_used=1), c("b", memory_mib=300, last_used=2)],
        c("x", resident=False, memory_mib=500),
        0,
        1000,
        ("a",),
        id="budget-unloads-until-it-fits",
    ),
    pytest.param(
        [c("a", memory_mib=400, last_used=1), c("b", memory_mib=300, last_used=2)],
        c("x", resident=False, memory_mib=900),
        0,
        1000,
        ("a", "b"),
        id="budget-unloads-several",
    ),
    pytest.param([], c("x", resident=False, memory_mib=2000), 0, 1000, (), id="alone-over-budget-loads-anyway"),
    pytest.param(
        [c("a", memory_mib=100, users=1)],
        c("x", resident=False, memory_mib=2000),
        0,
        1000,
        None,
        id="over-budget-with-a-busy-one-waits",
    ),
    pytest.param([c("a", resident=False)], c("b", resident=False), 1, 0, (), id="unloaded-ones-take-no-room"),
]


@pytest.mark.parametrize(("models", "want", "max_loaded", "budget", "expected"), VICTIMS)
def test_victims(
    models: list[Candidate], want: Candidate, max_loaded: int, budget: float, expected: tuple[str, ...] | None
) -> None:
    assert victims(want, [*models, want], max_loaded=max_loaded, budget_mib=budget) == expected


def test_in_the_way_names_what_a_load_waits_to_unload_busy_or_not() -> None:
    models = [c("a", users=2, last_used=1), c("b", last_used=2), c("x", resident=False)]
    assert in_the_way(models[2], models, max_loaded=2, budget_mib=0) == ("a",)
    assert in_the_way(models[2], models, max_loaded=1, budget_mib=0) == ("a", "b")
    assert in_the_way(models[2], models, max_loaded=3, budget_mib=0) == ()


@pytest.mark.parametrize(("waited", "bound", "expected"), [(0.0, 10.0, False), (9.9, 10.0, False), (10.0, 10.0, True)])
def test_starving(waited: float, bound: float, expected: bool) -> None:
    assert starving(waited, bound) is expected


EXPIRED = [
    pytest.param([c("a", ttl_s=10, last_used=0)], 10.0, ("a",), id="idle-past-ttl"),
    pytest.param([c("a", ttl_s=10, last_used=1)], 10.0, (), id="idle-within-ttl"),
    pytest.param([c("a", ttl_s=0, last_used=0)], 1e9, (), id="ttl-0-never"),
    pytest.param([c("a", ttl_s=10, last_used=0, users=1)], 99.0, (), id="in-use"),
    pytest.param([c("a", ttl_s=10, last_used=0, pin=True)], 99.0, (), id="pinned"),
    pytest.param([c("a", ttl_s=10, last_used=0, resident=False)], 99.0, (), id="not-loaded"),
]


@pytest.mark.parametrize(("models", "now", "expected"), EXPIRED)
def test_expired(models: list[Candidate], now: float, expected: tuple[str, ...]) -> None:
    assert expired(models, now) == expected


# (the models now, those waited for (oldest first), those wanted, max_loaded, what plan() says)
PLANS = [
    pytest.param([c("a"), c("x", resident=False)], ["x"], {"a"}, 0, Moves(load=("x",)), id="room-load-now"),
    pytest.param(
        [c("a"), c("x", resident=False)], ["x"], {"a"}, 1, Moves(unload=("a",)), id="idle-in-the-way-unloaded"
    ),
    pytest.param([c("a", users=1), c("x", resident=False)], ["x"], {"a"}, 1, Moves(), id="busy-in-the-way-waits"),
    pytest.param(
        [c("a"), c("x", resident=False), c("y", resident=False)],
        ["x", "a"],
        {"a"},
        1,
        Moves(unload=("a",)),
        id="younger-waiter-for-a-claimed-model-waits",
    ),
    pytest.param(
        [c("a"), c("x", resident=False)],
        ["x", "a"],
        set(),
        1,
        Moves(),
        id="a-model-on-its-way-out-is-not-loaded-back-for-a-younger-waiter",
    ),
    pytest.param([c("a"), c("x")], ["x"], {"a", "x"}, 1, Moves(), id="wanted-already-nothing-to-do"),
    pytest.param(
        [c("x", resident=False), c("y", resident=False)], ["x", "y"], set(), 0, Moves(load=("x", "y")), id="both-fit"
    ),
    pytest.param(
        [c("a", last_used=1), c("x", resident=False), c("y", resident=False)],
        ["x", "y"],
        {"a"},
        2,
        Moves(load=("x",), unload=("a",)),
        id="the-second-makes-room-beside-the-first",
    ),
    pytest.param(
        [c("a", users=1), c("x", resident=False), c("y", resident=False)],
        ["x", "y"],
        {"a"},
        2,
        Moves(load=("x",)),
        id="the-second-waits-when-the-room-left-is-busy",
    ),
    pytest.param([c("a")], ["gone"], {"a"}, 1, Moves(), id="a-removed-model-is-skipped"),
]


@pytest.mark.parametrize(("models", "waiting", "wanted", "max_loaded", "expected"), PLANS)
def test_plan(models: list[Candidate], waiting: list[str], wanted: set[str], max_loaded: int, expected: Moves) -> None:
    assert plan(waiting, models, frozenset(wanted), max_loaded=max_loaded, budget_mib=0) == expected

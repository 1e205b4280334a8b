"""The daemon's statistics: the frozen value the admin ``status`` verb sends and ``onebitctl status``
reads back.

Each part is its owner's ``statistics()`` snapshot (``Child``, ``SlotPool``, the providers,
``Front``, ``RouteStats``); :class:`DaemonStatistics` puts them together.  ``Front``'s are declared
here, not in ``front.py``, so that onebitctl reads them without importing the HTTP server.  On the
wire they are the one converter's unstructured form (:func:`to_wire`); :func:`from_wire` structures
that back with the same hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from cattrs.errors import BaseValidationError
from cattrs.gen import make_dict_structure_fn

from ..config import converter
from ..errors import AdminUnavailable
from ..llama.slots import SlotStatistics
from ..prefix.store import StoreStatistics
from ..providers.base import ProviderStatistics
from ..routes.rates import RateStatistics
from ..supervise.child import ChildStatistics
from .routestats import EstimateAccuracy, FirstByte


@attrs.frozen
class InflightStatistics:
    """A completion request being served."""

    req: str
    endpoint: str
    route: str  # its route so far
    slot: int | None
    age_s: float


@attrs.frozen
class FrontStatistics:
    draining: bool
    inflight: tuple[InflightStatistics, ...]


@attrs.frozen
class DaemonInfo:
    state: str  # loading, serving, draining, failed, stopping
    pid: int
    version: str
    started_at: float  # wall-clock seconds since the epoch
    uptime_s: float
    config: str | None  # the file it was started from
    runtime_dir: str
    binds: tuple[str, ...]


@attrs.frozen
class ModelStatistics:
    """One model of the daemon's (supervisor/models/model.py)."""

    name: str
    aliases: tuple[str, ...]
    state: str  # unloaded, loading, loaded, failed, unloading
    default: bool
    pin: bool
    ttl_s: float
    users: int  # requests holding it now
    loads: int
    last_load_ms: float | None  # its decoder's spawn to healthy, the last time
    last_unload_ms: float | None  # its slots kept and its children stopped, the last time
    last_used: float | None  # wall-clock seconds since the epoch
    memory_mib: float  # measured (its children's RSS) while loaded, else the estimate
    estimate_mib: float
    pid: int | None  # its decoder's
    state_since: float
    slots: SlotStatistics | None = None  # its decoder's slots (None from an older daemon)
    providers: tuple[ProviderStatistics, ...] = ()  # its providers (an older daemon: none said)
    store: StoreStatistics | None = None  # its prefix store (None from an older daemon)
    # What its restores can do this load (supervisor/routes/capability.py): unprobed, whole, prefix,
    # none, or withdrawn; and why.
    restores: str = "unprobed"
    restores_why: str = ""
    slot_context: int | None = None  # the tokens each slot got, as llama-server says
    swa_full: bool = False  # its llama-servers run with --swa-full
    # Why its decoder refused the share route (supervisor/routes/share.py), with its memory's
    # layout; empty while the route is off or not refused.
    share_refused: str = ""


@attrs.frozen
class ModelsStatistics:
    """The daemon's models and their scheduler (supervisor/models/registry.py)."""

    default: str
    max_loaded: int
    memory_budget_mib: int
    memory_mib: float  # the resident models', measured or estimated
    waiting: int  # requests waiting for a model to load
    swaps: int  # unloads made to load another model
    models: tuple[ModelStatistics, ...]


@attrs.frozen
class DaemonStatistics:
    """``Daemon.statistics()``; the route statistics' fields sit at the top level, as on the wire."""

    daemon: DaemonInfo
    children: tuple[ChildStatistics, ...]
    providers: tuple[ProviderStatistics, ...]
    slots: SlotStatistics
    inflight: tuple[InflightStatistics, ...]
    restore_unused: int
    routes: Mapping[str, int]
    outcomes: Mapping[str, int]
    fallbacks: Mapping[str, int]
    first_byte: FirstByte
    watchers: int
    watch_dropped: int
    watch_closed: int = 0  # status page feeds dropped for not keeping up (0 from an older daemon)
    store: StoreStatistics | None = None  # the prefix store (None from a daemon that predates it)
    models: ModelsStatistics | None = None  # None from a daemon that predates several models
    # The cost decision's estimates against the actual prefills, per route and engine, over the last
    # requests (none from a daemon that predates them).
    estimates: tuple[EstimateAccuracy, ...] = ()
    # What the default model's cost decision believes now (None from a daemon that predates it).
    costs: RateStatistics | None = None


def merged_slots(pools: list[SlotStatistics]) -> SlotStatistics:
    """Every model's slots as one pool (one model: its own, unchanged)."""
    if len(pools) == 1:
        return pools[0]
    fields = [f.name for f in attrs.fields(SlotStatistics) if f.name not in ("queue_limit", "each")]
    sums = {name: sum(getattr(pool, name) for pool in pools) for name in fields}
    return SlotStatistics(**sums, queue_limit=pools[0].queue_limit)


def to_wire(stats: DaemonStatistics) -> dict[str, Any]:
    """The JSON object the ``status`` verb answers with."""
    wire: dict[str, Any] = converter.unstructure(stats)
    return wire


# onebitctl may be older than the daemon it asks: a key a newer onebitd added is left out, not
# refused.  The same converter otherwise (its strict int, float and string hooks), lenient about
# extra keys: its hooks for tables and for lists (which may hold tables) are the ones that recurse,
# so they are replaced by ones that recurse into this copy.
_reader = converter.copy(forbid_extra_keys=False)


def _structure_tuple(value: Any, type_: Any) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {value!r}")
    (item_type, _ellipsis) = type_.__args__
    return tuple(_reader.structure(value, list[item_type]))  # type: ignore[valid-type]


_reader.register_structure_hook_factory(attrs.has, lambda cls: make_dict_structure_fn(cls, _reader))
_reader.register_structure_hook_func(lambda type_: getattr(type_, "__origin__", None) is tuple, _structure_tuple)


def from_wire(data: Any) -> DaemonStatistics:
    """The ``status`` verb's result, structured back."""
    try:
        stats: DaemonStatistics = _reader.structure(data, DaemonStatistics)
    except (BaseValidationError, TypeError, ValueError, KeyError) as exc:
        raise AdminUnavailable(f"onebitd's statistics do not read as this onebitctl's: {exc!r}") from None
    return stats

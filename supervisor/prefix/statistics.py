"""The prefix store's statistics: the frozen value ``onebitctl status`` and ``/metrics`` read, and
the running tallies the store keeps for it."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class StoreStatistics:
    enabled: bool
    directory: str | None
    entries: int
    bytes: int  # on disk now, entries dropped while pinned included
    max_bytes: int
    pinned: int  # entries in use by a restore
    hits: int
    misses: int
    evictions: int
    stores: int
    duplicates: int  # puts of tokens already stored: no-ops
    skipped: int  # puts refused by policy: shorter than min_tokens, larger than max_bytes, no room
    store_failures: int  # puts that failed on the disk (ENOSPC, EIO, ...): the entry dropped
    drops: int  # entries dropped by the caller (a refused restore) or at open
    restores: int
    restore_ms_mean: float | None
    restore_ms_last: float | None
    host_id: str | None = None  # server.host_id: what this host writes into its entries
    shared: bool = False  # the directory is cache.shared_dir, shared with other hosts
    # Why the shared directory is not in use (the host fell back to its private store at start) or
    # is unreachable now; None while all is well (or none is configured).
    shared_problem: str | None = None
    restores_other: int = 0  # of restores, those of entries another host stored


# A model without a prefix store (off, or it could not work): what its statistics say.
OFF = StoreStatistics(
    enabled=False,
    directory=None,
    entries=0,
    bytes=0,
    max_bytes=0,
    pinned=0,
    hits=0,
    misses=0,
    evictions=0,
    stores=0,
    duplicates=0,
    skipped=0,
    store_failures=0,
    drops=0,
    restores=0,
    restore_ms_mean=None,
    restore_ms_last=None,
)


@attrs.define
class Counts:
    """What the store has done since it opened: the running tallies behind its statistics."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    stores: int = 0
    duplicates: int = 0
    skipped: int = 0
    store_failures: int = 0
    drops: int = 0
    restores: int = 0
    restores_other: int = 0
    restore_ms_total: float = 0.0
    restore_ms_last: float | None = None

    def figures(self) -> dict[str, Any]:
        """The tallies as :class:`StoreStatistics`' fields."""
        figures = attrs.asdict(self)
        total = figures.pop("restore_ms_total")
        figures["restore_ms_mean"] = total / self.restores if self.restores else None
        return figures

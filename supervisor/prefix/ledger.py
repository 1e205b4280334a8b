"""What a prefix store holds, as it knows it: Ledger.

The entries by name in least-recently-used order with their index (supervisor/prefix/index.py), the
pins of restores in progress, the entries dropped while pinned, and the bytes all of it takes on
disk.  Pure and in memory, on the trio thread: each method changes the state and returns what the
caller must do on disk (the files that may go now), as httpcore's pool returns the connections to
close; :class:`~supervisor.prefix.store.PrefixStore` does the I/O and keeps the counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs

from .directory import Listed, Listing
from .files import Entry
from .index import PrefixIndex


class Ledger:
    def __init__(self) -> None:
        self._index = PrefixIndex()
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.pins: dict[str, int] = {}
        self.doomed: dict[str, Entry] = {}  # dropped while pinned: removed at the last release
        self._bytes = 0  # the entries' and the doomed ones'
        self._beside = 0  # what else counts against max_bytes: a shared directory's other fingerprints

    @property
    def bytes(self) -> int:
        """On disk now: the entries, those dropped while pinned, and a shared directory's others."""
        return self._bytes + self._beside

    def longest(self, tokens: Sequence[int]) -> Entry | None:
        """The longest entry whose tokens ``tokens`` starts with."""
        key = self._index.longest_prefix(tokens)
        return self.entries[key] if key is not None else None

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry for exactly ``tokens`` is known (each host's has its own name)."""
        found = self.longest(tokens)
        return found is not None and found.n_tokens == len(tokens)

    def known(self) -> dict[str, Entry]:
        """The entries and those dropped while pinned (still on disk), least recently used first."""
        return {**self.entries, **self.doomed}

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self._index.add(entry.key, entry.tokens)
        self._bytes += entry.disk_bytes

    def used(self, key: str, when: float) -> None:
        """A use of ``key`` at ``when`` (an entry gone meanwhile is ignored)."""
        if key in self.entries:
            self.entries[key] = attrs.evolve(self.entries[key], last_used=when)
            self.entries.move_to_end(key)

    def vanished(self, key: str) -> Entry | None:
        """Entry ``key`` is gone from the disk, or going: out of the index and the bytes."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self._index.remove(key)
            self._bytes -= entry.disk_bytes
        return entry

    def forget(self, key: str) -> bool:
        """Out of the index now; True when its files may go now, False when it is pinned (they go
        at its last release)."""
        entry = self.entries.pop(key)
        self._index.remove(key)
        if self.pins.get(key):
            self.doomed[key] = entry
            return False
        self._bytes -= entry.disk_bytes
        return True

    def pin(self, key: str) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def release(self, key: str) -> bool:
        """One pin of ``key`` let go; True when it was dropped meanwhile and its files may go now."""
        self.pins[key] -= 1
        if self.pins[key]:
            return False
        del self.pins[key]
        doomed = self.doomed.pop(key, None)
        if doomed is None:
            return False
        self._bytes -= doomed.disk_bytes
        return True

    def take_out(self, victims: list[str], listed: list[Listed]) -> dict[str, Entry | None]:
        """Evicted: out of the index and the bytes now (their files go next); each victim's entry
        (None: another fingerprint's, in a shared directory)."""
        sizes = {item.name: item.disk_bytes for item in listed}
        taken: dict[str, Entry | None] = {}
        for name in victims:
            taken[name] = self.vanished(name)
            if taken[name] is None:
                self._beside -= sizes[name]
        return taken

    def apply(self, found: Listing) -> None:
        """The entries become what a listing found (the doomed left out: removed at their release),
        ordered by their use times."""
        for key in [key for key in self.entries if key not in found.entries]:
            self.vanished(key)  # another host evicted it
        for entry in found.entries.values():
            if entry.key in self.doomed:
                continue
            if entry.key in self.entries:
                self.entries[entry.key] = entry  # its use time as the directory has it
            else:
                self.add(entry)
        self.entries = OrderedDict(sorted(self.entries.items(), key=lambda item: item[1].last_used))
        self._beside = found.leftovers + sum(
            item.disk_bytes for item in found.listed if item.name not in self.entries and item.name not in self.doomed
        )

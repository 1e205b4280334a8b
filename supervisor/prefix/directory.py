"""Where a prefix store's entries live: the I/O its bookkeeping asks for, as one Protocol.

:class:`~supervisor.prefix.store.PrefixStore` keeps the index, the least-recently-used order, the
pins and the counts, and touches no file.  What it asks of the disk goes through a
:class:`Directory`: list what is there, write an entry's files (the sidecar last: the commit),
record a use and say whether the entry is still there, remove an entry.  Three stand behind it:

    PrivateDirectory   prefix/private.py   cache.dir, locked: nothing changes there without us
    SharedDirectory    prefix/shareddir.py cache.shared_dir: other hosts store, use and evict there
    FallbackDirectory  prefix/fallback.py  a shared one, and the private one its puts go to while
                                           the shared one is unreachable

A store that is off has no directory and no store: its callers hold ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import attrs

from .files import Entry


@attrs.frozen
class Listed:
    """A committed entry of any fingerprint, as the budget sees it."""

    name: str
    disk_bytes: int
    last_used: float
    ours: bool  # of our fingerprint: restorable here


@attrs.frozen
class Listing:
    """A directory as it is now: what the bookkeeping takes in after each listing."""

    entries: dict[str, Entry]  # of our fingerprint, by name
    listed: list[Listed]  # what counts against max_bytes where the next put goes, least recently used first
    cleaned: int = 0  # leftovers removed (a write that never finished, a torn or foreign entry)
    aged: int = 0  # entries evicted for age
    foreign: frozenset[str] = frozenset()  # a shared directory's entries of other fingerprints: never read again
    leftovers: int = 0  # bytes of files no entry owns (a write in progress, or a dead host's): counted, never evicted

    @property
    def bytes(self) -> int:
        return sum(item.disk_bytes for item in self.listed) + self.leftovers


class Directory(Protocol):
    """The files of a prefix store.  ``write`` and ``remove`` run in a worker thread; the others on
    the trio thread.  Only ``write`` raises ``OSError`` at its caller."""

    @property
    def path(self) -> Path:
        """The store's directory (the shared one, where there is one)."""
        ...

    @property
    def shared(self) -> bool:
        """Other hosts use it too: the store lists it again every ``cache.shared_rescan_s``."""
        ...

    @property
    def problem(self) -> str | None:
        """Why the shared directory configured is not in use now (None: all is well, or none is)."""
        ...

    @property
    def degraded(self) -> bool:
        """The shared directory is unreachable and puts go to the private one."""
        ...

    def name(self, key: str) -> str:
        """A new entry's name for the token key ``key``."""
        ...

    async def list(self, known: Mapping[str, Entry]) -> Listing | None:
        """The entries there now (``known``: the store's, not read again); None when the directory
        the next put goes to cannot be listed (said once)."""
        ...

    async def use(self, name: str, when: float) -> bool:
        """Record a use of entry ``name`` (its state file's mtime); whether it is still there."""
        ...

    async def verify(self, name: str, blake2b: str) -> bool | None:
        """Whether entry ``name``'s state file holds what was saved (its content hash, read in a
        worker thread); None when the directory did not answer in time (said once)."""
        ...

    def state_path(self, name: str) -> Path:
        """Entry ``name``'s state file, for llama-server to restore."""
        ...

    def write(self, name: str, source: Path, sidecar: bytes, state_bytes: int) -> None:
        """Commit ``source`` as entry ``name`` (supervisor/prefix/files.py); raises OSError, leaving no file."""
        ...

    def remove(self, name: str) -> bool:
        """Remove entry ``name``: True when we did, False when another host took it first."""
        ...

    def close(self) -> None:
        """Let go of what the directory holds (a private one's lock).  Idempotent."""
        ...

"""A shared directory and the private one beside it: FallbackDirectory.

A host that stores in ``cache.shared_dir`` opens (and locks) its private ``cache.dir`` too.  While
the shared directory cannot be listed, puts go to the private one and count against its budget
(``max_bytes`` there too); the entries known of the shared directory stay known (a restore of one
that went with it costs a prefill); the next listing that succeeds brings the shared directory back.
What was stored privately meanwhile stays found.  Which directory an entry lives in its name says:
a shared entry's names its host (supervisor/prefix/shared.py), a private entry's is its token key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from . import shared as shared_files
from .directory import Listing
from .files import Entry
from .private import PrivateDirectory
from .shareddir import SharedDirectory


class FallbackDirectory:
    shared = True

    def __init__(self, shared: SharedDirectory, private: PrivateDirectory) -> None:
        self.shared_dir = shared
        self.private = private

    @property
    def path(self) -> Path:
        return self.shared_dir.path

    @property
    def problem(self) -> str | None:
        return self.shared_dir.problem

    @property
    def degraded(self) -> bool:
        return self.shared_dir.problem is not None

    def _of(self, name: str) -> SharedDirectory | PrivateDirectory:
        return self.private if shared_files.host_of(name) is None else self.shared_dir

    def name(self, key: str) -> str:
        return self.private.name(key) if self.degraded else self.shared_dir.name(key)

    async def list(self, known: Mapping[str, Entry]) -> Listing:
        """Both directories' entries; the budget of the one the next put goes to.  The shared
        directory's entries as known before, while it cannot be listed."""
        private_known = {name: entry for name, entry in known.items() if self._of(name) is self.private}
        shared_known = {name: entry for name, entry in known.items() if name not in private_known}
        private = await self.private.list(private_known)
        found = await self.shared_dir.list(shared_known)
        if found is None:
            return Listing({**shared_known, **private.entries}, private.listed)
        both = {**found.entries, **private.entries}
        return Listing(both, found.listed, found.cleaned, found.aged, found.foreign, found.leftovers)

    async def use(self, name: str, when: float) -> bool:
        return await self._of(name).use(name, when)

    async def verify(self, name: str, blake2b: str) -> bool | None:
        return await self._of(name).verify(name, blake2b)

    def state_path(self, name: str) -> Path:
        return self._of(name).state_path(name)

    def write(self, name: str, source: Path, sidecar: bytes, state_bytes: int) -> None:
        self._of(name).write(name, source, sidecar, state_bytes)

    def remove(self, name: str) -> bool:
        return self._of(name).remove(name)

    def close(self) -> None:
        self.private.close()
        self.shared_dir.close()
